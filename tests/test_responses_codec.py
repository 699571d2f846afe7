"""The Responses codec alone (sessions/responses/codec.py): frames as strings, no socket.

What a client of the Responses WebSocket would notice: the values a ``response.create``
(and ``response.cancel``, ``response.steer``) decodes to, and for each refusal its exact
``code`` and ``param``. The Realtime codec has the same kind of tests in
tests/test_realtime_codec.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import response_create_params as create_params
from openai.types.responses import tool_param

from gateway.engines.base import freeform_input
from sessions import codec, errors
from sessions.responses import codec as rs
from sessions.responses import tools as rtools


def create(**body: Any) -> rs.CreateBody:
    """The body a ``response.create`` frame with these fields decodes to."""
    event = rs.decode(json.dumps({"type": "response.create", **body}))
    assert isinstance(event, rs.Create), event
    return event.body


def refused(frame: str | bytes) -> errors.ProtocolError:
    with pytest.raises(errors.ProtocolError) as info:
        rs.decode(frame)
    assert info.value.message
    assert info.value.error_type == "invalid_request_error"
    return info.value


def items(body: rs.CreateBody) -> list[dict[str, Any]]:
    """The input items' fields (a message: id, role, text; a function call: id, call_id,
    name, arguments; a call's output: id, call_id, output)."""
    return [dataclasses.asdict(item) for item in body.input]


def message(role: str, content: Any, **fields: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content, **fields}


# -- response.create: what it decodes to ------------------------------------------------


def test_an_empty_create_takes_every_default() -> None:
    body = create()
    assert body.input == ()
    assert (body.model, body.instructions, body.previous_response_id, body.stream_id) == (
        None,
        None,
        None,
        None,
    )
    assert body.tools is codec.UNSET and body.tool_choice is codec.UNSET
    assert body.max_output_tokens is codec.UNSET and body.temperature is codec.UNSET
    assert body.top_p is codec.UNSET and body.metadata is None
    assert body.store and body.generate and body.parallel_tool_calls
    assert not body.stream and not body.background
    assert body.truncation == "disabled"


def test_input_as_a_string_is_one_user_message() -> None:
    assert items(create(input="Bonjour 🙂")) == [{"id": None, "role": "user", "text": "Bonjour 🙂"}]


def test_message_items_with_string_or_part_content() -> None:
    body = create(
        input=[
            message("developer", "Be brief."),
            message("system", [{"type": "input_text", "text": "No lists."}]),
            message(
                "user",
                [{"type": "input_text", "text": "안녕 "}, {"type": "input_text", "text": "🙂"}],
                id="msg_client_1",
            ),
            # As the API returned it: with an id, a status and part annotations.
            message(
                "assistant",
                [
                    {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []},
                    {"type": "refusal", "refusal": " (no)"},
                ],
                id="msg_2",
                status="completed",
            ),
            {"role": "user", "content": "no type: still a message"},
        ]
    )
    assert items(body) == [
        {"id": None, "role": "system", "text": "Be brief."},  # developer is a system message
        {"id": None, "role": "system", "text": "No lists."},
        {"id": "msg_client_1", "role": "user", "text": "안녕 🙂"},
        {"id": "msg_2", "role": "assistant", "text": "Hi (no)"},
        {"id": None, "role": "user", "text": "no type: still a message"},
    ]


def test_function_call_and_its_output_as_input_items() -> None:
    body = create(
        input=[
            message("user", "Weather in Paris?"),
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
                "status": "completed",  # sent back as received: left alone
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [
                    {"type": "input_text", "text": "21 "},
                    {"type": "input_text", "text": "°C"},
                ],
            },
        ],
        previous_response_id="resp_1",
    )
    assert items(body)[1:] == [
        {
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"id": None, "call_id": "call_1", "output": "Sunny"},
        {"id": None, "call_id": "call_2", "output": "21 °C"},
    ]
    assert body.previous_response_id == "resp_1"


