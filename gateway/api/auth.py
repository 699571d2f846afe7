"""Who may open a session: API keys, and the short-lived client secrets they mint.

An API key is long-lived and belongs on servers; it comes from ``--api-key``,
``--api-key-file`` or the ``LLM_GATEWAY_API_KEY`` variable, and several may be
configured at once so that keys can be rotated. A client secret (``ek_...``) is
what a browser holds instead: ``POST /v1/realtime/client_secrets`` with an API key
mints one, it opens sessions until it expires, and it can do nothing else (no
secret mints another one).

Secrets are stateless: ``ek_`` + base64url(version, key id, expiry, nonce, MAC),
the MAC an HMAC-SHA256 under a signing key derived (PBKDF2, once at start) from
the API key that minted it. So checking one costs one HMAC and no lookup, every
``--workers`` process (all configured with the same keys) accepts every other's
secrets, and removing a key from the configuration revokes the secrets it minted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import os
import re
import secrets
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson

from sessions import codec, errors
from sessions.realtime import codec as rt

ENV_VAR = "LLM_GATEWAY_API_KEY"
SECRET_PREFIX = "ek_"
DEFAULT_SECRET_TTL = 600  # seconds, the hosted API's default
MIN_SECRET_TTL = 10
MAX_SECRET_TTL = 7200  # the hosted API's ceiling

_VERSION = 1
_PAYLOAD = struct.Struct(">B4sI8s")  # version, key id, expires_at (epoch s), nonce
_MAC_BYTES = 16
_TOKEN_CHARS = (_PAYLOAD.size + _MAC_BYTES) * 4 // 3  # base64url, no padding (33 bytes)
# A key travels as an HTTP header value and as a WebSocket subprotocol (an RFC 7230 token).
_KEY_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_KDF_SALT = b"llm-gateway client secrets v1"
_KDF_ROUNDS = 100_000  # slows offline guessing of a weak key from a leaked secret


ANONYMOUS = ""  # the one tenant of a gateway with no keys


def tenant_name(key: str) -> str:
    """A key's tenant when its line names none: ``key-`` and the start of its SHA-256,
    which says which key without being one (safe in a metric label or a log line)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyConfigError(ValueError):
    """An API key that cannot be used (its source is named in the message)."""


def read_api_keys(
    keys: Sequence[str] = (), key_file: str | None = None, environ: Mapping[str, str] = os.environ
) -> tuple[str, ...]:
    """Every configured key, in order, without repeats: the flags, the file (one key a
    line, ``#`` comments), then the variable (several separated by commas)."""
    found: list[tuple[str, str]] = [(key, "--api-key") for key in keys]
    if key_file is not None:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyConfigError(f"--api-key-file {key_file}: {exc}") from None
        lines = (line.strip() for line in text.splitlines())
        file_keys = [line for line in lines if line and not line.startswith("#")]
        if not file_keys:
            raise KeyConfigError(f"--api-key-file {key_file}: no key in it")
        found += [(key, f"--api-key-file {key_file}") for key in file_keys]
    found += [(k.strip(), ENV_VAR) for k in environ.get(ENV_VAR, "").split(",") if k.strip()]
    for key, source in found:
        if not _KEY_RE.fullmatch(key):
            raise KeyConfigError(
                f"{source}: a key may hold only letters, digits and !#$%&'*+-.^_`|~ "
                "(it travels as an HTTP header and a WebSocket subprotocol)"
            )
        if key.startswith(SECRET_PREFIX):
            raise KeyConfigError(f"{source}: a key must not start with {SECRET_PREFIX!r}")
    return tuple(dict.fromkeys(key for key, _ in found))


@dataclass(frozen=True, slots=True)
class ClientSecret:
    value: str
    expires_at: int  # seconds since the epoch


