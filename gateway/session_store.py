"""The Redis session store: sessions that outlive the gateway process holding them.

``--session-store redis://HOST:PORT/DB`` (or ``rediss://``; also
``$LLM_GATEWAY_SESSION_STORE``). Per session, under ``llmgw:``:

- ``s:{id}``: the session as JSON (sessions/snapshot.py: settings, conversation,
  answers in flight, the resume token's hash), saved after the actor's turns;
- ``l:{id}``: its event log, a Redis stream, one entry per numbered frame, the entry id
  ``{sequence_number}-1``, trimmed like ``--replay-bytes``;
- ``o:{id}``: the owner lease, this process's id with a TTL, renewed while it holds
  the session;
- ``r:{id}``: a stored Responses response (``store: true``);
- ``i:{process}``: the pub/sub channel a process that resumed a session it does not
  own forwards its client's frames on (the relay; see gateway/store_relay.py).

The token path never awaits the store. Writes are queued (a list append) and leave in
one pipeline per loop turn, which is to say per engine step. A frame reaches its
client only once the log has it: a socket's writes are held until the flush that
carries them (``hold``), so a process that dies can lose nothing a client has seen. The
keys of a session expire ``--resume-window`` after its process stops renewing them.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as redis
from redis.exceptions import RedisError

from gateway.metrics import Metrics

log = logging.getLogger(__name__)

PREFIX = "llmgw:"
LEASE_SECONDS = 3.0
MAX_CONNECTIONS = 256
# Every frame a loop turn logged, for every session, in one command: a command (or even
# an argument) per frame would cost the gateway more CPU than the frame itself. KEYS: the
# logs; ARGV: the key TTL, then per key the first frame's number and the frames joined by
# newlines (a JSON text has none of its own). Numbers run on with no gap within a key.
_APPEND = """
local at = 2
for k = 1, #KEYS do
  local seq = tonumber(ARGV[at])
  local blob = ARGV[at + 1]
  at = at + 2
  local start = 1
  while true do
    local stop = string.find(blob, "\\n", start, true)
    local last = stop and stop - 1 or -1
    redis.pcall('xadd', KEYS[k], seq .. '-1', 'f', string.sub(blob, start, last))
    seq = seq + 1
    if not stop then break end
    start = stop + 1
  end
  redis.call('pexpire', KEYS[k], ARGV[1])
end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
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


def channel(process: str) -> str:
    return f"{PREFIX}i:{process}"


@dataclass(slots=True)
class _Pending:
    """What one session has to write at the next flush."""

    frames: list[tuple[int, bytes]] = field(default_factory=list)
    state: Callable[[], bytes] | None = None  # serialized at flush time: once per flush
    trim_before: int | None = None
    forget: bool = False
    release_for: float | None = None  # let go of the lease; keys live this long


@dataclass(slots=True)
class Loaded:
    state: dict[str, Any]
    frames: list[tuple[int, bytes]]  # the log, oldest first
    owner: str | None


