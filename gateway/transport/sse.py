"""The socket end of an outbox that is an HTTP response: Server-Sent Events.

Each numbered frame (a Responses event, already JSON) goes out as one SSE message,
``event: TYPE`` then ``data: JSON``, written straight to the transport while it has
room (as :class:`~gateway.transport.wire.SocketWire` does for a WebSocket), and through
``drain`` when the client reads slowly. The stream is over once a terminal event
(``response.completed``, ``.incomplete``, ``.failed``) went out, or the outbox closed
the wire: :attr:`over` tells the route handler, which then ends the HTTP response.
"""

from __future__ import annotations

import asyncio
import contextlib

from gateway.transport.http1 import ClientDisconnected, HttpReply

TERMINAL_TYPES = (b"response.completed", b"response.incomplete", b"response.failed")
_TYPE = b'"type":"'


def sse_message(frame: bytes) -> tuple[bytes, bytes]:
    """(the SSE message for an encoded event, its type)."""
    start = frame.find(_TYPE) + len(_TYPE)
    event_type = frame[start : frame.find(b'"', start)]
    return b"event: %b\ndata: %b\n\n" % (event_type, frame), event_type


class SseWire:
    """One SSE response as an outbox's wire (see the module docstring)."""

    __slots__ = ("_reply", "over")

    def __init__(self, reply: HttpReply) -> None:
        self._reply = reply
        self.over = asyncio.Event()

    def writable(self) -> bool:
        return self._reply.writable and not self.over.is_set()

    def write(self, frame: bytes) -> None:
        if self.over.is_set():
            return
        message, event_type = sse_message(frame)
        self._reply.write(message)
        if event_type in TERMINAL_TYPES:
            self.over.set()

    async def write_later(self, frame: bytes) -> None:
        with contextlib.suppress(ClientDisconnected):
            await self._reply.drain()
            self.write(frame)

    def close(self, code: int, reason: str) -> None:
        """The outbox let go of this stream (the session ended, or another stream
        took it over): the handler ends the response."""
        self.over.set()
