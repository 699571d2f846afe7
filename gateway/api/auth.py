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

A ``sha256:`` line of the key file holds no key to derive from, and what it does hold
is no secret from whoever reads the file: its client secrets are signed with a key
derived from the gateway's own client-secret key (``--client-secret-key``, the
same on every host; without it, a random one made at start and shared by the
``--workers`` of one parent) and the line's hash.
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

from gateway.tenants import LIMIT_NAMES, NO_LIMITS, KeyEntry, TenantLimits
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
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _tenant_of_digest(digest: bytes) -> str:
    """A key's tenant when its line names none: ``key-`` and the start of its SHA-256,
    which says which key without being one (safe in a metric label or a log line)."""
    return "key-" + digest.hex()[:12]


class KeyConfigError(ValueError):
    """An API key that cannot be used (its source is named in the message)."""


def read_api_keys(
    keys: Sequence[str] = (), key_file: str | None = None, environ: Mapping[str, str] = os.environ
) -> tuple[KeyEntry, ...]:
    """Every configured key, in order, without repeats: the flags, the file (a line per
    key: :func:`read_key_file`), then the variable (several separated by commas)."""
    found = [_checked(key, "--api-key") for key in keys]
    if key_file is not None:
        found += read_key_file(key_file)
    found += [
        _checked(k.strip(), ENV_VAR) for k in environ.get(ENV_VAR, "").split(",") if k.strip()
    ]
    unique: dict[bytes, KeyEntry] = {}
    for entry in found:
        unique.setdefault(entry.digest, entry)
    return tuple(unique.values())


def read_key_file(path: str) -> list[KeyEntry]:
    """``--api-key-file``: a line per key, ``#`` comments and blank lines aside. A line is
    the key itself, or ``sha256:HEX`` of it (so that the file holds no key), then
    optional ``word=VALUE`` fields: ``name=NAME`` (the tenant's name in metrics and logs)
    and the limits ``max_sessions``, ``max_running``, ``requests_per_minute``,
    ``tokens_per_minute``, ``weight`` (gateway/tenants.py). Two keys may share a name:
    one tenant, the first line's limits. Raises :class:`KeyConfigError` naming the line."""
    source = f"--api-key-file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyConfigError(f"{source}: {exc}") from None
    entries = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line and not line.startswith("#"):
            entries.append(_key_line(line, f"{source} line {number}"))
    if not entries:
        raise KeyConfigError(f"{source}: no key in it")
    return entries


def _key_line(line: str, where: str) -> KeyEntry:
    first, *fields = line.split()
    name: str | None = None
    limits: dict[str, int] = {}
    for word in fields:
        key, sep, value = word.partition("=")
        if not sep or not value:
            raise KeyConfigError(f"{where}: {word!r} is not word=VALUE")
        if key == "name":
            if not _NAME_RE.fullmatch(value):
                raise KeyConfigError(f"{where}: name= takes 1 to 64 letters, digits, '_.-'")
            name = value
        elif key in (*LIMIT_NAMES, "weight"):
            if not re.fullmatch(r"[0-9]{1,12}", value) or (key == "weight" and int(value) < 1):
                raise KeyConfigError(f"{where}: {key}= takes a whole number (weight: 1 or more)")
            limits[key] = int(value)
        else:
            known = ", ".join(("name", *LIMIT_NAMES, "weight"))
            raise KeyConfigError(f"{where}: unknown field {key!r} (known: {known})")
    tenant_limits = TenantLimits(**limits) if limits else NO_LIMITS
    if first.startswith("sha256:"):
        digest_hex = first.removeprefix("sha256:").lower()
        if not re.fullmatch(r"[0-9a-f]{64}", digest_hex):
            raise KeyConfigError(f"{where}: sha256: takes the 64 hex digits of the key's SHA-256")
        digest = bytes.fromhex(digest_hex)
        return KeyEntry(digest, name or _tenant_of_digest(digest), tenant_limits)
    entry = _checked(first, where)
    return KeyEntry(entry.digest, name or entry.tenant, tenant_limits, entry.key)


def _checked(key: str, source: str) -> KeyEntry:
    if not _KEY_RE.fullmatch(key):
        raise KeyConfigError(
            f"{source}: a key may hold only letters, digits and !#$%&'*+-.^_`|~ "
            "(it travels as an HTTP header and a WebSocket subprotocol)"
        )
    if key.startswith(SECRET_PREFIX):
        raise KeyConfigError(f"{source}: a key must not start with {SECRET_PREFIX!r}")
    digest = _digest(key)
    return KeyEntry(digest, _tenant_of_digest(digest), NO_LIMITS, key)