def test_every_field_a_create_takes() -> None:
    body = create(
        model="smollm2",
        instructions="Answer in French.",
        input="hi",
        max_output_tokens=16,
        temperature=0.5,
        top_p=0.9,
        frequency_penalty=-2,
        presence_penalty=2,
        metadata={"batch": "7"},
        store=False,
        generate=False,
        parallel_tool_calls=False,
        stream_id="lane-a.1:x_y",
        previous_response_id="resp_abc",
        truncation="auto",
        text={"format": {"type": "text"}},
    )
    assert (body.model, body.instructions) == ("smollm2", "Answer in French.")
    assert (body.max_output_tokens, body.temperature, body.top_p) == (16, 0.5, 0.9)
    assert (body.frequency_penalty, body.presence_penalty) == (-2.0, 2.0)
    assert body.metadata == {"batch": "7"}
    assert not body.store and not body.generate and not body.parallel_tool_calls
    assert (body.stream_id, body.previous_response_id) == ("lane-a.1:x_y", "resp_abc")
    assert body.truncation == "auto"


def test_null_fields_are_as_if_absent_and_null_sampling_resets() -> None:
    body = create(
        model=None,
        instructions=None,
        input=None,
        previous_response_id=None,
        stream_id=None,
        store=None,
        generate=None,
        truncation=None,
        text=None,
        tools=None,
        tool_choice=None,
        metadata=None,
    )
    assert body.input == () and body.model is None and body.stream_id is None
    assert body.store and body.generate and body.truncation == "disabled"
    assert body.tools == () and body.tool_choice == "auto" and body.metadata is None
    # null sampling fields are sent (the default, not the session's value): None, not UNSET
    sampling = create(max_output_tokens=None, temperature=None, top_p=None)
    assert (sampling.max_output_tokens, sampling.temperature, sampling.top_p) == (None, None, None)


def test_fields_that_ask_for_nothing_a_text_engine_lacks_are_accepted() -> None:
    body = create(
        input="hi",
        user="u-1",
        safety_identifier="s",
        prompt_cache_key="k",
        service_tier="auto",
        include=[],
        reasoning={"effort": "low"},
        stream_options={"include_obfuscation": False},
        top_logprobs=0,
        max_tool_calls=3,
        prompt_cache_retention="24h",
    )
    assert items(body) == [{"id": None, "role": "user", "text": "hi"}]


