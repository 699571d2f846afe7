"""A test engine that streams a given script of events (labelled: not a model).

The sim engine makes at most one call per answer, by its fixed rule; a model may
write text and then call several tools in one answer, streaming each call's
arguments in pieces, as OpenAI-compatible servers do. This engine replays such
an answer so the gateway's handling of it can be checked, and records every
request it was given (what a model would have seen in its prompt).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from gateway.engines.base import (
    Finished,
    GenerationRequest,
    StreamEvent,
    StreamingEngine,
    TextDelta,
    ToolCallDelta,
    Usage,
)


class ScriptedEngine(StreamingEngine):
    name = "scripted"

    def __init__(self, script: Sequence[StreamEvent], *, step_s: float = 0.001) -> None:
        super().__init__()
        self.script = list(script)
        self.step_s = step_s
        self.requests: list[GenerationRequest] = []

    @property
    def capacity(self) -> int:
        return 4

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        self.requests.append(request)
        tokens = 0
        for event in self.script:
            await asyncio.sleep(self.step_s)
            tokens += event.tokens if isinstance(event, TextDelta | ToolCallDelta) else 0
            yield event
        yield Finished("tool_calls", Usage(len(request.messages), tokens))


def text_then_two_calls() -> list[StreamEvent]:
    """'Let me check both.' then get_weather and get_time, each call's arguments in pieces."""
    return [
        TextDelta("Let me"),
        TextDelta(" check both."),
        ToolCallDelta(0, "", call_id="call_weather", name="get_weather"),
        ToolCallDelta(0, '{"city": '),
        ToolCallDelta(0, '"Paris"}'),
        ToolCallDelta(1, '{"zone": ', call_id="call_time", name="get_time"),
        ToolCallDelta(1, '"CET"}'),
    ]


class ToolLoopEngine(StreamingEngine):
    """Calls each tool of the request once, in order, one per answer, then answers with
    what the tools returned (labelled: not a model). What an agent's multi-step tool loop
    needs from a model, deterministically."""

    name = "tool-loop"

    def __init__(self, *, step_s: float = 0.001) -> None:
        super().__init__()
        self.step_s = step_s
        self.requests: list[GenerationRequest] = []

    @property
    def capacity(self) -> int:
        return 4

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        self.requests.append(request)
        outputs = [m.text for m in request.messages if m.role == "tool"]
        await asyncio.sleep(self.step_s)
        if len(outputs) < len(request.tools):
            tool = request.tools[len(outputs)]
            call_id = f"call_{len(request.messages)}_{tool.name}"
            yield ToolCallDelta(0, '{"city": "Paris"}', call_id=call_id, name=tool.name)
            yield Finished("tool_calls", Usage(len(request.messages), 4))
            return
        answer = "; ".join(outputs) or "Hello."
        for word in answer.split(" "):
            await asyncio.sleep(self.step_s)
            yield TextDelta(word + " ")
        yield Finished("stop", Usage(len(request.messages), len(answer.split(" "))))
