"""OpenTelemetry traces (``--otlp-traces-endpoint``) reaching a real OTLP/HTTP receiver: the
span of each request or answer, under the client's ``traceparent``, with the GenAI
conventions' attributes, and the parent of what the gateway asks of an upstream replica."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from websockets.asyncio.client import ClientConnection, connect

from gateway.engines.sim import SimEngine
from gateway.engines.upstream import UpstreamEngine
from gateway.observability.export import QueuedExport
from tests.support.fake_upstream import FakeUpstream, sse
from tests.support.gateway_processes import TIMEOUT, gateways
from tests.support.harness import RawClient, running_gateway
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401

CHUNKS = [sse("Hel"), sse("lo, "), sse("world"), sse(None, "stop")]


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as running:
        yield running


def client_context() -> tuple[str, str, dict[str, str]]:
    """A client's trace id, span id and the headers that carry them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "client=1"}
    return trace_id, span_id, headers


def in_trace(trace_id: str, attribute: str) -> Any:
    return lambda s: s.trace_id == trace_id and attribute in s.attributes


async def test_a_streamed_chat_answer_is_a_span_under_the_clients_and_over_its_upstream(
    receiver: OtlpReceiver,
) -> None:
    trace_id, client_span, headers = client_context()
    async with FakeUpstream(CHUNKS) as upstream:
        engine = UpstreamEngine([upstream.url], health_interval=0.2)
        async with running_gateway(engine, otlp_traces_endpoint=receiver.endpoint) as gw:
            body = {
                "model": "m",
                "stream": True,
                "temperature": 0.5,
                "max_completion_tokens": 40,
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with (
                httpx.AsyncClient(trust_env=False) as http,
                http.stream(
                    "POST", f"{gw.http_url}/v1/chat/completions", json=body, headers=headers
                ) as reply,
            ):
                chunks = [x[6:] async for x in reply.aiter_lines() if x.startswith("data: {")]
            completion_id = orjson.loads(chunks[0])["id"]
            span = await receiver.span(in_trace(trace_id, "gen_ai.operation.name"))
    assert span.parent_span_id == client_span and span.name == "chat m"
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "upstream"
    assert (a["gen_ai.request.model"], a["gen_ai.response.id"]) == ("m", completion_id)
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.max_tokens"]) == (0.5, 40)
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.usage.output_tokens"] == 3 and "gen_ai.usage.input_tokens" in a
    assert (a["http.route"], a["http.response.status_code"]) == ("/v1/chat/completions", 200)
    assert a["gateway.request_id"] == reply.headers["x-request-id"]
    assert span.event("gateway.slot_acquired") is not None
    assert span.event("gateway.first_token") is not None
    # The upstream request's parent is the gateway's span, in the client's trace.
    sent = upstream.headers[0]
    assert sent["traceparent"] == f"00-{trace_id}-{span.span_id}-01"
    assert sent["tracestate"] == "client=1"


async def test_a_completions_request_with_choices_is_one_span(receiver: OtlpReceiver) -> None:
    """Its prompts' ``n`` choices are answers of the one request: one span, each choice's
    finish reason in it, its usage the request's."""
    trace_id, client_span, headers = client_context()
    engine = SimEngine(step_ms=1, response_tokens=5)
    async with running_gateway(engine, otlp_traces_endpoint=receiver.endpoint) as gw:
        body = {"model": "m", "prompt": ["one two", "three"], "n": 2, "max_tokens": 4}
        async with httpx.AsyncClient(trust_env=False) as http:
            reply = await http.post(f"{gw.http_url}/v1/completions", json=body, headers=headers)
        completion = reply.json()
        span = await receiver.span(in_trace(trace_id, "gen_ai.operation.name"))
    assert span.parent_span_id == client_span and span.name == "text_completion m"
    a = span.attributes
    assert a["gen_ai.response.id"] == completion["id"]
    assert a["gen_ai.response.finish_reasons"] == ["length"] * 4
    usage = completion["usage"]
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert [s for s in receiver.spans if s.trace_id == trace_id] == [span]


async def test_a_cancelled_realtime_answer_is_a_span_under_the_upgrades_context(
    receiver: OtlpReceiver,
) -> None:
    trace_id, client_span, headers = client_context()
    engine = SimEngine(step_ms=5, response_tokens=200)
    async with running_gateway(engine, otlp_traces_endpoint=receiver.endpoint) as gw:
        async with RawClient.connect(gw.ws_url, additional_headers=headers) as c:
            await c.say("Hello")
            await c.send({"type": "response.create"})
            await c.recv_until("response.output_text.delta")
            await c.send({"type": "response.cancel"})
            done = (await c.recv_until("response.done"))["response"]
        span = await receiver.span(in_trace(trace_id, "gen_ai.response.id"))
    assert span.parent_span_id == client_span and span.name == f"chat {gw.gateway.model}"
    assert span.attributes["gen_ai.response.id"] == done["id"]
    assert span.attributes["gateway.response.status"] == "cancelled"
    assert span.attributes["gen_ai.response.finish_reasons"] == ["cancelled"]
    assert span.event("gateway.cancel") == {"gateway.cancel_reason": "client_cancelled"}


async def test_a_refused_request_is_a_span_with_its_error_type(receiver: OtlpReceiver) -> None:
    trace_id, client_span, headers = client_context()
    engine = SimEngine(step_ms=1)
    async with running_gateway(engine, otlp_traces_endpoint=receiver.endpoint) as gw:
        body = {"model": "m", "messages": [], "logit_bias": {"1": 2}}
        async with httpx.AsyncClient(trust_env=False) as http:
            refused = await http.post(
                f"{gw.http_url}/v1/chat/completions", json=body, headers=headers
            )
        assert refused.status_code == 400
        span = await receiver.span(in_trace(trace_id, "error.type"))
    assert span.parent_span_id == client_span and span.name == "POST /v1/chat/completions"
    assert span.attributes["error.type"] == "unsupported_value"
    assert span.attributes["http.response.status_code"] == 400


async def test_a_move_to_another_replica_keeps_one_span_over_both_requests(
    receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    trace_id, _, headers = client_context()
    async with FakeUpstream(CHUNKS, cut_after=2) as dying, FakeUpstream(CHUNKS) as survivor:
        engine = UpstreamEngine(
            [dying.url, survivor.url], health_interval=0.2, continuation="prefill"
        )
        settings = {"otlp_traces_endpoint": receiver.endpoint, "access_log": "json"}
        async with running_gateway(engine, **settings) as gw:
            async with RawClient.connect(gw.ws_url, additional_headers=headers) as c:
                await c.say("Hello")
                turn = await c.respond()
            assert turn.status == "completed" and turn.text == turn.final_text
            span = await receiver.span(in_trace(trace_id, "gen_ai.response.id"))
        parents = [h["traceparent"] for h in dying.headers + survivor.headers]
    assert parents == [f"00-{trace_id}-{span.span_id}-01"] * 2
    assert span.event("gateway.replica_move") is not None
    line = next(orjson.loads(r.getMessage()) for r in caplog.records if "moves" in r.getMessage())
    assert line["response_id"] == turn.id and line["moves"] == 1


class Chat:
    """A raw Realtime client that can resume its session on another gateway."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers
        self.ws: ClientConnection | None = None
        self.session_id = self.token = ""
        self.last = 0

    async def recv(self) -> dict[str, Any]:
        assert self.ws is not None
        async with asyncio.timeout(TIMEOUT):
            event: dict[str, Any] = orjson.loads(await self.ws.recv())
        self.last = event.get("sequence_number", self.last)
        return event

    async def open(self, url: str) -> None:
        self.ws = await connect(url, additional_headers=self.headers, open_timeout=TIMEOUT)
        created = await self.recv()
        self.session_id, self.token = created["session"]["id"], created["resume_token"]

    async def resume(self, url: str) -> None:
        last = self.last
        self.ws = await connect(url, open_timeout=TIMEOUT)
        await self.recv()  # this connection's own session.created
        resume = {"session_id": self.session_id, "resume_token": self.token}
        await self.send({"type": "session.resume", **resume, "last_sequence_number": last})
        assert (await self.recv())["type"] == "session.resumed"

    async def send(self, event: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(orjson.dumps(event).decode())

    async def until(self, event_type: str) -> dict[str, Any]:
        while (event := await self.recv())["type"] != event_type:
            pass
        return event


async def test_a_takeover_continues_the_answers_trace_on_the_other_gateway(
    receiver: OtlpReceiver,
    redis_server: RedisServer,
) -> None:
    trace_id, client_span, headers = client_context()
    flags = ("--otlp-traces-endpoint", receiver.endpoint, "--drain-timeout", "0")
    async with gateways(redis_server.url, 2, *flags, tokens=120) as (a, b):
        chat = Chat(headers)
        await chat.open(a.url())
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi"}],
        }
        await chat.send({"type": "conversation.item.create", "item": item})
        await chat.send({"type": "response.create"})
        response_id = (await chat.until("response.created"))["response"]["id"]
        await chat.until("response.output_text.delta")
        a.terminate()  # drains: the session goes to the store, the socket closes with 1012
        with contextlib.suppress(Exception):
            while True:
                await chat.recv()
        assert await a.stop() == 0
        await chat.resume(b.url())
        done = (await chat.until("response.done"))["response"]
        assert done["id"] == response_id and done["status"] == "completed"

        def answer_span(event: str) -> Any:
            return lambda s: (
                s.attributes.get("gen_ai.response.id") == response_id and s.event(event) is not None
            )

        first = await receiver.span(answer_span("gateway.handover"))
        taken = await receiver.span(answer_span("gateway.takeover"))
    # Both under the client's span, in its trace; the continuation linked to the first.
    for span in (first, taken):
        assert (span.trace_id, span.parent_span_id) == (trace_id, client_span)
    assert taken.links == [(trace_id, first.span_id)]
    assert taken.span_id != first.span_id
    assert taken.attributes["gateway.response.status"] == "completed"
    assert any(
        '"response.create /v1/realtime" completed' in x and "takeover=true" in x for x in b.log
    )


class _Blocked(SpanExporter):
    """A collector that does not answer until told to."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.exported = 0

    def export(self, spans: Any) -> SpanExportResult:
        self.go.wait(5)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.go.set()


def test_a_collector_that_does_not_answer_costs_bounded_memory_and_no_wait() -> None:
    exporter = _Blocked()
    queue = QueuedExport(exporter, max_queue=100, batch=10, delay=0.01)
    provider = TracerProvider()
    provider.add_span_processor(queue)
    tracer = provider.get_tracer("test")
    started = time.perf_counter()
    for _ in range(5000):
        tracer.start_span("answer").end()
    assert time.perf_counter() - started < 2.0  # ending a span never waits for the export
    assert len(queue._queue) <= 100
    assert queue.dropped >= 5000 - 100 - 10
    exporter.go.set()
    queue.close(5.0)
    assert exporter.exported + queue.dropped == 5000
