"""The session store without a single point of failure, end to end: gateway processes on a
single Redis, on Redis Sentinel and on a Redis Cluster (tests/support/redis_topologies.py),
through a gateway paused past its lease and a primary killed under streaming sessions.

What a client would notice is checked from the frames the clients receive: no answer
fails, every text is whole, every session can be resumed on the other gateway, and never
two owners (no number reaches two clients with two different frames, and a gateway
that lost a session sends nothing it numbered after the other one took it over).

These scenarios do not depend on the event loop: they run once, on uvloop (the budget of
the suite is per loop: docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest

from gateway.cluster.store_writes import log_key, owner_key
from tests.support.gateway_processes import GatewayProcess, gateways
from tests.support.redis_server import RedisServer, require_redis_server
from tests.support.redis_topologies import ClusterGroup, SentinelGroup, Single, Topology
from tests.test_store import Chat, fetch

LEASE = 1.5  # --session-lease: short, so that a stopped gateway's leases end soon
TIMEOUT = 30.0


@pytest.fixture(autouse=True)
def once(selected_loop: str) -> None:
    if selected_loop == "asyncio" and importlib.util.find_spec("uvloop") is not None:
        pytest.skip("a scenario of processes, whatever the loop: it runs once, on uvloop")


@contextlib.contextmanager
def started(kind: str) -> Iterator[Topology]:
    require_redis_server()
    if kind == "single":
        with RedisServer() as server:
            yield Single(server)
        return
    group: SentinelGroup | ClusterGroup = SentinelGroup() if kind == "sentinel" else ClusterGroup()
    try:
        yield group.start()
    finally:
        group.close()


@contextlib.asynccontextmanager
async def paused(gateway: GatewayProcess) -> AsyncIterator[None]:
    """``gateway`` stopped (SIGSTOP) meanwhile, as a GC pause or a frozen VM would."""
    os.kill(gateway.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(gateway.process.pid, signal.SIGCONT)


async def until_closed(chat: Chat) -> int | None:
    """What was on its way, then the socket's close code."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(TIMEOUT):
            while True:
                await chat.recv()
    assert chat.ws is not None
    return chat.ws.close_code


def one_owner(*chats: Chat) -> None:
    """Never two owners: a number that reached two clients carried the same frame."""
    seen: dict[int, dict[str, Any]] = {}
    for chat in chats:
        for event in chat.events:
            first = seen.setdefault(event["sequence_number"], event)
            assert first == event, (first, event)


def resumer(chat: Chat) -> Chat:
    """A second client of ``chat``'s session, which has what ``chat`` had so far."""
    other = Chat()
    other.session_id, other.token, other.events = chat.session_id, chat.token, list(chat.events)
    return other


@pytest.mark.parametrize("kind", ["single", "sentinel", "cluster"])
async def test_a_gateway_paused_past_its_lease_stops_streaming_and_closes(kind: str) -> None:
    """Gateway C holds 4 streaming sessions and is stopped past its lease while its clients
    keep its sockets open; D takes the sessions over (a second client of each resumes
    there) and streams them. When C wakes it sends none of the frames it numbers after
    that, and closes its sockets with 1012 (its clients resume on D)."""
    with started(kind) as topology:
        flags = ("--session-lease", str(LEASE))
        async with gateways(topology.url, 2, *flags, tokens=200, step_ms=10) as (c, d):
            firsts = [Chat() for _ in range(4)]
            for chat in firsts:
                await chat.open(c.url())
                await chat.ask("Tell me a long story")
            for chat in firsts:
                await chat.deltas(3)
            seconds = [resumer(chat) for chat in firsts]
            tops: list[int] = []
            async with paused(c):
                store = topology.client()
                try:
                    async with asyncio.timeout(TIMEOUT):
                        for chat in firsts:  # C's leases run out (C renews none)
                            while store.exists(owner_key(chat.session_id)):
                                await asyncio.sleep(0.05)
                    # What the logs hold now is all C can ever have stored of them.
                    for chat in firsts:
                        last = store.xrevrange(log_key(chat.session_id), count=1)
                        tops.append(int(last[0][0].split("-")[0]))
                finally:
                    store.close()
                for second in seconds:
                    assert (await second.resume(d.url()))["type"] == "session.resumed"
                    await second.deltas(3)  # D streams them
            for first, second, top in zip(firsts, seconds, tops, strict=True):
                assert await until_closed(first) == 1012
                assert max(e["sequence_number"] for e in first.events) <= top
                await second.until("response.done")
                second.check_whole()
                one_owner(first, second)
            assert any("taken over by another gateway" in line for line in c.log)


SESSIONS = 50


async def metric(gateway: GatewayProcess, name: str) -> float:
    """A counter or gauge of ``gateway``'s /metrics (0 if it has no sample yet)."""
    text = (await fetch(gateway.address, "/metrics")).decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def writable_again(gateway: GatewayProcess, errors_before: float) -> None:
    """Until ``gateway``'s store has failed (its writes to the dead primary) and written
    again since."""
    async with asyncio.timeout(TIMEOUT):
        while not (
            await metric(gateway, "gateway_session_store_errors_total") > errors_before
            and await metric(gateway, "gateway_session_store_up") == 1
        ):
            await asyncio.sleep(0.02)


