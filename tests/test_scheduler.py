"""Admission, fairness and cancellation, against the sim engine with no sessions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.engines.base import GenerationRequest, Message
from gateway.engines.sim import SimEngine
from gateway.scheduler import Job, Outcome, Scheduler


class Recorder:
    def __init__(self) -> None:
        self.deltas: dict[str, list[str]] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.started: list[str] = []
        self.done = asyncio.Event()

    def on_delta(self, job: Job, text: str) -> None:
        rid = job.request.request_id
        if rid not in self.deltas:
            self.started.append(rid)
        self.deltas.setdefault(rid, []).append(text)

    def on_finish(self, job: Job, outcome: Outcome) -> None:
        self.outcomes[job.request.request_id] = outcome
        self.done.set()

    async def wait_for(self, n: int) -> None:
        async with asyncio.timeout(5):
            while len(self.outcomes) < n:
                self.done.clear()
                await self.done.wait()


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    sim = SimEngine(step_ms=1, response_tokens=5)
    await sim.start()
    yield sim
    await sim.close()


def job(rid: str, session: str, sink: Recorder) -> Job:
    return Job(GenerationRequest(rid, (Message("user", rid),)), session, sink)


async def test_overload_is_refused_at_once(engine: SimEngine) -> None:
    scheduler, sink = Scheduler(engine, max_running=1, max_queued=1), Recorder()
    assert scheduler.submit(job("a", "s", sink))
    assert scheduler.submit(job("b", "s", sink))
    assert not scheduler.submit(job("c", "s", sink))
    assert (scheduler.running, scheduler.queued) == (1, 1)
    await sink.wait_for(2)
    assert set(sink.outcomes) == {"a", "b"}


async def test_round_robin_across_sessions(engine: SimEngine) -> None:
    scheduler, sink = Scheduler(engine, max_running=1, max_queued=100), Recorder()
    for i in range(6):
        scheduler.submit(job(f"greedy{i}", "greedy", sink))
    scheduler.submit(job("polite", "polite", sink))
    await sink.wait_for(7)
    # greedy0 was running; the polite session's one job goes right after it.
    assert sink.started[:3] == ["greedy0", "polite", "greedy1"]


async def test_cancel_queued_and_running(engine: SimEngine) -> None:
    engine.step_s = 0.01
    scheduler, sink = Scheduler(engine, max_running=1, max_queued=4), Recorder()
    running, queued = job("run", "s", sink), job("wait", "s", sink)
    scheduler.submit(running)
    scheduler.submit(queued)
    scheduler.cancel(queued, "client_cancelled")
    assert sink.outcomes["wait"].status == "cancelled"  # at once, never started
    while "run" not in sink.deltas:
        await asyncio.sleep(0.002)
    scheduler.cancel(running, "client_cancelled")
    await sink.wait_for(2)
    outcome = sink.outcomes["run"]
    assert outcome.status == "cancelled"
    assert outcome.text == "".join(sink.deltas["run"])
    await asyncio.sleep(0.03)
    assert engine.active == 0 and scheduler.running == 0


async def test_cancel_before_the_first_step_still_finishes_once(engine: SimEngine) -> None:
    scheduler, sink = Scheduler(engine, max_running=1, max_queued=1), Recorder()
    j = job("quick", "s", sink)
    scheduler.submit(j)
    scheduler.cancel(j, "disconnected")  # its task has not run a single step yet
    await sink.wait_for(1)
    assert sink.outcomes["quick"].status == "cancelled"
    assert scheduler.running == 0


async def test_close_ends_everything(engine: SimEngine) -> None:
    scheduler, sink = Scheduler(engine, max_running=2, max_queued=4), Recorder()
    for i in range(4):
        scheduler.submit(job(str(i), str(i), sink))
    await scheduler.close()
    assert len(sink.outcomes) == 4
    assert {o.cancel_reason for o in sink.outcomes.values()} == {"server_shutdown"}
    assert not scheduler.submit(job("late", "s", sink))
