"""The pure parts of structured output: the gateway's tool format (its grammar accepts
what its parser reads back, in any split of the stream), the grammars' narrowing, and
the sim's instances (each valid for its schema, with a real JSON Schema validator)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.engines import grammars, instances, tool_format
from gateway.engines.base import (
    Constraint,
    GenerationRequest,
    Message,
    TextDelta,
    Tool,
    ToolCallDelta,
)
from tests.test_structured_llamacpp import SCHEMAS

WEATHER = Tool(
    "get_weather",
    "The weather.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
NOTE = Tool("note", "Write a note.", freeform=True)
PATCH = Tool(
    "patch",
    "Edit.",
    freeform=True,
    grammar=Constraint("lark", 'start: "*** Begin\\n" LINE+ "*** End"\nLINE: /[+-][a-z ]*\\n/\n'),
)


def request(*tools: Tool, choice: str = "auto") -> GenerationRequest:
    return GenerationRequest("r", (Message("user", "hi"),), tools=tools, tool_choice=choice)


def parse(req: GenerationRequest, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = tool_format.CallText(req)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            calls.setdefault(e.index, []).append(e.arguments)
            names[e.index] = e.name or names.get(e.index, "")
    return text, [(names[i], "".join(parts)) for i, parts in calls.items()]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


CALL = '<tool_call name="get_weather">\n{"city": "Paris"}\n</tool_call>'
FREE = '<tool_call name="note">\nbuy "milk"\nand bread\n</tool_call>'


@given(st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_a_call_reads_back_whatever_the_stream_pieces(cuts: list[int]) -> None:
    req = request(WEATHER, NOTE)
    assert parse(req, split(CALL, cuts)) == ("", [("get_weather", '{"city": "Paris"}')])
    _, [(name, arguments)] = parse(req, split(FREE, cuts))
    assert name == "note" and json.loads(arguments) == {"input": 'buy "milk"\nand bread'}
    text = "  The weather is <b>fine</b>."
    assert parse(req, split(text, cuts)) == (text, [])


@pytest.mark.parametrize("choice", ["auto", "required", "get_weather", "patch"])
def test_the_grammar_accepts_what_the_parser_reads(choice: str) -> None:
    req = request(WEATHER, NOTE, PATCH, choice=choice)
    text = tool_format.check(req)  # compiles
    answers = {
        "get_weather": CALL,
        "patch": '<tool_call name="patch">\n*** Begin\n+hello\n*** End\n</tool_call>',
    }
    for name, answer in answers.items():
        allowed = choice in ("auto", "required", name)
        assert grammars.accepts(text, answer) is allowed, (choice, name)
    assert grammars.accepts(text, "Just text.") is (choice == "auto")
    assert not grammars.accepts(text, '<tool_call name="get_weather">\n{"town": 1}\n</tool_call>')
    assert not grammars.accepts(text, '<tool_call name="patch">\nnot a patch\n</tool_call>')


def test_the_schema_is_narrowed_never_widened() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    narrowed = grammars.grammar(Constraint("json_schema", json.dumps(schema), "a"))
    lenient = grammars.grammar(Constraint("json_schema", json.dumps(schema), "a"), lenient=True)
    assert grammars.accepts(narrowed, '{"a": "x"}')
    assert not grammars.accepts(narrowed, '{"a": "x", "b": 1}')  # no extra properties
    assert not grammars.accepts(narrowed, '{ "a" : "x" }')  # no free whitespace
    assert grammars.accepts(lenient, '{ "a" : "x", "b": 1 }')  # what the schema allows
    slash = grammars.grammar(Constraint("regex", "a/b"))
    assert grammars.accepts(slash, "a/b") and not grammars.accepts(slash, "ab")


def test_a_grammar_that_does_not_compile_is_refused_with_its_reason() -> None:
    with pytest.raises(grammars.GrammarError, match="does not compile"):
        tool_format.check(request(Tool("p", freeform=True, grammar=Constraint("lark", "start: ("))))


@pytest.mark.parametrize(("prompt", "schema"), SCHEMAS, ids=[p for p, _ in SCHEMAS])
def test_the_sims_instance_of_each_schema_validates(prompt: str, schema: dict[str, object]) -> None:
    value = json.loads(instances.json_text(json.dumps(schema), (prompt,)))
    jsonschema.validate(value, schema)


def test_the_sims_grammar_input_is_accepted_and_the_same_each_time() -> None:
    assert PATCH.grammar is not None
    first = instances.text_instance(PATCH.grammar, seed="x")
    assert first == instances.text_instance(PATCH.grammar, seed="x")
    assert grammars.accepts(grammars.grammar(PATCH.grammar), first)
