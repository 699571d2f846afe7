"""A socket-free :class:`~sessions.outbox.Wire` for outbox and session tests."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from sessions.outbox import CloseRequest


class MemoryWire:
    """Records what an outbox writes; ``room`` says whether writes may go through now."""

    def __init__(self, *, room: bool = True) -> None:
        self.frames: asyncio.Queue[dict[str, Any] | CloseRequest] = asyncio.Queue()
        self._room = asyncio.Event()
        if room:
            self._room.set()
        self.closed: CloseRequest | None = None
        self.written = 0

    def set_room(self, room: bool) -> None:
        if room:
            self._room.set()
        else:
            self._room.clear()

    def writable(self) -> bool:
        return self._room.is_set() and self.closed is None

    def write(self, frame: bytes) -> None:
        assert self.writable(), "written while it had no room"
        self._record(frame)

    async def write_later(self, frame: bytes) -> None:
        await self._room.wait()
        if self.closed is None:
            self._record(frame)

    def close(self, code: int, reason: str) -> None:
        if self.closed is None:
            self.closed = CloseRequest(code, reason)
            self.frames.put_nowait(self.closed)

    def _record(self, frame: bytes) -> None:
        self.written += 1
        self.frames.put_nowait(orjson.loads(frame))

    async def next(self, timeout: float = 5) -> dict[str, Any] | CloseRequest:
        async with asyncio.timeout(timeout):
            return await self.frames.get()

    def drain(self) -> list[dict[str, Any] | CloseRequest]:
        out = []
        while not self.frames.empty():
            out.append(self.frames.get_nowait())
        return out
