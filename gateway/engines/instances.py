"""Deterministic instances of constraints: what the sim engine answers under one.

:func:`json_instance` builds a value valid against a JSON Schema (types, ``enum``,
``const``, ``anyOf``/``oneOf``, ``allOf`` of objects, ``$ref`` into ``$defs``, arrays
with their bounds, numbers with theirs, string formats; a string ``pattern`` through
:func:`text_instance`). Strings take the words it is given, so an answer says something
about its prompt. :func:`text_instance` walks a Lark grammar or a regex with LLGuidance
over a byte "vocabulary", choosing each byte with a seeded generator, and ends as soon
as the grammar allows. Both are pure functions of their arguments, so tests can check
what the sim answers; a schema or grammar they cannot satisfy raises
:class:`InstanceError` (a 400: the sim engine cannot answer it).
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.engines import grammars
from gateway.engines.base import Constraint, InvalidRequestError

MAX_DEPTH = 12  # past it, only what is required (recursive schemas end)
MAX_TEXT_BYTES = 2048
_FORMATS = {
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "12:00:00",
    "duration": "P1D",
    "email": "user@example.com",
    "hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "uri": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
}
# Bytes a generated text prefers, in this order of classes: readable ones first.
_PRINTABLE = bytes(range(0x20, 0x7F)) + b"\n"


class InstanceError(InvalidRequestError):
    def __init__(self, message: str) -> None:
        super().__init__("invalid_json_schema", message)


def json_instance(schema: Mapping[str, Any], words: Sequence[str]) -> Any:
    """A value valid against ``schema``, its strings made of ``words``."""
    return _Builder(schema, list(words) or ["text"]).value(schema, 0)


@functools.lru_cache(maxsize=256)
def json_text(definition: str, words: tuple[str, ...]) -> str:
    """:func:`json_instance` of a schema given as JSON text, as JSON text (cached)."""
    try:
        schema = json.loads(definition)
    except ValueError as exc:
        raise InstanceError(f"the schema is not JSON: {exc}") from None
    return json.dumps(json_instance(schema, words), ensure_ascii=False)


class _Builder:
    def __init__(self, root: Mapping[str, Any], words: list[str]) -> None:
        self.root = root
        self.words = words
        self.turn = 0

    def value(self, node: Any, depth: int) -> Any:
        if node is True or node is None or node == {}:
            return self.text({})
        if not isinstance(node, Mapping):
            raise InstanceError(f"the sim engine cannot answer a schema of {node!r}")
        if "$ref" in node:
            return self.value(self.resolve(node["$ref"]), depth)
        if "const" in node:
            return node["const"]
        if isinstance(node.get("enum"), list) and node["enum"]:
            return node["enum"][0]
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key]:
                return self.value(self.choose(node[key], depth), depth)
        if isinstance(node.get("allOf"), list):
            return self.value(self.merged(node), depth)
        kind = node.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind is None:
            kind = "object" if "properties" in node else "string"
        return self.typed(str(kind), node, depth)

    def typed(self, kind: str, node: Mapping[str, Any], depth: int) -> Any:
        if kind == "object":
            return self.object(node, depth)
        if kind == "array":
            return self.array(node, depth)
        if kind == "string":
            return self.text(node)
        if kind == "integer":
            return _integer(node)
        if kind == "number":
            return _number(node)
        if kind == "boolean":
            return True
        if kind == "null":
            return None
        raise InstanceError(f"the sim engine cannot answer a schema of type {kind!r}")

    def object(self, node: Mapping[str, Any], depth: int) -> dict[str, Any]:
        properties = node.get("properties") or {}
        required = set(node.get("required") or ())
        out: dict[str, Any] = {}
        for name, sub in properties.items():
            if depth >= MAX_DEPTH and name not in required:
                continue
            out[name] = self.value(sub, depth + 1)
        for name in required - set(out):  # required but undeclared: any value
            out[name] = self.text({})
        return out

    def array(self, node: Mapping[str, Any], depth: int) -> list[Any]:
        prefix = list(node.get("prefixItems") or ())
        low = int(node.get("minItems", 0 if depth >= MAX_DEPTH else 1))
        high = node.get("maxItems")
        count = max(low, len(prefix) if depth < MAX_DEPTH else 0)
        if high is not None:
            count = min(count, int(high))
        items = node.get("items", {})
        return [
            self.value(prefix[i] if i < len(prefix) else items, depth + 1) for i in range(count)
        ]

    def text(self, node: Mapping[str, Any]) -> str:
        if isinstance(node.get("format"), str) and node["format"] in _FORMATS:
            return _FORMATS[node["format"]]
        if isinstance(node.get("pattern"), str):
            return text_instance(Constraint("regex", node["pattern"]), seed=node["pattern"])
        word = self.words[self.turn % len(self.words)]
        self.turn += 1
        low, high = int(node.get("minLength", 0)), node.get("maxLength")
        while len(word) < low:
            word += " " + word
        return word if high is None else word[: int(high)]

    def choose(self, options: list[Any], depth: int) -> Any:
        """The first option; past the depth limit, the first that cannot recurse."""
        if depth < MAX_DEPTH:
            return options[0]
        for option in options:
            resolved = (
                self.resolve(option["$ref"])
                if isinstance(option, dict) and "$ref" in option
                else option
            )
            if isinstance(resolved, Mapping) and resolved.get("type") in (
                "null",
                "string",
                "integer",
                "number",
                "boolean",
            ):
                return option
        return options[0]

    def merged(self, node: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in node.items() if k != "allOf"}
        for part in node["allOf"]:
            part = self.resolve(part["$ref"]) if isinstance(part, dict) and "$ref" in part else part
            if not isinstance(part, Mapping):
                continue
            for key, value in part.items():
                if key == "properties":
                    out["properties"] = {**out.get("properties", {}), **value}
                elif key == "required":
                    out["required"] = [*out.get("required", []), *value]
                else:
                    out.setdefault(key, value)
        return out

    def resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InstanceError(f"the sim engine cannot follow the reference {ref!r}")
        node: Any = self.root
        for part in (p for p in ref[1:].split("/") if p):
            key = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or key not in node:
                raise InstanceError(f"the reference {ref!r} does not resolve")
            node = node[key]
        return node


def _integer(node: Mapping[str, Any]) -> int:
    """1, or the bound nearest to it (on a ``multipleOf`` step)."""
    low, high = node.get("minimum"), node.get("maximum")
    if node.get("exclusiveMinimum") is not None:
        low = math.floor(node["exclusiveMinimum"]) + 1
    if node.get("exclusiveMaximum") is not None:
        high = math.ceil(node["exclusiveMaximum"]) - 1
    value = 1
    if low is not None:
        value = max(value, math.ceil(low))
    if high is not None:
        value = min(value, math.floor(high))
    step = node.get("multipleOf")
    if isinstance(step, int) and step > 0 and value % step:
        up = value + step - value % step
        value = up if high is None or up <= high else value - value % step
    return value


def _number(node: Mapping[str, Any]) -> float | int:
    if "multipleOf" in node:
        step: float = node["multipleOf"]
        return _integer({**node, "multipleOf": None}) * step
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    value = 1.5
    if low is not None and value <= low:
        value = low + 0.5
    if high is not None and value >= high:
        value = (low + high) / 2 if low is not None else high - 0.5
    return value


def text_instance(constraint: Constraint, *, seed: str) -> str:
    """A text ``constraint`` (a Lark grammar or a regex) accepts, the same for the same
    ``seed``; raises :class:`InstanceError` when none is found within the byte budget."""
    return _walk(grammars.grammar(constraint), seed)


@functools.lru_cache(maxsize=64)
def _walk(grammar_text: str, seed: str) -> str:
    import llguidance

    grammars.check(grammar_text, "the custom tool")
    rng = random.Random(seed)
    matcher = llguidance.LLMatcher(grammars.byte_tokenizer(), grammar_text, log_level=0)
    out = bytearray()
    while len(out) < MAX_TEXT_BYTES:
        if matcher.is_accepting() and (out or rng.random() < 0.5):
            return out.decode("utf-8", errors="replace")
        mask = matcher.compute_logit_bias()  # one byte per token: 0 is not allowed
        allowed = [b for b in _PRINTABLE if mask[b]]
        if not allowed:
            if matcher.is_accepting():
                return out.decode("utf-8", errors="replace")
            break
        # A newline ends a line soon enough (lines of a few words, not of hundreds), and
        # letters come first where they may: readable, if meaningless, input.
        letters = [b for b in allowed if 0x61 <= b <= 0x7A]
        if 0x0A in allowed and rng.random() < 0.1:
            choice = 0x0A
        else:
            choice = rng.choice(letters if letters and rng.random() < 0.8 else allowed)
        matcher.consume_token(choice)
        out.append(choice)
    raise InstanceError("the sim engine found no input within its budget for this grammar")
