"""Admission, fairness and cancellation, against the sim engine with no sessions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.engines.base import GenerationRequest, Message, ToolCallDelta
from gateway.engines.sim import SimEngine
from gateway.scheduler import Job, Outcome, Scheduler
from gateway.tenants import TenantBook, TenantLimits


class Recorder:
    def __init__(self) -> None:
        self.deltas: dict[str, list[str]] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.started: list[str] = []
        self.done = asyncio.Event()

    def on_delta(self, job: Job, text: str, token_ids: tuple[int, ...] = ()) -> None:
        rid = job.request.request_id
        if rid not in self.deltas:
            self.started.append(rid)
        self.deltas.setdefault(rid, []).append(text)

    def on_tool_call_delta(self, job: Job, delta: ToolCallDelta) -> None:
        raise AssertionError("no tools here")

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


async def until(condition: Callable[[], bool], timeout: float = 1.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)


async def test_cancel_queued_and_running(engine: SimEngine) -> None:
    engine.step_s = 0.01
    scheduler, sink = Scheduler(engine, max_running=1, max_queued=4), Recorder()
    running, queued = job("run", "s", sink), job("wait", "s", sink)
    scheduler.submit(running)
    scheduler.submit(queued)
    scheduler.cancel(queued, "client_cancelled")
    assert sink.outcomes["wait"].status == "cancelled"  # at once, never started
    await until(lambda: "run" in sink.deltas)
    scheduler.cancel(running, "client_cancelled")
    outcome = sink.outcomes["run"]  # at once: the session need not wait for the engine
    assert outcome.status == "cancelled"
    assert outcome.text == "".join(sink.deltas["run"])
    assert outcome.usage.input_tokens > 0  # the prompt was counted before the cancel
    delivered = len(sink.deltas["run"])
    await until(lambda: engine.active == 0 and scheduler.draining == 0)
    assert len(sink.deltas["run"]) == delivered  # nothing after the cancel


async def test_a_cancelled_slot_is_free_for_the_next_job_at_once(engine: SimEngine) -> None:
    engine.step_s = 0.01
    scheduler, sink = Scheduler(engine, max_running=1, max_queued=0), Recorder()
    first, second = job("first", "a", sink), job("second", "b", sink)
    assert scheduler.submit(first)
    scheduler.cancel(first, "disconnected")  # before the engine ran a single step for it
    assert sink.outcomes["first"].status == "cancelled"
    # The engine lets go of "first" at its next step; a new job is not refused meanwhile.
    assert scheduler.submit(second) and scheduler.draining == 1
    await sink.wait_for(2)
    assert sink.outcomes["second"].status == "completed"
    assert "first" not in sink.deltas and scheduler.draining == 0


async def test_the_watchdog_fails_a_stalled_generation_and_frees_its_slot() -> None:
    sim = SimEngine(step_ms=1, response_tokens=50, stall_after=2)
    await sim.start()
    scheduler = Scheduler(sim, max_running=1, max_queued=1, generation_timeout=0.2)
    sink = Recorder()
    try:
        scheduler.submit(job("stuck", "s", sink))
        await sink.wait_for(1)
        outcome = sink.outcomes["stuck"]
        assert outcome.status == "failed" and outcome.error is not None
        assert outcome.error.code == "generation_timeout"
        assert outcome.text == "".join(sink.deltas["stuck"])
        assert scheduler.metrics.generation_timeouts.value == 1
        await until(lambda: sim.active == 0 and scheduler.running == 0)
        assert scheduler.draining == 0
    finally:
        await scheduler.close()
        await sim.close()


async def test_close_ends_everything(engine: SimEngine) -> None:
    scheduler, sink = Scheduler(engine, max_running=2, max_queued=4), Recorder()
    for i in range(4):
        scheduler.submit(job(str(i), str(i), sink))
    await scheduler.close()
    assert len(sink.outcomes) == 4
    assert {o.cancel_reason for o in sink.outcomes.values()} == {"server_shutdown"}
    assert not scheduler.submit(job("late", "s", sink))


@pytest.mark.parametrize("merge", [True, False])
async def test_a_scheduler_that_fell_behind_merges_each_jobs_tokens_of_a_batch(
    engine: SimEngine, merge: bool
) -> None:
    engine.step_s, engine.response_tokens = 0.005, 40
    scheduler = Scheduler(engine, max_running=4, max_queued=4, merge_deltas=merge)
    sink = Recorder()
    for i in range(3):
        scheduler.submit(job(f"j{i}", f"s{i}", sink))
    await until(lambda: len(sink.deltas) == 3)
    time.sleep(0.05)  # noqa: ASYNC251 (the loop is busy elsewhere: steps pile up)
    await sink.wait_for(3)
    for rid, outcome in sink.outcomes.items():
        deltas = sink.deltas[rid]
        assert "".join(deltas) == outcome.text  # lossless either way
        assert outcome.usage.output_tokens == 40
        if merge:
            assert len(deltas) < 40  # the steps that piled up went out as one delta each
        else:
            assert len(deltas) == 40  # a delta per token, as --no-coalesce promises


async def test_a_streaming_engine_cancelled_before_its_first_step_still_confirms() -> None:
    """Found in review: a per-request stream task cancelled before it ever ran never
    reported its end, so the scheduler waited for the engine forever."""
    from tests.support.scripted_engine import ScriptedEngine, text_then_two_calls

    engine = ScriptedEngine(text_then_two_calls())
    await engine.start()
    scheduler, sink = Scheduler(engine, max_running=4, max_queued=4), Recorder()
    try:
        for i in range(5):
            j = job(f"c{i}", "s", sink)
            scheduler.submit(j)
            scheduler.cancel(j, "client_cancelled")  # before the stream's task ran at all
        await until(lambda: scheduler.draining == 0)
        assert not engine._streams and len(sink.outcomes) == 5
    finally:
        await scheduler.close()
        await engine.close()


async def test_with_two_tenants_one_cannot_fill_every_slot(engine: SimEngine) -> None:
    """Admission does not preempt: a reserve of slots keeps a busy tenant from holding
    them all, so another tenant's answer starts at once; with one tenant, no reserve."""
    book = TenantBook({"alice": TenantLimits(), "bob": TenantLimits()})
    scheduler, sink = Scheduler(engine, max_running=64, max_queued=1000, tenants=book), Recorder()
    for i in range(100):
        scheduler.submit(
            Job(GenerationRequest(f"a{i}", (Message("user", "x"),)), f"a{i}", sink, tenant="alice")
        )
    assert scheduler.running == 64 - scheduler.reserve == 62
    scheduler.submit(Job(GenerationRequest("b", (Message("user", "x"),)), "b", sink, tenant="bob"))
    assert scheduler.running == 63  # bob's answer took a reserved slot at once
    await sink.wait_for(101)
    other = SimEngine(step_ms=1, response_tokens=5)
    await other.start()
    try:
        alone, done = Scheduler(other, max_running=64, max_queued=1000), Recorder()
        for i in range(100):
            alone.submit(job(f"c{i}", f"c{i}", done))
        assert alone.reserve == 0 and alone.running == 64
        await done.wait_for(100)
    finally:
        await other.close()


