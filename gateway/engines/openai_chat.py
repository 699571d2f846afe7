"""Tools and log probabilities in the OpenAI chat-completions format, shared by the
engines that speak it (``upstream`` over HTTP, ``llamacpp`` in-process).

Pure functions: what a request's tools and log probabilities add to a chat-completions
body, the :class:`ToolCallDelta` pieces in one streamed ``choices[].delta``, and the
:class:`TokenLogprob` entries in one streamed choice's ``logprobs``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.engines.base import (
    TOOL_CHOICE_MODES,
    Constraint,
    GenerationRequest,
    TokenLogprob,
    ToolCallDelta,
    clamp_logprob,
)


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


def logprobs_body(request: GenerationRequest) -> dict[str, Any]:
    """``logprobs`` and ``top_logprobs`` for a request that asks for log probabilities.
    At least one alternative is asked for: llama.cpp's server reports nothing at all for
    ``top_logprobs: 0``; :func:`choice_logprobs` keeps as many as the request wants."""
    top = request.sampling.logprobs
    if top is None:
        return {}
    return {"logprobs": True, "top_logprobs": max(1, top)}


def choice_logprobs(choice: Mapping[str, Any], top: int) -> tuple[TokenLogprob, ...] | None:
    """The log probabilities one streamed choice carries (its ``logprobs.content``), each
    with at most ``top`` alternatives; None when it carries none."""
    raw = choice.get("logprobs")
    content = raw.get("content") if isinstance(raw, Mapping) else None
    if not isinstance(content, list):
        return None
    return tuple(_token_logprob(entry, top) for entry in content if isinstance(entry, Mapping))


def _token_logprob(entry: Mapping[str, Any], top: int) -> TokenLogprob:
    alternatives = entry.get("top_logprobs")
    tops = alternatives[:top] if isinstance(alternatives, list) and top else ()
    return TokenLogprob(
        *_token(entry),
        tuple(
            TokenLogprob(*_token(alternative))
            for alternative in tops
            if isinstance(alternative, Mapping)
        ),
    )


def _token(entry: Mapping[str, Any]) -> tuple[str, float, bytes]:
    """A token's text, log probability and bytes (its text's UTF-8 where none are given)."""
    token = entry.get("token")
    text = token if isinstance(token, str) else ""
    logprob = entry.get("logprob")
    value = float(logprob) if isinstance(logprob, int | float) else float("-inf")
    raw = entry.get("bytes")
    if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        return text, clamp_logprob(value), bytes(raw)
    return text, clamp_logprob(value), text.encode()