class RedisStore:
    def __init__(
        self,
        url: str,
        process: str,
        *,
        resume_window: float,
        metrics: Metrics | None = None,
        lease_seconds: float = LEASE_SECONDS,
        max_buffer_bytes: int = 64 << 20,
    ) -> None:
        self.url = url
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
        self._pending: dict[str, _Pending] = {}
        self._responses: list[tuple[str, bytes | None, float]] = []  # None: delete
        self._owned: set[str] = set()
        self._after_flush: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._renew: Any = None
        self._append: Any = None

    @property
    def key_ttl_ms(self) -> int:
        """How long a session's keys outlive the last renewal of its lease."""
        return int(1000 * (max(self.resume_window, 0.0) + 2 * self.lease_seconds))

    async def start(self) -> None:
        """Connect (a Redis that is down now is retried in the background)."""
        self._renew = self.client.register_script(_RENEW)
        self._append = self.client.register_script(_APPEND)
        with contextlib.suppress(RedisError, OSError):
            await self.client.ping()
            self._set_up(True)
        if not self.up:
            log.warning(
                "session store %s does not answer: memory-only until it does", _safe(self.url)
            )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._writer(), name="store-writer"),
            loop.create_task(self._renewer(), name="store-leases"),
        ]

    async def close(self) -> None:
        """Write what waits, let go of every lease (another process may take the sessions
        over at once), close the connections."""
        self._closing = True
        for session_id in list(self._owned):
            self.release(session_id, self.resume_window)
        self._wake.set()
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

    # -- writes: queued, sent by the writer task --------------------------------------

    def log(self, session_id: str, seq: int, frame: bytes) -> None:
        pending = self._pending.get(session_id)
        if pending is None:
            pending = self._pending[session_id] = _Pending()
        pending.frames.append((seq, frame))
        self.buffered_bytes += len(frame)
        if self.buffered_bytes > self.max_buffer_bytes:
            self._shed()
        self._kick()

    def save(self, session_id: str, state: Callable[[], bytes]) -> None:
        """Save the session (``state`` is called at the flush, once however often asked)."""
        self._entry(session_id).state = state
        self._kick()

    def trim(self, session_id: str, first_kept: int) -> None:
        self._entry(session_id).trim_before = first_kept

    def own(self, session_id: str) -> None:
        self._owned.add(session_id)
        self._entry(session_id).release_for = None
        self._kick()

    def release(self, session_id: str, keep_for: float) -> None:
        """This process no longer holds the session: its keys live ``keep_for`` seconds
        (for a resume elsewhere)."""
        self._owned.discard(session_id)
        self._entry(session_id).release_for = keep_for
        self._kick()

    def forget(self, session_id: str) -> None:
        """The session ended for good: its keys go."""
        self._owned.discard(session_id)
        pending = self._entry(session_id)
        self.buffered_bytes -= sum(len(f) for _, f in pending.frames)
        pending.frames.clear()
        pending.state = None
        pending.forget = True
        self._kick()

    def put_response(self, response_id: str, data: bytes, ttl: float) -> None:
        self._responses.append((response_id, data, ttl))
        self._kick()

    def delete_response(self, response_id: str) -> None:
        self._responses.append((response_id, None, 0))
        self._kick()

    def after_flush(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once what is queued now is in Redis (at once while it is down)."""
        if not self.up:
            callback()
            return
        self._after_flush.append(callback)
        self._kick()

    def _entry(self, session_id: str) -> _Pending:
        pending = self._pending.get(session_id)
        if pending is None:
            pending = self._pending[session_id] = _Pending()
        return pending

    def _kick(self) -> None:
        self._wake.set()

    def _shed(self) -> None:
        """Over the buffer: the oldest session's log goes (that session can then not be
        resumed elsewhere: its state is deleted when Redis is back)."""
        for pending in self._pending.values():
            if pending.frames:
                self.buffered_bytes -= sum(len(f) for _, f in pending.frames)
                pending.frames.clear()
                pending.state = None
                pending.forget = True
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

    async def _writer(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, {}
            responses, self._responses = self._responses, []
            callbacks, self._after_flush = self._after_flush, []
            started = time.perf_counter()
            try:
                await self._write(pending, responses)
            except (RedisError, OSError) as exc:
                if self.up:
                    log.warning(
                        "session store write failed (%s): memory-only until it is back", exc
                    )
                self._set_up(False)
                if self.metrics is not None:
                    self.metrics.store_errors.inc()
                self._requeue(pending, responses)
                for callback in callbacks:
                    callback()  # degraded: the sockets are not held meanwhile
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                self._wake.set()
                continue
            backoff = 0.05
            if not self.up:
                log.info("session store is back: sessions are stored again")
            self._set_up(True)
            if self.metrics is not None:
                self.metrics.store_flush_seconds.observe(time.perf_counter() - started)
            for callback in callbacks:
                callback()

    def _requeue(
        self, pending: dict[str, _Pending], responses: list[tuple[str, bytes | None, float]]
    ) -> None:
        for session_id, old in pending.items():
            new = self._pending.get(session_id)
            if new is None:
                self._pending[session_id] = old
                continue
            if old.forget or new.forget:
                continue
            new.frames[:0] = old.frames
            new.state = new.state or old.state
            new.trim_before = new.trim_before or old.trim_before
        self._responses[:0] = responses

    async def _write(
        self, pending: dict[str, _Pending], responses: list[tuple[str, bytes | None, float]]
    ) -> None:
        ttl = self.key_ttl_ms
        pipe = self.client.pipeline(transaction=False)
        logs: list[str] = []
        frames: list[Any] = [ttl]
        for session_id, p in pending.items():
            if p.frames and not p.forget:
                # An id not above the stream's top (a frame a takeover's process wrote
                # already) is refused alone (pcall): the others still go in.
                logs.append(log_key(session_id))
                blob = b"\n".join(frame for _, frame in p.frames)
                frames += (p.frames[0][0], blob)
                self.buffered_bytes -= len(blob) - len(p.frames) + 1
        if logs:
            await self._append(keys=logs, args=frames, client=pipe)
        for session_id, p in pending.items():
            if p.forget:
                pipe.delete(state_key(session_id), log_key(session_id), owner_key(session_id))
                continue
            if p.state is not None:
                pipe.set(state_key(session_id), p.state(), px=ttl)
            if p.trim_before is not None:
                pipe.xtrim(log_key(session_id), minid=f"{p.trim_before}-0")
            if session_id in self._owned:
                pipe.set(owner_key(session_id), self.process, px=int(1000 * self.lease_seconds))
            elif p.release_for is not None:
                keep = max(1, int(1000 * p.release_for))
                pipe.delete(owner_key(session_id))
                pipe.pexpire(state_key(session_id), keep)
                pipe.pexpire(log_key(session_id), keep)
        for response_id, data, seconds in responses:
            if data is None:
                pipe.delete(response_key(response_id))
            else:
                pipe.set(response_key(response_id), data, px=max(1, int(1000 * seconds)))
        if len(pipe):
            await pipe.execute(raise_on_error=False)

    async def _renewer(self) -> None:
        """Renew the leases (and key lifetimes) of every session this process holds."""
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
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
        frames = [(int(entry_id.split(b"-")[0]), fields[b"f"]) for entry_id, fields in entries]
        return Loaded(orjson.loads(state), frames, owner.decode() if owner else None)

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