@dataclass(frozen=True, slots=True)
class ClientSecret:
    value: str
    expires_at: int  # seconds since the epoch


@lru_cache(maxsize=4096)  # a SIGHUP derives only the keys it has not seen (100k rounds each)
def _signing_key(secret: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret, _KDF_SALT, _KDF_ROUNDS)


def _signing_key_of(entry: KeyEntry, client_secret_key: bytes) -> bytes:
    """The key that signs ``entry``'s client secrets: derived from the key itself, or,
    for a ``sha256:`` line (whose hash anyone who reads the file knows), from the
    gateway's own ``client_secret_key`` and the hash."""
    if entry.key is not None:
        return _signing_key(entry.key.encode())
    return hmac.digest(client_secret_key, _HASH_LINE_LABEL + entry.digest, "sha256")


_HASH_LINE_LABEL = b"llm-gateway client secrets of a sha256: line v2\0"
MIN_CLIENT_SECRET_KEY_BYTES = 16


def read_client_secret_key(path: str) -> bytes:
    """``--client-secret-key``: the secret (at least 16 bytes, surrounding blanks
    aside) that signs a ``sha256:`` line's client secrets on every gateway given it.
    Raises :class:`KeyConfigError` naming the file."""
    source = f"--client-secret-key {path}"
    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise KeyConfigError(f"{source}: {exc}") from None
    if len(data) < MIN_CLIENT_SECRET_KEY_BYTES:
        raise KeyConfigError(
            f"{source}: holds {len(data)} bytes; use at least {MIN_CLIENT_SECRET_KEY_BYTES} "
            "random ones (python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return data


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
        api_keys: Sequence[str | KeyEntry] = (),
        *,
        max_secret_ttl: int = DEFAULT_SECRET_TTL,
        clock: Callable[[], float] = time.time,
        client_secret_key: bytes | None = None,
    ) -> None:
        """``client_secret_key``: the gateway's own, for ``sha256:`` lines (None: a random
        one, which only this object knows)."""
        first: dict[bytes, KeyEntry] = {}  # a key given twice: its first line counts
        for k in api_keys:
            entry = _checked(k, "a key") if isinstance(k, str) else k
            first.setdefault(entry.digest, entry)
        self.entries = tuple(first.values())
        self.required = bool(self.entries)
        self.max_secret_ttl = max_secret_ttl
        self._clock = clock
        own = client_secret_key or secrets.token_bytes(32)
        self._signing_by_digest = {e.digest: _signing_key_of(e, own) for e in self.entries}
        self._open_signing_key = secrets.token_bytes(32)  # used while no key is configured
        self._signing_by_id: dict[bytes, list[tuple[bytes, str]]] = {}
        signing_keys = [(self._signing_by_digest[e.digest], e.tenant) for e in self.entries]
        for signing, tenant in signing_keys or [(self._open_signing_key, ANONYMOUS)]:
            self._signing_by_id.setdefault(_key_id(signing), []).append((signing, tenant))

    @property
    def limits(self) -> dict[str, TenantLimits]:
        """Each tenant's limits (a name on several lines: the first line's)."""
        found: dict[str, TenantLimits] = {}
        for entry in self.entries:
            found.setdefault(entry.tenant, entry.limits)
        return found

    def is_api_key(self, offered: str) -> KeyEntry | None:
        """The configured key ``offered`` is (compared in constant time), or None."""
        digest = _digest(offered)
        match = None
        for entry in self.entries:  # no early exit: the time names no key
            if hmac.compare_digest(digest, entry.digest):
                match = entry
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
        entry = self.is_api_key(offered)
        return None if entry is None else entry.tenant

    def mint(self, api_key: KeyEntry | None, ttl: int | None = None) -> ClientSecret:
        """A secret signed with ``api_key``'s signing key, valid for ``ttl`` seconds
        (the default and the ceiling are ``max_secret_ttl``)."""
        lifetime = self.max_secret_ttl if ttl is None else min(ttl, self.max_secret_ttl)
        signing = (
            self._open_signing_key if api_key is None else self._signing_by_digest[api_key.digest]
        )
        expires_at = int(self._clock()) + lifetime
        payload = _PAYLOAD.pack(_VERSION, _key_id(signing), expires_at, secrets.token_bytes(8))
        mac = hmac.digest(signing, payload, "sha256")[:_MAC_BYTES]
        token = base64.urlsafe_b64encode(payload + mac).decode().rstrip("=")
        return ClientSecret(SECRET_PREFIX + token, expires_at)

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
