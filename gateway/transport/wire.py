"""The socket end of a session's outbox: a WebSocket connection the outbox writes to.

Direct writes when the transport has room (no task and no await; the frames of one batch
of work joined into one transport write, gateway/transport/coalesce.py), ``send`` when it
pushes back, the stall probe that tells a client that stopped reading, and a close that
cannot hang on a client that reads nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Protocol

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request
from websockets.protocol import State

from gateway.transport.coalesce import CoalescedWrites, WriteBatch

CLOSE_TIMEOUT = 2.0
KERNEL_SEND_BUFFER = 64 << 10  # per connection (Linux doubles it for bookkeeping)


class Hold(Protocol):
    """What a socket's writes wait for before they reach the client: the session store's
    flush (gateway/cluster/store_holds.py), so that no client sees a frame the store lacks,
    nor one numbered by a process whose lease another has taken (a callback for a session
    the store has lost is never called: the wire is abandoned instead)."""

    up: bool  # False: nothing to wait for (memory-only meanwhile)...
    lapsed: bool  # ...unless the lease may have run out meanwhile: then frames wait

    def after_flush(self, callback: Callable[[], None], session: str | None = None) -> None:
        """After everything queued now is stored."""

    def due(self, session_id: str | None) -> tuple[int, int]:
        """The flushes (of each of the store's lanes) that store what ``session_id`` (None:
        every session) queued so far."""

    def after(
        self, due: tuple[int, int], callback: Callable[[], None], session: str | None = None
    ) -> None:
        """After the flushes ``due`` are written."""


MAX_HELD = 256  # frames held for the store's flush before the outbox is told to wait


class SocketWire:
    """The socket end of a session's outbox.

    When the transport has room, a frame goes straight to the transport, on the
    caller's stack: no task, no await. It is framed here, as websockets' sans-I/O
    protocol would frame it for a server (a final text frame, unmasked: the
    connection negotiates no extension), without building a ``Frame`` per token, and
    only while that protocol is open. The outbox guarantees the one-writer rule
    ``send`` would otherwise enforce. When the transport pushes back, the outbox's
    writer task uses ``send`` itself, which waits for room.
    """

    __slots__ = (
        "_abandoned",
        "_close_task",
        "_group",
        "_group_due",
        "_held",
        "_held_upto",
        "_hold",
        "_probe",
        "_probe_at",
        "_probed_bytes",
        "_protocol",
        "_released",
        "_sent_bytes",
        "_writes",
        "_ws",
        "session_id",
    )

    def __init__(
        self, ws: ServerConnection, hold: Hold | None = None, batch: WriteBatch | None = None
    ) -> None:
        self._ws = ws
        self._writes = CoalescedWrites(ws.transport, batch)
        self._hold = hold
        self._abandoned = False  # the session's lease went elsewhere: write nothing more
        self._held: list[bytes] = []
        # Held frames leave in groups, each once the flushes it needs are written: frames
        # ever held, frames ever released, and the latest group still waiting (the count
        # of frames it ends at, and what it waits for).
        self._held_upto = 0
        self._released = 0
        self._group: list[int] | None = None
        self._group_due = (0, 0)
        self._protocol = ws.protocol
        self._close_task: asyncio.Task[None] | None = None
        self._sent_bytes = 0
        self._probed_bytes = 0  # what was sent when the last probe went out
        self._probe: asyncio.Task[None] | None = None
        self._probe_at = 0.0
        # The session whose outbox writes here (set by the store's persistence at each
        # attach): its held frames wait for its own writes only. None: for all writes.
        self.session_id: str | None = None

    def writable(self) -> bool:
        return not self._ws.paused and len(self._held) < MAX_HELD

    def write(self, frame: bytes) -> None:
        hold = self._hold
        if hold is not None and (hold.up or hold.lapsed):
            self._hold_frame(hold, frame)
            return
        # _send, inline: this is every token's way out.
        if self._protocol.state is not State.OPEN:
            return  # closing or gone: the frame stays in the replay buffer only
        size = len(frame)
        self._writes.write((_HEADERS[size] if size < _TABLED else text_frame_header(size)) + frame)
        self._sent_bytes += size

    def _hold_frame(self, hold: Hold, frame: bytes) -> None:
        """Out once the store has it: with the frames held before it that wait for the same
        flushes (one callback per flush, not per frame), else in a group of its own. A frame
        logged while a flush is in flight is in the next one: it must not leave with the
        frames of the flush in flight. A group never waits for less than the one before
        it (the wire may have moved to another session), so groups leave in order."""
        log_due, state_due = hold.due(self.session_id)
        last_log, last_state = self._group_due
        due = (max(log_due, last_log), max(state_due, last_state))
        self._held.append(frame)
        self._held_upto += 1
        group = self._group
        if group is not None and due == self._group_due:
            group[0] = self._held_upto
            return
        group = self._group = [self._held_upto]
        self._group_due = due
        hold.after(due, lambda: self._release_group(group), self.session_id)

    def _release_group(self, group: list[int]) -> None:
        if self._group is group:
            self._group = None
        self._release(group[0])

    def _release(self, upto: int | None = None) -> None:
        """The held frames (up to the ``upto``-th ever held), in one write."""
        count = (self._held_upto if upto is None else upto) - self._released
        if count <= 0:
            return
        held = self._held[:count]
        del self._held[:count]
        self._released += count
        if self._protocol.state is not State.OPEN or self._abandoned:
            return  # closing or gone: the frames stay in the replay buffer only
        parts: list[bytes] = []
        for frame in held:
            parts += (text_frame_header(len(frame)), frame)
            self._sent_bytes += len(frame)
        self._writes.write(b"".join(parts))

    def _send(self, frame: bytes) -> None:
        if self._protocol.state is not State.OPEN or self._abandoned:
            return  # closing or gone: the frame stays in the replay buffer only
        size = len(frame)
        self._writes.write((_HEADERS[size] if size < _TABLED else text_frame_header(size)) + frame)
        self._sent_bytes += size

    async def write_later(self, frame: bytes) -> None:
        hold = self._hold
        if hold is not None and (hold.up or hold.lapsed):
            flushed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            hold.after_flush(lambda: _resolve(flushed), self.session_id)
            await flushed  # held frames before it went out in an earlier callback
            if self._abandoned:
                return
            self._release()
        with contextlib.suppress(ConnectionClosed):
            await self._ws.send(frame, text=True)
            self._sent_bytes += len(frame)

    def close(self, code: int, reason: str) -> None:
        if self._held and self._hold is not None:
            # After the frames it holds: they reach the client once the store has them.
            self._hold.after_flush(lambda: self._close(code, reason), self.session_id)
            return
        self._close(code, reason)

    def abandon(self, code: int, reason: str) -> None:
        """The session lost its lease to another process: the frames held for the store
        are dropped (never sent: they were numbered after the other one took over), nothing
        more is written, and the client is closed with ``code`` now (it resumes there)."""
        self._abandoned = True
        self._held.clear()
        self._released = self._held_upto
        self._group = None
        self._close(code, reason)

    def _close(self, code: int, reason: str, timeout: float = CLOSE_TIMEOUT) -> None:
        self._release()
        if self._protocol.state is not State.OPEN:
            return  # closing or closed already (the client's close, say): websockets ends it
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(
                close_socket(self._ws, code, reason, timeout)
            )

    def check_stall(self, now: float, stall: float) -> bool:
        """Called a few times per ``stall`` seconds; True when it closed a stalled client.

        "Reading" is defined by progress, not by buffer sizes: after frames were sent,
        a ping goes out behind them, and the client answers it only once it has read
        everything before it. Kernel buffers (which can absorb megabytes, and which a
        TCP peer acknowledges without its application reading anything) cannot hide a
        client that stopped reading: its pong never comes. A client with nothing sent
        to it is left to websockets' keepalive.
        """
        if self._close_task is not None or self._protocol.state is not State.OPEN:
            return False
        probe = self._probe
        if probe is not None and not probe.done():
            if now - self._probe_at < stall:
                return False
            self._close(1008, "client stopped reading", timeout=min(CLOSE_TIMEOUT, stall))
            return True
        if self._sent_bytes > self._probed_bytes:
            self._probed_bytes, self._probe_at = self._sent_bytes, now
            self._probe = asyncio.get_running_loop().create_task(self._ping())
        return False

    async def _ping(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            await (await self._ws.ping())

    @property
    def closing(self) -> bool:
        """This wire started a close (whose end :meth:`closed` waits for)."""
        return self._close_task is not None

    async def closed(self) -> None:
        """Until the close this wire started (if any) is done."""
        if self._close_task is not None:
            await asyncio.shield(self._close_task)


def text_frame_header(size: int) -> bytes:
    """The header of a server's final, unmasked text frame of ``size`` bytes (RFC 6455
    5.2: the length in 7 bits, or 126 and 16 bits, or 127 and 64 bits)."""
    if size < 126:
        return bytes((0x81, size))
    if size < 1 << 16:
        return struct.pack("!BBH", 0x81, 126, size)
    return struct.pack("!BBQ", 0x81, 127, size)


# The headers of the frame sizes most events have (a delta is about 150 to 250 bytes),
# made once: about 190 KiB per process.
_TABLED = 4096
_HEADERS = [text_frame_header(size) for size in range(_TABLED)]


class NullWire:
    """The wire of a detached session that has a store: its frames are numbered and
    logged (another process may resume the session from the log) and go nowhere else."""

    __slots__ = ()

    def writable(self) -> bool:
        return True

    def write(self, frame: bytes) -> None:
        pass

    async def write_later(self, frame: bytes) -> None:
        pass

    def close(self, code: int, reason: str) -> None:
        pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def cap_kernel_send_buffer(ws: ServerConnection) -> None:
    """Keep what the kernel holds for one client small: a client that stops reading
    then pushes back on the outbox (which merges deltas) within a few frames, instead
    of parking megabytes in an auto-tuned socket buffer."""
    sock = ws.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_SEND_BUFFER)


def forget_handshake(ws: ServerConnection) -> None:
    """Drop the opening handshake's request and response, which websockets keeps for the
    handler to read: nothing reads them once the connection is open, and their headers
    are about 3 KiB of every idle connection. (The request object itself must stay:
    websockets takes a connection without one for one still in its handshake.)"""
    if ws.request is not None:
        ws.request = Request(ws.request.path, Headers())
    ws.response = None


async def close_socket(
    ws: ServerConnection,
    code: int,
    reason: str,
    timeout: float = CLOSE_TIMEOUT,  # noqa: ASYNC109 (the close frame's own deadline)
) -> None:
    """Close with ``code``; if the close frame cannot even be written (the client reads
    nothing, so ``close()`` would wait on a full buffer forever), drop the TCP connection."""
    try:
        async with asyncio.timeout(timeout):
            await ws.close(code, reason)
    except TimeoutError:
        ws.transport.abort()
