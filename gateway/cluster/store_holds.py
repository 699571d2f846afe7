"""What a socket's frames wait for before they reach the client: the store's flushes.

A frame reaches its client only once the log has it, and its session's state as it was
when the frame was numbered (redis_store.py): a socket's writes are held (the ``Hold`` of
gateway/transport/wire.py) until the flush of each lane that carries what its session
queued is written, not other sessions' writes. :class:`Holds` keeps those callbacks, and
the store's own (a lease let go once what its session queued before is written), and
whether the store is up: while it is down, frames flow memory-only until the lease last
renewed may have run out (``lapsed``); then those of sessions Redis holds wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.cluster.store_lanes import Lane
from gateway.cluster.store_leases import Leases
from gateway.cluster.store_responses import ResponseWrites
from gateway.metrics import Metrics
from gateway.transport.coalesce import WriteBatch

log = logging.getLogger(__name__)


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


class Holds:
    """The callbacks waiting for the lanes' flushes, and whether the store is up."""

    def __init__(
        self,
        log_lane: Lane,
        state_lane: Lane,
        responses: ResponseWrites,
        leases: Leases,
        metrics: Metrics | None,
        write_batch: WriteBatch | None,
    ) -> None:
        self._log_lane = log_lane
        self._state_lane = state_lane
        self._responses = responses
        self._leases = leases
        self._metrics = metrics
        # Open while a flush's callbacks release held frames: each socket's, in one write.
        self._write_batch = write_batch or contextlib.nullcontext()
        self.up = False
        # Down past the lease last renewed: frames of sessions Redis holds wait.
        self.lapsed = False
        self._lapse: asyncio.TimerHandle | None = None
        # The flush of each lane that carries a session's latest queued write, while it
        # is not written yet (what a held frame of that session waits for).
        self._log_due: dict[str, int] = {}
        self._state_due: dict[str, int] = {}
        self._waiters: list[_Waiter] = []

    def queued(self, lane: Lane, session_id: str) -> None:
        """``session_id`` queued a write for ``lane``: it leaves in the lane's next flush."""
        due = self._log_due if lane is self._log_lane else self._state_due
        due[session_id] = lane.next
        lane.wake.set()

    def due(self, session_id: str | None) -> tuple[int, int]:
        """The flush of each lane (log, state) that writes what ``session_id`` queued so
        far, its frames and its state, and any stored response queued so far (None: what
        every session queued). A held frame waits for these, not other sessions' writes."""
        if session_id is None:
            return self._log_lane.next, self._state_lane.next
        state_due = max(self._state_due.get(session_id, 0), self._responses.due)
        return self._log_due.get(session_id, 0), state_due

    def after(
        self, due: tuple[int, int], callback: Callable[[], None], session: str | None = None
    ) -> None:
        """Run ``callback`` once the flushes ``due`` (see :meth:`due`) are written; while
        Redis is down, at once, unless ``session``'s lease may have run out (``lapsed``);
        never if ``session`` is lost to another process meanwhile."""
        if not self.up and not (self.lapsed and session in self._leases.leased):
            callback()
            return
        if not self.up:
            due = (self._log_lane.next, self._state_lane.next)
        self._wait(_Waiter(due[0], due[1], callback, time.perf_counter(), session))

    def after_flush(self, callback: Callable[[], None], session: str | None = None) -> None:
        """Run ``callback`` once everything queued now is in Redis (as :meth:`after`)."""
        self.after((self._log_lane.next, self._state_lane.next), callback, session)

    def after_written(self, session_id: str, callback: Callable[[], None]) -> None:
        """The store's own: run ``callback`` once both lanes have written what
        ``session_id`` queued so far, real writes even across a failure."""
        due = (self._log_due.get(session_id, 0), self._state_due.get(session_id, 0))
        self._wait(_Waiter(due[0], due[1], callback, internal=True))

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

    def call_back(self, *, failed: bool = False) -> None:
        """Run the callbacks whose flushes are written. ``failed``: Redis failed; the
        sockets are not held meanwhile (those of sessions whose lease may have lapsed
        are), and what the store itself waits for waits for the flushes that write again
        what the failure took back."""
        log_done, state_done = self._log_lane.done, self._state_lane.done
        ready, waiting = [], []
        for w in self._waiters:
            if failed and (w.internal or (self.lapsed and w.session in self._leases.leased)):
                w.log, w.state = self._log_lane.next, self._state_lane.next
                waiting.append(w)
            elif failed or (w.log <= log_done and w.state <= state_done):
                ready.append(w)
            else:
                waiting.append(w)
        self._waiters = waiting
        held = self._metrics.store_hold_seconds if self._metrics is not None else None
        now = time.perf_counter()
        with self._write_batch:
            for w in ready:
                if held is not None and w.since:
                    held.observe(now - w.since)
                w.callback()

    def lost(self, session_id: str) -> None:
        """``session_id`` is another process's now: its held frames are never sent."""
        self._waiters = [w for w in self._waiters if w.session != session_id]

    def rewriting(self, session_id: str) -> None:
        """``session_id``'s log is written again in the log lane's next flush: the frames
        that waited for this one wait for that one."""
        following = self._log_lane.next
        for w in self._waiters:
            if w.session == session_id and w.log < following:
                w.log = following

    def forget_written(self, lane: Lane, held: int) -> None:
        """Bounded (``held``: the sessions held): entries of written flushes go."""
        due = self._log_due if lane is self._log_lane else self._state_due
        if len(due) > 2 * held + 64:
            done = lane.done
            for session_id in [k for k, v in due.items() if v <= done]:
                del due[session_id]

    def set_up(self, up: bool) -> None:
        self.up = up
        if up:
            self.lapsed = False
            if self._lapse is not None:
                self._lapse.cancel()
                self._lapse = None
        if self._metrics is not None:
            self._metrics.store_up.set(1 if up else 0)

    def down(self, exc: BaseException) -> None:
        """A write failed: memory-only, until the leases last renewed may have run out."""
        if self.up:
            log.warning("session store write failed (%s): memory-only until it is back", exc)
            delay = max(0.0, self._leases.valid_until - time.monotonic())
            self._lapse = asyncio.get_running_loop().call_later(delay, self._lapsed)
        self.set_up(False)

    def _lapsed(self) -> None:
        """Down for longer than the lease last renewed: another process may hold it now."""
        self._lapse = None
        if not self.up:
            log.warning("session store away past the lease: held sessions wait for it")
            self.lapsed = True
