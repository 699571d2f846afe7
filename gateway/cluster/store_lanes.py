"""A lane of the session store: one writer task, its flushes pipelined per node.

The store (redis_store.py) has two lanes, each a :class:`Lane`: what it queued leaves in
one flush per loop turn. A flush's commands go to the node their keys live on (one node
for one server or Sentinel; a slot's primary in a cluster), each node on a connection of
the lane's own, with a task that reads that node's replies in order. A flush goes out
while the ones before it wait for their replies (up to ``depth`` in flight: a slow Redis
pushes back on the lane); it is *written* once every node it went to has answered, and
flushes are reported written in the order they were sent, so that what waits for flush N
waits for everything before it too. On one connection Redis runs the flushes in the
order they were sent, so a session's writes (all on its slot's node) arrive in order.

Any failure (a connection lost, a node that is no primary any more: ``MOVED``,
``READONLY``, a Sentinel's demoted primary) fails the lane as a whole: what was in flight
is queued again (every write is idempotent: a frame the log has stays as it is), the
connections go, the topology is asked again after a backoff, and the lane goes on. A
script's refusal for one session is not a failure: it is a status in the reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.cluster import store_scripts
from gateway.cluster.redis_topology import Topology

log = logging.getLogger(__name__)

RETRY_SECONDS = 0.05  # after a failure, doubling up to
MAX_RETRY_SECONDS = 0.5  # a new primary is written to within this of being there


@dataclass(slots=True)
class Batch:
    """What one flush writes: commands by node, what each node's replies mean (called
    with the node and its replies, as soon as they are in), how to queue it all again if
    they never come, and the bytes of frames it carries."""

    commands: dict[str, list[tuple[Any, ...]]]
    replies: Callable[[str, list[Any]], None]
    requeue: Callable[[], None]
    frame_bytes: int = 0


@dataclass(slots=True)
class _Sent:
    number: int
    parts: int  # nodes that have not answered yet
    batch: Batch
    at: float  # perf_counter when it went out


@dataclass(slots=True)
class _Channel:
    """A lane's connection to one node, and the flushes whose replies it waits for."""

    connection: AbstractConnection
    waiting: deque[tuple[_Sent, int]] = field(default_factory=deque)  # (flush, replies)
    more: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None


class Lane:
    """One writer task and what waits for it. ``started``: flushes begun; ``done``:
    flushes written (or given up on at a failure). What is queued now leaves in flush
    :attr:`next`."""

    def __init__(
        self,
        name: str,
        depth: int,
        topology: Topology,
        take: Callable[[], Batch],
        written: Callable[[Lane, int, float, int], None],
        failed: Callable[[Lane, BaseException], None],
    ) -> None:
        self.name = name
        self.depth = depth
        self.wake = asyncio.Event()
        self.started = 0
        self.done = 0
        self._topology = topology
        self._take = take
        self._written = written  # (lane, flush number, when it went out, frame bytes)
        self._failed = failed
        self._sent: deque[_Sent] = deque()
        self._channels: dict[str, _Channel] = {}
        self._full = False
        self._backoff = RETRY_SECONDS

    @property
    def next(self) -> int:
        return self.started + 1

    async def run(self) -> None:
        """Forever: the flushes, and after a failure a backoff and the topology again."""
        task = asyncio.current_task()
        while True:
            # redis-py can lose a cancel that lands in a read, a send or a connect, or turn
            # it into an error of its own: the cancel must still win, or close() would
            # wait for this task forever.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            try:
                await self._serve()
            except Exception as exc:
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from exc
                # A lane outlives whatever its connections do: a dead lane would hold
                # every socket's frames for good (each waits for its next flush).
                if not isinstance(exc, RedisError | OSError):
                    log.exception("session store: the %s lane failed", self.name)
                self._fail(exc)
                await asyncio.sleep(self._backoff)
                self._backoff = min(MAX_RETRY_SECONDS, 2 * self._backoff)
                with contextlib.suppress(RedisError, OSError):
                    await self._topology.refresh()
                self.wake.set()

    async def _serve(self) -> None:
        task = asyncio.current_task()
        await self.wake.wait()  # connect when there is something to write (not while idle)
        try:
            while True:
                # A cancel that landed as a send completed is lost by asyncio.wait_for
                # before Python 3.12 (redis-py sends through it): it must still win.
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError
                await self.wake.wait()  # something to send; room again; a reader ended
                for channel in self._channels.values():
                    if channel.reader is not None and channel.reader.done():
                        channel.reader.result()  # its error
                self.wake.clear()
                if len(self._sent) >= self.depth:
                    self._full = True  # a reader wakes the lane when one is answered
                    continue
                await self._send()
        finally:
            await self._close()

    async def _send(self) -> None:
        batch = self._take()
        self.started += 1
        sent = _Sent(self.started, len(batch.commands), batch, time.perf_counter())
        self._sent.append(sent)  # before the send: a failure queues it again
        for node, commands in batch.commands.items():
            channel = self._channels.get(node) or await self._open(node)
            channel.waiting.append((sent, len(commands)))
            try:
                packed = channel.connection.pack_commands(commands)
                await channel.connection.send_packed_command(packed, check_health=False)
            except AttributeError as exc:
                # The reader's failure (Redis went away) closed the connection under this
                # send: redis-py then has no writer. The same failure, seen from here.
                raise RedisConnectionError("the connection closed during a send") from exc
            channel.more.set()
        self._complete()  # a flush with nothing to write is written in its turn

    async def _open(self, node: str) -> _Channel:
        """A connection to ``node`` with the store's scripts loaded on it."""
        connection = await self._topology.connect(node)
        channel = self._channels[node] = _Channel(connection)
        loads = store_scripts.load_commands()
        await connection.send_packed_command(connection.pack_commands(loads), check_health=False)
        for _ in loads:
            await connection.read_response()
        channel.reader = asyncio.get_running_loop().create_task(self._read(node, channel))
        return channel

    async def _read(self, node: str, channel: _Channel) -> None:
        """``node``'s replies, flush by flush, in the order they were sent."""
        task = asyncio.current_task()
        try:
            while True:
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError  # lost in redis-py (see _serve)
                if not channel.waiting:
                    channel.more.clear()
                    await channel.more.wait()
                    continue
                sent, count = channel.waiting[0]
                # A refusal (an error reply: READONLY, MOVED, OOM...) raises here, failing
                # the lane: nothing of this flush is taken as written.
                replies = [await channel.connection.read_response() for _ in range(count)]
                channel.waiting.popleft()
                sent.batch.replies(node, replies)
                sent.parts -= 1
                self._complete()
        finally:
            self.wake.set()  # the writer: see whether this reader ended

    def _complete(self) -> None:
        """Report the flushes every node has answered, oldest first, up to the first
        still waiting for one."""
        while self._sent and self._sent[0].parts == 0:
            sent = self._sent.popleft()
            self._backoff = RETRY_SECONDS
            self._written(self, sent.number, sent.at, sent.batch.frame_bytes)
            if self._full:  # room for one more in flight
                self._full = False
                self.wake.set()

    def _fail(self, exc: BaseException) -> None:
        # Newest first: each goes before what is queued, so the oldest ends first.
        while self._sent:
            self._sent.pop().batch.requeue()
        self.done = self.started
        self._failed(self, exc)

    async def _close(self) -> None:
        channels, self._channels = self._channels, {}
        for node, channel in channels.items():
            if channel.reader is not None:
                channel.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await channel.reader
            with contextlib.suppress(RedisError, OSError):
                await self._topology.release(node, channel.connection, broken=True)
