"""Constraints as grammars in LLGuidance's Lark dialect, compiled here before any engine.

llama.cpp (built with LLGuidance: its ``grammar`` field, when the text starts with
``%llguidance``) and TensorRT-LLM's ``llguidance`` backend (``GuidedDecodingParams(grammar=...)``)
take these grammars as they are. A :class:`~gateway.engines.base.Constraint` becomes a rule
(:func:`rule`): ``%json {schema}`` for JSON, a nested ``%lark {...}`` for a Lark grammar, a
regex terminal for a regex.

Every grammar is compiled with the ``llguidance`` library before it is sent
(:func:`check`): llama.cpp fails open on a grammar LLGuidance cannot compile (it logs the
error and samples unconstrained text, llama.cpp#19051), so a grammar that does not compile
must be refused here, as a 400, and never reach it. Compiling is cached by the grammar's
text, since agent loops send the same schema every turn.

Two liberties are taken with JSON Schemas, each only narrowing what is generated (any
answer still validates against the client's schema): an object that says nothing about
``additionalProperties`` gets none (as vLLM does for LLGuidance), and JSON is written
without free whitespace: a small model left free to add properties or blank lines can
fill its whole budget with them and end with JSON that does not parse.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.engines.base import Constraint, InvalidRequestError

LARK_HEADER = "%llguidance {}\n"
# LLGuidance's JSON options: no free whitespace between tokens (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_ENTRIES = 512
_ANY_OBJECT = '{"type": "object"}'


class GrammarError(InvalidRequestError):
    """The engine's grammar compiler refused a constraint: the client's to fix (a 400)."""


def grammar(constraint: Constraint, *, lenient: bool = False) -> str:
    """A whole answer under ``constraint``, as a Lark grammar. ``lenient``: JSON as the
    schema allows it, any whitespace, no narrowing (to check an answer, not to make one)."""
    return f"{LARK_HEADER}start: answer\n{rule('answer', constraint, lenient=lenient)}"


def rule(name: str, constraint: Constraint, *, lenient: bool = False) -> str:
    """The Lark rule ``name`` matching ``constraint`` (with a newline at its end)."""
    if constraint.kind in ("json_object", "json_schema"):
        definition = constraint.definition if constraint.kind == "json_schema" else _ANY_OBJECT
        body = _lenient_text(definition) if lenient else schema_text(definition)
        return f"{name}: %json {body}\n"
    if constraint.kind == "regex":
        return f"{name}: /{_regex_literal(constraint.definition)}/\n"
    return f"{name}: %lark {{\n{constraint.definition.rstrip()}\n}}\n"


@functools.lru_cache(maxsize=_CACHE_ENTRIES)
def schema_text(definition: str) -> str:
    """A JSON Schema as the ``%json`` body: narrowed as the module docstring says."""
    try:
        schema = json.loads(definition)
    except ValueError as exc:
        raise GrammarError("invalid_json_schema", f"the schema is not JSON: {exc}") from None
    return json_text(schema)


def _lenient_text(definition: str) -> str:
    try:
        schema = json.loads(definition)
    except ValueError as exc:
        raise GrammarError("invalid_json_schema", f"the schema is not JSON: {exc}") from None
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {"whitespace_flexible": True}}
    return json.dumps(schema, ensure_ascii=False)


def json_text(schema: Any) -> str:
    narrowed = _no_extra_properties(schema)
    if isinstance(narrowed, dict):
        options = narrowed.get("x-guidance")
        narrowed["x-guidance"] = {**JSON_OPTIONS, **(options if isinstance(options, dict) else {})}
    return json.dumps(narrowed, ensure_ascii=False, separators=(",", ":"))


def _no_extra_properties(node: Any) -> Any:
    if isinstance(node, list):
        return [_no_extra_properties(item) for item in node]
    if not isinstance(node, Mapping):
        return node
    out = {key: _no_extra_properties(value) for key, value in node.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _regex_literal(pattern: str) -> str:
    """A regex as the body of a Lark ``/.../`` terminal: its slashes escaped."""
    return re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", pattern)


def check(grammar_text: str, subject: str) -> None:
    """Raise :class:`GrammarError` if LLGuidance cannot compile ``grammar_text``;
    ``subject`` names what it constrains in the message ("response_format 'person'")."""
    error = compile_error(grammar_text)
    if error:
        raise GrammarError(
            "invalid_grammar",
            f"The grammar for {subject} does not compile (LLGuidance): {_first_line(error)}",
        )


@functools.lru_cache(maxsize=_CACHE_ENTRIES)
def compile_error(grammar_text: str) -> str:
    """LLGuidance's error for ``grammar_text`` ("" if it compiles); cached by content."""
    import llguidance

    error: str = llguidance.LLMatcher.validate_grammar(grammar_text)
    return error


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else error


def subject(constraint: Constraint) -> str:
    """How a message names what ``constraint`` constrains."""
    if constraint.kind in ("lark", "regex"):
        return f"the custom tool '{constraint.name}'"
    return f"response_format '{constraint.name}'" if constraint.name else "the response format"


def accepts(grammar_text: str, text: str) -> bool:
    """Whether ``text`` is a whole answer ``grammar_text`` accepts (a compiled grammar)."""
    import llguidance

    matcher = llguidance.LLMatcher(byte_tokenizer(), grammar_text, log_level=0)
    consumed = matcher.try_consume_tokens(list(text.encode()))
    return bool(consumed == len(text.encode()) and matcher.is_accepting())


@functools.cache
def byte_tokenizer() -> Any:
    """An LLGuidance tokenizer whose tokens are the 256 bytes (and an end token): what
    walks and checks texts against a grammar without a model's vocabulary."""
    import llguidance

    class Bytes:
        eos_token_id = 256
        bos_token_id = None

        def __init__(self) -> None:
            self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
            self.special_token_ids = [256]

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))
