"""Tool calls read from generated text (gateway/engines/toolparse.py), and the trtllm
engine with tools on the TensorRT-LLM stand-in."""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from gateway.engines import trtllm
from gateway.engines.base import (
    Finished,
    GenerationRequest,
    Message,
    StreamEvent,
    TextDelta,
    Tool,
    ToolCallDelta,
)
from gateway.engines.toolparse import ToolCallText, ToolFormat, detect_format
from tests.test_trtllm import collect, engine, standin  # noqa: F401 (fixtures)

HERMES_TEMPLATE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"
WEATHER = Tool("get_weather", "The weather.", {"type": "object", "properties": {}})


def run(fmt: ToolFormat, text: str, piece: int = 3) -> tuple[str, list[ToolCallDelta], list[str]]:
    """Feed ``text`` in pieces: (text handed on, calls, the text deltas as they came)."""
    parser = ToolCallText(fmt, "r")
    events: list[StreamEvent] = []
    streamed: list[str] = []
    for i in range(0, len(text), piece):
        fed = parser.feed(text[i : i + piece])
        streamed += [e.text for e in fed if isinstance(e, TextDelta)]
        events += fed
    events += parser.finish()
    shown = "".join(e.text for e in events if isinstance(e, TextDelta))
    return shown, [e for e in events if isinstance(e, ToolCallDelta)], streamed


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("...<tool_call>...", "hermes"),
        ("...[TOOL_CALLS]...", "mistral"),
        ("...<|python_tag|>...", "llama3_json"),
        ("{{ messages }}", None),
        (None, None),
    ],
)
def test_the_format_is_told_from_the_template(template: str | None, fmt: str | None) -> None:
    assert detect_format(template) == fmt


@pytest.mark.parametrize(
    ("fmt", "text", "head"),
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "Let me look.",
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}},'
            ' {"name": "get_time", "arguments": {}}]',
            "",
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
            "",
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}};'
            '{"name": "get_time", "parameters": {}}',
            "",
        ),
    ],
)
def test_calls_are_parsed_in_every_supported_format(fmt: ToolFormat, text: str, head: str) -> None:
    shown, calls, _ = run(fmt, text)
    assert shown == head
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Oslo"}),
        (1, "get_time", {}),
    ]
    assert len({c.call_id for c in calls}) == 2


def test_text_streams_and_a_marker_split_across_deltas_is_held() -> None:
    text = 'Sure <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    shown, calls, streamed = run("hermes", text, piece=2)
    assert shown == "Sure" and [c.name for c in calls] == ["f"]
    assert "".join(streamed) == "Sure"  # never a piece of the marker (nor the blank before it)
    assert run("hermes", "a < b <tool but no call", piece=1)[0] == "a < b <tool but no call"


def test_what_looks_like_a_call_but_is_not_is_text() -> None:
    broken = "<tool_call>{not json"
    assert run("hermes", broken) == (broken, [], [])
    assert run("llama3_json", '{"a": 1}')[0] == '{"a": 1}'  # no name: not a call
    assert run("llama3_json", "Hello there.")[2] != []  # plain text streams


def tools_request(*messages: Message) -> GenerationRequest:
    return GenerationRequest("r", messages or (Message("user", "Weather?"),), tools=(WEATHER,))


async def test_trtllm_renders_the_tools_and_parses_the_models_calls(
    standin: ModuleType,  # noqa: F811
    engine: trtllm.TrtllmEngine,  # noqa: F811
) -> None:
    standin.controls.chat_template_text = HERMES_TEMPLATE
    standin.controls.reply = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {}}'
    events = await collect(engine, tools_request())
    assert isinstance(events[-1], Finished) and events[-1].reason == "tool_calls"
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", "{}")]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Checking."
    record = standin.stats.requests[-1]  # the prompt went as token ids: decode them
    prompt = engine.llm.tokenizer.decode(record.prompt_token_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt  # the template had them


async def test_trtllm_gives_tools_to_a_model_without_a_call_format_in_the_gateways_own(
    standin: ModuleType,  # noqa: F811
    engine: trtllm.TrtllmEngine,  # noqa: F811
) -> None:
    """A template with no call format this gateway reads: the tools go in the system
    prompt, the answer under the gateway's tool grammar (llguidance, the default backend)."""
    standin.controls.chat_template_text = "{{ messages }}"
    standin.controls.reply = '<tool_call name="get_weather">\n{}\n</tool_call>'
    events = await collect(engine, tools_request())
    assert isinstance(events[-1], Finished) and events[-1].reason == "tool_calls"
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert "".join(c.arguments for c in calls) == "{}" and calls[0].name == "get_weather"
    record = standin.stats.requests[-1]
    guide = record.sampling_params.guided_decoding
    assert guide is not None and guide.grammar.startswith("%llguidance")
    prompt = engine.llm.tokenizer.decode(record.prompt_token_ids, skip_special_tokens=False)
    assert "- get_weather" in prompt and '<tool_call name="' in prompt
