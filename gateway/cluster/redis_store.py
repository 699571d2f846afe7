"""The Redis session store: sessions that outlive the gateway process holding them.

``--session-store redis://HOST:PORT/DB`` (or ``rediss://``; also
``$LLM_GATEWAY_SESSION_STORE``). Per session, under ``llmgw:``:

- ``s:{id}``: the session as JSON (sessions/snapshot.py: settings, conversation,
  answers in flight, the resume token's hash), saved after the actor's turns;
- ``l:{id}``: its event log, a Redis stream, one entry per numbered frame (field ``f``;
  ``t``: the token ids of a delta's text, where the engine gave them), the entry id
  ``{sequence_number}-1``, trimmed like ``--replay-bytes``;
- ``o:{id}``: the owner lease, this process's id with a TTL, renewed while it holds
  the session;
- ``r:{id}``: a stored Responses response (``store: true``);
- ``b:{id}``: a background response's session id and resume token, while a stored
  response would live (gateway/cluster/background.py);
- ``i:{process}``: the pub/sub channel a process that resumed a session it does not
  own forwards its client's frames on (the relay; see gateway/cluster/store_relay.py).

The token path never awaits the store. Writes are queued (a list append) and leave in
one pipeline per loop turn and lane, which is to say per engine step: frames on the
log lane, states, leases and responses on the state lane (see :class:`RedisStore`). A
frame reaches its client only once the log has it, and its session's state as it was
when the frame was numbered: a socket's writes are held until then
(:meth:`RedisStore.due`), so a process that dies can lose nothing a client has seen.
The keys of a session expire ``--resume-window`` after its process stops renewing them.

While Redis is down or slow the gateway goes on memory-only (documented in
docs/deployment.md): sockets are no longer held, writes wait in a bounded buffer
(``max_buffer_bytes``; beyond, the oldest session's log is dropped and that session can
no longer be resumed elsewhere), ``/healthz`` says ``"store": {"up": false}``, and the
writer retries with a backoff until Redis is back, then writes what waited.
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

import orjson
import redis.asyncio as redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from gateway.metrics import Metrics
from gateway.transport.coalesce import WriteBatch

log = logging.getLogger(__name__)

PREFIX = "llmgw:"
LEASE_SECONDS = 3.0
MAX_CONNECTIONS = 256
# Flushes of a lane sent and not answered yet. The state lane's go out while those before
# them wait for their replies (bounded, so that a slow Redis pushes back on the lane); the
# log lane's one at a time: what comes in meanwhile joins the next flush, and a gateway
# flat out would spend more CPU per token on more, smaller flushes (bench/store.py cpu).
LOG_FLUSHES_IN_FLIGHT = 1
STATE_FLUSHES_IN_FLIGHT = 8
# Every frame a loop turn logged, for every session, in one command: a command (or even
# an argument) per frame would cost the gateway more CPU than the frame itself. KEYS: the
# logs; ARGV: the key TTL, then per key the first frame's number, the frames joined by
# newlines (a JSON text has none of its own) and, where an engine reported them
# (TensorRT-LLM), each frame's token ids on a line of their own ("" for none at all: the
# common case costs one comparison per key). Numbers run on with no gap within a key.
_APPEND = """
local at = 2
for k = 1, #KEYS do
  local seq = tonumber(ARGV[at])
  local blob = ARGV[at + 1]
  local ids = ARGV[at + 2]
  at = at + 3
  local start, istart = 1, 1
  while true do
    local stop = string.find(blob, "\\n", start, true)
    local last = stop and stop - 1 or -1
    local id = seq .. '-1'
    if ids == '' then
      redis.pcall('xadd', KEYS[k], id, 'f', string.sub(blob, start, last))
    else
      local istop = string.find(ids, "\\n", istart, true)
      local t = string.sub(ids, istart, istop and istop - 1 or -1)
      istart = (istop or #ids) + 1
      if t == '' then
        redis.pcall('xadd', KEYS[k], id, 'f', string.sub(blob, start, last))
      else
        redis.pcall('xadd', KEYS[k], id, 'f', string.sub(blob, start, last), 't', t)
      end
    end
    seq = seq + 1
    if not stop then break end
    start = stop + 1
  end
  redis.call('pexpire', KEYS[k], ARGV[1])
end
return 0
"""
# The lease is renewed if this process holds it, and taken again if it is gone while the
# session's state is there (a Redis that restarted without its data): never taken from
# another owner, never made for a session whose keys were deleted.
_RENEW = """
local owner = redis.call('get', KEYS[1])
if owner == false and redis.call('exists', KEYS[2]) == 1 then
  redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[2])
  owner = ARGV[1]