async def test_the_sims_continuation_is_the_rest_of_the_whole_answer() -> None:
    """A takeover's continuation: the tokens after the text sent, with the whole answer's
    usage and budget (it reported only its own part, and ran past max_output_tokens)."""
    from gateway.engines.base import Finished, SamplingParams, TextDelta
    from gateway.engines.driver import EngineDriver

    sim = SimEngine(step_ms=0, response_tokens=300)
    await sim.start()
    try:
        async with EngineDriver(sim) as driver:

            async def answer(
                continuation: str = "", budget: int | None = None
            ) -> tuple[str, Finished]:
                sampling = SamplingParams(max_output_tokens=budget)
                request = GenerationRequest(
                    "r", (Message("user", "story"),), sampling, continuation=continuation
                )
                text, end = "", None
                async for event in driver.stream(request):
                    if isinstance(event, TextDelta):
                        text += event.text
                    elif isinstance(event, Finished):
                        end = event
                assert end is not None
                return text, end

            whole, done = await answer()
            cut = len(whole) // 3
            prefix = whole[: whole.index(" ", cut)]
            rest, again = await answer(prefix)
            assert prefix + rest == whole
            assert again.usage.output_tokens == done.usage.output_tokens == 300
            short, limited = await answer(budget=100)
            prefix = short[: short.index(" ", len(short) // 2)]
            rest, cut_again = await answer(prefix, budget=100)
            assert prefix + rest == short and cut_again.reason == limited.reason == "length"
            assert cut_again.usage.output_tokens == 100
    finally:
        await sim.close()
