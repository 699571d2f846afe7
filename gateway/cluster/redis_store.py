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
(gateway/cluster/store_holds.py), so a process that dies can lose nothing a client has
seen.
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
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.cluster import redis_topology, store_responses, store_scripts
from gateway.cluster.store_holds import Holds
from gateway.cluster.store_lanes import Batch, Lane
from gateway.cluster.store_leases import LEASE_SECONDS, Leases
from gateway.cluster.store_reads import PatientReads
from gateway.cluster.store_responses import ResponseWrites
from gateway.cluster.store_writes import (
    LogWrites,
    NodeOf,
    StateWrites,
    append_args,
    append_call,
    calls,
    channel,
    log_key,
    owner_key,
    put_back,
    save_args,
    save_call,
)
from gateway.metrics import Metrics
from gateway.transport.coalesce import WriteBatch

__all__ = ["RedisStore", "Source", "channel", "log_key", "owner_key"]

log = logging.getLogger(__name__)

# Flushes of a lane sent and not answered yet. The state lane's go out while those before
# them wait for their replies (bounded, so that a slow Redis pushes back on the lane); the
# log lane's one at a time: what comes in meanwhile joins the next flush, and a gateway
# flat out would spend more CPU per token on more, smaller flushes (bench/store.py cpu).
# One at a time also means a log flush goes out only once the one before it is written:
# the number a log must hold already (its gap check) is then known.
LOG_FLUSHES_IN_FLIGHT = 1
STATE_FLUSHES_IN_FLIGHT = 8


@dataclass(frozen=True, slots=True)
class Source:
    """What a session held here can write again from memory, for a store that lost it:
    its state now, and its frames after a number (those its replay buffer keeps)."""

    state: Callable[[], bytes]
    frames_after: Callable[[int], list[tuple[int, bytes]]]


