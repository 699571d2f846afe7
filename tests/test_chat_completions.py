"""Chat Completions and the models list, through the official openai-python client (sync and
async, streaming and not, a tool loop) and curl-like raw HTTP; every object validated strictly
against openai-python's own types (a field the types lack fails)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat import completion_create_params as params
from pydantic import BaseModel, TypeAdapter

from gateway.engines.sim import TOOL_ANSWER_PREFIX, SimEngine
from sessions.chat import codec as cc
from tests.support.harness import RawClient, RunningGateway, running_gateway
from tests.support.responses_harness import ResponsesClient

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def strict(model: type[BaseModel], obj: Any) -> Any:
    """``obj`` as the SDK's ``model``, with no field that the types (or their parts) lack."""
    validated = TypeAdapter(model).validate_python(obj, strict=False)
    _no_extra(obj, validated)
    return validated


def _no_extra(raw: Any, parsed: Any) -> None:
    """Every key of ``raw`` is a field of ``parsed`` (recursively): nothing lands in extras."""
    if isinstance(parsed, BaseModel):
        assert not parsed.model_extra, f"fields the SDK's types lack: {parsed.model_extra}"
        for name, value in raw.items():
            assert name in type(parsed).model_fields, f"{type(parsed).__name__} has no {name}"
            _no_extra(value, getattr(parsed, name))
    elif isinstance(parsed, list):
        for r, p in zip(raw, parsed, strict=True):
            _no_extra(r, p)


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=12)) as running:
        yield running


def responses_url(gw: RunningGateway) -> str:
    return gw.ws_url.replace("/v1/realtime", "/v1/responses")


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return gw.openai()


async def raw_post(gw: RunningGateway, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http:
        return await http.post("/v1/chat/completions", json=body)


def sse_chunks(text: str) -> list[dict[str, Any]]:
    """The chunks of a Chat Completions SSE body: ``data:`` lines only, ``[DONE]`` last."""
    messages = text.strip().split("\n\n")
    assert messages[-1] == "data: [DONE]", messages[-1:]
    chunks = []
    for message in messages[:-1]:
        assert message.startswith("data: ") and "\n" not in message, message
        chunks.append(orjson.loads(message.removeprefix("data: ")))
    return chunks


async def test_the_sdk_gets_a_completion_and_its_usage(gw: RunningGateway) -> None:
    async with client(gw) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="anything", messages=[{"role": "user", "content": "hello"}]
        )
    body = json.loads(raw.text)
    completion = strict(ChatCompletion, body)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert choice.message.content and completion.model == "anything"
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    await gw.wait_idle()


async def test_a_stream_joins_to_the_completion_and_reports_usage_last(
    gw: RunningGateway,
) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply = await raw_post(gw, body)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(reply.text)
    for chunk in chunks:
        strict(ChatCompletionChunk, chunk)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    non_stream = await raw_post(gw, {**body, "stream": False, "stream_options": None})
    assert text and text.split()[0] in non_stream.json()["choices"][0]["message"]["content"]
    async with client(gw) as c:
        stream = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        pieces = [chunk async for chunk in stream]
    assert pieces[-1].choices[0].finish_reason == "stop" and pieces[-1].usage is None
    assert "".join(p.choices[0].delta.content or "" for p in pieces)
    await gw.wait_idle()


async def test_max_tokens_cuts_the_answer_with_finish_reason_length(gw: RunningGateway) -> None:
    async with client(gw) as c:
        for field in ("max_tokens", "max_completion_tokens"):
            completion = await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], **{field: 3}
            )
            assert completion.choices[0].finish_reason == "length"
            assert completion.usage is not None and completion.usage.completion_tokens == 3


async def test_a_tool_loop_with_the_sync_client_streams_tool_call_deltas(
    gw: RunningGateway,
) -> None:
    def loop() -> tuple[list[Any], str | None]:
        with openai.OpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as c:
            messages: list[Any] = [{"role": "user", "content": "get_weather in Paris?"}]
            stream = c.chat.completions.create(
                model="m", messages=messages, tools=[WEATHER], stream=True
            )
            chunks = list(stream)
            calls: dict[int, dict[str, str]] = {}
            for chunk in chunks:
                for call in chunk.choices[0].delta.tool_calls or ():
                    entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] = call.id or entry["id"]
                    if call.function is not None:
                        entry["name"] = call.function.name or entry["name"]
                        entry["arguments"] += call.function.arguments or ""
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            call = calls[0]
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["name"], "arguments": call["arguments"]},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21C"})
            answer = c.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
            return [call], answer.choices[0].message.content

    calls, answer = await asyncio.to_thread(loop)
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) is not None
    assert answer == TOOL_ANSWER_PREFIX + "sunny, 21C"
    await gw.wait_idle()


