"""One write per socket per batch of work: what an engine step's fan-out (or a session
actor's turn, or a store flush's release of held frames) writes to one connection leaves
in one ``transport.write``.

A transport write is the costly part of sending a frame: the Python call into the
transport, a ``send`` system call, and over TLS a record with its own header, MAC and
encryption call. The frames one batch of work makes for one socket (several lanes'
deltas, a response's closing events, an SSE event and its chunk framing, the frames a
store flush releases) are joined and written once, when the outermost batch closes:
in the same loop turn, with no timer, so no token waits for another.

Who owns what: one :class:`WriteBatch` per process (the server makes it and hands it to
the scheduler, the HTTP service, the WebSocket wires and the store); each connection's
:class:`CoalescedWrites` holds that connection's bytes while a batch is open. Nothing
awaits inside a batch, so no other callback can write to the same transport between a
frame being held and its write: the bytes of one transport still leave in the order
they were written.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class WriteBatch:
    """Open (``with batch:``) while a batch of work writes; nests. When the outermost
    closes, every connection that wrote meanwhile writes its bytes at once."""

    __slots__ = ("_depth", "_dirty", "joined", "writes")

    def __init__(self) -> None:
        self._depth = 0
        self._dirty: list[CoalescedWrites] = []
        self.writes = 0  # transport writes made through it (in a batch or not)
        self.joined = 0  # the writes handed to it (more than ``writes``: it joined some)

    @property
    def open(self) -> bool:
        return self._depth > 0

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._depth -= 1
        if self._depth == 0 and self._dirty:
            dirty, self._dirty = self._dirty, []
            for writes in dirty:
                writes.flush()


class CoalescedWrites:
    """A connection's writes: straight to the transport outside a batch, held and joined
    into one write inside one."""

    __slots__ = ("_batch", "_parts", "transport")

    def __init__(self, transport: asyncio.WriteTransport, batch: WriteBatch | None) -> None:
        self.transport = transport
        self._batch = batch
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        batch = self._batch
        if batch is None:
            self.transport.write(data)
            return
        batch.joined += 1
        if batch._depth:
            if not self._parts:
                batch._dirty.append(self)
            self._parts.append(data)
            return
        batch.writes += 1
        self.transport.write(data)

    def flush(self) -> None:
        """Write what the batch held (the batch calls it as it closes)."""
        parts = self._parts
        if not parts:
            return
        self._parts = []
        if self.transport.is_closing():  # aborted meanwhile: the bytes have nowhere to go
            return
        self.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))
        if self._batch is not None:
            self._batch.writes += 1