end
if owner == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  redis.call('pexpire', KEYS[2], ARGV[3])
  redis.call('pexpire', KEYS[3], ARGV[3])
  return 1
end
return 0
"""


def state_key(session_id: str) -> str:
    return f"{PREFIX}s:{session_id}"


def log_key(session_id: str) -> str:
    return f"{PREFIX}l:{session_id}"


def owner_key(session_id: str) -> str:
    return f"{PREFIX}o:{session_id}"


def response_key(response_id: str) -> str:
    return f"{PREFIX}r:{response_id}"


def background_key(response_id: str) -> str:
    return f"{PREFIX}b:{response_id}"


def channel(process: str) -> str:
    return f"{PREFIX}i:{process}"


@dataclass(slots=True)
class _LogWrites:
    """What one session has for the log lane at its next flush."""

    frames: list[tuple[int, bytes]] = field(default_factory=list)
    token_ids: dict[int, bytes] = field(default_factory=dict)  # by frame number
    trim_before: int | None = None
    expire_in: float | None = None  # let go: the log lives this long
    forget: bool = False


@dataclass(slots=True)
class _StateWrites:
    """What one session has for the state lane at its next flush."""

    state: Callable[[], bytes] | None = None  # serialized at flush time: once per flush
    own: bool = False  # take the lease
    release_for: float | None = None  # let go of the lease; the state lives this long
    forget: bool = False


@dataclass(slots=True)
class _Sent:
    """A flush that went out: its number, how many replies it waits for, how to queue
    what it wrote again if they never come, and the frames' bytes it took."""

    number: int
    replies: int
    requeue: Callable[[], None]
    frame_bytes: int
    sent: float


@dataclass(slots=True)
class _Lane:
    """One writer task and what waits for it. ``started``: flushes begun; ``done``:
    flushes written. What is queued now leaves in flush ``started + 1``. ``sent``: the
    flushes in flight, oldest first; ``more``: the reader has one more to read; ``full``:
    the writer waits for room in flight."""

    name: str
    depth: int  # flushes in flight at most
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    started: int = 0
    done: int = 0
    sent: deque[_Sent] = field(default_factory=deque)
    more: asyncio.Event = field(default_factory=asyncio.Event)
    full: bool = False

    @property
    def next(self) -> int:
        return self.started + 1


@dataclass(slots=True)
class _Waiter:
    """A callback and the flush of each lane it waits for."""

    log: int
    state: int
    callback: Callable[[], None]
    since: float = 0.0  # a held socket's: when it began to wait (0: not timed)


@dataclass(slots=True)
class Loaded:
    state: dict[str, Any]
    frames: list[tuple[int, bytes]]  # the log, oldest first
    owner: str | None
    token_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)  # by frame number