def test_tools_and_tool_choice() -> None:
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    body = create(
        tools=[
            {
                "type": "function",
                "name": "get_weather",
                "description": "Weather now",
                "parameters": weather,
                "strict": True,
            },
            {"name": "now"},  # type defaults to function, parameters to an empty object
        ],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert body.tools is not codec.UNSET
    assert [(t.name, t.description, dict(t.parameters)) for t in body.tools] == [
        ("get_weather", "Weather now", weather),
        ("now", "", {"type": "object", "properties": {}}),
    ]
    assert body.tool_choice == "get_weather"
    for mode in ("auto", "none", "required"):
        assert create(tool_choice=mode).tool_choice == mode


def test_namespace_tools_are_offered_flat_and_map_back() -> None:
    """Codex's multi_agent_v1 namespace: its functions reach the engine as NS__NAME."""
    space = {
        "type": "namespace",
        "name": "agents",
        "description": "Sub-agents.",
        "tools": [
            {"type": "function", "name": "spawn", "description": "Start one.", "strict": False},
            {"type": "function", "name": "close", "parameters": {"type": "object"}},
        ],
    }
    body = create(
        tools=[{"type": "function", "name": "spawn"}, space],
        tool_choice={"type": "function", "name": "close"},
    )
    assert [t.name for t in body.tools] == ["spawn", "agents__spawn", "agents__close"]
    assert [(n.flat, n.namespace, n.name) for n in body.mapped] == [
        ("agents__spawn", "agents", "spawn"),
        ("agents__close", "agents", "close"),
    ]
    # A name both plain and namespaced is the plain one; an inner name alone maps to its flat.
    assert body.tool_choice == "agents__close"
    assert (
        create(
            tools=[{"type": "function", "name": "spawn"}, space],
            tool_choice={"type": "function", "name": "spawn"},
        ).tool_choice
        == "spawn"
    )
    echoed = rtools.tools_echo(body.tools, body.mapped)
    assert [t["type"] for t in echoed] == ["function", "namespace"]
    assert [t["name"] for t in echoed[1]["tools"]] == ["spawn", "close"]
    # A call sent back with its namespace is the flat call the model made.
    call = {"type": "function_call", "call_id": "c1", "namespace": "agents", "name": "close"}
    body = create(input=[{**call, "arguments": "{}"}])
    assert items(body)[0]["name"] == "agents__close"


def test_custom_tools_are_offered_as_one_string_parameter() -> None:
    grammar = {"type": "grammar", "syntax": "lark", "definition": 'start: "yes" | "no"'}
    body = create(
        tools=[
            {"type": "custom", "name": "apply_patch", "description": "Patch files."},
            {"type": "custom", "name": "answer", "format": grammar},
        ],
        tool_choice={"type": "custom", "name": "answer"},
    )
    patch, answer = body.tools
    assert patch.parameters["required"] == ["input"]
    assert "start:" in answer.parameters["properties"]["input"]["description"]
    assert body.tool_choice == "answer"
    assert [t["type"] for t in rtools.tools_echo(body.tools, body.mapped)] == ["custom"] * 2
    assert rtools.tools_echo(body.tools, body.mapped)[1]["format"] == grammar
    # A call sent back is the function call the model made; its output is a tool output.
    body = create(
        input=[
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "ok"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
        ]
    )
    call, output = items(body)
    assert (call["name"], json.loads(call["arguments"])) == ("apply_patch", {"input": "ok"})
    assert output["output"] == "done"


@pytest.mark.parametrize("text", ["plain", 'a "quoted"\nline\\', "é ✨ 🚀 한글", "", "x" * 300])
def test_a_custom_inputs_prefix_decodes_as_its_arguments_arrive(text: str) -> None:
    arguments = json.dumps({"input": text})
    for size in (1, 2, 3, 7, len(arguments)):  # every cut, escapes and pairs included
        decoder = rtools.InputDecoder()
        pieces = [arguments[i : i + size] for i in range(0, len(arguments), size)]
        assert "".join(decoder.feed(p) for p in pieces) == text == freeform_input(arguments)
    other = rtools.InputDecoder()
    assert other.feed('{"other": 1, "input": "x"}') == "" and other.feed("more") == ""
    assert freeform_input("not json") == "not json"


def test_a_custom_inputs_decoder_holds_back_at_most_an_escape() -> None:
    """What makes streaming a long input linear: each piece is decoded once, and only an
    escape cut in two waits for the next piece (not the input so far)."""
    arguments = json.dumps({"input": "line \u00e9 \U0001f680 \\ of a patch\n" * 500})
    decoder = rtools.InputDecoder()
    decoded = []
    for i in range(0, len(arguments), 3):
        decoded.append(decoder.feed(arguments[i : i + 3]))
        assert len(decoder._pending) < 12  # at most a \uXXXX\uXXXX pair
    assert "".join(decoded) == json.loads(arguments)["input"]


def test_hosted_tools_are_noted_for_the_dialect_and_left_out() -> None:
    body = create(
        tools=[
            {"type": "web_search", "external_web_access": False},
            {"type": "function", "name": "f"},
            {"type": "mcp"},
        ]
    )
    assert [t.name for t in body.tools] == ["f"]
    assert body.hosted_tools == (("tools[0]", "web_search"), ("tools[2]", "mcp"))


def test_reasoning_items_are_accepted_and_left_out_of_the_prompt() -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}
    body = create(input=[reasoning, message("user", "hi"), {"type": "reasoning", "summary": []}])
    assert items(body) == [{"id": None, "role": "user", "text": "hi"}]


