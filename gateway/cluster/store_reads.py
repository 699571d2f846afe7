"""The session store's reads, which wait out a failover.

A resume on a process that does not hold its session reads it from Redis (its state, its
log, who holds its lease), and so do a takeover's lease and the lookups of stored and
background responses. Each is tried again while Redis fails over (its primary gone,
``READONLY``, ``CLUSTERDOWN``...), the topology asked again between tries: a failover
costs a client a wait, not its session. Writes never come here: the lanes
(store_lanes.py) retry theirs on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from gateway.cluster.redis_topology import Topology
from gateway.cluster.store_writes import (
    background_key,
    log_key,
    owner_key,
    response_key,
    state_key,
    token_process,
)

# A read is tried again for this long while Redis fails over: a Sentinel or a cluster
# replaces a primary within seconds.
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


@dataclass(slots=True)
class Loaded:
    state: dict[str, Any]
    frames: list[tuple[int, bytes]]  # the log, oldest first
    owner: str | None  # the process holding the lease
    token_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)  # by frame number


class PatientReads:
    """Reads of the store, each tried again while Redis fails over; ``closing``: the
    store is closing, so a read gives up at its next failure."""

    def __init__(self, topology: Topology, closing: asyncio.Event) -> None:
        self.topology = topology
        self._closing = closing

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

    async def get(self, key: str) -> str | None:
        """The string at ``key`` (None: no such key)."""
        value = await self.patiently(lambda: self.topology.client.get(key))
        return value.decode() if isinstance(value, bytes) else value

    async def load(self, session_id: str) -> Loaded | None:
        return await self.patiently(lambda: self._load(session_id))

    async def _load(self, session_id: str) -> Loaded | None:
        pipe = self.topology.client.pipeline(transaction=False)
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
        token = await self.get(owner_key(session_id))
        return token_process(token) if token else None

    async def response(self, response_id: str) -> bytes | None:
        """A stored Responses response (``store: true``)."""
        return await self._get_bytes(response_key(response_id))

    async def background(self, response_id: str) -> bytes | None:
        """A background response's record: its session id and resume token."""
        return await self._get_bytes(background_key(response_id))

    async def _get_bytes(self, key: str) -> bytes | None:
        data = await self.patiently(lambda: self.topology.client.get(key))
        return data.encode() if isinstance(data, str) else data
