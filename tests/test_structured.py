"""Structured output on the sim engine with openai-python: response formats on both HTTP
APIs (its ``parse`` and ``stream`` helpers), OpenAI's strict-schema refusals in its words,
schemas and grammars an engine cannot compile refused before anything streams, and tool
calls a ``tool_choice`` or a custom tool's grammar makes the engine give, on all three APIs.
The other clients users bring run on the sim and on the bundled model in
tests/test_structured_llamacpp.py.

Answers are validated with a real JSON Schema validator (``jsonschema``); the sim answers
a deterministic valid instance (gateway/engines/instances.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import jsonschema
import openai
import orjson
import pytest
from pydantic import BaseModel

from gateway.engines import grammars
from gateway.engines.base import Constraint
from gateway.engines.sim import SimEngine
from tests.support.gateway_processes import gateways
from tests.support.harness import RawClient, RunningGateway, running_gateway
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401
from tests.support.responses_harness import drained_mid_answer, validate
from tests.support.scripted_engine import ScriptedEngine

KEY = "key-structured"


class Step(BaseModel):
    explanation: str
    output: str


class Math(BaseModel):
    steps: list[Step]
    final_answer: str
    confidence: Literal["low", "high"]
    note: str | None  # optional as nullable, as OpenAI's strict mode has it


MATH_SCHEMA = openai.lib._pydantic.to_strict_json_schema(Math)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
PATCH_GRAMMAR = 'start: "*** Begin Patch\\n" LINE+ "*** End Patch"\nLINE: /[+-][a-z ]*\\n/\n'


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    async with running_gateway(SimEngine(step_ms=1), api_keys=(KEY,)) as running:
        yield running


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return gw.openai(KEY)


async def test_openai_python_parse_and_stream_on_both_apis(gw: RunningGateway) -> None:
    c = client(gw)
    messages: Any = [{"role": "user", "content": "Solve 8x + 7 = -23."}]
    parsed = await c.chat.completions.parse(model="m", messages=messages, response_format=Math)
    math = parsed.choices[0].message.parsed
    assert isinstance(math, Math) and parsed.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(parsed.choices[0].message.content or ""), MATH_SCHEMA)
    async with c.chat.completions.stream(
        model="m", messages=messages, response_format=Math
    ) as stream:
        chunks = [event async for event in stream if event.type == "content.delta"]
        final = await stream.get_final_completion()
    assert len(chunks) > 1 and final.choices[0].message.parsed == math  # deterministic

    response = await c.responses.parse(model="m", input="Solve 8x + 7 = -23.", text_format=Math)
    assert response.output_parsed == math
    assert response.text.format.type == "json_schema"
    assert response.text.format.name == "Math" and response.text.format.strict is True
    async with c.responses.stream(model="m", input="Solve 8x + 7 = -23.", text_format=Math) as s:
        deltas = [event async for event in s if event.type == "response.output_text.delta"]
        streamed = await s.get_final_response()
    assert len(deltas) > 1 and streamed.output_parsed == math
    stored = await c.responses.retrieve(streamed.id)  # stored and retrieved as any answer
    assert Math.model_validate_json(stored.output_text) == math
    assert stored.text.format.type == "json_schema"


async def test_json_object_on_both_apis(gw: RunningGateway) -> None:
    c = client(gw)
    chat = await c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Paris as JSON."}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    response = await c.responses.create(
        model="m", input="Paris as JSON.", text={"format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(response.output_text), dict)
    assert response.text.format.type == "json_object"


async def test_each_of_n_choices_validates_against_the_schema(gw: RunningGateway) -> None:
    c = client(gw)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    messages: Any = [{"role": "user", "content": "The weather in Paris."}]
    whole = await c.chat.completions.create(model="m", messages=messages, response_format=fmt, n=3)
    assert len(whole.choices) == 3
    for choice in whole.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), WEATHER)
    stream = await c.chat.completions.create(
        model="m", messages=messages, response_format=fmt, n=3, stream=True
    )
    texts = ["", "", ""]
    async for chunk in stream:
        for streamed in chunk.choices:
            texts[streamed.index] += streamed.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), WEATHER)


def strict_format(schema: Any) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "strict": True, "schema": schema},
    }


OBJECT = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
CLOSED = {**OBJECT, "additionalProperties": False}


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            OBJECT,
            "In context=(), 'additionalProperties' is required to be supplied and to be false.",
        ),
        (
            {**CLOSED, "required": []},
            "In context=(), 'required' is required to be supplied and to be an array including "
            "every key in properties. Missing 'a'.",
        ),
        (
            {**CLOSED, "properties": {"a": {"allOf": [{"type": "string"}]}}},
            "In context=('properties', 'a'), 'allOf' is not permitted.",
        ),
        (
            {**CLOSED, "properties": {"a": {"description": "no type"}}},
            "In context=('properties', 'a'), schema must have a 'type' key.",
        ),
        (
            {"type": "array", "items": {"type": "string"}},
            "schema must be a JSON Schema of 'type: \"object\"', got 'type: \"array\"'.",
        ),
        (
            {**CLOSED, "properties": {"a": {"$ref": "#/$defs/missing"}}},
            "In context=('properties', 'a'), reference '#/$defs/missing' cannot be resolved.",
        ),
    ],
)
async def test_a_strict_schema_outside_openais_subset_is_refused_in_openais_words(
    gw: RunningGateway, schema: dict[str, Any], message: str
) -> None:
    c = client(gw)
    with pytest.raises(openai.BadRequestError) as chat:
        await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            response_format=strict_format(schema),  # type: ignore[arg-type]
        )
    error = chat.value.body
    assert isinstance(error, dict)
    assert error["message"] == f"Invalid schema for response_format 'answer': {message}"
    assert (error["type"], error["param"]) == (
        "invalid_request_error",
        "response_format.json_schema.schema",
    )
    with pytest.raises(openai.BadRequestError) as responses:
        fmt = {"type": "json_schema", "name": "answer", "strict": True, "schema": schema}
        await c.responses.create(model="m", input="hi", text={"format": fmt})  # type: ignore[typeddict-item]
    assert isinstance(responses.value.body, dict)
    assert responses.value.body["param"] == "text.format.schema"


async def test_a_strict_function_outside_the_subset_is_refused(gw: RunningGateway) -> None:
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": OBJECT}}
    with pytest.raises(openai.BadRequestError) as info:
        await client(gw).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            tools=[tool],  # type: ignore[list-item]
        )
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_function_parameters"
    assert body["message"].startswith("Invalid schema for function 'f': In context=()")
    assert body["param"] == "tools[0].function.parameters"


async def test_what_the_engine_cannot_constrain_is_a_400_before_anything_streams() -> None:
    """A schema the sim cannot answer, and any structure on an engine that constrains
    nothing (the scripted one): refused with a 400, never a 200 stream of free text."""
    bad = {"type": "json_schema", "json_schema": {"name": "odd", "schema": {"type": "frob"}}}
    for engine, code in (
        (SimEngine(step_ms=1), "invalid_json_schema"),
        (ScriptedEngine([]), "structured_output_unsupported"),
    ):
        async with running_gateway(engine) as gw:
            for fmt in (bad, {"type": "json_object"}):
                if code == "invalid_json_schema" and fmt["type"] == "json_object":
                    continue
                with pytest.raises(openai.BadRequestError) as info:
                    await client(gw).chat.completions.create(
                        model="m",
                        messages=[{"role": "user", "content": "hi"}],
                        stream=True,
                        response_format=fmt,  # type: ignore[arg-type]
                    )
                assert isinstance(info.value.body, dict) and info.value.body["code"] == code


async def test_a_required_or_named_tool_choice_makes_a_valid_call_on_all_three_apis(
    gw: RunningGateway,
) -> None:
    c = client(gw)
    chat_tools: Any = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": WEATHER, "strict": True},
        },
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    ]
    question: Any = [{"role": "user", "content": "Nothing to do with tools."}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        chat = await c.chat.completions.create(
            model="m",
            messages=question,
            tools=chat_tools,
            tool_choice=choice,
            parallel_tool_calls=False,  # type: ignore[arg-type]
        )
        (call,) = chat.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]
    flat: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    response = await c.responses.create(
        model="m", input="Nothing to do with tools.", tools=flat, tool_choice="required"
    )
    (item,) = response.output
    assert item.type == "function_call"
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    async with RawClient.connect(
        gw.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}
    ) as rt:
        realtime_tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
        await rt.send(
            {
                "type": "session.update",
                "session": {"tools": [realtime_tool], "tool_choice": "required"},
            }
        )
        await rt.recv_until("session.updated")
        await rt.say("Nothing to do with tools.")
        await rt.send({"type": "response.create"})
        done = await rt.recv_until("response.function_call_arguments.done")
        jsonschema.validate(json.loads(done["arguments"]), WEATHER)
        await rt.recv_until("response.done")


async def test_a_custom_tools_input_matches_its_grammar(gw: RunningGateway) -> None:
    tool: Any = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edit files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
    }
    response = await client(gw).responses.create(
        model="m",
        input="Fix the greeting.",
        tools=[tool],
        tool_choice={"type": "custom", "name": "apply_patch"},
    )
    (call,) = response.output
    assert call.type == "custom_tool_call"
    checked = grammars.grammar(Constraint("lark", PATCH_GRAMMAR), lenient=True)
    assert grammars.accepts(checked, call.input), call.input
    bad = {**tool, "format": {**tool["format"], "definition": "start: foo("}}
    with pytest.raises(openai.BadRequestError) as info:
        await client(gw).responses.create(model="m", input="x", tools=[bad], tool_choice="required")
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "invalid_grammar"


def test_the_schemas_are_what_the_clients_send() -> None:
    """The strict schema openai-python sends for ``Math`` passes the gateway's checks."""
    from sessions import strict_schema

    assert strict_schema.violation(MATH_SCHEMA) is None
    assert orjson.loads(orjson.dumps(MATH_SCHEMA))["additionalProperties"] is False


async def test_a_takeover_ends_an_answer_under_a_schema_rather_than_splice_it(
    redis_server: RedisServer,
) -> None:
    """The gateway streaming a structured answer drains mid-answer: the one that takes the
    session over cannot continue it (an engine's grammar would start again after the text
    so far), so the answer fails (``gateway_restarted``), keeping what the client has,
    never completed with JSON that does not parse."""
    # Slow steps: the answer (some 20 pieces) is still streaming when the drain gives up.
    async with gateways(redis_server.url, 2, "--drain-timeout", "0.2", step_ms=100) as (a, b):
        fmt = {"type": "json_schema", "name": "math", "schema": MATH_SCHEMA, "strict": True}
        create = {"input": "The weather, gateway", "text": {"format": fmt}}
        seen, rest = await drained_mid_answer(a, b, 6, **create)
    for event in seen + rest.events:
        validate(event)
    sent = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
    assert sent and not [e for e in rest.events if e["type"] == "response.output_text.delta"]
    response = rest.response
    assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert "under a constraint" in response["error"]["message"]  # gateway_restarted's
    assert response["output"][0]["content"][0]["text"] == sent  # kept, not continued
