"""Guided decoding on the TensorRT-LLM engine, against the stand-in (tests/support/trtllm_standin),
which takes ``GuidedDecodingParams`` and ``LLM(guided_decoding_backend=...)`` as the real API
does (tensorrt_llm/sampling_params.py, llmapi/llm_args.py) and answers under the guide the
way the real backends compile it (_torch/pyexecutor/grammar_matcher.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import jsonschema
import openai
import pytest

from gateway.engines import trtllm
from gateway.engines.base import (
    Constraint,
    Finished,
    GenerationRequest,
    InvalidRequestError,
    Message,
    TextDelta,
    Tool,
    ToolCallDelta,
)
from tests.support.harness import running_gateway
from tests.test_trtllm import MODEL, collect, make_args, standin  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
}
WEATHER = Tool("get_weather", "The weather.", SCHEMA)


def engine_with(*flags: str) -> trtllm.TrtllmEngine:
    return trtllm.from_args(make_args("--model", MODEL, *flags))


@pytest.fixture
async def engine(standin: ModuleType) -> AsyncIterator[trtllm.TrtllmEngine]:  # noqa: F811
    eng = engine_with()
    await eng.start()
    yield eng
    await eng.close()


def ask(**fields: Any) -> GenerationRequest:
    return GenerationRequest("r", (Message("user", "Name a city."),), **fields)


async def test_the_backend_is_set_when_the_llm_is_built(standin: ModuleType) -> None:  # noqa: F811
    for flags, backend in (
        ((), "llguidance"),
        (("--guided-decoding-backend", "xgrammar"), "xgrammar"),
    ):
        eng = engine_with(*flags)
        await eng.start()
        assert standin.stats.llm_kwargs[-1]["guided_decoding_backend"] == backend
        assert eng.describe()["guided_decoding_backend"] == backend
        await eng.close()
    eng = engine_with("--guided-decoding-backend", "none")
    await eng.start()
    assert "guided_decoding_backend" not in standin.stats.llm_kwargs[-1]  # LLM's own default
    await eng.close()


async def test_a_response_format_goes_as_guided_decoding_params(
    standin: ModuleType,  # noqa: F811
    engine: trtllm.TrtllmEngine,
) -> None:
    constraint = Constraint("json_schema", json.dumps(SCHEMA), "city")
    events = await collect(engine, ask(constraint=constraint))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    jsonschema.validate(json.loads(text), SCHEMA)  # the stand-in answered under the guide
    guide = standin.stats.requests[-1].sampling_params.guided_decoding
    assert isinstance(guide, standin_guided_class())
    assert guide.grammar.startswith("%llguidance") and "%json" in guide.grammar
    assert (guide.json, guide.regex, guide.json_object) == (None, None, False)


def standin_guided_class() -> type:
    from tensorrt_llm.llmapi import GuidedDecodingParams

    return GuidedDecodingParams


async def test_xgrammar_takes_json_and_refuses_what_needs_lark(standin: ModuleType) -> None:  # noqa: F811
    eng = engine_with("--guided-decoding-backend", "xgrammar")
    await eng.start()
    try:
        await collect(eng, ask(constraint=Constraint("json_object")))
        assert standin.stats.requests[-1].sampling_params.guided_decoding.json_object is True
        await collect(eng, ask(constraint=Constraint("json_schema", json.dumps(SCHEMA), "c")))
        assert json.loads(standin.stats.requests[-1].sampling_params.guided_decoding.json) == SCHEMA
        with pytest.raises(InvalidRequestError, match="llguidance"):
            eng.check(ask(tools=(WEATHER,), tool_choice="required"))
    finally:
        await eng.close()


async def test_without_a_backend_structure_is_refused_never_answered_unconstrained(
    standin: ModuleType,  # noqa: F811
) -> None:
    eng = engine_with("--guided-decoding-backend", "none")
    async with running_gateway(eng) as gw:
        c = gw.openai()
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_object"},
                stream=True,
            )
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "structured_output_unsupported"
    assert not standin.stats.requests  # nothing reached TensorRT-LLM


async def test_a_required_tool_is_called_under_the_tool_grammar(
    standin: ModuleType,  # noqa: F811
    engine: trtllm.TrtllmEngine,
) -> None:
    events = await collect(engine, ask(tools=(WEATHER,), tool_choice="required"))
    assert isinstance(events[-1], Finished) and events[-1].reason == "tool_calls"
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert calls[0].name == "get_weather"
    jsonschema.validate(json.loads("".join(c.arguments for c in calls)), SCHEMA)
    guide = standin.stats.requests[-1].sampling_params.guided_decoding
    assert "start: call\n" in guide.grammar


def test_the_standin_takes_guided_decoding_as_the_real_api_does(standin: ModuleType) -> None:  # noqa: F811
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import GuidedDecodingParams

    with pytest.raises(ValueError, match="Only one guide"):
        SamplingParams(guided_decoding=GuidedDecodingParams(json="{}", regex="a"))
    with pytest.raises(TypeError):
        GuidedDecodingParams(lark="start: x")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="guided_decoding_backend"):
        LLM(model=MODEL, guided_decoding_backend="outlines")
