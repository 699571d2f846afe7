"""OpenAI's strict subset of JSON Schema, checked before anything is generated.

A ``strict: true`` schema (a ``json_schema`` response format, a strict function's
``parameters``) is held to the rules OpenAI's Structured Outputs apply: the root is an
object; every object lists every one of its properties in ``required`` and sets
``additionalProperties: false``; every schema names its ``type`` (or is an ``anyOf``, an
``enum``, a ``const`` or a ``$ref``); ``allOf``, ``not`` and ``if``/``then``/``else`` are
not permitted; ``$ref`` points into the schema; and the nesting and size limits hold. A
violation is reported in OpenAI's words: ``In context=('properties', 'a'), ...``, the path
to the offending schema. A schema that is not strict is left to the engine's grammar
compiler (gateway/engines/grammars.py). Pure, no I/O; results are cached by content
since agent loops send the same schema every turn.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

MAX_DEPTH = 10  # nesting levels of objects
MAX_PROPERTIES = 5000  # object properties in the whole schema
MAX_ENUM_VALUES = 1000  # enum values in the whole schema
MAX_NAME_CHARS = 120_000  # property names, definition names, enum and const values together
_NOT_PERMITTED = ("allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas")
_UNTYPED = ("anyOf", "enum", "const", "$ref")
_NESTED_MAPS = ("properties", "$defs", "definitions")
_NESTED_ONE = ("items", "additionalProperties")


class _Violation(Exception):
    """One rule the schema breaks, with OpenAI's wording."""


def violation(schema: Mapping[str, Any]) -> str | None:
    """Why ``schema`` is outside OpenAI's strict subset (its message without the
    ``Invalid schema for ...:`` head), or None if it is inside."""
    return _cached(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS))


@functools.lru_cache(maxsize=256)
def _cached(text: bytes) -> str | None:
    try:
        _check(orjson.loads(text))
    except _Violation as why:
        return str(why)
    return None


def _check(schema: Any) -> None:
    if not isinstance(schema, dict):
        raise _Violation("schema must be a JSON Schema object.")
    kind = schema.get("type")
    if kind != "object" or "anyOf" in schema:
        got = "anyOf" if "anyOf" in schema else kind
        raise _Violation(
            f"schema must be a JSON Schema of 'type: \"object\"', got 'type: \"{got}\"'."
        )
    totals = _Totals()
    _walk(schema, (), schema, totals, depth=0)


class _Totals:
    __slots__ = ("chars", "enums", "properties")

    def __init__(self) -> None:
        self.properties = 0
        self.enums = 0
        self.chars = 0


def _walk(
    node: Any, context: tuple[str, ...], root: dict[str, Any], totals: _Totals, depth: int
) -> None:
    if not isinstance(node, dict):
        raise _Violation(f"In context={context!r}, schema must be a JSON Schema object.")
    for key in _NOT_PERMITTED:
        if key in node:
            raise _Violation(f"In context={context!r}, '{key}' is not permitted.")
    if "type" not in node and not any(key in node for key in _UNTYPED):
        raise _Violation(f"In context={context!r}, schema must have a 'type' key.")
    if "$ref" in node:
        _check_ref(node["$ref"], context, root)
    _count_values(node, context, totals)
    types = node.get("type")
    if types == "object" or (isinstance(types, list) and "object" in types):
        depth += 1
        if depth > MAX_DEPTH:
            raise _Violation(
                f"In context={context!r}, objects are nested more than {MAX_DEPTH} levels deep."
            )
        _check_object(node, context, totals)
    for child, where in _children(node, context):
        _walk(child, where, root, totals, depth)


def _check_object(node: dict[str, Any], context: tuple[str, ...], totals: _Totals) -> None:
    if node.get("additionalProperties") is not False:
        raise _Violation(
            f"In context={context!r}, 'additionalProperties' is required to be supplied and "
            "to be false."
        )
    properties = node.get("properties", {})
    if not isinstance(properties, dict):
        raise _Violation(f"In context={context!r}, 'properties' must be an object.")
    required = node.get("required")
    missing = [key for key in properties if not isinstance(required, list) or key not in required]
    if missing:
        raise _Violation(
            f"In context={context!r}, 'required' is required to be supplied and to be an array "
            f"including every key in properties. Missing '{missing[0]}'."
        )
    totals.properties += len(properties)
    totals.chars += sum(len(key) for key in properties)
    if totals.properties > MAX_PROPERTIES:
        raise _Violation(f"The schema has more than {MAX_PROPERTIES} object properties.")


def _count_values(node: dict[str, Any], context: tuple[str, ...], totals: _Totals) -> None:
    values = node.get("enum")
    if values is not None:
        if not isinstance(values, list) or not values:
            raise _Violation(f"In context={context!r}, 'enum' must be a non-empty array.")
        totals.enums += len(values)
        totals.chars += sum(len(v) for v in values if isinstance(v, str))
    if isinstance(node.get("const"), str):
        totals.chars += len(node["const"])
    if totals.enums > MAX_ENUM_VALUES:
        raise _Violation(f"The schema has more than {MAX_ENUM_VALUES} enum values.")
    if totals.chars > MAX_NAME_CHARS:
        raise _Violation(
            f"The schema's property names and enum values are longer than {MAX_NAME_CHARS} "
            "characters in all."
        )


def _check_ref(ref: Any, context: tuple[str, ...], root: dict[str, Any]) -> None:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise _Violation(f"In context={context!r}, '$ref' must point into the schema ('#/...').")
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else ():
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or key not in node:
            raise _Violation(f"In context={context!r}, reference '{ref}' cannot be resolved.")
        node = node[key]


def _children(
    node: dict[str, Any], context: tuple[str, ...]
) -> Iterator[tuple[Any, tuple[str, ...]]]:
    for key in _NESTED_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, child in value.items():
                yield child, (*context, key, name)
    for key in _NESTED_ONE:
        value = node.get(key)
        if isinstance(value, dict):
            yield value, (*context, key)
    for key in ("anyOf", "prefixItems"):
        value = node.get(key)
        if isinstance(value, list):
            for index, child in enumerate(value):
                yield child, (*context, key, str(index))
