"""The socket end of an outbox that is an HTTP response: Server-Sent Events.

Each numbered frame (an event or a chunk, already JSON) goes out as one SSE message,
written straight to the transport while it has room (as
:class:`~gateway.transport.wire.SocketWire` does for a WebSocket), and through ``drain``
when the client reads slowly. How a frame is framed, and which frame ends the stream, is
the API's (a :data:`Messages` function):

- the Responses API: ``event: TYPE`` then ``data: JSON``; over after a terminal event
  (``response.completed``, ``.incomplete``, ``.failed``);
- Chat Completions and Completions: ``data: JSON`` alone; the last chunk (the last
  choice's with a ``finish_reason``, or with ``include_usage`` the usage chunk after them,
  whose ``choices`` is empty; or an error object) is followed by ``data: [DONE]``.

The wire ends the HTTP response with its last message (in the same write). The stream is
also over once the outbox closed the wire: :attr:`SseWire.over` tells the route handler
either way, and a response not ended yet is ended when the handler returns.

With a ``hold`` (the session store, for a background response that another instance
may take over) each message waits for the store's flush that logs its frame, as a
WebSocket's frames do (gateway/transport/wire.py): a client never reads an event the
store lacks, so its ``starting_after`` is always one the next instance can continue from.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from gateway.transport.http1 import ClientDisconnected, HttpReply
from gateway.transport.wire import MAX_HELD, Hold

TERMINAL_TYPES = (b"response.completed", b"response.incomplete", b"response.failed")
_TYPE = b'"type":"'

Messages = Callable[[bytes], tuple[bytes, bytes, bool]]
"""What goes before and after a frame in its SSE message, and whether it ends the stream."""

# A Responses text delta (its framing's template starts so): every token's event.
_DELTA_START = b'{"type":"response.output_text.delta"'
_DELTA_PREFIX = b"event: response.output_text.delta\ndata: "
_END = b"\n\n"


def responses_message(frame: bytes) -> tuple[bytes, bytes, bool]:
    if frame.startswith(_DELTA_START):
        return _DELTA_PREFIX, _END, False
    start = frame.find(_TYPE) + len(_TYPE)
    event_type = frame[start : frame.find(b'"', start)]
    return b"event: %b\ndata: " % event_type, _END, event_type in TERMINAL_TYPES


_DATA = b"data: "
_DONE = b"\n\ndata: [DONE]\n\n"


def chunk_messages(include_usage: bool, choices: int = 1) -> Messages:
    """Chat Completions' and Completions' chunks: over after the usage chunk, or without
    one after the last of ``choices`` chunks with a ``finish_reason`` (or an error)."""
    # The markers are JSON keys with their quotes: inside a string value (a token's text,
    # a call's arguments) a quote is escaped, so no content can look like them.
    last = b'"choices":[]' if include_usage else b'"finish_reason":"'
    left = [1 if include_usage else choices]  # marked chunks still to come

    def message(frame: bytes) -> tuple[bytes, bytes, bool]:
        if frame.startswith(b'{"error"') or (last in frame and _counted(left)):
            return _DATA, _DONE, True
        return _DATA, _END, False

    return message


def _counted(left: list[int]) -> bool:
    """One more marked chunk came: True if it was the last."""
    left[0] -= 1
    return left[0] == 0


class SseWire:
    """One SSE response as an outbox's wire (see the module docstring)."""

    __slots__ = ("_ended", "_held", "_hold", "_messages", "_reply", "over", "session_id")

    def __init__(
        self, reply: HttpReply, messages: Messages = responses_message, hold: Hold | None = None
    ) -> None:
        self._reply = reply
        self._messages = messages
        self.over = asyncio.Event()
        self._ended = False  # ``over`` is set (a flag for the per-token path)
        self._hold = hold
        self._held = 0  # frames waiting for the store
        self.session_id: str | None = None  # whose writes they wait for (the store sets it)

    def writable(self) -> bool:
        return not self._ended and self._reply.writable and self._held < MAX_HELD

    def write(self, frame: bytes) -> None:
        if self._ended:
            return
        hold = self._hold
        if hold is not None and (hold.up or hold.lapsed):
            # One callback a frame: the store calls them back in order.
            self._held += 1
            due = hold.due(self.session_id)
            hold.after(due, lambda: self._release(frame), self.session_id)
            return
        # _send, inline: this is every token's way out.
        prefix, suffix, last = self._messages(frame)
        self._reply.write_framed(prefix, frame, suffix)
        if last:
            # The body's end goes with the last event, in the same write.
            self._reply.end()
            self._end()

    def _release(self, frame: bytes) -> None:
        self._held -= 1
        self._send(frame)

    def _send(self, frame: bytes) -> None:
        if self._ended:
            return
        prefix, suffix, last = self._messages(frame)
        self._reply.write_framed(prefix, frame, suffix)
        if last:
            # The body's end goes with the last event, in the same write.
            self._reply.end()
            self._end()

    async def write_later(self, frame: bytes) -> None:
        with contextlib.suppress(ClientDisconnected):
            await self._reply.drain()
            self.write(frame)

    def close(self, code: int, reason: str) -> None:
        """The outbox let go of this stream (the session ended, or another stream
        took it over): the handler ends the response (after the frames held)."""
        if self._held and self._hold is not None:
            self._hold.after_flush(self._end, self.session_id)
            return
        self._end()

    def abandon(self, code: int, reason: str) -> None:
        """The session lost its lease to another process: the frames held are never sent
        and the stream ends now, unfinished (its client asks again, with
        ``starting_after``, and reaches the owner's log)."""
        self._end()

    def _end(self) -> None:
        self._ended = True
        self.over.set()