async def first_delta_after_resume(chat: Chat, gateway: GatewayProcess, since: float) -> float:
    """Resume ``chat`` on ``gateway``; the seconds from ``since`` to its next delta."""
    assert (await chat.resume(gateway.url()))["type"] == "session.resumed"
    await chat.until("response.output_text.delta")
    return time.monotonic() - since


@pytest.mark.parametrize("kind", ["sentinel", "cluster"])
async def test_a_primary_killed_under_50_streaming_sessions_costs_no_answer(kind: str) -> None:
    """SIGKILL of the primary (Sentinel promotes its replica) or of a cluster master (its
    replica takes its slots) while 50 sessions stream on two gateways: every answer ends
    whole, no client is closed, each gateway writes to the new primary again within
    seconds, and afterwards every session resumes on the other gateway (through the log,
    which the owners wrote again where the failover lost frames) and answers again."""
    with started(kind) as topology:
        async with gateways(topology.url, 2, tokens=150, step_ms=20) as pair:
            chats = [Chat() for _ in range(SESSIONS)]
            homes = [pair[i % 2] for i in range(SESSIONS)]
            await asyncio.gather(*(c.open(g.url()) for c, g in zip(chats, homes, strict=True)))
            await asyncio.gather(*(c.ask(f"Story {i}") for i, c in enumerate(chats)))
            await asyncio.gather(*(c.deltas(3) for c in chats))
            errors = [await metric(g, "gateway_session_store_errors_total") for g in pair]
            victim = topology.primary_for(log_key(chats[0].session_id))
            on_victim = [
                i
                for i, c in enumerate(chats)
                if topology.primary_for(log_key(c.session_id)) is victim
            ]
            movers = on_victim[:6]
            # Its replica falls behind first (cut off for a moment, as a network partition
            # would: stopped, and its replication link dropped by the primary): the one
            # promoted lacks what the primary took meanwhile, acknowledged.
            (replica,) = topology.replicas_of(victim)
            assert replica.pid is not None
            os.kill(replica.pid, signal.SIGSTOP)
            with victim.client() as primary:
                primary.execute_command("CLIENT", "KILL", "TYPE", "replica")
            await asyncio.sleep(0.3)  # the sessions stream on meanwhile
            killed_at = time.monotonic()
            victim.kill()
            os.kill(replica.pid, signal.SIGCONT)
            # Some clients of sessions on the killed primary lose their connection just then,
            # and resume on the other gateway at once: their resumes wait for the store (they
            # are not refused).
            for i in movers:
                assert chats[i].ws is not None
                chats[i].ws.transport.abort()
            moving = [
                asyncio.create_task(first_delta_after_resume(chats[i], pair[1 - i % 2], killed_at))
                for i in movers
            ]
            promoted = await asyncio.to_thread(topology.wait_replaced, victim)
            await asyncio.gather(*(writable_again(g, e) for g, e in zip(pair, errors, strict=True)))
            writable = time.monotonic() - killed_at
            resumed = min(await asyncio.gather(*moving))
            print(f"\n{kind}: replica promoted {promoted:.2f} s after the kill; both gateways "
                  f"writing again {writable:.2f} s after it; the first answer resumed on "
                  f"the other gateway {resumed:.2f} s after it")  # fmt: skip
            assert writable < 15
            # Every answer ends, whole, on the socket it began on (the movers' on the one they
            # resumed on): the gateways closed nobody.
            await asyncio.gather(*(c.until("response.done") for c in chats))
            for chat in chats:
                chat.check_whole()
            # Every session resumes on the other gateway (a relay, through its log).
            for chat in chats:
                assert chat.ws is not None
                chat.ws.transport.abort()
            others = [pair[1 - i % 2] for i in range(SESSIONS)]
            answers = await asyncio.gather(
                *(c.resume(g.url()) for c, g in zip(chats, others, strict=True))
            )
            assert {a["type"] for a in answers} == {"session.resumed"}, answers
            await asyncio.gather(*(c.ask("And then?") for c in chats))
            await asyncio.gather(*(c.until("response.done") for c in chats))
            for chat in chats:
                chat.check_whole(answers=2)
            for g in pair:
                assert await metric(g, "gateway_session_store_leases_lost_total") == 0
            # What the promoted replica lacked, its owners wrote again from memory: each log
            # holds every frame its client got (from its start), as it got it.
            rewritten = [await metric(g, "gateway_session_store_rewrites_total") for g in pair]
            assert sum(rewritten) > 0, rewritten
            store = topology.client()
            try:
                for chat in chats:
                    logged = {
                        int(entry_id.split("-")[0]): orjson.loads(fields["f"])
                        for entry_id, fields in store.xrange(log_key(chat.session_id))
                    }
                    got = [e for e in chat.events if e["sequence_number"] >= min(logged)]
                    assert [logged.get(e["sequence_number"]) for e in got] == got
            finally:
                store.close()
