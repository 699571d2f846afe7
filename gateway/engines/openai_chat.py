"""Tools in the OpenAI chat-completions format, shared by the engines that speak it
(``upstream`` over HTTP, ``llamacpp`` in-process).

Pure functions: what a request's tools add to a chat-completions body, and the
:class:`ToolCallDelta` pieces in one streamed ``choices[].delta``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.engines.base import TOOL_CHOICE_MODES, Constraint, GenerationRequest, ToolCallDelta


def tools_body(request: GenerationRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` for the body; nothing when the request has no tools
    (some servers refuse a ``tool_choice`` without tools)."""
    if not request.tools:
        return {}
    choice = request.tool_choice
    return {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": dict(tool.parameters),
                    **({"strict": True} if tool.strict else {}),
                },
            }
            for tool in request.tools
        ],
        "tool_choice": choice
        if choice in TOOL_CHOICE_MODES
        else {"type": "function", "function": {"name": choice}},
    }


def response_format_body(constraint: Constraint | None) -> dict[str, Any]:
    """``response_format`` for a JSON constraint (nothing for none)."""
    if constraint is None:
        return {}
    if constraint.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    schema = json.loads(constraint.definition)
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": constraint.name or "answer", "schema": schema},
        }
    }


def tool_call_deltas(delta: Mapping[str, Any], tokens: int = 1) -> list[ToolCallDelta]:
    """The call pieces in one streamed ``delta``: ``tool_calls[]`` entries carry their
    ``index``, the first one of each call its ``id`` and ``function.name``, and each a
    piece of ``function.arguments``. ``tokens`` is counted once, on the first piece."""
    out: list[ToolCallDelta] = []
    for raw in delta.get("tool_calls") or ():
        if not isinstance(raw, Mapping):
            continue
        function = raw.get("function")
        function = function if isinstance(function, Mapping) else {}
        index = raw.get("index")
        call_id, name = raw.get("id"), function.get("name")
        arguments = function.get("arguments")
        out.append(
            ToolCallDelta(
                index=index if isinstance(index, int) else 0,
                arguments=arguments if isinstance(arguments, str) else "",
                call_id=call_id if isinstance(call_id, str) and call_id else None,
                name=name if isinstance(name, str) and name else None,
                tokens=0 if out else tokens,
            )
        )
    return out
