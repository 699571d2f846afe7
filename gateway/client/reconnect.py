"""Getting a dropped session back: new connections, with a short backoff, until one
resumes it (``session.resume``) or the time is up.

The bookkeeping (what to resume, from which event) is :mod:`gateway.client.resume`'s; the
chat that called decides what to do with the new connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from gateway.client.errors import (
    ConnectionLost,
    GatewayError,
    GatewayUnavailable,
    HandshakeRefused,
)
from gateway.client.events import JSON
from gateway.client.resume import Cursor, backoff, resume_url
from gateway.client.sockets import close_quietly, open_socket, recv_json

logger = logging.getLogger("gateway.client")


@dataclass(frozen=True, slots=True)
class Dialer:
    """How to reach the gateway again: the first connection's URL and credentials."""

    url: str
    api_key: str | None
    timeout: float | None  # the longest wait for any one event (None: no limit)
    resume: bool
    resume_timeout: float


class _Retry(Exception):
    """One attempt failed in a way that another attempt may not (its cause says how)."""


_REFUSALS: dict[str | None, str] = {
    "session_not_found": "the gateway no longer holds it (session_not_found: its resume "
    "window is over, or the gateway restarted)",
    "resume_gap": "the gateway no longer keeps every event this client missed (resume_gap)",
}


async def reconnect(
    dialer: Dialer, cursor: Cursor, closing: Callable[[], bool]
) -> tuple[ClientConnection, JSON]:
    """A new connection that resumed ``cursor``'s session, and its ``session.resumed``.

    Tries until ``dialer.resume_timeout`` has passed (or ``closing()``); raises
    :class:`ConnectionLost` then, or at once if the gateway refuses the resume.
    """
    loop = asyncio.get_running_loop()
    limit = dialer.resume_timeout
    deadline = loop.time() + limit
    url = resume_url(dialer.url, str(cursor.session_id))
    delays = backoff()
    why: BaseException | None = None  # the latest failure, a timeout only if nothing else
    while True:
        if closing():
            raise ConnectionLost("the chat was closed while its connection was being resumed")
        left = deadline - loop.time()
        if left <= 0:
            raise ConnectionLost(
                f"the connection to the gateway was lost, and no new one could resume "
                f"the session within {limit:g} s: {why or 'no attempt finished'}"
            ) from why
        try:
            return await _attempt(dialer, cursor, url, left)
        except _Retry as retry:
            failure = retry.__cause__ or retry
            if why is None or not isinstance(failure, TimeoutError):
                why = failure
            logger.debug("resume attempt failed (%r); retrying", failure)
            await asyncio.sleep(min(next(delays), max(0.0, deadline - loop.time())))


async def _attempt(
    dialer: Dialer, cursor: Cursor, url: str, seconds: float
) -> tuple[ClientConnection, JSON]:
    """A new connection, its own ``session.created``, then ``session.resume`` and the
    answer. Raises :class:`_Retry`, or :class:`ConnectionLost` if refused."""
    if dialer.timeout is not None:
        seconds = min(seconds, dialer.timeout)
    ws: ClientConnection | None = None
    try:
        async with asyncio.timeout(seconds):
            ws = await open_socket(url, dialer.api_key, None)
            created = await recv_json(ws, None)
            if created.get("type") != "session.created":
                raise _Retry(f"expected session.created, got {created.get('type')!r}")
            await ws.send(json.dumps(cursor.resume_event()))
            answer = await recv_json(ws, None)
    except HandshakeRefused as exc:
        if exc.status >= 500:  # overloaded, or restarting: the next attempt may pass
            raise _Retry from exc
        raise ConnectionLost(f"the connection to the gateway was lost: {exc}") from exc
    except (GatewayUnavailable, ConnectionClosed, TimeoutError, _Retry) as exc:
        if ws is not None:
            ws.transport.abort()
        if isinstance(exc, _Retry):
            raise
        raise _Retry from exc
    except BaseException:
        if ws is not None:
            ws.transport.abort()
        raise
    if answer.get("type") == "session.resumed":
        return ws, answer
    await close_quietly(ws)  # a close frame ends the fresh session it started as
    code = GatewayError.from_event(answer).code if answer.get("type") == "error" else None
    why = _REFUSALS.get(code, f"the gateway answered {answer.get('type')!r}")
    raise ConnectionLost(
        f"the connection to the gateway was lost and the conversation cannot be resumed: {why}",
        resume_error=code,
    )