class RedisStore:
    """Two writer tasks ("lanes"), each one pipeline per loop turn, each on a connection of
    its own: the **log lane** appends frames to the event logs; the **state lane** writes
    sessions' states, leases and stored responses. A lane's flushes are pipelined on its
    connection: one goes out while those before it wait for their replies, each releasing
    what waits for it when its own replies are in, in order. A socket's held frames go out once the
    log lane has written them *and* the state lane has written what their own session
    queued before them (:meth:`due`): a ``response.created`` never reaches a
    client before the state that has its response in flight, yet a delta never waits
    behind the states of other sessions. Each lane writes its flushes in order, so a
    session's log entries arrive in sequence and its state is never older than the one
    written before it; keys are split between lanes (``l:`` to the log lane, ``s:`` and
    ``o:`` to the state lane), so no lane's write can land after the other's delete."""

    def __init__(
        self,
        url: str,
        process: str,
        *,
        resume_window: float,
        metrics: Metrics | None = None,
        lease_seconds: float = LEASE_SECONDS,
        max_buffer_bytes: int = 64 << 20,
        write_batch: WriteBatch | None = None,
    ) -> None:
        self.url = url
        # Open while a flush's callbacks release held frames: each socket's, in one write.
        self._write_batch = write_batch or contextlib.nullcontext()
        self.process = process
        self.resume_window = resume_window
        self.lease_seconds = lease_seconds
        self.max_buffer_bytes = max_buffer_bytes
        self.metrics = metrics
        # A bounded pool that makes a command wait for a connection rather than fail: a
        # burst of resumes (a drained gateway's clients) shares it with relays' tails.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=10,
            socket_timeout=5.0,
            socket_connect_timeout=2.0,
            health_check_interval=5,
        )
        self.client: redis.Redis = redis.Redis(connection_pool=pool)
        self.up = False
        self.buffered_bytes = 0
        self._logs: dict[str, _LogWrites] = {}
        self._states: dict[str, _StateWrites] = {}
        # Stored responses and background records, by key; None: delete.
        self._responses: list[tuple[str, bytes | None, float]] = []
        self._owned: set[str] = set()
        self._trimmed: dict[str, int] = {}  # the log's first kept entry, as last trimmed
        self._log_lane = _Lane("log", LOG_FLUSHES_IN_FLIGHT)
        self._state_lane = _Lane("state", STATE_FLUSHES_IN_FLIGHT)
        # The flush of each lane that carries a session's latest queued write, while it
        # is not written yet (what a held frame of that session waits for).
        self._log_due: dict[str, int] = {}
        self._state_due: dict[str, int] = {}
        self._responses_due = 0  # a stored response: every held frame waits for it
        self._waiters: list[_Waiter] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._renewing: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()  # close() has begun: no more lease renewals
        self._renew: Any = None

    @property
    def key_ttl_ms(self) -> int:
        """How long a session's keys outlive the last renewal of its lease."""
        return int(1000 * (max(self.resume_window, 0.0) + 2 * self.lease_seconds))

    async def start(self) -> None:
        """Connect (a Redis that is down now is retried in the background)."""
        self._renew = self.client.register_script(_RENEW)
        with contextlib.suppress(RedisError, OSError):
            await self.client.ping()
            self._set_up(True)
        if not self.up:
            log.warning(
                "session store %s does not answer: memory-only until it does", _safe(self.url)
            )
        loop = asyncio.get_running_loop()
        self._renewing = loop.create_task(self._renewer(), name="store-leases")
        self._tasks = [
            loop.create_task(self._writer(self._log_lane), name="store-log-writer"),
            loop.create_task(self._writer(self._state_lane), name="store-state-writer"),
            self._renewing,
        ]

    async def close(self) -> None:
        """Write what waits, let go of every lease (another process may take the sessions
        over at once), close the connections."""
        # The renewals go on a connection of their own, and their script takes a lease that
        # is gone again (a Redis that lost it): one in flight now could land after the
        # releases below and hold every session for another lease. So the renewer stops
        # first, letting a renewal it has begun finish.
        self._closing.set()
        if self._renewing is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._renewing
        for session_id in list(self._owned):
            self.release(session_id, self.resume_window)
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            async with asyncio.timeout(5):
                await self.flush()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(RedisError, OSError):
            await self.client.aclose()

    # -- writes: queued, sent by the lanes' writer tasks ------------------------------

    def log(self, session_id: str, seq: int, frame: bytes) -> None:
        self._log_entry(session_id).frames.append((seq, frame))
        self.buffered_bytes += len(frame)
        if self.buffered_bytes > self.max_buffer_bytes:
            self._shed()

    def log_token_ids(self, session_id: str, seq: int, token_ids: tuple[int, ...]) -> None:
        """The token ids frame ``seq`` (just logged) was generated from, kept with it."""
        self._log_entry(session_id).token_ids[seq] = " ".join(map(str, token_ids)).encode()

    def save(self, session_id: str, state: Callable[[], bytes]) -> None:
        """Save the session (``state`` is called at the flush, once however often asked)."""
        self._state_entry(session_id).state = state

    def trim(self, session_id: str, first_kept: int) -> None:
        if self._trimmed.get(session_id) == first_kept:
            return  # an XTRIM only when the replay buffer's start moved
        self._trimmed[session_id] = first_kept
        self._log_entry(session_id).trim_before = first_kept

    def own(self, session_id: str) -> None:
        self._owned.add(session_id)
        entry = self._state_entry(session_id)
        entry.own, entry.release_for = True, None
        self._log_entry(session_id).expire_in = None

    def release(self, session_id: str, keep_for: float) -> None:
        """This process no longer holds the session: its keys live ``keep_for`` seconds
        (for a resume elsewhere)."""
        self._owned.discard(session_id)
        self._trimmed.pop(session_id, None)
        entry = self._state_entry(session_id)
        entry.own, entry.release_for = False, keep_for
        self._log_entry(session_id).expire_in = keep_for

    def forget(self, session_id: str) -> None:
        """The session ended for good: its keys go."""
        self._owned.discard(session_id)
        self._trimmed.pop(session_id, None)
        logs = self._log_entry(session_id)
        self.buffered_bytes -= sum(len(f) for _, f in logs.frames)
        logs.frames.clear()
        logs.token_ids.clear()
        logs.forget = True
        state = self._state_entry(session_id)
        state.state, state.forget = None, True

    def put_response(self, response_id: str, data: bytes, ttl: float) -> None:
        self._put(response_key(response_id), data, ttl)

    def delete_response(self, response_id: str) -> None:
        self._responses.append((response_key(response_id), None, 0))
        self._state_lane.wake.set()

    def put_background(self, response_id: str, data: bytes, ttl: float) -> None:
        self._put(background_key(response_id), data, ttl)

    def delete_background(self, response_id: str) -> None:
        self._responses.append((background_key(response_id), None, 0))
        self._state_lane.wake.set()

    def _put(self, key: str, data: bytes, ttl: float) -> None:
        self._responses.append((key, data, ttl))
        self._responses_due = self._state_lane.next
        self._state_lane.wake.set()

    def due(self, session_id: str | None) -> tuple[int, int]:
        """The flush of each lane (log, state) that writes what ``session_id`` queued so
        far, its frames and its state, and any stored response queued so far (None: what
        every session queued). A held frame waits for these, not other sessions' writes."""
        if session_id is None:
            return self._log_lane.next, self._state_lane.next
        state_due = max(self._state_due.get(session_id, 0), self._responses_due)
        return self._log_due.get(session_id, 0), state_due

    def after(self, due: tuple[int, int], callback: Callable[[], None]) -> None:
        """Run ``callback`` once the flushes ``due`` (see :meth:`due`) are written (at once
        while Redis is down)."""
        if not self.up:
            callback()
            return
        self._wait(_Waiter(due[0], due[1], callback, time.perf_counter()))

    def after_flush(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything queued now is in Redis (at once while it is
        down)."""
        if not self.up:
            callback()
            return
        self._wait(_Waiter(self._log_lane.next, self._state_lane.next, callback))

    def _wait(self, waiter: _Waiter) -> None:
        self._waiters.append(waiter)
        # A lane with nothing to write still counts a flush, and calls back whoever waits.
        if waiter.log > self._log_lane.done:
            self._log_lane.wake.set()
        if waiter.state > self._state_lane.done:
            self._state_lane.wake.set()
        if waiter.log <= self._log_lane.done and waiter.state <= self._state_lane.done:
            # Nothing left to wait for, but never on the caller's stack (it may be about
            # to hold the frame this callback sends): at the next flush of the log lane.
            waiter.log = self._log_lane.next
            self._log_lane.wake.set()

    def _log_entry(self, session_id: str) -> _LogWrites:
        entry = self._logs.get(session_id)
        if entry is None:
            entry = self._logs[session_id] = _LogWrites()
        lane = self._log_lane
        self._log_due[session_id] = lane.next
        lane.wake.set()
        return entry

    def _state_entry(self, session_id: str) -> _StateWrites:
        entry = self._states.get(session_id)
        if entry is None:
            entry = self._states[session_id] = _StateWrites()
        lane = self._state_lane
        self._state_due[session_id] = lane.next
        lane.wake.set()
        return entry

    def _shed(self) -> None:
        """Over the buffer: the oldest session's log goes (that session can then not be
        resumed elsewhere: its state is deleted when Redis is back)."""
        for session_id, entry in self._logs.items():
            if entry.frames:
                self.buffered_bytes -= sum(len(f) for _, f in entry.frames)
                entry.frames.clear()
                entry.token_ids.clear()
                entry.forget = True
                state = self._states.setdefault(session_id, _StateWrites())
                state.state, state.forget = None, True
                if self.metrics is not None:
                    self.metrics.store_dropped.inc()
                if self.buffered_bytes <= self.max_buffer_bytes:
                    return

    async def flush(self) -> None:
        """Until everything queued before now is written (or Redis failed)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def flushed() -> None:
            if not done.done():
                done.set_result(None)

        self.after_flush(flushed)
        await done

    def _call_back(self, *, everyone: bool = False) -> None:
        """Run the callbacks whose flushes are written (all of them: Redis failed, the
        sockets are not held meanwhile)."""
        log_done, state_done = self._log_lane.done, self._state_lane.done
        ready, waiting = [], []
        for w in self._waiters:
            if everyone or (w.log <= log_done and w.state <= state_done):
                ready.append(w)
            else:
                waiting.append(w)
        self._waiters = waiting
        held = self.metrics.store_hold_seconds if self.metrics is not None else None
        now = time.perf_counter()
        with self._write_batch:
            for w in ready:
                if held is not None and w.since:
                    held.observe(now - w.since)
                w.callback()

    async def _writer(self, lane: _Lane) -> None:
        """A lane: flushes pipelined on a connection of its own (see :meth:`_pipeline`);
        when Redis fails, what was in flight is queued again and retried with a backoff."""
        backoff = 0.05
        while True:
            try:
                await self._pipeline(lane)
            except Exception as exc:
                # A lane outlives whatever its connection does: a dead lane would hold
                # every socket's frames for good (each waits for its next flush).
                if not isinstance(exc, RedisError | OSError):
                    log.exception("session store: the %s lane failed", lane.name)
                if self.up:
                    log.warning(
                        "session store write failed (%s): memory-only until it is back", exc
                    )
                self._set_up(False)
                if self.metrics is not None:
                    self.metrics.store_errors.inc()
                # Newest first: each goes before what is queued, so the oldest ends first.
                while lane.sent:
                    lane.sent.pop().requeue()
                lane.done = lane.started
                self._call_back(everyone=True)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                lane.wake.set()
                continue

    def _written(self, lane: _Lane, number: int, started: float) -> None:
        """Flush ``number`` of ``lane`` (and every one before it) is in Redis."""
        if not self.up:
            log.info("session store is back: sessions are stored again")
            for session_id in self._owned:  # Redis may have lost the leases
                self._state_entry(session_id).own = True
        self._set_up(True)
        lane.done = number
        if self.metrics is not None:
            self.metrics.store_flush_seconds.observe(time.perf_counter() - started)
        self._forget_written(lane)
        # The sockets' releases (a transport write each) after this lane's next flush
        # has gone out, not before it: they are ready now, the next flush is not.
        asyncio.get_running_loop().call_soon(self._call_back)

    async def _pipeline(self, lane: _Lane) -> None:
        """Send each flush as soon as it is due, without waiting for the replies of those
        in flight (a task of its own reads them, in order: one connection, so Redis runs the
        flushes in the order they were sent, a session's log entries arrive in sequence and
        its state is never older than the one written before it). Raises when the
        connection fails."""
        pool = self.client.connection_pool
        await lane.wake.wait()  # connect when there is something to write (not while idle)
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        lane.more.clear()
        reader = asyncio.get_running_loop().create_task(self._read_replies(lane, conn))
        try:
            while True:
                await lane.wake.wait()  # something to send; room again; the reader ended
                if reader.done():
                    reader.result()  # its error
                lane.wake.clear()
                if len(lane.sent) >= lane.depth:
                    lane.full = True  # the reader wakes the lane when one is answered
                    continue
                await self._send_flush(lane, conn)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            with contextlib.suppress(RedisError, OSError):
                await conn.disconnect()
            await pool.release(conn)

    async def _send_flush(self, lane: _Lane, conn: AbstractConnection) -> None:
        lane.started += 1
        if lane is self._log_lane:
            commands, requeue, frame_bytes = self._take_logs()
        else:
            commands, requeue, frame_bytes = self._take_states()
        sent = _Sent(lane.started, len(commands), requeue, frame_bytes, time.perf_counter())
        lane.sent.append(sent)  # before the send: a failure queues it again
        if commands:
            try:
                await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            except AttributeError as exc:
                # The reader's failure (Redis went away) closed the connection under this
                # send: redis-py then has no writer. The same failure, seen from here.
                raise RedisConnectionError("the connection closed during a send") from exc
        lane.more.set()  # the reader: one more flush to read (maybe with no reply)

    async def _read_replies(self, lane: _Lane, conn: AbstractConnection) -> None:
        """The replies of the lane's flushes in flight, oldest first: what waits for a
        flush is called back when its own replies are in."""
        sent = lane.sent
        try:
            while True:
                if not sent:
                    lane.more.clear()
                    await lane.more.wait()
                    continue
                flush = sent[0]
                for _ in range(flush.replies):
                    with contextlib.suppress(ResponseError):  # one command's refusal
                        await conn.read_response()
                sent.popleft()
                self.buffered_bytes -= flush.frame_bytes
                self._written(lane, flush.number, flush.sent)
                if lane.full:  # room for one more in flight
                    lane.full = False
                    lane.wake.set()
        finally:
            lane.wake.set()  # the writer: see whether the reader ended

    def _forget_written(self, lane: _Lane) -> None:
        due = self._log_due if lane is self._log_lane else self._state_due
        if len(due) > 2 * len(self._owned) + 64:  # bounded: entries of written flushes go
            done = lane.done
            for session_id in [k for k, v in due.items() if v <= done]:
                del due[session_id]

    def _take_logs(self) -> tuple[list[tuple[Any, ...]], Callable[[], None], int]:
        """What the log lane's next flush writes: its commands, how to queue it again, and
        its frames' bytes."""
        taken, self._logs = self._logs, {}
        frame_bytes = sum(len(f) for p in taken.values() for _, f in p.frames)
        return self._log_commands(taken), lambda: self._requeue_logs(taken), frame_bytes

    def _log_commands(self, taken: dict[str, _LogWrites]) -> list[tuple[Any, ...]]:
        ttl = self.key_ttl_ms
        commands: list[tuple[Any, ...]] = []
        keys: list[str] = []
        args: list[Any] = [ttl]
        for session_id, p in taken.items():
            if p.frames and not p.forget:
                # An id not above the stream's top (a frame a takeover's process wrote
                # already) is refused alone (pcall): the others still go in.
                keys.append(log_key(session_id))
                ids = b""
                if p.token_ids:
                    ids = b"\n".join(p.token_ids.get(seq, b"") for seq, _ in p.frames)
                args += (p.frames[0][0], b"\n".join(frame for _, frame in p.frames), ids)
        if keys:
            # EVAL with the script's text, not a registered script: redis-py makes a
            # pipeline that runs one ask SCRIPT EXISTS first, a round trip of its own
            # before every flush (the text costs Redis a hash; that round trip cost each
            # frame's client one more wait). The text also survives a Redis restart.
            commands.append(("EVAL", _APPEND, len(keys), *keys, *args))
        for session_id, p in taken.items():
            key = log_key(session_id)
            if p.forget:
                commands.append(("DEL", key))
                continue
            if p.trim_before is not None:
                commands.append(("XTRIM", key, "MINID", f"{p.trim_before}-0"))
            if p.expire_in is not None:
                commands.append(("PEXPIRE", key, max(1, int(1000 * p.expire_in))))
        return commands

    def _requeue_logs(self, taken: dict[str, _LogWrites]) -> None:
        for session_id, old in taken.items():
            new = self._logs.get(session_id)
            if new is None:
                self._logs[session_id] = old
                continue
            if old.forget or new.forget:
                continue
            new.frames[:0] = old.frames
            new.token_ids.update(old.token_ids)
            new.trim_before = new.trim_before or old.trim_before
            if new.expire_in is None:
                new.expire_in = old.expire_in

    def _take_states(self) -> tuple[list[tuple[Any, ...]], Callable[[], None], int]:
        """What the state lane's next flush writes, and how to queue it again."""
        taken, self._states = self._states, {}
        responses, self._responses = self._responses, []
        commands = self._state_commands(taken, responses)
        return commands, lambda: self._requeue_states(taken, responses), 0

    def _state_commands(
        self, taken: dict[str, _StateWrites], responses: list[tuple[str, bytes | None, float]]
    ) -> list[tuple[Any, ...]]:
        ttl = self.key_ttl_ms
        lease = int(1000 * self.lease_seconds)
        commands: list[tuple[Any, ...]] = []
        for session_id, p in taken.items():
            if p.forget:
                commands.append(("DEL", state_key(session_id), owner_key(session_id)))
                continue
            if p.state is not None:
                commands.append(("SET", state_key(session_id), p.state(), "PX", ttl))
            if p.own:
                commands.append(("SET", owner_key(session_id), self.process, "PX", lease))
            elif p.release_for is not None:
                commands.append(("DEL", owner_key(session_id)))
                keep = max(1, int(1000 * p.release_for))
                commands.append(("PEXPIRE", state_key(session_id), keep))
        for key, data, seconds in responses:
            if data is None:
                commands.append(("DEL", key))
            else:
                commands.append(("SET", key, data, "PX", max(1, int(1000 * seconds))))
        return commands

    def _requeue_states(
        self, taken: dict[str, _StateWrites], responses: list[tuple[str, bytes | None, float]]
    ) -> None:
        for session_id, old in taken.items():
            new = self._states.get(session_id)
            if new is None:
                self._states[session_id] = old
                continue
            if old.forget or new.forget:
                continue
            new.state = new.state or old.state
            if not new.own and new.release_for is None:
                new.own, new.release_for = old.own, old.release_for
        self._responses[:0] = responses

    async def _renewer(self) -> None:
        """Renew the leases (and key lifetimes) of every session this process holds."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.lease_seconds / 3)
            if self._closing.is_set():
                return
            if not self._owned or not self.up:
                continue
            lease, ttl = int(1000 * self.lease_seconds), self.key_ttl_ms
            try:
                pipe = self.client.pipeline(transaction=False)
                for session_id in self._owned:
                    keys = [owner_key(session_id), state_key(session_id), log_key(session_id)]
                    await self._renew(keys=keys, args=[self.process, lease, ttl], client=pipe)
                await pipe.execute(raise_on_error=False)
            except (RedisError, OSError):
                self._set_up(False)

    def _set_up(self, up: bool) -> None:
        self.up = up
        if self.metrics is not None:
            self.metrics.store_up.set(1 if up else 0)

    # -- reads (a resume on a process that does not hold the session) ---------------

    async def load(self, session_id: str) -> Loaded | None:
        pipe = self.client.pipeline(transaction=False)
        pipe.get(state_key(session_id))
        pipe.xrange(log_key(session_id))
        pipe.get(owner_key(session_id))
        state, entries, owner = await pipe.execute()
        if state is None:
            return None
        frames, token_ids = [], {}
        for entry_id, fields in entries:
            seq = int(entry_id.split(b"-")[0])
            frames.append((seq, fields[b"f"]))
            if (ids := fields.get(b"t")) is not None:
                token_ids[seq] = tuple(map(int, ids.split()))
        return Loaded(orjson.loads(state), frames, owner.decode() if owner else None, token_ids)

    async def acquire(self, session_id: str) -> bool:
        """Take the session's lease if nobody holds it (its owner is gone)."""
        taken = await self.client.set(
            owner_key(session_id), self.process, nx=True, px=int(1000 * self.lease_seconds)
        )
        if taken:
            self.own(session_id)
        return bool(taken)

    async def get_response(self, response_id: str) -> bytes | None:
        data = await self.client.get(response_key(response_id))
        return data.encode() if isinstance(data, str) else data

    async def get_background(self, response_id: str) -> bytes | None:
        data = await self.client.get(background_key(response_id))
        return data.encode() if isinstance(data, str) else data

    def describe(self) -> dict[str, object]:
        return {
            "kind": "redis",
            "url": _safe(self.url),
            "up": self.up,
            "sessions": len(self._owned),
            "buffered_bytes": self.buffered_bytes,
        }


def _safe(url: str) -> str:
    """``url`` without its password, for logs and /healthz."""
    scheme, sep, rest = url.partition("://")
    _, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}" if sep else url
