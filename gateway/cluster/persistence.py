"""What a gateway does with a Redis session store (gateway/cluster/redis_store.py).

- Every session it opens is saved: its frames go to the event log as they are numbered
  (the outbox's ``on_sent``), its state after each turn of its actor (``on_change``),
  and the process holds its lease (:meth:`Persistence.adopt`).
- A resume for a session this process does not hold is served from the store
  (:meth:`Persistence.resume`): if the owner is gone (its lease expired, or it let go
  at a drain) this process **takes the session over**: it restores it, replays the
  log the client missed and continues its answers in flight; if the owner is alive
  (another host or worker), this process **relays**: it replays from the log, tails
  the live frames from Redis and forwards the client's frames to the owner over the
  owner's pub/sub channel (gateway/cluster/store_relay.py). With a store this is the one relay
  mechanism, between workers too (the Unix-socket relay is for the memory store).
- At a drain (:meth:`Persistence.hand_over`) every session is saved once more with its
  answers in flight, its lease released, and its hooks cut, so that what the local
  shutdown then does (cancelling answers) never reaches the store.
- A session whose lease another process has taken (this one was paused past it, cut off
  from Redis, or a failover lost its lease: the store's fenced writes say so) ends here
  at once (:meth:`Persistence.lost`): nothing more of it is sent or stored, its socket
  is closed with 1012, and its client resumes where the lease is. This is where a
  takeover by another process shows on this one (a hook for its log line and metric).

Who owns what: the store's queue and connections are the store's; this module only
calls it from the event loop thread; restored sessions belong to the gateway like any.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket

import orjson
from redis.exceptions import RedisError

from gateway.cluster.redis_store import RedisStore, Source
from gateway.cluster.store_reads import Loaded
from gateway.metrics import Metrics
from gateway.observability import Record
from gateway.session_table import SessionTable
from gateway.transport.sse import SseWire
from gateway.transport.wire import SocketWire
from sessions import snapshot
from sessions.core import Session
from sessions.dialects import BY_NAME, DialectContext
from sessions.errors import ResumeRefused
from sessions.outbox import Outbox, Wire
from sessions.response_store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)


def process_id(node: str | None) -> str:
    """This process's name in leases: host (or ``--node``), pid and a random part."""
    return f"{node or socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def response_json(stored: StoredResponse) -> bytes:
    return orjson.dumps(
        {
            "id": stored.id,
            "body": stored.body,
            "history": [snapshot.item_json(i) for i in stored.history],
            "input": [snapshot.item_json(i) for i in stored.input_items],
            "pending_calls": [list(c) for c in stored.pending_calls],
            "tenant": stored.tenant,
        }
    )


def response_from(data: bytes) -> StoredResponse:
    obj = orjson.loads(data)
    return StoredResponse(
        obj["id"],
        obj["body"],
        tuple(snapshot.item_from(i) for i in obj["history"]),
        tuple(snapshot.item_from(i) for i in obj["input"]),
        tuple((c[0], c[1]) for c in obj["pending_calls"]),
        obj.get("tenant", ""),
    )


LOST_CLOSE_CODE = 1012
LOST_REASON = "the session moved to another gateway: resume again"


def frames_after(outbox: Outbox, after: int) -> list[tuple[int, bytes]]:
    """The numbered frames after ``after`` that ``outbox``'s replay buffer keeps (from its
    oldest kept, where it no longer keeps all of them)."""
    start = max(after, outbox.first_kept - 1)
    frames = outbox.replay_after(start) or []
    return [(start + 1 + i, frame) for i, frame in enumerate(frames)]


def _serve(wire: object, session_id: str) -> None:
    """A socket now serving ``session_id``: its held frames wait for that session's writes."""
    if isinstance(wire, SocketWire | SseWire):
        wire.session_id = session_id


