"""``/metrics`` over HTTP: the counters move as responses run, end, are refused or cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.sim import SimEngine
from tests.support.harness import RawClient, RunningGateway, running_gateway

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(gw: RunningGateway) -> Samples:
    """Every sample of ``/metrics``, keyed by name and labels."""
    status, body = await gw.get("/metrics")
    assert status == 200
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; a labelled counter never incremented reads as 0."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape_until(gw: RunningGateway, name: str, expected: float) -> Samples:
    """Scrape until ``name`` reads ``expected`` (a session's teardown ends after its socket)."""
    async with asyncio.timeout(5):
        while True:
            samples = await scrape(gw)
            if value(samples, name) == expected:
                return samples
            await asyncio.sleep(0.01)


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    # One engine slot and no queue, so a second response is refused as overloaded.
    # 100 tokens at 2 ms: a response lasts long enough to be cancelled mid-stream.
    engine = SimEngine(step_ms=2, response_tokens=100)
    async with running_gateway(engine, max_running=1, max_queued=0) as running:
        yield running


async def test_metrics_is_prometheus_text(gw: RunningGateway) -> None:
    status, body = await gw.get("/metrics")
    assert status == 200
    text = body.decode()
    assert "# TYPE gateway_time_to_first_token_seconds histogram" in text
    samples = await scrape(gw)
    assert value(samples, "gateway_info", worker="0", engine="sim") == 1
    assert value(samples, "gateway_sessions") == 0


async def test_a_completed_response_moves_the_counters(gw: RunningGateway) -> None:
    before = await scrape(gw)
    async with RawClient.connect(gw.ws_url) as c:
        during = await scrape(gw)
        assert value(during, "gateway_sessions") == value(before, "gateway_sessions") + 1
        assert value(during, "gateway_sessions_opened_total") == (
            value(before, "gateway_sessions_opened_total") + 1
        )
        await c.say("Hello")
        turn = await c.respond()
        assert turn.status == "completed"
        after = await scrape(gw)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("gateway_responses_finished_total", status="completed") == 1
    # The latency histograms go by route and status, as the access log line says.
    answer = {"route": "WS /v1/realtime", "status": "completed"}
    assert grew("gateway_time_to_first_token_seconds_count", **answer) == 1
    assert grew("gateway_request_duration_seconds_count", **answer) == 1
    assert grew("gateway_queue_wait_seconds_count", **answer) == 1
    assert grew("gateway_response_duration_seconds_count") == 1
    assert grew("gateway_output_tokens_total") == 100
    # A gateway that falls behind its engine merges a job's tokens of one batch into one
    # delta (and the outbox merges a slow reader's deltas into fewer frames), never more.
    deltas = grew("gateway_deltas_total")
    assert 1 <= deltas <= 100
    assert grew("gateway_inter_token_seconds_count") == deltas - 1
    delta_frames = grew("gateway_delta_frames_sent_total")
    assert 1 <= delta_frames <= deltas
    assert delta_frames == len(turn.deltas)
    # Every event the client received is one frame, counted by the time the next scrape runs:
    # session.created, item added+done, the response's events.
    assert grew("gateway_frames_sent_total") >= len(c.events)
    assert grew("gateway_bytes_sent_total") >= sum(len(d.encode()) for d in turn.deltas)
    assert value(after, "gateway_responses_running") == 0
    assert value(after, "gateway_responses_queued") == 0

    gone = await scrape_until(gw, "gateway_sessions", value(before, "gateway_sessions"))
    assert value(gone, "gateway_sessions_opened_total") == value(
        after, "gateway_sessions_opened_total"
    )


async def test_overload_and_cancel_are_counted(gw: RunningGateway) -> None:
    before = await scrape(gw)
    async with RawClient.connect(gw.ws_url) as a, RawClient.connect(gw.ws_url) as b:
        await a.send({"type": "response.create"})
        await a.recv_until("response.output_text.delta")
        busy = await scrape(gw)
        assert value(busy, "gateway_responses_running") == 1
        assert value(busy, "gateway_sessions") == value(before, "gateway_sessions") + 2

        # The only slot is taken and there is no queue: b is refused at once.
        await b.send({"type": "response.create"})
        error = await b.recv_until("error")
        assert error["error"]["code"] == "overloaded"

        await a.send({"type": "response.cancel"})
        done = await a.recv_until("response.done")
        assert done["response"]["status"] == "cancelled"
        after = await scrape(gw)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("gateway_responses_refused_total", reason="overloaded") == 1
    assert grew("gateway_error_events_total", code="overloaded") == 1
    assert grew("gateway_responses_finished_total", status="cancelled") == 1
    assert grew("gateway_responses_finished_total", status="completed") == 0
    cancelled = {"route": "WS /v1/realtime", "status": "cancelled"}
    assert grew("gateway_time_to_first_token_seconds_count", **cancelled) == 1
    # The cancelled response's partial output is still counted.
    assert 1 <= grew("gateway_output_tokens_total") < 100
    # The engine lets go of the cancelled request at its next step: the slot is free.
    confirmed = value(before, "gateway_abort_confirm_seconds_count") + 1
    await scrape_until(gw, "gateway_abort_confirm_seconds_count", confirmed)
    await scrape_until(gw, "gateway_responses_running", 0)
    await scrape_until(gw, "gateway_sessions", value(before, "gateway_sessions"))


def test_histogram_buckets_are_inclusive_and_cumulative() -> None:
    from gateway.metrics import Metrics

    m = Metrics()
    ttft = m.ttft.labels(route="WS /v1/realtime", status="completed")
    for seconds in (0.001, 0.0015, 100.0):  # exactly on a bound, between two, past the last
        ttft.observe(seconds)
    m.ttft.labels(route="POST /v1/chat/completions", status="200").observe(0.5)
    samples = {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(m.render().decode())
        for s in family.samples
        if s.name.startswith("gateway_time_to_first_token")
        and s.labels.get("route") == "WS /v1/realtime"
        and s.labels.get("status") == "completed"
    }
    bucket = "gateway_time_to_first_token_seconds_bucket"
    assert samples[(bucket, "0.0005")] == 0
    assert samples[(bucket, "0.001")] == 1
    assert samples[(bucket, "0.002")] == 2
    assert samples[(bucket, "60.0")] == 2
    assert samples[(bucket, "+Inf")] == 3
    assert samples[("gateway_time_to_first_token_seconds_count", None)] == 3
    assert samples[("gateway_time_to_first_token_seconds_sum", None)] == pytest.approx(100.0025)