async def test_a_non_streaming_tool_call_is_one_message_with_tool_calls(
    gw: RunningGateway,
) -> None:
    reply = await raw_post(
        gw,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "call get_weather"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    completion = strict(ChatCompletion, reply.json())
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"messages": []}, 400, "invalid_type", "messages"),
        ({}, 400, "missing_required_parameter", "messages"),
        ({"n": 17}, 400, "invalid_value", "n"),  # over --max-choices (16)
        ({"top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),
        ({"response_format": {"type": "xml"}}, 400, "invalid_value", "response_format.type"),
        ({"functions": [{"name": "f"}]}, 400, "unsupported_value", "functions"),
        ({"frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
        ({"temperature": 3}, 400, "invalid_value", "temperature"),
        (
            {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
            400,
            "unsupported_value",
            "tools[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "unsupported_value",
            "messages[0].content[0].type",
        ),
    ],
)
async def test_a_client_mistake_is_an_openai_error_object(
    gw: RunningGateway, body: dict[str, Any], status: int, code: str, param: str
) -> None:
    full = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    if not body:
        del full["messages"]
    reply = await raw_post(gw, full)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    # The connection, and the gateway, go on.
    assert (
        await raw_post(gw, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    ).status_code == 200


async def test_a_full_scheduler_answers_429_with_retry_after() -> None:
    engine = SimEngine(step_ms=5, response_tokens=10_000)
    async with running_gateway(engine, max_running=1, max_queued=0) as gw:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with (
            httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as first,
        ):
            async for _ in first.aiter_bytes():
                break
            refused = await http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        # The first client left mid-answer: its answer was aborted in the engine.
        await gw.wait_idle()
        assert not gw.gateway.scheduler.running


async def test_a_client_that_leaves_aborts_its_answer_in_the_engine() -> None:
    engine = SimEngine(step_ms=5, response_tokens=10_000)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with running_gateway(engine) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http:
            request = {**body, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=request) as streaming:
                async for _ in streaming.aiter_bytes():
                    break  # the first chunk came: leave mid-answer
        await gw.wait_idle()
        assert not gw.gateway.scheduler.running and not gw.gateway.sessions
        # Not streaming, the client waits for the whole answer and gives up first.
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(base_url=gw.http_url, timeout=0.3) as http:
                await http.post("/v1/chat/completions", json=body)
        await gw.wait_idle()
        assert not gw.gateway.scheduler.running and not gw.gateway.sessions


async def test_the_models_list_names_what_every_route_accepts() -> None:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=4)) as gw, client(gw) as c:
        models = [m async for m in c.models.list()]
        assert [m.id for m in models] == [gw.gateway.model]
        strict(
            Model,
            (await c.models.with_raw_response.retrieve(models[0].id)).http_response.json(),
        )
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("nope")
        # Without --served-model-name any model name is served, as before.
        await c.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    engine = SimEngine(step_ms=1, response_tokens=4)
    async with (
        running_gateway(engine, served_model_names=("alpha", "beta")) as gw,
        client(gw) as c,
    ):
        assert [m.id async for m in c.models.list()] == ["alpha", "beta"]
        await c.chat.completions.create(model="beta", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.NotFoundError) as refused:
            await c.chat.completions.create(
                model="gamma", messages=[{"role": "user", "content": "x"}]
            )
        assert refused.value.code == "model_not_found"


async def test_served_model_names_refuse_other_names_on_every_route() -> None:
    """With --served-model-name, a name outside the list is OpenAI's 404 model_not_found
    on HTTP and an error event on the WebSockets, whose connections go on."""
    engine = SimEngine(step_ms=1, response_tokens=4)
    async with running_gateway(engine, served_model_names=("alpha",)) as gw, client(gw) as c:
        with pytest.raises(openai.NotFoundError) as refused:
            await c.responses.create(model="gamma", input="x")
        assert (refused.value.code, refused.value.param) == ("model_not_found", "model")
        assert (await c.responses.create(model="alpha", input="x")).status == "completed"

        async with ResponsesClient.connect(responses_url(gw)) as ws:
            await ws.create(model="gamma", input="x")
            error = await ws.error()
            assert error["status"] == 404 and error["error"]["code"] == "model_not_found"
            assert (await ws.respond(model="alpha", input="x")).types[-1] == "response.completed"

        async with RawClient.connect(gw.ws_url + "?model=gamma") as rt:
            error = await rt.recv_until("error")
            assert error["error"]["code"] == "model_not_found"
            await rt.send({"type": "session.update", "session": {"model": "gamma"}})
            error = await rt.recv_until("error")
            assert (error["error"]["code"], error["error"]["param"]) == ("model_not_found", "model")
            await rt.send({"type": "session.update", "session": {"model": "alpha"}})
            updated = await rt.recv_until("session.updated")
            assert updated["session"]["model"] == "alpha"
            assert (await rt.respond()).status == "completed"


def test_every_field_the_sdk_can_send_has_an_answer() -> None:
    """Each field of openai-python's CompletionCreateParams is served, accepted and ignored,
    or refused with unsupported_value: a new SDK field fails here until it is placed."""
    sdk_fields = set(params.CompletionCreateParamsBase.__annotations__)
    sdk_fields |= set(params.CompletionCreateParamsStreaming.__annotations__)
    placed = cc.SERVED | set(cc.IGNORED) | set(cc.REFUSED)
    assert sdk_fields - placed == set(), "fields of the SDK with no answer"
    assert placed - sdk_fields == set(), "answers for fields the SDK does not have"
    for field in cc.IGNORED:
        body = cc.read_body({"messages": [{"role": "user", "content": "x"}], field: None})
        assert body.messages


def test_docs_give_every_field_its_answer() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    section = docs.split("\n## Chat Completions\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1)[0] for line in section.splitlines() if line.startswith("| `")]
    documented = set(re.findall(r"`(\w+)`", " ".join(rows)))
    missing = (cc.SERVED | set(cc.IGNORED) | set(cc.REFUSED)) - documented
    assert not missing, f"fields docs/protocol.md's Chat Completions table lacks: {missing}"


def test_no_system_message_gets_the_engines_default_instructions() -> None:
    body = cc.read_body({"messages": [{"role": "developer", "content": "be brief"}]})
    assert body.has_system and body.messages[0].role == "system"
    assert not cc.read_body({"messages": [{"role": "user", "content": "x"}]}).has_system
    assert dataclasses.replace(body, stream=True).stream
