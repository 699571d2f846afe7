"""The sessions this process holds: made, run, counted and ended here.

Who owns what: the table owns the map of sessions by id (connected or detached), the
task that runs each one, the set of detached ones and the replay budget that all their
outboxes share. The WebSocket endpoint, the HTTP routes, resumes and takeovers all make
and find sessions through it; a :class:`SessionKeeper` (with a session store, the
cluster layer's persistence) is told of each session it adopts and of each that ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import ValuesView
from typing import Protocol

from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.observability import Observability, Record
from gateway.scheduler import CancelReason, Scheduler
from sessions import codec
from sessions.core import Dialect, Session, SessionConfig, SessionLimits
from sessions.outbox import Framing, Outbox, ReplayBudget

log = logging.getLogger(__name__)


class SessionKeeper(Protocol):
    """Keeps a copy of sessions elsewhere (gateway/cluster/persistence.py)."""

    def adopt(self, session: Session) -> None: ...

    def ended(self, session: Session) -> None: ...


class SessionTable:
    def __init__(
        self,
        config: GatewayConfig,
        scheduler: Scheduler,
        metrics: Metrics,
        owner_tag: str,
        defaults: SessionConfig,
        observability: Observability | None = None,
    ) -> None:
        self._config = config
        self.observability = observability  # each session's answers' lines and spans
        self.scheduler = scheduler
        self.metrics = metrics
        self._owner_tag = owner_tag  # which process and worker holds a session, in its id
        # What a new session starts with: the engine's and the command line's defaults.
        self.defaults = defaults
        self.limits = SessionLimits(
            served_models=config.served_model_names,
            hosted_tools=config.hosted_tools,
            max_choices=config.max_choices,
        )
        self.keeper: SessionKeeper | None = None
        self._by_id: dict[str, Session] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._detached: set[Session] = set()
        self._unkept: set[Session] = set()  # sessions the keeper was not given
        self._ended_traffic = (0, 0, 0)  # frames, delta frames, bytes of ended sessions
        self._replay_budget = ReplayBudget(config.replay_buffer_total_bytes)

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def sessions(self) -> ValuesView[Session]:
        """Every session: connected, or detached and waiting for a resume."""
        return self._by_id.values()

    def get(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    @property
    def detached(self) -> int:
        return len(self._detached)

    def new_session_id(self) -> str:
        # The worker that holds a session is in its id: a resume landing on another
        # worker is relayed there (gateway/cluster/worker_relay.py).
        return codec.new_id(f"sess_{self._owner_tag}")

    def new_outbox(
        self, framing: Framing, replay_bytes: int | None = None, *, unread: bool = False
    ) -> Outbox:
        c = self._config
        if replay_bytes is None:
            replay_bytes = c.replay_buffer_bytes if c.resume_window > 0 else 0
        return Outbox(
            framing,
            coalesce=c.coalesce,
            replay_bytes=replay_bytes,
            replay_budget=self._replay_budget,
            unread=unread,
        )

    def open(
        self,
        dialect: Dialect,
        framing: Framing,
        session_id: str | None = None,
        resume_token: str | None = None,
        replay_bytes: int | None = None,
        *,
        kept: bool = True,
        tenant: str = "",
        origin: Record | None = None,
        unread: bool = False,
    ) -> Session:
        """A new session and the task that runs it, until it ends (which may be long after
        its first connection closed: a dropped one waits detached for a resume).
        ``kept``: the keeper saves it (False for what no client can resume); ``origin``: the
        HTTP request or WebSocket connection it is made for (its answers' access log);
        ``unread``: no socket will read its events (a one-shot HTTP answer): none is made."""
        session = Session(
            self.scheduler,
            self.new_outbox(framing, replay_bytes, unread=unread),
            dialect,
            config=self.defaults,
            limits=self.limits,
            metrics=self.metrics,
            session_id=session_id or self.new_session_id(),
            resume_token=resume_token,
            tenant=tenant,
            observability=self.observability,
            origin=origin,
        )
        self.register(session, kept=kept)
        return session

    def register(self, session: Session, *, kept: bool = True) -> None:
        """``session`` is this process's from now on: counted, run, kept (with a keeper)."""
        self._by_id[session.id] = session
        self.metrics.sessions.inc()
        self.metrics.sessions_total.inc()
        if not kept:
            self._unkept.add(session)
        else:
            # A session a client can come back to counts against its tenant's max_sessions.
            self._count_tenant(session, 1)
            if self.keeper is not None:
                self.keeper.adopt(session)
        task = asyncio.get_running_loop().create_task(self._live(session), name=session.id)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def set_detached(self, session: Session, detached: bool) -> None:
        was = session in self._detached
        if detached:
            self._detached.add(session)
        else:
            self._detached.discard(session)
        self.metrics.detached.set(len(self._detached))
        if was != detached and session.id in self._by_id and session not in self._unkept:
            # A tenant's max_sessions counts connected sessions: one waiting for its
            # resume leaves room for the connection that resumes it.
            self._count_tenant(session, -1 if detached else 1)

    def _count_tenant(self, session: Session, change: int) -> None:
        if change > 0:
            self.scheduler.tenants.session_opened(session.tenant)
        else:
            self.scheduler.tenants.session_closed(session.tenant)
        self.metrics.tenant_sessions.labels(tenant=session.tenant).inc(change)

    def close_all(self, reason: CancelReason, code: int, message: str) -> None:
        for session in list(self._by_id.values()):
            session.close(reason, code, message)

    async def wait_ended(self, seconds: float) -> None:
        """Until every session's task has ended (detached ones have no connection to wait
        for), or ``seconds``."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=seconds)

    def traffic(self) -> tuple[int, int, int]:
        """Frames, delta frames and bytes sent by every session so far, ended ones too.
        Counted per session on the hot path (a few additions, no call), summed here."""
        frames, delta_frames, sent = self._ended_traffic
        for session in self._by_id.values():
            stats = session.outbox.stats
            frames += stats.frames_out
            delta_frames += stats.delta_frames_out
            sent += stats.bytes_out
        return frames, delta_frames, sent

    async def _live(self, session: Session) -> None:
        try:
            await session.run()
        except Exception:
            log.exception("session %s ended with an error", session.id)
        finally:
            del self._by_id[session.id]
            if session not in self._unkept:
                if session not in self._detached:
                    self._count_tenant(session, -1)
                if self.keeper is not None:
                    self.keeper.ended(session)
            self._unkept.discard(session)
            session.outbox.release()
            stats, (frames, deltas, sent) = session.outbox.stats, self._ended_traffic
            self._ended_traffic = (
                frames + stats.frames_out,
                deltas + stats.delta_frames_out,
                sent + stats.bytes_out,
            )
            self.metrics.sessions.dec()
            self.set_detached(session, False)
