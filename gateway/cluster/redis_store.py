"""The Redis session store: sessions that outlive the gateway process holding them.

``--session-store URL``: one Redis, Redis Sentinel or a Redis Cluster
(gateway/cluster/redis_topology.py; also ``$LLM_GATEWAY_SESSION_STORE``). Per session,
under ``llmgw:``, its id the keys' hash tag (one slot in a cluster):

- ``s:{id}``: the session as JSON (sessions/snapshot.py: settings, conversation,
  answers in flight, the resume token's hash), saved after the actor's turns;
- ``l:{id}``: its event log, a Redis stream, one entry per numbered frame (field ``f``;
  ``t``: the token ids of a delta's text, where the engine gave them), the entry id
  ``{sequence_number}-1``, trimmed like ``--replay-bytes``;
- ``o:{id}``: the owner's lease: a token of this process's (``PROCESS#N``, new at each
  take) with a TTL, renewed while it holds the session. Every write to the session's
  keys is a script that checks it first (gateway/cluster/store_scripts.py);
- ``r:ID``: a stored Responses response (``store: true``);
- ``b:ID``: a background response's session id and resume token, while a stored
  response would live (gateway/cluster/background.py);
- ``i:{process}``: the channel a process that resumed a session it does not own forwards
  its client's frames on (the relay; see gateway/cluster/store_relay.py).

The token path never awaits the store. Writes are queued (a list append) and leave in
one flush per loop turn and lane (gateway/cluster/store_lanes.py), which is to say per
engine step: frames on the log lane; states, leases and stored responses on the state
lane. A frame reaches its client only once the log has it, and its session's state as
it was when the frame was numbered: a socket's writes are held until then
(:meth:`RedisStore.due`), so a process that dies can lose nothing a client has seen.
The keys of a session expire ``--resume-window`` after its process stops renewing them.

**Fencing.** A write the lease refuses (another process took the session: this one was
paused, cut off, or a failover lost its lease) tells this process it has lost the
session: its held frames are dropped, never sent, and ``on_lost`` closes it here, so
that its client resumes where the lease is. A lease that is gone (a failover or a
restart lost it) is taken again only by a process that cannot have been paused past
it: one whose renewer ran at least once a lease (a pause shows as a gap between its
turns). While the store cannot be reached, frames of sessions Redis holds flow
memory-only only until the lease last renewed runs out; then they wait (``lapsed``), so
that even a partition leaves at most one process streaming a session.

**Failover.** A write Redis acknowledged can still be lost with its primary (replication
is asynchronous). The owner holds each session's state and its replay buffer in memory,
so after any failure, once a flush is written again (to the new primary), it saves every
state again and checks each log: a log that lacks frames the owner had written (the
reply says so) gets them again from the replay buffer.

While Redis is down or slow the gateway goes on memory-only (docs/deployment.md): writes
wait in a bounded buffer (``max_buffer_bytes``; beyond, the oldest session's log is
dropped and that session can no longer be resumed elsewhere), ``/healthz`` says
``"store": {"up": false}``, and the lanes retry with a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from redis.exceptions import (
    ClusterError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.cluster import redis_topology, store_scripts
from gateway.cluster.store_lanes import Batch, Lane
from gateway.cluster.store_writes import (
    LogWrites,
    NodeOf,
    StateWrites,
    append_args,
    append_call,
    background_key,
    channel,
    groups,
    log_key,
    owner_key,
    response_key,
    save_args,
    save_call,
    state_key,
    token_process,
)
from gateway.metrics import Metrics
from gateway.transport.coalesce import WriteBatch

__all__ = ["Loaded", "RedisStore", "Source", "channel", "log_key", "owner_key"]

log = logging.getLogger(__name__)

LEASE_SECONDS = 3.0
# Flushes of a lane sent and not answered yet. The state lane's go out while those before
# them wait for their replies (bounded, so that a slow Redis pushes back on the lane); the
# log lane's one at a time: what comes in meanwhile joins the next flush, and a gateway
# flat out would spend more CPU per token on more, smaller flushes (bench/store.py cpu).
# One at a time also means a log flush goes out only once the one before it is written:
# the number a log must hold already (its gap check) is then known.
LOG_FLUSHES_IN_FLIGHT = 1
STATE_FLUSHES_IN_FLIGHT = 8
# A read (a resume's load, a takeover's lease) is tried again for this long while Redis
# fails over (its primary gone, READONLY, CLUSTERDOWN...): a failover costs a client a wait,
# not its session. A Sentinel or a cluster replaces a primary within seconds.
PATIENCE_SECONDS = 10.0
FAILING_OVER = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    ClusterError,
    TryAgainError,
    RedisClusterException,
    OSError,
)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Source:
    """What a session held here can write again from memory, for a store that lost it:
    its state now, and its frames after a number (those its replay buffer keeps)."""

    state: Callable[[], bytes]
    frames_after: Callable[[int], list[tuple[int, bytes]]]


@dataclass(slots=True)
class _Waiter:
    """A callback and the flush of each lane it waits for. ``session``: whose frames it
    releases (dropped if that session is lost); ``internal``: the store's own (a lease let
    go), which waits for real writes even across a failure."""

    log: int
    state: int
    callback: Callable[[], None]
    since: float = 0.0  # a held socket's: when it began to wait (0: not timed)
    session: str | None = None
    internal: bool = False


@dataclass(slots=True)
class Loaded:
    state: dict[str, Any]
    frames: list[tuple[int, bytes]]  # the log, oldest first
    owner: str | None  # the process holding the lease
    token_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)  # by frame number


class RedisStore:
    """The session store's queues, leases and reads (the module docstring says how).

    Writes are split between the lanes by kind: frames to the log lane, the rest to the
    state lane; a lease let go (released, or the keys deleted) goes to the state lane only
    once both lanes have written what the session queued before, so that nothing of it
    lands after."""

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
        self.topology = redis_topology.connect(url)
        self.client: Any = self.topology.client
        self._slots: NodeOf | None = None
        if self.topology.kind == "cluster":
            self._slots = self._node_of_slot
        self.up = False
        # Down past the lease last renewed: frames of sessions Redis holds wait.
        self.lapsed = False
        self.on_lost: Callable[[str], None] | None = None  # a session another process took
        self.buffered_bytes = 0
        self._logs: dict[str, LogWrites] = {}
        self._states: dict[str, StateWrites] = {}
        # Stored responses and background records, by key; None: delete.
        self._responses: list[tuple[str, bytes | None, float]] = []
        self._owned: set[str] = set()
        self._tokens: dict[str, str] = {}  # each held session's lease token
        self._leased: set[str] = set()  # held sessions whose lease Redis has had
        self._sources: dict[str, Source] = {}
        self._log_top: dict[str, int] = {}  # the last frame each log surely has
        self._trimmed: dict[str, int] = {}  # the log's first kept entry, as last trimmed
        self._numbers = itertools.count(1)
        self._log_lane = Lane("log", LOG_FLUSHES_IN_FLIGHT, self.topology, self._take_logs,
                              self._written, self._failed)  # fmt: skip
        self._state_lane = Lane("state", STATE_FLUSHES_IN_FLIGHT, self.topology,
                                self._take_states, self._written, self._failed)  # fmt: skip
        # The flush of each lane that carries a session's latest queued write, while it
        # is not written yet (what a held frame of that session waits for).
        self._log_due: dict[str, int] = {}
        self._state_due: dict[str, int] = {}
        self._responses_due = 0  # a stored response: every held frame waits for it
        self._waiters: list[_Waiter] = []
        # Leases to let go once what their sessions queued before is written: their tokens.
        self._letting_go: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._renewing: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()  # close() has begun: no more lease renewals
        self._renew_all = False  # the next state flush renews every lease held
        self._tick = time.monotonic()  # the renewer's last turn: a pause shows as a gap
        self._paused = False  # a gap longer than a lease: take no lease that is gone
        self._valid_until = 0.0  # monotonic: every lease held is surely ours till then
        self._lapse: asyncio.TimerHandle | None = None

    @property
    def key_ttl_ms(self) -> int:
        """How long a session's keys outlive the last renewal of its lease."""
        return int(1000 * (max(self.resume_window, 0.0) + 2 * self.lease_seconds))

    async def start(self) -> None:
        """Connect (a Redis that is down now is retried in the background)."""
        with contextlib.suppress(RedisError, OSError):
            await self.topology.refresh()
            await self.client.ping()
            self._set_up(True)
        if not self.up:
            log.warning(
                "session store %s does not answer: memory-only until it does",
                redis_topology.safe(self.url),
            )
        loop = asyncio.get_running_loop()
        self._renewing = loop.create_task(self._renewer(), name="store-leases")
        self._tasks = [
            loop.create_task(self._log_lane.run(), name="store-log-writer"),
            loop.create_task(self._state_lane.run(), name="store-state-writer"),
            self._renewing,
        ]

    async def close(self) -> None:
        """Write what waits, let go of every lease (another process may take the sessions
        over at once), close the connections."""
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
            await self.topology.aclose()

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

    def own(self, session_id: str, source: Source) -> None:
        """Hold ``session_id`` from now on: a new session (its lease taken at the next
        flush), or one :meth:`acquire` took. ``source``: what it can write again."""
        self._owned.add(session_id)
        self._sources[session_id] = source
        if session_id not in self._tokens:
            self._tokens[session_id] = self._new_token()
            self._state_entry(session_id).take = "n"
            if self._valid_until < time.monotonic() + self.lease_seconds / 2:
                # No renewal lately (the first session): one now, with this take, so
                # that the leases' validity is known from the start.
                self._renew_all = True

    def logged_upto(self, session_id: str, seq: int) -> None:
        """The log of a session taken over holds its frames up to ``seq`` (as loaded)."""
        if seq >= 0:
            self._log_top[session_id] = seq

    def release(self, session_id: str, keep_for: float) -> None:
        """This process no longer holds the session: its keys live ``keep_for`` seconds
        (for a resume elsewhere)."""

        def mark(entry: StateWrites) -> None:
            entry.release_for = keep_for

        self._let_go(session_id, mark)

    def forget(self, session_id: str) -> None:
        """The session ended for good: its keys go."""
        logs = self._logs.get(session_id)
        if logs is not None and session_id in self._tokens:
            self.buffered_bytes -= sum(len(f) for _, f in logs.frames)
            logs.frames.clear()
            logs.token_ids.clear()

        def mark(entry: StateWrites) -> None:
            entry.state, entry.forget = None, True

        self._let_go(session_id, mark)

    def _let_go(self, session_id: str, mark: Callable[[StateWrites], None]) -> None:
        """Stop holding ``session_id``; once both lanes have written what it queued so
        far, its lease goes as ``mark`` says (nothing of it may land after that)."""
        token = self._tokens.pop(session_id, None)
        self._drop(session_id)
        if token is None:
            return  # not this process's (lost to another one): nothing to let go
        # What it queued before still goes, with its token, ahead of the lease let go.
        self._letting_go[session_id] = token

        def queue() -> None:
            if self._letting_go.pop(session_id, None) is None:
                return  # lost meanwhile
            entry = self._state_entry(session_id)
            entry.token, entry.take, entry.renew = token, "", False
            mark(entry)

        due = (self._log_due.get(session_id, 0), self._state_due.get(session_id, 0))
        self._wait(_Waiter(due[0], due[1], queue, internal=True))

    def _drop(self, session_id: str) -> None:
        self._owned.discard(session_id)
        self._leased.discard(session_id)
        self._sources.pop(session_id, None)
        self._log_top.pop(session_id, None)
        self._trimmed.pop(session_id, None)

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

    # -- what held frames wait for ------------------------------------------------------

    def due(self, session_id: str | None) -> tuple[int, int]:
        """The flush of each lane (log, state) that writes what ``session_id`` queued so
        far, its frames and its state, and any stored response queued so far (None: what
        every session queued). A held frame waits for these, not other sessions' writes."""
        if session_id is None:
            return self._log_lane.next, self._state_lane.next
        state_due = max(self._state_due.get(session_id, 0), self._responses_due)
        return self._log_due.get(session_id, 0), state_due

    def after(
        self, due: tuple[int, int], callback: Callable[[], None], session: str | None = None
    ) -> None:
        """Run ``callback`` once the flushes ``due`` (see :meth:`due`) are written; while
        Redis is down, at once, unless ``session``'s lease may have run out (``lapsed``);
        never if ``session`` is lost to another process meanwhile."""
        if not self.up and not (self.lapsed and session in self._leased):
            callback()
            return
        if not self.up:
            due = (self._log_lane.next, self._state_lane.next)
        self._wait(_Waiter(due[0], due[1], callback, time.perf_counter(), session))

    def after_flush(self, callback: Callable[[], None], session: str | None = None) -> None:
        """Run ``callback`` once everything queued now is in Redis (as :meth:`after`)."""
        self.after((self._log_lane.next, self._state_lane.next), callback, session)

    def _wait(self, waiter: _Waiter) -> None:
        self._waiters.append(waiter)
        log_lane, state_lane = self._log_lane, self._state_lane
        # A lane with nothing to write still counts a flush, and calls back whoever waits.
        if waiter.log > log_lane.done:
            log_lane.wake.set()
        if waiter.state > state_lane.done:
            state_lane.wake.set()
        if waiter.log <= log_lane.done and waiter.state <= state_lane.done:
            # Nothing left to wait for, but never on the caller's stack (it may be about
            # to hold the frame this callback sends): at the next flush of the log lane.
            waiter.log = log_lane.next
            log_lane.wake.set()

    def _call_back(self, *, failed: bool = False) -> None:
        """Run the callbacks whose flushes are written. ``failed``: Redis failed; the
        sockets are not held meanwhile (those of sessions whose lease may have lapsed
        are), and what the store itself waits for waits for the flushes that write again
        what the failure took back."""
        log_done, state_done = self._log_lane.done, self._state_lane.done
        ready, waiting = [], []
        for w in self._waiters:
            if failed and (w.internal or (self.lapsed and w.session in self._leased)):
                w.log, w.state = self._log_lane.next, self._state_lane.next
                waiting.append(w)
            elif failed or (w.log <= log_done and w.state <= state_done):
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

    def _set_up(self, up: bool) -> None:
        self.up = up
        if up:
            self.lapsed = False
            if self._lapse is not None:
                self._lapse.cancel()
                self._lapse = None
        if self.metrics is not None:
            self.metrics.store_up.set(1 if up else 0)

    def _failed(self, lane: Lane, exc: BaseException) -> None:
        if self.up:
            log.warning("session store write failed (%s): memory-only until it is back", exc)
            delay = max(0.0, self._valid_until - time.monotonic())
            self._lapse = asyncio.get_running_loop().call_later(delay, self._lapsed)
        self._set_up(False)
        if self.metrics is not None:
            self.metrics.store_errors.inc()
        self._call_back(failed=True)

    def _lapsed(self) -> None:
        """Down for longer than the lease last renewed: another process may hold it now."""
        self._lapse = None
        if not self.up:
            log.warning("session store away past the lease: held sessions wait for it")
            self.lapsed = True

    def _written(self, lane: Lane, number: int, started: float, frame_bytes: int) -> None:
        """Flush ``number`` of ``lane`` (and every one before it) is in Redis."""
        self.buffered_bytes -= frame_bytes
        if not self.up:
            log.info("session store is back: sessions are stored again")
            self._set_up(True)
            self._resync()
        lane.done = number
        if self.metrics is not None:
            self.metrics.store_flush_seconds.observe(time.perf_counter() - started)
        self._forget_written(lane)
        # The sockets' releases (a transport write each) after this lane's next flush
        # has gone out, not before it: they are ready now, the next flush is not.
        asyncio.get_running_loop().call_soon(self._call_back)

    def _resync(self, session_ids: list[str] | None = None) -> None:
        """After a failure (a failover may have lost what a primary acknowledged): every
        held session's state saved again, its lease asserted again, its log checked (and
        written again from memory where it lacks frames)."""
        for session_id in self._owned if session_ids is None else session_ids:
            source = self._sources.get(session_id)
            if source is None or session_id not in self._tokens:
                continue
            entry = self._state_entry(session_id)
            entry.state = source.state
            if entry.take != "n":
                entry.take = "r"
            self._log_entry(session_id).check = True

    def _forget_written(self, lane: Lane) -> None:
        due = self._log_due if lane is self._log_lane else self._state_due
        if len(due) > 2 * len(self._owned) + 64:  # bounded: entries of written flushes go
            done = lane.done
            for session_id in [k for k, v in due.items() if v <= done]:
                del due[session_id]

    # -- the flushes ----------------------------------------------------------------------

    def _retake(self) -> bool:
        """May a lease that is gone be taken again now? Not after a pause longer than a
        lease (the renewer's turns show it): another process may have held it since."""
        return not self._paused and time.monotonic() - self._tick < self.lease_seconds

    def _head(self) -> list[Any]:
        return [self.key_ttl_ms, int(1000 * self.lease_seconds), "1" if self._retake() else ""]

    def _take_logs(self) -> Batch:
        """What the log lane's next flush writes."""
        taken, self._logs = self._logs, {}
        frame_bytes = sum(len(f) for p in taken.values() for _, f in p.frames)
        parts: dict[str, list[Any]] = {}
        tops: dict[str, int] = {}
        for session_id, p in taken.items():
            token = self._tokens.get(session_id) or self._letting_go.get(session_id)
            if token is None or not (p.frames or p.check or p.trim_before is not None):
                continue
            take = "n" if session_id not in self._leased else ""
            parts[session_id] = append_args(
                session_id, p, token, take, self._log_top.get(session_id)
            )
            if p.frames:
                tops[session_id] = p.frames[-1][0]
        head = self._head()
        commands: dict[str, list[tuple[Any, ...]]] = {}
        order: dict[str, list[list[str]]] = {}
        for node, slot_groups in groups(parts, self._slots).items():
            commands[node] = [append_call(head, [(s, parts[s]) for s in g]) for g in slot_groups]
            order[node] = slot_groups

        answered: set[str] = set()  # sessions whose node has replied

        def replies(node: str, answers: list[Any]) -> None:
            for ids, reply in zip(order[node], answers, strict=True):
                for session_id, status in zip(ids, store_scripts.statuses(reply), strict=True):
                    answered.add(session_id)
                    self._logged(session_id, status, tops.get(session_id))

        def requeue() -> None:
            # Another node failed the flush after this one replied (a cluster's master
            # killed): what the nodes that replied wrote stays written, and what they said
            # a log lacks _rewrite has queued already. Queued again, such a part would go
            # before that, and the script, which numbers frames from the first one's,
            # would log them twice, the second time under the wrong numbers.
            written = [taken.pop(s) for s in answered if s in taken]
            self.buffered_bytes -= sum(len(f) for p in written for _, f in p.frames)
            self._requeue_logs(taken)

        return Batch(commands, replies, requeue, frame_bytes)

    def _logged(self, session_id: str, status: int, top: int | None) -> None:
        if session_id not in self._tokens:
            if status == store_scripts.LOST:
                self._letting_go.pop(session_id, None)
            return
        if status == store_scripts.LOST:
            self._lose(session_id)
        elif status >= 0:
            self._rewrite(session_id, status - 1)
        else:
            self._leased.add(session_id)
            if top is not None:
                self._log_top[session_id] = top
            if status == store_scripts.RETAKEN:
                self._resync([session_id])

    def _requeue_logs(self, taken: dict[str, LogWrites]) -> None:
        for session_id, old in taken.items():
            new = self._logs.get(session_id)
            if new is None:
                self._logs[session_id] = old
                continue
            new.frames[:0] = old.frames
            new.token_ids.update(old.token_ids)
            new.trim_before = new.trim_before or old.trim_before
            new.check = new.check or old.check

    def _take_states(self) -> Batch:
        """What the state lane's next flush writes (with every lease renewed, at a
        renewal's turn)."""
        taken, self._states = self._states, {}
        responses, self._responses = self._responses, []
        renewal = self._renew_all
        self._renew_all = False
        if renewal:
            for session_id in self._owned:
                entry = taken.get(session_id)
                if entry is None:
                    entry = taken[session_id] = StateWrites()
                entry.renew = True
        parts: dict[str, list[Any]] = {}
        for session_id, p in taken.items():
            p.token = (
                p.token or self._tokens.get(session_id) or self._letting_go.get(session_id, "")
            )
            if p.token:
                parts[session_id] = save_args(p)
        head = self._head()
        commands: dict[str, list[tuple[Any, ...]]] = {}
        order: dict[str, list[list[str]]] = {}
        for node, slot_groups in groups(parts, self._slots).items():
            commands[node] = [save_call(head, [(s, parts[s]) for s in g]) for g in slot_groups]
            order[node] = slot_groups
        for key, data, seconds in responses:
            node = self.topology.node_of(key) if self._slots is not None else ""
            command = ("DEL", key) if data is None else ("SET", key, data, "PX", _ms(seconds))
            commands.setdefault(node, []).append(command)
        sent = time.monotonic()
        waiting = set(commands)  # nodes that have not answered

        def replies(node: str, answers: list[Any]) -> None:
            # The scripts' replies, then the stored responses' (OK, or a count).
            for ids, reply in zip(order.get(node, ()), answers, strict=False):
                for session_id, status in zip(ids, store_scripts.statuses(reply), strict=True):
                    self._saved(session_id, status)
            waiting.discard(node)
            if renewal and not waiting:
                # Every lease held was renewed when this flush went out (or found lost).
                self._valid_until = max(self._valid_until, sent + self.lease_seconds)
                self._paused = False

        requeue = lambda: self._requeue_states(taken, responses)  # noqa: E731
        return Batch(commands, replies, requeue)

    def _saved(self, session_id: str, status: int) -> None:
        if session_id not in self._tokens:
            if status == store_scripts.LOST:
                self._letting_go.pop(session_id, None)
            return
        if status == store_scripts.LOST:
            self._lose(session_id)
            return
        self._leased.add(session_id)
        if status == store_scripts.RETAKEN:
            self._resync([session_id])

    def _requeue_states(
        self, taken: dict[str, StateWrites], responses: list[tuple[str, bytes | None, float]]
    ) -> None:
        for session_id, old in taken.items():
            new = self._states.get(session_id)
            if new is None:
                self._states[session_id] = old
                continue
            new.token = new.token or old.token
            new.state = new.state or old.state
            new.take = new.take or old.take
            new.renew = new.renew or old.renew
            if new.release_for is None:
                new.release_for = old.release_for
            new.forget = new.forget or old.forget
        self._responses[:0] = responses

    def _node_of_slot(self, slot: int) -> str:
        node = self.topology.client.nodes_manager.get_node_from_slot(slot)
        name: str = node.name
        return name

    # -- losing a session, and writing again what Redis lost ------------------------------

    def _lose(self, session_id: str) -> None:
        """Another process holds ``session_id``'s lease: nothing more of it is written,
        its held frames are never sent, and ``on_lost`` ends it here."""
        self._tokens.pop(session_id, None)
        self._drop(session_id)
        logs = self._logs.pop(session_id, None)
        if logs is not None:
            self.buffered_bytes -= sum(len(f) for _, f in logs.frames)
        self._states.pop(session_id, None)
        self._waiters = [w for w in self._waiters if w.session != session_id]
        log.warning("session %s: another gateway holds its lease now: it ends here", session_id)
        if self.metrics is not None:
            self.metrics.store_leases_lost.inc()
        if self.on_lost is not None:
            self.on_lost(session_id)

    def _rewrite(self, session_id: str, top: int) -> None:
        """The log ends at ``top``, short of what this process wrote (a failover lost the
        rest): write again what the replay buffer keeps after it, and hold the frames
        that waited for this flush until then."""
        source = self._sources.get(session_id)
        if source is None:
            return
        frames = source.frames_after(top)
        entry = self._log_entry(session_id)
        self.buffered_bytes += sum(len(f) for _, f in frames) - sum(len(f) for _, f in entry.frames)
        entry.frames = frames
        entry.check = not frames
        if frames and frames[0][0] == top + 1:
            self._log_top[session_id] = top
        else:
            self._log_top.pop(session_id, None)  # older frames are gone here too: as it is
        log.info("session %s: the store lost frames after %d: written again", session_id, top)
        if self.metrics is not None:
            self.metrics.store_rewrites.inc()
        following = self._log_lane.next
        for w in self._waiters:
            if w.session == session_id and w.log < following:
                w.log = following

    # -- leases -----------------------------------------------------------------------------

    def _new_token(self) -> str:
        return f"{self.process}#{next(self._numbers)}"

    async def acquire(self, session_id: str) -> bool:
        """Take the session's lease if nobody holds it (its owner is gone). Where writes
        are replicated, wait (briefly) for a replica to have it: a failover right after
        this take then keeps it."""
        token = self._new_token()
        key, lease = owner_key(session_id), int(1000 * self.lease_seconds)
        commands: list[tuple[Any, ...]] = [("SET", key, token, "NX", "PX", lease)]
        if self.topology.replicated:
            # On the same connection: WAIT counts that connection's writes.
            commands.append(("WAIT", 1, redis_topology.WAIT_REPLICA_MS))
        taken, *_ = await self.patiently(lambda: self.topology.execute_on(key, commands))
        if not taken:
            # A take tried again (its first reply lost with a primary) finds its own token.
            held = await self.patiently(lambda: self.client.get(key))
            if (held.decode() if isinstance(held, bytes) else held) != token:
                return False
        self._tokens[session_id] = token
        self._leased.add(session_id)
        return True

    async def _renewer(self) -> None:
        """Every third of a lease: renew every lease held (in the state lane's next
        flush), and notice a pause (a turn that came later than a lease)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.lease_seconds / 3)
            if self._closing.is_set():
                return
            now = time.monotonic()
            if now - self._tick > self.lease_seconds:
                log.warning("this process was paused for %.1f s: past its leases", now - self._tick)
                self._paused = True
            self._tick = now
            if self._owned:
                self._renew_all = True
                self._state_lane.wake.set()

    # -- the queues -------------------------------------------------------------------------

    def _log_entry(self, session_id: str) -> LogWrites:
        entry = self._logs.get(session_id)
        if entry is None:
            entry = self._logs[session_id] = LogWrites()
        lane = self._log_lane
        self._log_due[session_id] = lane.next
        lane.wake.set()
        return entry

    def _state_entry(self, session_id: str) -> StateWrites:
        entry = self._states.get(session_id)
        if entry is None:
            entry = self._states[session_id] = StateWrites()
        lane = self._state_lane
        self._state_due[session_id] = lane.next
        lane.wake.set()
        return entry

    def _shed(self) -> None:
        """Over the buffer: the oldest session's log goes (that session can then not be
        resumed elsewhere: its keys are deleted when Redis is back)."""
        for session_id, entry in list(self._logs.items()):
            if entry.frames:
                self.forget(session_id)
                if self.metrics is not None:
                    self.metrics.store_dropped.inc()
                if self.buffered_bytes <= self.max_buffer_bytes:
                    return

    async def flush(self) -> None:
        """Until everything queued before now is written (or Redis failed), leases let go
        included."""
        while True:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def flushed(done: asyncio.Future[None] = done) -> None:
                if not done.done():
                    done.set_result(None)

            self.after_flush(flushed)
            await done
            if not self._letting_go or not self.up:
                return
            await asyncio.sleep(0)  # the leases just queued: in the next flush

    # -- reads (a resume on a process that does not hold the session) ---------------

    async def patiently(self, read: Callable[[], Awaitable[T]]) -> T:
        """``read()``, tried again while Redis fails over (up to :data:`PATIENCE_SECONDS`);
        then its error, as a ``RedisError``."""
        backoff, deadline = 0.05, time.monotonic() + PATIENCE_SECONDS
        while True:
            try:
                return await read()
            except FAILING_OVER as exc:
                if time.monotonic() > deadline or self._closing.is_set():
                    if isinstance(exc, RedisError):
                        raise
                    raise RedisConnectionError(str(exc)) from exc
            await asyncio.sleep(backoff)
            backoff = min(0.5, 2 * backoff)
            with contextlib.suppress(*FAILING_OVER):
                await self.topology.refresh()

    async def load(self, session_id: str) -> Loaded | None:
        return await self.patiently(lambda: self._load(session_id))

    async def _load(self, session_id: str) -> Loaded | None:
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
        holder = token_process(owner.decode()) if owner else None
        return Loaded(orjson.loads(state), frames, holder, token_ids)

    async def owner(self, session_id: str) -> str | None:
        """The process holding ``session_id``'s lease now (None: nobody)."""
        token = await self.patiently(lambda: self.client.get(owner_key(session_id)))
        if isinstance(token, bytes):
            token = token.decode()
        return token_process(token) if token else None

    async def get_response(self, response_id: str) -> bytes | None:
        data = await self.patiently(lambda: self.client.get(response_key(response_id)))
        return data.encode() if isinstance(data, str) else data

    async def get_background(self, response_id: str) -> bytes | None:
        data = await self.patiently(lambda: self.client.get(background_key(response_id)))
        return data.encode() if isinstance(data, str) else data

    def describe(self) -> dict[str, object]:
        return {
            "kind": "redis",
            "topology": self.topology.kind,
            "url": redis_topology.safe(self.url),
            "up": self.up,
            "sessions": len(self._owned),
            "buffered_bytes": self.buffered_bytes,
        }


def _ms(seconds: float) -> int:
    return max(1, int(1000 * seconds))