def test_what_codex_sends_is_accepted() -> None:
    """The fields of Codex 0.169's first request (tests/test_codex.py runs Codex itself)."""
    body = create(
        model="gpt-5-codex",
        input=[
            message("developer", [{"type": "input_text", "text": "You are Codex."}], id="msg_1"),
            message("user", "Say hello"),
        ],
        tools=[
            {
                "type": "function",
                "name": "exec_command",
                "strict": False,
                "parameters": {"type": "object", "properties": {}},
            },
            {"type": "web_search", "external_web_access": False},
        ],
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning={"summary": "auto"},
        store=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="01a2-thread",
        client_metadata={"x-codex-installation-id": "c8c4"},
        stream=True,
    )
    assert body.affinity_key == codec.PROMPT_CACHE_KEY + "01a2-thread"
    assert [t.name for t in body.tools] == ["exec_command"]


def test_every_create_field_and_tool_type_of_the_sdk_has_an_answer() -> None:
    """Each field of openai-python's ResponseCreateParams, and each type of its Tool
    union, is served, accepted and ignored, or refused: a new one fails here until placed."""
    sdk_fields = set(create_params.ResponseCreateParamsBase.__annotations__)
    sdk_fields |= set(create_params.ResponseCreateParamsStreaming.__annotations__)
    placed = rs.SERVED | set(rs.IGNORED) | set(rs.REFUSED)
    assert sdk_fields - placed == set(), "fields of the SDK with no answer"
    # The answers for fields the SDK lacks: the gateway's extensions, and Codex's field.
    assert placed - sdk_fields == {"client_metadata"}
    assert not rs.EXTENSIONS & sdk_fields
    sdk_types = set()
    for tool in typing.get_args(tool_param.ToolParam):
        annotation = typing.get_type_hints(tool, include_extras=True)["type"]
        while typing.get_origin(annotation) is not typing.Literal:
            annotation = typing.get_args(annotation)[0]
        sdk_types |= set(typing.get_args(annotation))
    placed = rtools.SERVED_TOOL_TYPES | rtools.REFUSED_TOOL_TYPES | rtools.HOSTED_TOOL_TYPES
    assert sdk_types == placed


