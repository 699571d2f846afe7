"""Per-session buffer between the session (and scheduler) and the socket writer.

Like vLLM's ``RequestOutputCollector``: while the writer is behind, consecutive
text deltas of one response merge into one pending delta, so a slow reader
costs memory proportional to the text, not to the number of tokens, and the
joined text is unchanged. Anything else a client can make pile up (errors,
item events) is capped: past the cap the outbox asks for the connection to be
closed with 1008 instead of growing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from gateway.protocol import JSON, encode, event

# Rough memory costs, so the byte cap means memory: a pending delta's event fields,
# and each merged piece of text (a str object and its list slot).
_DELTA_OVERHEAD = 160
_PART_OVERHEAD = 64
_MAX_PARTS = 256


@dataclass(slots=True)
class _PendingDelta:
    response_id: str
    item_id: str
    parts: list[str] = field(default_factory=list)

    def encode(self) -> bytes:
        return encode(
            event(
                "response.output_text.delta",
                response_id=self.response_id,
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                delta="".join(self.parts),
            )
        )


@dataclass(frozen=True, slots=True)
class CloseRequest:
    """Tells the writer to close the socket with this code once it gets here."""

    code: int
    reason: str


@dataclass(slots=True)
class OutboxStats:
    deltas_in: int = 0  # deltas handed to the outbox
    frames_out: int = 0  # frames handed to the writer
    delta_frames_out: int = 0  # of which text deltas (fewer than deltas_in when coalescing)


class Outbox:
    def __init__(
        self, *, max_pending: int = 2048, max_pending_bytes: int = 16 << 20, coalesce: bool = True
    ) -> None:
        self._pending: deque[bytes | _PendingDelta | CloseRequest] = deque()
        # Deltas still mergeable, by response. Cleared by any other event, so each
        # response's events keep their order on the wire.
        self._open: dict[str, _PendingDelta] = {}
        self._bytes = 0
        self._max_pending = max_pending
        self._max_bytes = max_pending_bytes
        self._coalesce = coalesce
        self._ready = asyncio.Event()
        self._closed = False
        self.stats = OutboxStats()

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def put(self, server_event: JSON) -> None:
        if self._closed:
            return
        self._open.clear()
        frame = encode(server_event)
        self._append(frame, len(frame))

    def put_delta(self, response_id: str, item_id: str, text: str) -> None:
        if self._closed:
            return
        self.stats.deltas_in += 1
        pending = self._open.get(response_id) if self._coalesce else None
        if pending is not None:
            pending.parts.append(text)
            self._bytes += len(text) + _PART_OVERHEAD
            if len(pending.parts) >= _MAX_PARTS:  # one string, not thousands of small ones
                self._bytes -= _PART_OVERHEAD * (len(pending.parts) - 1)
                pending.parts = ["".join(pending.parts)]
            self._check_limits()
            return
        pending = _PendingDelta(response_id, item_id, [text])
        self._open[response_id] = pending
        self._append(pending, len(text) + _DELTA_OVERHEAD)

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Send what is pending, then have the writer close with ``code``."""
        if not self._closed:
            self._pending.append(CloseRequest(code, reason))
            self._closed = True
            self._ready.set()

    def abort(self, code: int, reason: str) -> None:
        """Drop what is pending and close at once (the client is not reading)."""
        self._pending.clear()
        self._open.clear()
        self._bytes = 0
        self._closed = False
        self.close(code, reason)

    async def get(self) -> tuple[bytes, bool] | CloseRequest:
        """The next frame and whether it is a text delta, or the close request that ends it."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        entry = self._pending.popleft()
        if isinstance(entry, CloseRequest):
            return entry
        self.stats.frames_out += 1
        if isinstance(entry, bytes):
            self._bytes -= len(entry)
            return entry, False
        # Taking a delta ends its mergeability: later text goes into a new frame.
        if self._open.get(entry.response_id) is entry:
            del self._open[entry.response_id]
        self._bytes -= sum(map(len, entry.parts)) + _PART_OVERHEAD * (len(entry.parts) - 1)
        self._bytes -= _DELTA_OVERHEAD
        self.stats.delta_frames_out += 1
        return entry.encode(), True

    def _append(self, entry: bytes | _PendingDelta, size: int) -> None:
        self._pending.append(entry)
        self._bytes += size
        self._ready.set()
        self._check_limits()

    def _check_limits(self) -> None:
        if len(self._pending) > self._max_pending or self._bytes > self._max_bytes:
            self.abort(1008, "client is not reading its events")
