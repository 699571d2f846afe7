"""Connections that have not sent a whole request yet, and the answers that refuse a
WebSocket handshake.

:class:`Pending` keeps every connection whose first request head has not arrived,
oldest first. Such a connection costs a file descriptor and may never send anything
(a browser's preconnect, a load balancer's probe, an attack): beyond
``--max-handshakes`` the oldest is dropped, and shutdown aborts them all at once
instead of waiting for each one's handshake timeout. gateway/transport/http1.py adds a
connection when it is accepted and discards it when its first request head is whole;
the handshake timeout itself is that module's timer.
"""

from __future__ import annotations

import http
from collections.abc import Callable
from typing import Protocol

from websockets.datastructures import Headers
from websockets.http11 import Response


class Droppable(Protocol):
    def abort(self) -> None: ...


class Pending:
    """Connections still waiting for their first whole request head, oldest first."""

    def __init__(self, limit: int, on_drop: Callable[[str], None] | None = None) -> None:
        self.limit = limit
        self.closed = False  # shutdown: a connection that arrives now is dropped at once
        self._on_drop = on_drop
        self._connections: dict[Droppable, None] = {}

    def __len__(self) -> int:
        return len(self._connections)

    def add(self, connection: Droppable) -> None:
        if self.closed:
            self._drop(connection, "shutdown")
            return
        self._connections[connection] = None
        while len(self._connections) > self.limit:
            # The oldest, not the newest: a real client sends its request within one
            # round trip, so the longest waiter is the likeliest to send nothing.
            self._drop(next(iter(self._connections)), "limit")

    def discard(self, connection: Droppable) -> None:
        self._connections.pop(connection, None)

    def close(self) -> None:
        """Shutdown: abort every connection still waiting, and any that comes."""
        self.closed = True
        for connection in list(self._connections):
            self._drop(connection, "shutdown")

    def _drop(self, connection: Droppable, reason: str) -> None:
        self.discard(connection)
        connection.abort()
        if self._on_drop is not None:
            self._on_drop(reason)


def refusal(status: int, text: str, extra: dict[str, str] | None = None) -> Response:
    """A plain-text answer that refuses a WebSocket handshake (websockets sends it, then
    closes the connection)."""
    body = text.encode() + b"\n"
    headers = Headers(
        {
            "Content-Type": "text/plain; charset=utf-8",
            "Content-Length": str(len(body)),
            "Connection": "close",
        }
    )
    for name, value in (extra or {}).items():
        headers[name] = value
    return Response(status, http.HTTPStatus(status).phrase, headers, body)