def test_docs_give_every_create_field_and_tool_type_its_answer() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    section = docs.split("\n### The create body\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1)[0] for line in section.splitlines() if line.startswith("| `")]
    documented = set(re.findall(r"`(\w+)`", " ".join(rows)))
    fields = rs.SERVED | rs.EXTENSIONS | set(rs.IGNORED) | set(rs.REFUSED)
    types = rtools.SERVED_TOOL_TYPES | rtools.REFUSED_TOOL_TYPES | rtools.HOSTED_TOOL_TYPES
    assert not (fields | types) - documented, "docs/protocol.md's create-body tables lack these"


def test_cancel_steer_and_processed() -> None:
    cancel = rs.decode('{"type": "response.cancel", "response_id": "resp_1"}')
    assert isinstance(cancel, rs.Cancel) and cancel.response_id == "resp_1"
    latest = rs.decode('{"type": "response.cancel"}')
    assert isinstance(latest, rs.Cancel) and latest.response_id is None
    raw_input = [message("user", "shorter, please")]
    steer = rs.decode(
        json.dumps({"type": "response.steer", "previous_response_id": "resp_1", "input": raw_input})
    )
    assert isinstance(steer, rs.Steer)
    assert steer.previous_response_id == "resp_1" and steer.raw_input == raw_input
    assert [dataclasses.asdict(i) for i in steer.input] == [
        {"id": None, "role": "user", "text": "shorter, please"}
    ]
    assert isinstance(rs.decode('{"type": "response.processed", "x": 1}'), rs.Ignored)


def test_limits_are_inclusive() -> None:
    create(stream_id="s" * 64, previous_response_id="r" * 64, max_output_tokens=1_000_000)
    create(input=[message("user", "x")] * rs.MAX_INPUT_ITEMS, temperature=2, top_p=0)
    create(
        input=[{"type": "function_call_output", "call_id": "c" * 64, "output": ""}],
        tools=[{"name": "n" * 64}],
    )


# -- refusals: each one's code and param ------------------------------------------------


def _create(**body: Any) -> str:
    return json.dumps({"type": "response.create", **body})


def _first(item: Any) -> str:
    return _create(input=[item])


_CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}

REFUSALS: list[tuple[str | bytes, str, str | None]] = [
    # the frame
    (b'{"type": "response.create"}', "binary_frame_not_supported", None),
    ("{nope", "invalid_json", None),
    ("", "invalid_json", None),
    ("[1, 2]", "invalid_event", None),
    ('"response.create"', "invalid_event", None),
    ("{}", "missing_required_parameter", "type"),
    ('{"type": null}', "missing_required_parameter", "type"),
    ('{"type": 5}', "invalid_type", "type"),
    ('{"type": "response.create", "event_id": 5}', "invalid_value", "event_id"),
    ('{"type": "no.such.event"}', "unknown_event_type", "type"),
    # the Realtime dialect's events are not this socket's
    ('{"type": "session.update", "session": {}}', "unknown_event_type", "type"),
    ('{"type": "conversation.item.create"}', "unknown_event_type", "type"),
    # response.create's own fields
    (_create(colour="blue"), "unknown_parameter", "colour"),
    (_create(response={"input": "hi"}), "unknown_parameter", "response"),  # Realtime's shape
    (_create(model=5), "invalid_type", "model"),
    (_create(model="m" * 257), "invalid_value", "model"),
    (_create(instructions=["a"]), "invalid_type", "instructions"),
    (_create(store="yes"), "invalid_type", "store"),
    (_create(generate=0), "invalid_type", "generate"),
    (_create(stream=1), "invalid_type", "stream"),
    (_create(background="no"), "invalid_type", "background"),
    (_create(parallel_tool_calls="true"), "invalid_type", "parallel_tool_calls"),
    (_create(max_output_tokens=0), "invalid_value", "max_output_tokens"),
    (_create(max_output_tokens=1_000_001), "invalid_value", "max_output_tokens"),
    (_create(max_output_tokens="inf"), "invalid_type", "max_output_tokens"),  # Realtime's
    (_create(max_output_tokens=1.5), "invalid_type", "max_output_tokens"),
    (_create(max_output_tokens=True), "invalid_type", "max_output_tokens"),
    (_create(temperature="hot"), "invalid_type", "temperature"),
    (_create(temperature=2.5), "invalid_value", "temperature"),
    (_create(top_p=-0.1), "invalid_value", "top_p"),
    (_create(frequency_penalty=3), "invalid_value", "frequency_penalty"),
    (_create(presence_penalty=[]), "invalid_type", "presence_penalty"),
    (_create(metadata={"a": 1}), "invalid_value", "metadata"),
    (_create(metadata=["a"]), "invalid_value", "metadata"),
    (_create(previous_response_id=5), "invalid_type", "previous_response_id"),
    (_create(previous_response_id="r" * 65), "invalid_value", "previous_response_id"),
    (_create(stream_id="lane a"), "invalid_stream_id", "stream_id"),
    (_create(stream_id=""), "invalid_stream_id", "stream_id"),
    (_create(stream_id="s" * 65), "invalid_stream_id", "stream_id"),
    (_create(stream_id=7), "invalid_stream_id", "stream_id"),
    (_create(truncation="sometimes"), "invalid_value", "truncation"),
    (_create(text="plain"), "invalid_type", "text"),
    (
        _create(text={"format": {"type": "json_schema"}}),
        "missing_required_parameter",
        "text.format.name",
    ),
    (_create(text={"format": {"type": "grammar"}}), "invalid_value", "text.format.type"),
    (_create(text={"format": "text"}), "invalid_type", "text.format"),
    # input
    (_create(input=5), "invalid_type", "input"),
    (_create(input={"role": "user"}), "invalid_type", "input"),
    (_create(input=["hi"]), "invalid_type", "input[0]"),
    (_create(input=[message("user", "x")] * 4097), "invalid_value", "input"),
    (_first({"type": "item_reference", "id": "msg_1"}), "unsupported_value", "input[0].type"),
    (_first({"type": "input_image"}), "unsupported_value", "input[0].type"),
    (_first({"type": 3}), "invalid_value", "input[0].type"),
    (_first({"content": "no role, no type"}), "invalid_value", "input[0].type"),
    (_first({"type": "message", "content": "x"}), "missing_required_parameter", "input[0].role"),
    (_first(message("robot", "x")), "invalid_value", "input[0].role"),
    (_first(message(["user"], "x")), "invalid_value", "input[0].role"),
    (
        _first({"type": "message", "role": "user"}),
        "missing_required_parameter",
        "input[0].content",
    ),
    (_first(message("user", [])), "invalid_type", "input[0].content"),
    (_first(message("user", 5)), "invalid_type", "input[0].content"),
    (_first(message("user", ["x"])), "invalid_type", "input[0].content[0]"),
    (
        _first(message("user", [{"text": "x"}])),
        "missing_required_parameter",
        "input[0].content[0].type",
    ),
    (
        _first(message("user", [{"type": "input_image", "image_url": "x"}])),
        "unsupported_value",
        "input[0].content[0].type",
    ),
    (
        _first(message("user", [{"type": "input_file", "file_id": "f"}])),
        "unsupported_value",
        "input[0].content[0].type",
    ),
    (
        _first(message("user", [{"type": "output_text", "text": "x"}])),
        "invalid_value",
        "input[0].content[0].type",
    ),
    (
        _first(message("assistant", [{"type": "input_text", "text": "x"}])),
        "invalid_value",
        "input[0].content[0].type",
    ),
    (
        _first(message("user", [{"type": "input_text"}])),
        "missing_required_parameter",
        "input[0].content[0].text",
    ),
    (
        _first(message("user", [{"type": "input_text", "text": 3}])),
        "invalid_type",
        "input[0].content[0].text",
    ),
    (
        _first(message("assistant", [{"type": "refusal"}])),
        "missing_required_parameter",
        "input[0].content[0].refusal",
    ),
    (_first(message("user", "x", id=5)), "invalid_type", "input[0].id"),
    (_first(message("user", "x", id="i" * 65)), "invalid_value", "input[0].id"),
    # function_call and function_call_output items
    (
        _first({k: v for k, v in _CALL.items() if k != "call_id"}),
        "missing_required_parameter",
        "input[0].call_id",
    ),
    (_first({**_CALL, "call_id": "c" * 65}), "invalid_value", "input[0].call_id"),
    (
        _first({k: v for k, v in _CALL.items() if k != "name"}),
        "missing_required_parameter",
        "input[0].name",
    ),
    (_first({**_CALL, "name": "n" * 65}), "invalid_value", "input[0].name"),
    (_first({**_CALL, "arguments": {}}), "invalid_type", "input[0].arguments"),
    (
        _first({"type": "function_call_output", "call_id": "call_1"}),
        "missing_required_parameter",
        "input[0].output",
    ),
    (
        _first({"type": "function_call_output", "output": "x"}),
        "missing_required_parameter",
        "input[0].call_id",
    ),
    (
        _first({"type": "function_call_output", "call_id": "c", "output": 5}),
        "invalid_type",
        "input[0].output",
    ),
    (
        _first({"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}),
        "invalid_value",
        "input[0].output[0].type",
    ),
    (
        _first({"type": "function_call_output", "call_id": "c", "output": [{"text": "x"}]}),
        "missing_required_parameter",
        "input[0].output[0].type",
    ),
    (
        _first(
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]}
        ),
        "missing_required_parameter",
        "input[0].output[0].text",
    ),
    # tools and tool_choice
    (_create(tools={"name": "f"}), "invalid_type", "tools"),
    (_create(tools=[{"name": "f"}] * 129), "invalid_value", "tools"),
    (_create(tools=["f"]), "invalid_type", "tools[0]"),
    (
        _create(tools=[{"type": "custom", "name": "x", "format": {"type": "json"}}]),
        "invalid_value",
        "tools[0].format.type",
    ),
    (
        _create(tools=[{"type": "custom", "name": "x", "format": {"type": "grammar"}}]),
        "missing_required_parameter",
        "tools[0].format.syntax",
    ),
    (_create(tools=[{"type": "magic"}]), "invalid_value", "tools[0].type"),
    (
        _create(tools=[{"type": "namespace", "name": "n", "description": "", "tools": []}]),
        "invalid_type",
        "tools[0].tools",
    ),
    (
        _create(tools=[{"type": "namespace", "name": "n", "tools": [{"type": "mcp"}]}]),
        "invalid_value",
        "tools[0].tools[0].type",
    ),
    (_create(conversation="conv_1"), "unsupported_value", "conversation"),
    (_create(prompt={"id": "pmpt_1"}), "unsupported_value", "prompt"),
    (_create(input=[{"type": "image_generation_call"}]), "unsupported_value", "input[0].type"),
    (_create(tools=[{"type": "function"}]), "missing_required_parameter", "tools[0].name"),
    (_create(tools=[{"name": "get weather"}]), "invalid_value", "tools[0].name"),
    (_create(tools=[{"name": 5}]), "invalid_type", "tools[0].name"),
    (_create(tools=[{"name": "f"}, {"name": "f"}]), "invalid_value", "tools[1].name"),
    (_create(tools=[{"name": "f", "colour": 1}]), "unknown_parameter", "tools[0].colour"),
    (_create(tools=[{"name": "f", "parameters": "{}"}]), "invalid_type", "tools[0].parameters"),
    (
        _create(tools=[{"name": "f", "parameters": {"type": "string"}}]),
        "invalid_value",
        "tools[0].parameters",
    ),
    (_create(tools=[{"name": "f", "description": 1}]), "invalid_type", "tools[0].description"),
    (_create(tool_choice="sometimes"), "invalid_value", "tool_choice"),
    (_create(tool_choice=5), "invalid_type", "tool_choice"),
    (_create(tool_choice={"type": "file_search"}), "unsupported_value", "tool_choice.type"),
    (_create(tool_choice={"type": "web_search"}), "unsupported_value", "tool_choice.type"),
    (_create(tool_choice={"name": "f"}), "missing_required_parameter", "tool_choice.type"),
    (_create(tool_choice={"type": "function"}), "missing_required_parameter", "tool_choice.name"),
    (
        _create(tool_choice={"type": "function", "name": "auto"}),
        "invalid_value",
        "tool_choice.name",
    ),
    (
        _create(tool_choice={"type": "function", "name": "f", "x": 1}),
        "unknown_parameter",
        "tool_choice.x",
    ),
    # response.cancel
    ('{"type": "response.cancel", "response_id": 7}', "invalid_type", "response_id"),
    ('{"type": "response.cancel", "response": {}}', "unknown_parameter", "response"),
    # response.steer
    (
        '{"type": "response.steer", "input": "x"}',
        "missing_required_parameter",
        "previous_response_id",
    ),
    (
        '{"type": "response.steer", "previous_response_id": "r"}',
        "missing_required_parameter",
        "input",
    ),
    (
        '{"type": "response.steer", "previous_response_id": "r", "input": []}',
        "invalid_value",
        "input",
    ),
    (
        '{"type": "response.steer", "previous_response_id": 1, "input": "x"}',
        "invalid_type",
        "previous_response_id",
    ),
    (
        json.dumps(
            {
                "type": "response.steer",
                "previous_response_id": "r",
                "input": [message("assistant", "x")],
            }
        ),
        "invalid_value",
        "input[0]",
    ),
    (
        json.dumps(
            {
                "type": "response.steer",
                "previous_response_id": "r",
                "input": ["x", {"type": "function_call_output", "call_id": "c", "output": "o"}],
            }
        ),
        "invalid_type",
        "input[0]",
    ),
    (
        json.dumps(
            {
                "type": "response.steer",
                "previous_response_id": "r",
                "input": [
                    message("user", "x"),
                    {"type": "function_call_output", "call_id": "c", "output": "o"},
                ],
            }
        ),
        "invalid_value",
        "input[1]",
    ),
    (
        '{"type": "response.steer", "previous_response_id": "r", "input": "x", "stream_id": "a"}',
        "unknown_parameter",
        "stream_id",
    ),
]


@pytest.mark.parametrize(("frame", "code", "param"), REFUSALS)
def test_each_refusal_names_its_code_and_param(
    frame: str | bytes, code: str, param: str | None
) -> None:
    error = refused(frame)
    assert (error.code, error.param) == (code, param)


def test_the_error_envelope_and_its_http_status() -> None:
    """The Responses envelope: a status, and no event_id (its client events have none)."""
    error = refused(_create(temperature=9))
    assert rs.error_json(error, codec.http_status(error)) == {
        "type": "error",
        "status": 400,
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_value",
            "message": error.message,
            "param": "temperature",
        },
    }


def test_the_http_body_is_read_by_the_same_rules() -> None:
    """``POST /v1/responses`` reads its JSON body with read_create: the same values and
    refusals as the WebSocket event, without the event's ``type``."""
    body = rs.read_create({"input": "hi", "stream": True, "stream_id": "a"})
    assert body.stream and body.stream_id == "a"
    assert [dataclasses.asdict(i) for i in body.input] == [
        {"id": None, "role": "user", "text": "hi"}
    ]
    with pytest.raises(errors.ProtocolError) as info:
        rs.read_create({"input": "hi", "type": "response.create"})
    assert (info.value.code, info.value.param) == ("unknown_parameter", "type")


# -- anything else: a refusal, never the codec's own failure ----------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "input",
        "tools",
        "tool_choice",
        "metadata",
        "text",
        "stream_id",
        "previous_response_id",
        "max_output_tokens",
        "temperature",
        "response_id",
        "role",
        "content",
    ]
)
_items = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "x"]),
        "role": st.sampled_from(["user", "assistant", "developer", "robot"]) | _json,
        "content": _json,
        "call_id": _json,
        "name": _json,
        "arguments": _json,
        "output": _json,
        "id": _json,
    },
)


@settings(max_examples=300, deadline=None)
@given(
    event_type=st.sampled_from(
        ["response.create", "response.cancel", "response.steer", "response.processed"]
    ),
    body=st.dictionaries(_fields | st.text(max_size=12), _json, max_size=4),
    input_items=st.none() | st.lists(_items, max_size=3),
)
def test_random_events_decode_or_are_refused_as_the_clients_fault(
    event_type: str, body: dict[str, Any], input_items: list[dict[str, Any]] | None
) -> None:
    if input_items is not None:
        body["input"] = input_items
    try:
        rs.decode(json.dumps({**body, "type": event_type}))
    except errors.ProtocolError as error:
        # not "invalid_event" as a server_error: that is a validator's own bug
        assert error.error_type == "invalid_request_error", error.message
        assert error.code and error.message