class RedisStore:
    """The session store's write queues and their flushes, fenced by the leases (the
    module docstring says how). Its parts: :attr:`reads` (store_reads.py), :attr:`leases`
    (store_leases.py), :attr:`responses` (store_responses.py), :attr:`holds` (what a
    socket's frames wait for: store_holds.py).

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
        self.process = process
        self.resume_window = resume_window
        self.max_buffer_bytes = max_buffer_bytes
        self.metrics = metrics
        self.topology = redis_topology.connect(url)
        self.client: Any = self.topology.client
        self._slots: NodeOf | None = None
        if self.topology.kind == "cluster":
            self._slots = self._node_of_slot
        self.on_lost: Callable[[str], None] | None = None  # a session another process took
        self.buffered_bytes = 0
        self._logs: dict[str, LogWrites] = {}
        self._states: dict[str, StateWrites] = {}
        self._owned: set[str] = set()
        self._sources: dict[str, Source] = {}
        self._log_top: dict[str, int] = {}  # the last frame each log surely has
        self._trimmed: dict[str, int] = {}  # the log's first kept entry, as last trimmed
        self._log_lane = Lane("log", LOG_FLUSHES_IN_FLIGHT, self.topology, self._take_logs,
                              self._written, self._failed)  # fmt: skip
        self._state_lane = Lane("state", STATE_FLUSHES_IN_FLIGHT, self.topology,
                                self._take_states, self._written, self._failed)  # fmt: skip
        # Stored responses and background records: every held frame waits for a put.
        self.responses = ResponseWrites(self._state_lane)
        # Leases to let go once what their sessions queued before is written: their tokens.
        self._letting_go: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._renewing: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()  # close() has begun: no more lease renewals
        # Reads (a resume's load, a takeover's lease) wait out a failover.
        self.reads = PatientReads(self.topology, self._closing)
        self.leases = Leases(process, lease_seconds, self.reads, self._closing)
        # What a socket's frames wait for (the store is a wire's Hold through it).
        self.holds = Holds(self._log_lane, self._state_lane, self.responses, self.leases,
                           metrics, write_batch)  # fmt: skip

    @property
    def key_ttl_ms(self) -> int:
        """How long a session's keys outlive the last renewal of its lease."""
        return int(1000 * (max(self.resume_window, 0.0) + 2 * self.leases.seconds))

    async def start(self) -> None:
        """Connect (a Redis that is down now is retried in the background)."""
        with contextlib.suppress(RedisError, OSError):
            await self.topology.refresh()
            await self.client.ping()
            self.holds.set_up(True)
        if not self.holds.up:
            log.warning(
                "session store %s does not answer: memory-only until it does",
                redis_topology.safe(self.url),
            )
        loop = asyncio.get_running_loop()
        renewer = self.leases.renewer(lambda: bool(self._owned), self._state_lane.wake.set)
        self._renewing = loop.create_task(renewer, name="store-leases")
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
        flush), or one :meth:`Leases.acquire` took. ``source``: what it can write again."""
        self._owned.add(session_id)
        self._sources[session_id] = source
        if session_id not in self.leases.tokens:
            self.leases.take(session_id)
            self._state_entry(session_id).take = "n"

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
        if logs is not None and session_id in self.leases.tokens:
            self.buffered_bytes -= sum(len(f) for _, f in logs.frames)
            logs.frames.clear()
            logs.token_ids.clear()

        def mark(entry: StateWrites) -> None:
            entry.state, entry.forget = None, True

        self._let_go(session_id, mark)

    def _let_go(self, session_id: str, mark: Callable[[StateWrites], None]) -> None:
        """Stop holding ``session_id``; once both lanes have written what it queued so
        far, its lease goes as ``mark`` says (nothing of it may land after that)."""
        token = self.leases.tokens.pop(session_id, None)
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

        self.holds.after_written(session_id, queue)

    def _drop(self, session_id: str) -> None:
        self._owned.discard(session_id)
        self.leases.leased.discard(session_id)
        self._sources.pop(session_id, None)
        self._log_top.pop(session_id, None)
        self._trimmed.pop(session_id, None)

    # -- a lane's flush written, or failed --------------------------------------------

    def _failed(self, lane: Lane, exc: BaseException) -> None:
        self.holds.down(exc)
        if self.metrics is not None:
            self.metrics.store_errors.inc()
        self.holds.call_back(failed=True)

    def _written(self, lane: Lane, number: int, started: float, frame_bytes: int) -> None:
        """Flush ``number`` of ``lane`` (and every one before it) is in Redis."""
        self.buffered_bytes -= frame_bytes
        if not self.holds.up:
            log.info("session store is back: sessions are stored again")
            self.holds.set_up(True)
            self._resync()
        lane.done = number
        if self.metrics is not None:
            self.metrics.store_flush_seconds.observe(time.perf_counter() - started)
        self.holds.forget_written(lane, len(self._owned))
        # The sockets' releases (a transport write each) after this lane's next flush
        # has gone out, not before it: they are ready now, the next flush is not.
        asyncio.get_running_loop().call_soon(self.holds.call_back)

    def _resync(self, session_ids: list[str] | None = None) -> None:
        """After a failure (a failover may have lost what a primary acknowledged): every
        held session's state saved again, its lease asserted again, its log checked (and
        written again from memory where it lacks frames)."""
        for session_id in self._owned if session_ids is None else session_ids:
            source = self._sources.get(session_id)
            if source is None or session_id not in self.leases.tokens:
                continue
            entry = self._state_entry(session_id)
            entry.state = source.state
            if entry.take != "n":
                entry.take = "r"
            self._log_entry(session_id).check = True

    # -- the flushes ----------------------------------------------------------------------

    def _token(self, session_id: str) -> str | None:
        """The token a session's writes carry: held, or its lease being let go."""
        return self.leases.tokens.get(session_id) or self._letting_go.get(session_id)

    def _head(self) -> list[Any]:
        retake = "1" if self.leases.may_retake() else ""
        return [self.key_ttl_ms, int(1000 * self.leases.seconds), retake]

    def _take_logs(self) -> Batch:
        """What the log lane's next flush writes."""
        taken, self._logs = self._logs, {}
        frame_bytes = sum(len(f) for p in taken.values() for _, f in p.frames)
        parts: dict[str, list[Any]] = {}
        tops: dict[str, int] = {}
        for session_id, p in taken.items():
            token = self._token(session_id)
            if token is None or not (p.frames or p.check or p.trim_before is not None):
                continue
            take = "n" if session_id not in self.leases.leased else ""
            parts[session_id] = append_args(
                session_id, p, token, take, self._log_top.get(session_id)
            )
            if p.frames:
                tops[session_id] = p.frames[-1][0]
        commands, order = calls(append_call, self._head(), parts, self._slots)

        answered: set[str] = set()  # sessions whose node has replied

        def replies(node: str, answers: list[Any]) -> None:
            for ids, reply in zip(order[node], answers, strict=True):
                for session_id, status in zip(ids, store_scripts.statuses(reply), strict=True):
                    answered.add(session_id)
                    self._answered(session_id, status, tops.get(session_id))

        def requeue() -> None:
            # Another node failed the flush after this one replied (a cluster's master
            # killed): what the nodes that replied wrote stays written, and what they said
            # a log lacks _rewrite has queued already. Queued again, such a part would go
            # before that, and the script, which numbers frames from the first one's,
            # would log them twice, the second time under the wrong numbers.
            written = [taken.pop(s) for s in answered if s in taken]
            self.buffered_bytes -= sum(len(f) for p in written for _, f in p.frames)
            put_back(self._logs, taken)

        return Batch(commands, replies, requeue, frame_bytes)

    def _answered(self, session_id: str, status: int, top: int | None = None) -> None:
        """A script's status for ``session_id`` (store_scripts.py); a log append's can
        also say that the log lacks frames (>= 0: its top + 1). ``top``: the last frame
        the append carried."""
        if session_id not in self.leases.tokens:
            if status == store_scripts.LOST:
                self._letting_go.pop(session_id, None)
            return
        if status == store_scripts.LOST:
            self._lose(session_id)
        elif status >= 0:
            self._rewrite(session_id, status - 1)
        else:
            self.leases.leased.add(session_id)
            if top is not None:
                self._log_top[session_id] = top
            if status == store_scripts.RETAKEN:
                self._resync([session_id])

    def _take_states(self) -> Batch:
        """What the state lane's next flush writes (with every lease renewed, at a
        renewal's turn)."""
        taken, self._states = self._states, {}
        responses = self.responses.take()
        renewal = self.leases.renewal()
        if renewal:
            for session_id in self._owned:
                entry = taken.get(session_id)
                if entry is None:
                    entry = taken[session_id] = StateWrites()
                entry.renew = True
        parts: dict[str, list[Any]] = {}
        for session_id, p in taken.items():
            p.token = p.token or self._token(session_id) or ""
            if p.token:
                parts[session_id] = save_args(p)
        commands, order = calls(save_call, self._head(), parts, self._slots)
        for key, data, seconds in responses:
            node = self.topology.node_of(key) if self._slots is not None else ""
            commands.setdefault(node, []).append(store_responses.command(key, data, seconds))
        sent = time.monotonic()
        waiting = set(commands)  # nodes that have not answered

        def replies(node: str, answers: list[Any]) -> None:
            # The scripts' replies, then the stored responses' (OK, or a count).
            for ids, reply in zip(order.get(node, ()), answers, strict=False):
                for session_id, status in zip(ids, store_scripts.statuses(reply), strict=True):
                    self._answered(session_id, status)
            waiting.discard(node)
            if renewal and not waiting:
                # Every lease held was renewed when this flush went out (or found lost).
                self.leases.renewed(sent)

        requeue = lambda: self._requeue_states(taken, responses)  # noqa: E731
        return Batch(commands, replies, requeue)

    def _requeue_states(
        self, taken: dict[str, StateWrites], responses: store_responses.Queued
    ) -> None:
        put_back(self._states, taken)
        self.responses.requeue(responses)

    def _node_of_slot(self, slot: int) -> str:
        node = self.topology.client.nodes_manager.get_node_from_slot(slot)
        name: str = node.name
        return name

    # -- losing a session, and writing again what Redis lost ------------------------------

    def _lose(self, session_id: str) -> None:
        """Another process holds ``session_id``'s lease: nothing more of it is written,
        its held frames are never sent, and ``on_lost`` ends it here."""
        self.leases.tokens.pop(session_id, None)
        self._drop(session_id)
        logs = self._logs.pop(session_id, None)
        if logs is not None:
            self.buffered_bytes -= sum(len(f) for _, f in logs.frames)
        self._states.pop(session_id, None)
        self.holds.lost(session_id)
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
        self.holds.rewriting(session_id)

    # -- the queues -------------------------------------------------------------------------

    def _log_entry(self, session_id: str) -> LogWrites:
        entry = self._logs.get(session_id)
        if entry is None:
            entry = self._logs[session_id] = LogWrites()
        self.holds.queued(self._log_lane, session_id)
        return entry

    def _state_entry(self, session_id: str) -> StateWrites:
        entry = self._states.get(session_id)
        if entry is None:
            entry = self._states[session_id] = StateWrites()
        self.holds.queued(self._state_lane, session_id)
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

            self.holds.after_flush(flushed)
            await done
            if not self._letting_go or not self.holds.up:
                return
            await asyncio.sleep(0)  # the leases just queued: in the next flush

    def describe(self) -> dict[str, object]:
        return {
            "kind": "redis",
            "topology": self.topology.kind,
            "url": redis_topology.safe(self.url),
            "up": self.holds.up,
            "sessions": len(self._owned),
            "buffered_bytes": self.buffered_bytes,
        }
