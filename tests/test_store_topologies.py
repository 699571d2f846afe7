"""The Redis store itself (gateway/cluster/redis_store.py) on a single Redis, on Redis
Sentinel and on a 3-master Redis Cluster: what it writes, what it reads back, its fenced
lease, a log that lost frames written again, and the relay channel. In-process stores
against real servers (one of each, shared by the module)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest

from gateway.cluster.redis_store import RedisStore, Source
from gateway.cluster.store_writes import channel, log_key, owner_key, state_key
from tests.support.redis_server import RedisServer, require_redis_server
from tests.support.redis_topologies import ClusterGroup, SentinelGroup, Single, Topology

LEASE = 0.6
TIMEOUT = 10.0


@pytest.fixture(scope="module", params=["single", "sentinel", "cluster"])
def topology(request: pytest.FixtureRequest) -> Iterator[Topology]:
    require_redis_server()
    if request.param == "single":
        with RedisServer() as server:
            yield Single(server)
        return
    group = SentinelGroup() if request.param == "sentinel" else ClusterGroup()
    try:
        yield group.start()
    finally:
        group.close()


class Session:
    """What a gateway's session gives its store: a state and numbered frames."""

    def __init__(self, session_id: str) -> None:
        self.id = session_id
        self.frames: list[tuple[int, bytes]] = []
        self.source = Source(self.state, self.after)

    def state(self) -> bytes:
        return orjson.dumps({"id": self.id, "frames": len(self.frames)})

    def after(self, seq: int) -> list[tuple[int, bytes]]:
        return [(n, f) for n, f in self.frames if n > seq]

    def frame(self, store: RedisStore) -> None:
        seq = len(self.frames) + 1
        data = orjson.dumps({"type": "x", "sequence_number": seq})
        self.frames.append((seq, data))
        store.log(self.id, seq, data)


@pytest.fixture
async def stores(topology: Topology) -> AsyncIterator[list[RedisStore]]:
    """Two processes' stores on the topology."""
    started = [
        RedisStore(topology.url, f"p{i}", resume_window=5, lease_seconds=LEASE) for i in (1, 2)
    ]
    for store in started:
        await store.start()
    yield started
    for store in started:
        await store.close()


def session_ids(n: int, tag: str) -> list[str]:
    return [f"sess_0_{tag}{i:04d}" for i in range(n)]


async def test_sessions_are_written_and_read_back_each_on_one_slot(
    topology: Topology, stores: list[RedisStore]
) -> None:
    """Many sessions in one flush (on a cluster: a script call per slot, on its node):
    each one's state, frames and lease, read back whole by another process."""
    a, b = stores
    sessions = [Session(s) for s in session_ids(40, "w")]
    for session in sessions:
        a.own(session.id, session.source)
        a.save(session.id, session.state)
        for _ in range(5):
            session.frame(a)
    await a.flush()
    assert a.holds.up
    for session in sessions:
        loaded = await b.reads.load(session.id)
        assert loaded is not None and loaded.owner == "p1"
        assert loaded.frames == session.frames
        assert loaded.state == orjson.loads(session.state())
    if topology.kind == "cluster":
        client = topology.client()
        try:
            slots = {client.keyslot(k(sessions[0].id)) for k in (state_key, log_key, owner_key)}
        finally:
            client.close()
        assert len(slots) == 1


async def test_a_write_the_lease_refuses_ends_the_session_there(
    topology: Topology, stores: list[RedisStore]
) -> None:
    """Another process took the session (its lease ran out here): this one's next write
    is refused, what it held for that write is never released, and it is told."""
    a, b = stores
    (session,) = [Session(s) for s in session_ids(1, "f")]
    lost: list[str] = []
    a.on_lost = lost.append
    a.own(session.id, session.source)
    session.frame(a)
    await a.flush()
    client = topology.client()
    try:
        # As if its lease had run out and the other process had taken it (the other
        # process's token).
        client.set(owner_key(session.id), "p2#1", px=5000)
    finally:
        client.close()
    released: list[int] = []
    session.frame(a)
    a.holds.after(a.holds.due(session.id), lambda: released.append(1), session.id)
    await a.flush()
    assert lost == [session.id] and released == []
    loaded = await b.reads.load(session.id)
    assert loaded is not None and loaded.owner == "p2"
    assert [seq for seq, _ in loaded.frames] == [1]  # the refused frame is not in the log


async def test_frames_the_store_lost_are_written_again_from_memory(
    topology: Topology, stores: list[RedisStore]
) -> None:
    """The log lacks frames the owner had written (a failover to a replica that had not
    got them): the owner's next write finds out and writes them again."""
    a, b = stores
    (session,) = [Session(s) for s in session_ids(1, "g")]
    a.own(session.id, session.source)
    for _ in range(10):
        session.frame(a)
    await a.flush()
    client = topology.client()
    try:  # the log as a replica that missed frames 8 to 10 has it
        key = log_key(session.id)
        kept = client.xrange(key, count=7)
        client.delete(key)
        for entry_id, fields in kept:
            client.xadd(key, fields, id=entry_id)
    finally:
        client.close()
    session.frame(a)
    await a.flush()
    await a.flush()  # the frames written again
    loaded = await b.reads.load(session.id)
    assert loaded is not None
    assert loaded.frames == session.frames


async def test_a_released_lease_is_taken_at_once_and_the_channel_reaches_its_owner(
    stores: list[RedisStore],
) -> None:
    a, b = stores
    (session,) = [Session(s) for s in session_ids(1, "r")]
    a.own(session.id, session.source)
    session.frame(a)
    await a.flush()
    assert not await b.leases.acquire(session.id)  # held
    a.release(session.id, 5)
    await a.flush()
    assert await b.leases.acquire(session.id)
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def listen() -> None:
        async for message in b.topology.messages(channel(b.process)):
            received.put_nowait(message)

    listener = asyncio.create_task(listen())
    try:
        async with asyncio.timeout(TIMEOUT):
            while not await a.topology.publish(channel(b.process), b"hello"):
                await asyncio.sleep(0.02)  # until the subscription is in place
            assert await received.get() == b"hello"
    finally:
        listener.cancel()
