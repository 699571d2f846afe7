"""Who may open a session or call the API: the checks every entry point shares.

A WebSocket upgrade, an HTTP API request and a client secret's mint read the credential
headers the same way (each at most once, and ASCII), honour ``--allowed-origins`` and
``--api-key`` alike; they differ only in where a key may travel (a browser's WebSocket
can only send it as a subprotocol) and whether a client secret will do (not to mint one).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from websockets.datastructures import Headers

from gateway.api import auth

KEY_SUBPROTOCOL = "openai-insecure-api-key."
# Headers that carry credentials: each at most once, and ASCII (a key is ASCII, and a
# browser sends an Origin in its ASCII serialization).
_SINGLE_HEADERS = ("Origin", "Authorization")
_ASCII_HEADERS = ("Origin", "Authorization", "Sec-WebSocket-Protocol")


class Entry(Enum):
    """Where a request comes in, which decides what credential it may show."""

    WEBSOCKET = "websocket"  # a key or a client secret, as a Bearer or a subprotocol
    HTTP = "http"  # a key or a client secret, as a Bearer
    MINT = "mint"  # a key, as a Bearer: a client secret cannot mint another


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is not served: an HTTP status, an OpenAI error code, the words."""

    status: int
    code: str
    message: str
    headers: dict[str, str] | None = None

    @property
    def error_type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


class Admission:
    """The credential and Origin checks, on one request's headers."""

    def __init__(self, credentials: auth.Credentials, allowed_origins: tuple[str, ...]) -> None:
        self.credentials = credentials
        self.allowed_origins = allowed_origins

    def refuse(self, headers: Headers, entry: Entry) -> Refusal | None:
        """Why these headers may not come in at ``entry``, or None."""
        malformed = _malformed_credentials(headers)
        if malformed is not None:
            return Refusal(400, "invalid_header", malformed)
        origin = headers.get("Origin")
        allowed = self.allowed_origins
        if allowed and origin is not None and origin not in allowed:
            return Refusal(403, "origin_not_allowed", f"Origin {origin} is not allowed.")
        if not self.credentials.required:
            return None
        challenge = {"WWW-Authenticate": "Bearer"}
        if entry is Entry.MINT:
            offered = bearer(headers)
            if self.credentials.is_api_key(offered) is not None:
                return None
            message = (
                "A client secret cannot mint client secrets: use an API key."
                if offered.startswith(auth.SECRET_PREFIX)
                else "Missing or wrong API key: send 'Authorization: Bearer KEY'."
            )
            return Refusal(401, "invalid_api_key", message, challenge)
        if entry is Entry.HTTP:
            if self.credentials.admits(bearer(headers)):
                return None
            message = "Missing, wrong or expired key: send 'Authorization: Bearer KEY'."
            return Refusal(401, "invalid_api_key", message, challenge)
        if any(self.credentials.admits(o) for o in _offered_on_websocket(headers) if o):
            return None
        message = (
            "Missing, wrong or expired credential: send 'Authorization: Bearer KEY' or the "
            "subprotocol 'openai-insecure-api-key.KEY', where KEY is an API key or a "
            "client secret (ek_...) that has not expired."
        )
        return Refusal(401, "invalid_api_key", message, challenge)

    def refuse_http(
        self, headers: Headers, *, ready: bool, need_engine: bool = True
    ) -> Refusal | None:
        """Why an API request over plain HTTP may not be served (the WebSocket handshake's
        rules, as JSON errors), or None; ``ready``: the gateway takes new work."""
        refused = self.refuse(headers, Entry.HTTP)
        if refused is None and need_engine and not ready:
            message = "The engine is not ready (loading, stopping, or no replica is up)."
            refused = Refusal(
                503, "engine_unavailable", message + " Retry shortly.", {"Retry-After": "1"}
            )
        return refused

    def tenant(self, headers: Headers, entry: Entry) -> str:
        """The tenant of headers that :meth:`refuse` admitted: the first credential's that
        speaks for one (``auth.ANONYMOUS`` on a gateway with no keys)."""
        offered = (
            [bearer(headers)] if entry is not Entry.WEBSOCKET else _offered_on_websocket(headers)
        )
        for credential in offered:
            tenant = self.credentials.tenant_of(credential) if credential else None
            if tenant is not None:
                return tenant
        return auth.ANONYMOUS

    def tenant_of_http(self, headers: Headers) -> str | None:
        """The tenant an HTTP request's Bearer credential names, or None (no credential, or
        a wrong one): for the access log of any route."""
        if _malformed_credentials(headers) is not None:
            return None
        token = bearer(headers)
        return self.credentials.tenant_of(token) if token else None


def bearer(headers: Headers) -> str:
    """The token of ``Authorization: Bearer TOKEN`` ("" if there is none)."""
    scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _offered_on_websocket(headers: Headers) -> list[str]:
    """The Bearer token and every key subprotocol's key."""
    offered = [bearer(headers)]
    for header in headers.get_all("Sec-WebSocket-Protocol"):
        offered += [
            p.strip()[len(KEY_SUBPROTOCOL) :]
            for p in header.split(",")
            if p.strip().startswith(KEY_SUBPROTOCOL)
        ]
    return offered


def _malformed_credentials(headers: Headers) -> str | None:
    """Why the credential headers cannot be read (sent twice, not ASCII), or None."""
    for name in _SINGLE_HEADERS:
        if len(headers.get_all(name)) > 1:
            return f"Send the {name} header once."
    for name in _ASCII_HEADERS:
        if not all(value.isascii() for value in headers.get_all(name)):
            return f"The {name} header must be ASCII."
    return None