@lru_cache(maxsize=64)
def _signing_key(api_key: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", api_key.encode(), _KDF_SALT, _KDF_ROUNDS)


def _key_id(signing_key: bytes) -> bytes:
    return hashlib.sha256(b"key id" + signing_key).digest()[:4]


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


class Credentials:
    """The configured API keys, and the client secrets minted with them.

    With no key configured the gateway is open: anything is admitted, and secrets
    are still minted (under a key of this process) so that code written for a
    locked gateway runs against an open one.
    """

    def __init__(
        self,
        api_keys: Sequence[str] = (),
        *,
        max_secret_ttl: int = DEFAULT_SECRET_TTL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        keys = tuple(dict.fromkeys(api_keys))
        self.required = bool(keys)
        self.max_secret_ttl = max_secret_ttl
        self._clock = clock
        self._keys = [(key, _digest(key)) for key in keys]
        self._signing_by_key = {key: _signing_key(key) for key in keys}
        self._open_signing_key = secrets.token_bytes(32)  # used while no key is configured
        self._signing_by_id: dict[bytes, list[tuple[bytes, str]]] = {}
        self._tenant_by_key = {key: tenant_name(key) for key in keys}
        signing_keys = [(s, self._tenant_by_key[k]) for k, s in self._signing_by_key.items()]
        for signing, tenant in signing_keys or [(self._open_signing_key, ANONYMOUS)]:
            self._signing_by_id.setdefault(_key_id(signing), []).append((signing, tenant))

    def is_api_key(self, offered: str) -> str | None:
        """The configured key ``offered`` is (compared in constant time), or None."""
        digest = _digest(offered)
        match = None
        for key, key_digest in self._keys:  # no early exit: the time names no key
            if hmac.compare_digest(digest, key_digest):
                match = key
        return match

    def admits(self, offered: str) -> bool:
        """May ``offered`` (a key or a client secret) open a session?"""
        return self.tenant_of(offered) is not None

    def tenant_of(self, offered: str) -> str | None:
        """The tenant ``offered`` speaks for (a key's; a client secret's is the key's that
        minted it), or None if it is no credential; with no key configured, anything is
        the one anonymous tenant."""
        if offered.startswith(SECRET_PREFIX):
            return self.secret_tenant(offered)
        if not self.required:
            return ANONYMOUS
        key = self.is_api_key(offered)
        return None if key is None else self._tenant_by_key[key]

    def mint(self, api_key: str | None, ttl: int | None = None) -> ClientSecret:
        """A secret signed with ``api_key``'s signing key, valid for ``ttl`` seconds
        (the default and the ceiling are ``max_secret_ttl``)."""
        lifetime = self.max_secret_ttl if ttl is None else min(ttl, self.max_secret_ttl)
        signing = self._open_signing_key if api_key is None else self._signing_by_key[api_key]
        expires_at = int(self._clock()) + lifetime
        payload = _PAYLOAD.pack(_VERSION, _key_id(signing), expires_at, secrets.token_bytes(8))
        mac = hmac.digest(signing, payload, "sha256")[:_MAC_BYTES]
        token = base64.urlsafe_b64encode(payload + mac).decode().rstrip("=")
        return ClientSecret(SECRET_PREFIX + token, expires_at)

    def check_secret(self, value: str) -> bool:
        """Is ``value`` a secret minted with a configured key, and not yet expired?"""
        return self.secret_tenant(value) is not None

    def secret_tenant(self, value: str) -> str | None:
        """The tenant of the key that minted ``value``, if it is a secret that key signed
        and has not expired; else None."""
        token = value.removeprefix(SECRET_PREFIX)
        if len(token) != _TOKEN_CHARS or not token.isascii():
            return None
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            return None
        payload, mac = raw[: _PAYLOAD.size], raw[_PAYLOAD.size :]
        version, key_id, expires_at, _nonce = _PAYLOAD.unpack(payload)
        if version != _VERSION or expires_at <= self._clock():
            return None
        found = None
        for key, tenant in self._signing_by_id.get(key_id, ()):  # no early exit
            if hmac.compare_digest(hmac.digest(key, payload, "sha256")[:_MAC_BYTES], mac):
                found = tenant
        return found


class SecretRequestError(ValueError):
    """A ``POST /v1/realtime/client_secrets`` body the gateway refuses (HTTP 400)."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


def parse_secret_request(body: bytes) -> int | None:
    """The lifetime a mint request asks for (None: the default), validated as the hosted
    API does: ``{"expires_after": {"anchor": "created_at", "seconds": 10..7200}}``.

    A ``session`` is accepted only if it configures nothing: a secret carries no
    settings here, so a browser sends them with ``session.update`` once connected.
    """
    try:
        request = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise SecretRequestError(f"The body is not valid JSON: {exc}.", "invalid_json") from None
    if not isinstance(request, dict):
        raise SecretRequestError("The body must be a JSON object.", "invalid_type")
    for key in request:
        if key not in ("expires_after", "session"):
            raise SecretRequestError(f"Unknown parameter: '{key}'.", "unknown_parameter", key)
    _check_session(request.get("session"))
    expires_after = request.get("expires_after")
    if expires_after is None:
        return None
    if not isinstance(expires_after, dict) or not set(expires_after) <= {"anchor", "seconds"}:
        raise SecretRequestError(
            "'expires_after' must be an object with 'anchor' and 'seconds'.",
            param="expires_after",
        )
    if expires_after.get("anchor", "created_at") != "created_at":
        raise SecretRequestError(
            "'expires_after.anchor' must be 'created_at'.", param="expires_after.anchor"
        )
    seconds = expires_after.get("seconds", DEFAULT_SECRET_TTL)
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not MIN_SECRET_TTL <= seconds <= MAX_SECRET_TTL
    ):
        raise SecretRequestError(
            f"'expires_after.seconds' must be between {MIN_SECRET_TTL} and {MAX_SECRET_TTL}.",
            param="expires_after.seconds",
        )
    return int(seconds)


def _check_session(session: Any) -> None:
    if session is None:
        return
    try:
        frame = orjson.dumps({"type": "session.update", "session": session}).decode()
        update = rt.decode(frame)
    except errors.ProtocolError as err:
        raise SecretRequestError(err.message, err.code, err.param) from None
    assert isinstance(update, rt.SessionUpdate)
    patch = update.patch
    settings = [k for k in patch.__slots__ if k != "model" and getattr(patch, k) != codec.UNSET]
    if settings:
        raise SecretRequestError(
            f"A client secret carries no session settings here ('session.{settings[0]}'): "
            "send them with session.update once connected.",
            "unsupported_session_config",
            f"session.{settings[0]}",
        )
