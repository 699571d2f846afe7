"""Response formats as the dialects read them: what the answer's text must match.

Chat Completions' ``response_format`` and the Responses API's ``text.format`` (its flat
shape) both come down to one :class:`~gateway.engines.base.Constraint` for the engine,
or None for plain text. A ``strict: true`` schema is checked against OpenAI's strict
subset here (sessions/strict_schema.py), before anything is generated; whether the
engine can compile a schema is its own check (``Engine.check``), also before the answer
starts. The format as the client sent it is kept for the ``Response`` object's echo.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.engines.base import Constraint
from sessions import strict_schema
from sessions.codec import JSON, TOOL_NAME, Reader
from sessions.errors import ProtocolError

FORMAT_TYPES = ("text", "json_object", "json_schema")


def read_format(f: Reader, *, nested: bool) -> JSON | None:
    """A format object (``f``): ``{"type": "text"}`` (None), ``json_object``, or
    ``json_schema`` with its fields under ``json_schema`` (Chat: ``nested``) or beside
    ``type`` (Responses). Returned in the Responses API's flat shape (what a ``Response``
    echoes); :func:`constraint` is what the engine is asked for."""
    kind = f.required("type")
    if kind not in FORMAT_TYPES:
        raise f.fail(
            "type",
            f"'{f.param('type')}' must be one of {', '.join(repr(t) for t in FORMAT_TYPES)}.",
        )
    if kind == "text":
        f.only(frozenset({"type"}))
        return None
    if kind == "json_object":
        f.only(frozenset({"type"}))
        return {"type": "json_object"}
    if nested:
        f.only(frozenset({"type", "json_schema"}))
        f.required("json_schema")
        return _schema_format(f.child("json_schema"))
    return _schema_format(f)


_SCHEMA_FIELDS = frozenset({"name", "description", "schema", "strict"})


def constraint(fmt: JSON) -> Constraint:
    """What the engine is asked for, for a format :func:`read_format` gave: a schema's
    JSON text (an empty or absent schema: any JSON object)."""
    schema = fmt.get("schema")
    if fmt["type"] == "json_object" or not schema:
        return Constraint("json_object", name=fmt.get("name", ""))
    return Constraint("json_schema", orjson.dumps(schema).decode(), fmt["name"])


def _schema_format(s: Reader) -> JSON:
    s.only(_SCHEMA_FIELDS | ({"type"} if "type" in s.obj else set()))
    s.required("name")
    name = s.string("name")
    if not TOOL_NAME.fullmatch(name):
        raise s.fail("name", f"'{s.param('name')}' must be 1 to 64 letters, digits, '_' or '-'.")
    description = s.optional_string("description")
    strict = s.optional_boolean("strict")
    schema: Any = s.obj.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise s.fail(
            "schema", f"'{s.param('schema')}' must be a JSON Schema object.", "invalid_type"
        )
    if strict:
        why = strict_schema.violation(schema or {})
        if why is not None:
            raise ProtocolError(
                "invalid_json_schema",
                f"Invalid schema for response_format '{name}': {why}",
                param=s.param("schema"),
                event_id=s.event_id,
            )
    echo: JSON = {"type": "json_schema", "name": name, "schema": schema or {}}
    if description is not None:
        echo["description"] = description
    if strict is not None:
        echo["strict"] = strict
    return echo
