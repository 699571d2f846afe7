"""An answer checked, at its end, against the structure it was asked for.

For an engine that is asked to constrain but whose compliance the gateway cannot see: an
upstream replica is sent ``response_format``, ``tool_choice``, ``strict`` and
``parallel_tool_calls`` (vLLM, SGLang, llama.cpp's server and trtllm-serve with a guided
decoding backend constrain them), but one that ignores them answers unconstrained with a
200 of its own. So the answer is checked once it ends: its text against the response
format, a call against a required or named choice, each call's arguments against a strict
tool's parameters and a custom tool's input against its grammar. An answer that does not
hold is failed with ``upstream_unconstrained`` instead of being reported complete: never
repaired, never retried. The deltas are only collected (no per-token work beyond an
append), and only for requests that ask for structure.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from gateway.engines import grammars
from gateway.engines.base import (
    TOOL_CHOICE_MODES,
    Constraint,
    EngineError,
    Finished,
    GenerationRequest,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    freeform_input,
)

CODE = "upstream_unconstrained"


async def checked(
    request: GenerationRequest, events: AsyncIterator[StreamEvent]
) -> AsyncIterator[StreamEvent]:
    """``events``, with the answer checked before its :class:`Finished` is handed on."""
    text: list[str] = []
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, ToolCallDelta):
                calls.setdefault(event.index, []).append(event.arguments)
                if event.name:
                    names[event.index] = event.name
            elif isinstance(event, Finished) and event.reason in ("stop", "tool_calls"):
                found = {i: (names.get(i, ""), "".join(parts)) for i, parts in calls.items()}
                violation = _violation(request, "".join(text), found)
                if violation is not None:
                    raise EngineError(
                        CODE,
                        f"the upstream server's answer {violation}: it did not constrain its "
                        "output as asked (serve the model with vLLM, SGLang, llama.cpp's server "
                        "or trtllm-serve with a guided decoding backend)",
                    )
            yield event
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _violation(
    request: GenerationRequest, text: str, calls: dict[int, tuple[str, str]]
) -> str | None:
    choice = request.tool_choice
    if request.tools and choice != "auto" and not calls:
        return "makes no tool call, where one was required"
    if calls and not request.parallel_tool_calls and len(calls) > 1:
        return "makes several tool calls, where parallel_tool_calls is false"
    tools = {t.name: t for t in request.tools}
    for name, arguments in calls.values():
        tool = tools.get(name)
        if tool is None or (choice not in TOOL_CHOICE_MODES and name != choice):
            return f"calls '{name}', which it was not offered"
        if tool.freeform and tool.grammar is not None:
            if not _matches(tool.grammar, freeform_input(arguments)):
                return f"gives the custom tool '{name}' input its grammar does not accept"
        elif tool.strict:
            schema = Constraint("json_schema", json.dumps(dict(tool.parameters)), name)
            if not _matches(schema, arguments):
                return f"calls '{name}' with arguments its parameters do not allow"
    if not calls and request.constraint is not None and not _matches(request.constraint, text):
        return "does not match its response format"
    return None


def _matches(constraint: Constraint, text: str) -> bool:
    if constraint.kind in ("json_object", "json_schema"):
        text = text.strip()  # a JSON text may come with blank lines around it
    return grammars.accepts(grammars.grammar(constraint, lenient=True), text)
