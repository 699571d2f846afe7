"""Sans-I/O half of the client: URLs, the client events it sends, and options checking.

Nothing here touches a socket, so the wire shapes are testable with dicts alone.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict
from urllib.parse import urlsplit, urlunsplit

JSON = dict[str, Any]

DEFAULT_URL = "ws://127.0.0.1:8765/v1/realtime"
REALTIME_PATH = "/v1/realtime"
URL_ENV = "GATEWAY_URL"


class SessionOptions(TypedDict, total=False):
    """Settings of the whole conversation, sent with ``session.update``."""

    instructions: str
    max_output_tokens: int | Literal["inf"]
    temperature: float
    top_p: float
    seed: int
    stop: str | Sequence[str]
    frequency_penalty: float
    presence_penalty: float


class ResponseOptions(SessionOptions, total=False):
    """Per-answer overrides, sent with ``response.create``; ``metadata`` comes back in the reply."""

    metadata: Mapping[str, str]


_SESSION_KEYS = frozenset(SessionOptions.__annotations__)
_RESPONSE_KEYS = frozenset(ResponseOptions.__annotations__) | _SESSION_KEYS


def resolve_url(url: str | None) -> str:
    """The gateway's WebSocket URL: ``url``, else ``$GATEWAY_URL``, else the local default.

    ``ws://host:port`` (no path) gets ``/v1/realtime`` added, and ``http(s)://`` becomes
    ``ws(s)://``, so the address printed by the server or used for ``/healthz`` works too.
    """
    raw = url or os.environ.get(URL_ENV) or DEFAULT_URL
    parts = urlsplit(raw)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"not a WebSocket URL: {raw!r} (expected ws://host:port/v1/realtime)")
    path = parts.path if parts.path not in ("", "/") else REALTIME_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class EventIds:
    """Fresh client ``event_id``s and item ids, unique on this connection.

    The gateway echoes an event's id in any ``error`` it causes, which is how the client
    tells whose request failed.
    """

    def __init__(self) -> None:
        self._tag = secrets.token_hex(3)
        self._count = itertools.count(1)

    def event(self) -> str:
        return f"cevt_{self._tag}{next(self._count):x}"

    def item(self) -> str:
        return f"citem_{self._tag}{next(self._count):x}"


def _fields(options: Mapping[str, Any], allowed: frozenset[str]) -> JSON:
    """Keep the set options (``None`` means "not set"); refuse unknown names early."""
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
    out = {key: value for key, value in options.items() if value is not None}
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    elif "stop" in out:
        out["stop"] = list(out["stop"])
    if "metadata" in out:
        out["metadata"] = dict(out["metadata"])
    return out


def session_update(event_id: str, options: Mapping[str, Any]) -> JSON:
    session = {"type": "realtime", "output_modalities": ["text"]}
    session.update(_fields(options, _SESSION_KEYS))
    return {"type": "session.update", "event_id": event_id, "session": session}


def user_message(event_id: str, item_id: str, text: str) -> JSON:
    item = {
        "id": item_id,
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    return {"type": "conversation.item.create", "event_id": event_id, "item": item}


def response_create(event_id: str, options: Mapping[str, Any]) -> JSON:
    event: JSON = {"type": "response.create", "event_id": event_id}
    fields = _fields(options, _RESPONSE_KEYS)
    if fields:
        event["response"] = fields
    return event


def response_cancel(event_id: str, response_id: str | None) -> JSON:
    event: JSON = {"type": "response.cancel", "event_id": event_id}
    if response_id is not None:
        event["response_id"] = response_id
    return event


def item_retrieve(event_id: str, item_id: str) -> JSON:
    return {"type": "conversation.item.retrieve", "event_id": event_id, "item_id": item_id}


def response_id_of(event: Mapping[str, Any]) -> str | None:
    """The response a server event belongs to (``response.*`` events name it one of two ways)."""
    rid = event.get("response_id")
    if isinstance(rid, str):
        return rid
    response = event.get("response")
    if isinstance(response, Mapping) and isinstance(response.get("id"), str):
        return str(response["id"])
    return None
