"""The client's WebSocket I/O: opening a connection, receiving one event, and the
exceptions of :mod:`gateway.client.errors` that socket failures become."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from gateway.client.errors import (
    ClientError,
    ConnectionLost,
    GatewayTimeout,
    GatewayUnavailable,
    HandshakeRefused,
)
from gateway.client.events import JSON

CLOSE_TIMEOUT = 2.0
"""Seconds to wait for the gateway to confirm a close before dropping the connection."""


@contextlib.asynccontextmanager
async def deadline(seconds: float | None, doing: str) -> AsyncIterator[None]:
    """Raise :class:`GatewayTimeout` if the block takes longer than ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise GatewayTimeout(f"no progress {doing} for {seconds} s") from None


async def open_socket(url: str, api_key: str | None, seconds: float | None) -> ClientConnection:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        return await ws_connect(url, additional_headers=headers, open_timeout=seconds)
    except InvalidStatus as exc:
        raise _refused(exc) from None
    except TimeoutError:
        raise GatewayTimeout(f"no WebSocket handshake with {url} within {seconds} s") from None
    except (OSError, InvalidHandshake, InvalidURI) as exc:
        raise GatewayUnavailable(f"cannot connect to the gateway at {url}: {exc}") from exc


def _refused(exc: InvalidStatus) -> HandshakeRefused:
    status = exc.response.status_code
    code = "unauthorized" if status in (401, 403) else f"http_{status}"
    message = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = json.loads(message).get("error", {})
        code, message = str(error.get("code") or code), str(error.get("message") or message)
    return HandshakeRefused(status, code, message or exc.response.reason_phrase)


async def recv_json(ws: ClientConnection, seconds: float | None) -> JSON:
    """The next server event; raises ``ConnectionClosed`` for the caller to judge.

    Cancelling ``recv`` loses nothing, so the timeout is safe.
    """
    async with deadline(seconds, "waiting for the gateway"):
        frame = await ws.recv()
    try:
        event = json.loads(frame)
    except ValueError:
        raise ClientError(f"the gateway sent a frame that is not JSON: {frame[:80]!r}") from None
    if not isinstance(event, dict):
        raise ClientError(f"the gateway sent a frame that is not an event: {frame[:80]!r}")
    return event


async def close_quietly(ws: ClientConnection) -> None:
    """Close with a close frame (the gateway ends the session at once), or drop it if the
    gateway does not confirm in time."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await ws.close()
    except TimeoutError:
        ws.transport.abort()


def lost(exc: ConnectionClosed) -> ConnectionLost:
    close = exc.rcvd or exc.sent
    code = close.code if close is not None else None
    reason = close.reason if close is not None else ""
    detail = f" (close code {code}{': ' + reason if reason else ''})" if code is not None else ""
    return ConnectionLost(
        f"the connection to the gateway was lost{detail}", code=code, reason=reason
    )
