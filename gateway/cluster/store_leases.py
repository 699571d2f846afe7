"""This process's leases on the sessions it holds, and the clock that says they are its.

Each session held here has a lease in Redis (``o:{id}``): a token of this process's
(``PROCESS#N``, new at each take) with a TTL. The lease scripts (store_scripts.py) write
a session's keys only for its token, so a process that lost a lease learns it from its
next write. Leases are renewed every third of a lease, in the state lane's next flush
(redis_store.py); a renewal that went out at ``t`` and was answered makes every lease held
surely this process's until ``t`` plus a lease (:attr:`Leases.valid_until`: how long frames
may flow memory-only while Redis is away). A renewer's turn that comes later than a lease
shows a pause: another process may have taken a lease meanwhile, so one that is gone is
not taken again until a renewal is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.cluster import redis_topology
from gateway.cluster.store_reads import PatientReads
from gateway.cluster.store_writes import owner_key

log = logging.getLogger(__name__)

LEASE_SECONDS = 3.0


class Leases:
    """The lease token of each session held here, which of them Redis has had, and the
    renewer's clock. ``closing``: the store is closing, so renewals stop."""

    def __init__(
        self, process: str, seconds: float, reads: PatientReads, closing: asyncio.Event
    ) -> None:
        self.process = process
        self.seconds = seconds
        self._reads = reads
        self._closing = closing
        self.tokens: dict[str, str] = {}  # each held session's lease token
        self.leased: set[str] = set()  # held sessions whose lease Redis has had
        self._numbers = itertools.count(1)
        self._renew_all = False  # the next state flush renews every lease held
        self._tick = time.monotonic()  # the renewer's last turn: a pause shows as a gap
        self._paused = False  # a gap longer than a lease: take no lease that is gone
        self.valid_until = 0.0  # monotonic: every lease held is surely ours till then

    def _new_token(self) -> str:
        return f"{self.process}#{next(self._numbers)}"

    def take(self, session_id: str) -> None:
        """A new session's token (its lease is taken at the next flush)."""
        self.tokens[session_id] = self._new_token()
        if self.valid_until < time.monotonic() + self.seconds / 2:
            # No renewal lately (the first session): one now, with this take, so
            # that the leases' validity is known from the start.
            self._renew_all = True

    async def acquire(self, session_id: str) -> bool:
        """Take the session's lease if nobody holds it (its owner is gone). Where writes
        are replicated, wait (briefly) for a replica to have it: a failover right after
        this take then keeps it."""
        token = self._new_token()
        topology = self._reads.topology
        key, lease = owner_key(session_id), int(1000 * self.seconds)
        commands: list[tuple[Any, ...]] = [("SET", key, token, "NX", "PX", lease)]
        if topology.replicated:
            # On the same connection: WAIT counts that connection's writes.
            commands.append(("WAIT", 1, redis_topology.WAIT_REPLICA_MS))
        taken, *_ = await self._reads.patiently(lambda: topology.execute_on(key, commands))
        # A take tried again (its first reply lost with a primary) finds its own token.
        if not taken and await self._reads.get(key) != token:
            return False
        self.tokens[session_id] = token
        self.leased.add(session_id)
        return True

    async def renewer(self, held: Callable[[], bool], wake: Callable[[], None]) -> None:
        """Every third of a lease: renew every lease held (``held()``: any; ``wake()``:
        the state lane, whose next flush renews them), and notice a pause (a turn that
        came later than a lease)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.seconds / 3)
            if self._closing.is_set():
                return
            now = time.monotonic()
            if now - self._tick > self.seconds:
                log.warning("this process was paused for %.1f s: past its leases", now - self._tick)
                self._paused = True
            self._tick = now
            if held():
                self._renew_all = True
                wake()

    def renewal(self) -> bool:
        """Whether the state lane's next flush renews every lease held (asked once)."""
        renewal, self._renew_all = self._renew_all, False
        return renewal

    def renewed(self, sent: float) -> None:
        """Every lease held was renewed when a flush went out at ``sent`` (or found lost)."""
        self.valid_until = max(self.valid_until, sent + self.seconds)
        self._paused = False

    def may_retake(self) -> bool:
        """May a lease that is gone be taken again now? Not after a pause longer than a
        lease (the renewer's turns show it): another process may have held it since."""
        return not self._paused and time.monotonic() - self._tick < self.seconds
