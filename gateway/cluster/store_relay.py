"""Resume on a process that does not hold the session, while its owner is alive.

The process the client reached (the *relay*) replays the event log after the client's
last number, then tails the log (``XREAD BLOCK``) and writes each new frame to the
client; the client's own frames go to the owner over its pub/sub channel, with a
heartbeat that keeps the owner's detached session alive. The owner (:class:`Inbound`,
one subscription per process) delivers those frames to the session's actor as if they
came from a socket. The owner keeps numbering and logging, so the relay's client sees
the same events, in the same order, as a local one would. If the owner goes away
meanwhile (its lease ends), the relay closes the socket with 1012: the client's next
resume takes the session over. While Redis is away (a restart) the relay waits and reads
on from where it was; a gap in the log (frames the owner could not log meanwhile) closes
it with 1012 too, never with a normal close the client would take for the end; a
client's frame is sent to the owner again until it has it. A store away for longer than
the resume window closes the relay with 1012.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.exceptions import RedisError
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from gateway.cluster.redis_store import RedisStore, channel, log_key, owner_key
from gateway.cluster.store_reads import Loaded
from gateway.transport.wire import SocketWire
from sessions import errors
from sessions.core import Session
from sessions.realtime import codec as rt

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
TAIL_BLOCK_MS = 1000
RETRY_SECONDS = 0.05  # a tail whose read failed reads again after this, doubling to
MAX_RETRY_SECONDS = 1.0
SEEN_IDS = 4096  # relayed messages remembered by id, so that one sent again is taken once


def gap(loaded: Loaded, last: int) -> bool:
    """Whether frames after ``last`` are missing from the log (trimmed, or lost)."""
    if not loaded.frames:
        return False
    first = loaded.frames[0][0]
    return last + 1 < first and not (last < 0 and first == 0)


async def relay(
    ws: ServerConnection,
    wire: SocketWire,
    store: RedisStore,
    loaded: Loaded,
    last: int,
    greeting: bytes | None,
) -> None:
    """Serve the client on ``ws`` from the log and the owner, until either goes."""
    session_id, owner = loaded.state["id"], loaded.owner or ""
    frames = [frame for seq, frame in loaded.frames if seq > last]
    # The client may have more than the log (a failover lost frames its owner writes
    # again): the tail goes on after what the client has.
    top = max(loaded.frames[-1][0], last) if loaded.frames else last
    relay_id = secrets.token_hex(6)
    sent = itertools.count()
    for frame in ([greeting] if greeting is not None else []) + frames:
        await wire.write_later(frame)

    loop = asyncio.get_running_loop()
    patience = max(store.resume_window, 2 * HEARTBEAT_SECONDS)  # for a store that is away

    async def publish(kind: str, frame: str | None = None) -> None:
        """Tell the owner. A client's frame is sent again until the owner has it (Redis
        away, or back but the owner not subscribed again yet: nobody received it), in
        order (``forward`` awaits each); past ``patience`` the client resumes again."""
        # An id, so that the owner takes a message sent again (no receiver counted, yet
        # one received it: a cluster's shard in a failover) once.
        message = orjson.dumps(
            {"session": session_id, "kind": kind, "frame": frame, "id": f"{relay_id}.{next(sent)}"}
        )
        backoff, since = RETRY_SECONDS, loop.time()
        while True:
            with contextlib.suppress(RedisError, OSError):
                if await store.topology.publish(channel(owner), message) or kind != "frame":
                    return
            if loop.time() - since > patience:
                wire.close(1012, "the session's gateway cannot be reached: resume again")
                return
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_RETRY_SECONDS)

    async def tail(after: int) -> None:
        await tail_log(store, session_id, after, wire.write_later)
        # Frames the log lacks (the owner was memory-only meanwhile): the client must
        # resume where they are kept, not read past them.
        wire.close(1012, "the session's log has a gap: resume again")

    async def heartbeat() -> None:
        answered = loop.time()
        while True:
            await publish("heartbeat")
            await asyncio.sleep(HEARTBEAT_SECONDS)
            try:
                owner_there = await store.client.get(owner_key(session_id)) is not None
            except (RedisError, OSError):
                if loop.time() - answered > patience:  # not a restart: a store that is gone
                    wire.close(1012, "the session store does not answer: resume again")
                    return
                continue  # Redis is away: ask again at the next beat
            answered = loop.time()
            if not owner_there:
                log.info("relay of %s: its owner is gone; the client resumes again", session_id)
                wire.close(1012, "the session's gateway stopped: resume again")
                return

    async def forward() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                if isinstance(frame, str):
                    await publish("frame", frame)

    tasks = [asyncio.create_task(job) for job in (tail(top), heartbeat(), forward())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError, ConnectionClosed):
                await task
        if ws.protocol.close_rcvd is not None:  # the client closed it: the session ends
            await publish("close")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.5):
                await wire.closed()


async def tail_log(
    store: RedisStore, session_id: str, after: int, write: Callable[[bytes], Awaitable[None]]
) -> None:
    """Write each frame the session's log gets after number ``after``, as it comes; return
    at a gap in the log (a frame missing: the owner could not log it meanwhile). While
    Redis is away (a restart) it reads on from the same place once Redis is back."""
    cursor = f"{after}-1" if after >= 0 else "0-0"
    expected = after + 1 if after >= 0 else None  # the number the next frame must carry
    backoff = RETRY_SECONDS
    task = asyncio.current_task()
    while True:
        # redis-py can swallow a cancel that lands in XREAD BLOCK (its read timeout and
        # retries turn it into an error, or into a read that goes on): the cancel must
        # still win, or whoever cancelled this task would wait for it forever.
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        try:
            entries: Any = await store.client.xread(
                {log_key(session_id): cursor}, block=TAIL_BLOCK_MS
            )
        except (RedisError, OSError) as exc:
            log.debug("tail of %s: the log does not answer (%s)", session_id, exc)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_RETRY_SECONDS)
            # A failover: the primaries learnt again (a relaying process may write
            # nothing itself, so no lane of its own would).
            with contextlib.suppress(RedisError, OSError):
                await store.topology.refresh()
            continue
        backoff = RETRY_SECONDS
        for _, items in entries or []:
            for entry_id, fields in items:
                seq = int(entry_id.split(b"-")[0])
                if expected is not None and seq > expected:
                    return
                cursor, expected = entry_id.decode(), seq + 1
                await write(fields[b"f"])


class Inbound:
    """The owner's side: frames that relays forward to this process's sessions."""

    def __init__(
        self, store: RedisStore, sessions: Callable[[str], Session | None], window: float
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.window = window
        self._task: asyncio.Task[None] | None = None
        self._seen: OrderedDict[str, None] = OrderedDict()  # recent message ids

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._listen(), name="store-inbound")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _listen(self) -> None:
        while True:
            try:
                async for data in self.store.topology.messages(channel(self.store.process)):
                    await self._handle(orjson.loads(data))
            except (RedisError, OSError) as exc:
                log.debug("relay channel: %s; listening again", exc)
                await asyncio.sleep(0.5)

    async def _handle(self, message: dict[str, Any]) -> None:
        message_id = message.get("id")
        if isinstance(message_id, str):
            if message_id in self._seen:
                return  # sent again: taken once
            self._seen[message_id] = None
            if len(self._seen) > SEEN_IDS:
                self._seen.popitem(last=False)
        session = self.sessions(message.get("session", ""))
        if session is None or session.ending:
            return
        kind = message.get("kind")
        if kind == "heartbeat":
            session.detach(self.window)  # its client is on a relay: keep it that long
        elif kind == "close":
            session.close("disconnected")
        elif kind == "frame":
            try:
                command: object = session.dialect.decode(message.get("frame") or "")
            except errors.ProtocolError as err:
                command = err
            if not isinstance(command, rt.SessionResume):
                await session.deliver(command)