class Persistence:
    """One gateway's use of its store (see the module docstring)."""

    def __init__(
        self,
        store: RedisStore,
        table: SessionTable,
        responses: ResponseStore,
        metrics: Metrics,
        dialects: DialectContext,
        resume_window: float,
    ) -> None:
        self.store = store
        self._table = table
        self._responses = responses
        self._metrics = metrics
        self._dialects = dialects
        self._resume_window = resume_window
        self._handed_over = False  # a drain gave every session back to the store
        table.keeper = self
        store.on_lost = self.lost
        responses.on_put = lambda r: store.responses.put_response(
            r.id, response_json(r), responses.ttl
        )
        responses.on_delete = store.responses.delete_response

    # -- sessions of this process ------------------------------------------------------

    def adopt(self, session: Session) -> None:
        """Save ``session`` from now on, and hold its lease."""
        store, session_id, name = self.store, session.id, session.dialect.name
        session.outbox.on_sent = lambda seq, frame: store.log(session_id, seq, frame)
        session.outbox.on_token_ids = lambda seq, ids: store.log_token_ids(session_id, seq, ids)
        session.outbox.on_attach = lambda wire: _serve(wire, session_id)

        def changed(s: Session) -> None:
            store.save(session_id, lambda: snapshot.dump(s, name))
            store.trim(session_id, s.outbox.first_kept)

        session.on_change = changed
        changed(session)
        outbox = session.outbox
        source = Source(lambda: snapshot.dump(session, name), lambda n: frames_after(outbox, n))
        store.own(session_id, source)

    def ended(self, session: Session) -> None:
        """``session`` ended here: for good (its keys go), or handed over at a drain."""
        _cut(session)
        if not self._handed_over:
            self.store.forget(session.id)

    def lost(self, session_id: str) -> None:
        """Another process holds ``session_id``'s lease now: end the session here without
        a word more to its client or the store (see the module docstring)."""
        session = self._table.get(session_id)
        if session is None or session.ending:
            return
        log.warning("session %s was taken over by another gateway: closed here", session_id)
        _cut(session)
        _handed_over(session)
        wire = session.outbox.abandon()
        if wire is not None:
            abandon = getattr(wire, "abandon", None)
            if abandon is not None:
                abandon(LOST_CLOSE_CODE, LOST_REASON)
            else:
                wire.close(LOST_CLOSE_CODE, LOST_REASON)
        session.close("disconnected")

    def hand_over(self, sessions: list[Session]) -> None:
        """A drain: save each session as it is now, answers in flight included, and let
        go of it; nothing this process does with them afterwards is saved."""
        window = self._resume_window
        self._handed_over = True
        for session in sessions:
            if session.ending and not session.live_responses:
                continue
            data = snapshot.dump(session, session.dialect.name)
            self.store.save(session.id, lambda data=data: data)  # type: ignore[misc]
            self.store.release(session.id, window)
            _cut(session)
            _handed_over(session)
            # At once, with no await before it: a frame numbered from now on would reach
            # the client without being in the log. What is pending still goes, after the
            # flush that logs it (the socket holds it till then).
            session.outbox.close(1012, "service restart: resume on another gateway")

    # -- sessions of other processes ---------------------------------------------------

    async def fetch_response(self, response_id: str) -> None:
        """Bring a stored response another process made into this process's cache, where
        ``ResponseStore.get`` finds it (for its own tenant only)."""
        local = self._responses
        if response_id in local:
            return
        try:
            data = await self.store.reads.response(response_id)
        except (RedisError, OSError):
            return
        if data is not None:
            local.put(response_from(data), notify=False)

    async def load(self, session_id: str, token: str, tenant: str) -> Loaded:
        """The stored session, if ``token`` is its and ``tenant`` owns it; else
        :class:`ResumeRefused` (the same ``session_not_found`` for either)."""
        try:
            loaded = await self.store.reads.load(session_id)
        except (RedisError, OSError) as exc:
            log.warning("resume of %s: the session store does not answer (%r)", session_id, exc)
            raise ResumeRefused("session_not_found") from None
        if loaded is None or not snapshot.token_matches(token, loaded.state["token"]):
            raise ResumeRefused("session_not_found")
        if loaded.state.get("tenant", "") != tenant:
            raise ResumeRefused("session_not_found")
        return loaded

    async def take_over(
        self, loaded: Loaded, token: str, last: int, wire: Wire, origin: Record | None = None
    ) -> Session:
        """Make the stored session this process's, its client on ``wire`` (replayed from
        ``last``; ``origin``: its connection or request), its answers in flight going on;
        else raise :class:`ResumeRefused`."""
        table = self._table
        session_id = loaded.state["id"]
        if not await self.store.leases.acquire(session_id):
            raise ResumeRefused("session_busy")
        if loaded.frames:
            self.store.logged_upto(session_id, loaded.frames[-1][0])
        kind = BY_NAME[loaded.state["dialect"]]
        for response_id in kind.continued_responses(loaded.state["dialect_state"]):
            await self.fetch_response(response_id)
        dialect, framing = kind.make(self._dialects)
        outbox = table.new_outbox(framing)
        outbox.seed(loaded.frames)
        session, in_flight = snapshot.restore(
            loaded.state,
            table.scheduler,
            outbox,
            dialect,
            token=token,
            limits=table.limits,
            metrics=self._metrics,
            observability=table.observability,
        )
        table.register(session)
        rotate = kind.rotates_resume_token
        code = session.resume(token, last, wire, rotate=rotate, origin=origin)
        if code is not None:
            session.close("disconnected")
            self._metrics.takeovers.labels(outcome=code).inc()
            raise ResumeRefused(code)
        snapshot.continue_responses(session, in_flight, loaded.frames, loaded.token_ids)
        self._metrics.takeovers.labels(outcome="taken_over").inc()
        log.info(
            "took over session %s from %s (%d answers in flight)",
            session_id,
            loaded.owner or "a stopped gateway",
            len(in_flight),
        )
        return session


def _cut(session: Session) -> None:
    """Nothing ``session`` does from now on reaches the store."""
    session.outbox.on_sent = None
    session.outbox.on_token_ids = None
    session.outbox.on_attach = None
    session.on_change = None


def _handed_over(session: Session) -> None:
    """What this process ends of ``session``'s answers from now on is no cancel: another
    process goes on with them (its access log line and span say so)."""
    for r in session.responses:
        if r.record is not None:
            r.record.handed_over = True
            r.record.note("handover")
