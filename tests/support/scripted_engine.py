"""A test engine that streams a given script of events (labelled: not a model).

The sim engine makes at most one call per answer, by its fixed rule; a model may
write text and then call several tools in one answer, streaming each call's
arguments in pieces, as OpenAI-compatible servers do. This engine replays such
an answer so the gateway's handling of it can be checked, and records every
request it was given (what a model would have seen in its prompt).
"""

from __future__ import annotations

import asyncio
import json
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

    def check_structure(self, request: GenerationRequest) -> None:
        """A script, not a model: its calls are fixed (and valid for the tools the tests
        offer it, strict ones too), so there is nothing to constrain and nothing refused."""

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


TOOL_COMMAND = "echo codex-tool-ok"


class CodexEngine(StreamingEngine):
    """What Codex needs from a model, deterministically (labelled: not a model).

    Asked to "run the command", it calls ``exec_command`` with :data:`TOOL_COMMAND`, then
    answers with the output it was sent back; asked for "a long answer", it streams slowly
    (for a cancel mid-answer to land in it); else it answers which answer of the thread
    this is and what the user said last. Every request is recorded, and every stream that
    ended before its last event (an abort) in ``aborted``."""

    name = "codex-script"

    def __init__(self, *, step_s: float = 0.002) -> None:
        super().__init__()
        self.step_s = step_s
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.streaming = asyncio.Event()  # set at a long answer's first delta

    def check_structure(self, request: GenerationRequest) -> None:
        """A script, not a model: its calls are fixed (and valid for the tools the tests
        offer it, strict ones too), so there is nothing to constrain and nothing refused."""

    @property
    def capacity(self) -> int:
        return 4

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        self.requests.append(request)
        finished = False
        try:
            async for event in self._answer(request):
                yield event
            finished = True
        finally:
            if not finished:
                self.aborted.append(request.request_id)

    async def _answer(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        users = [m.text for m in request.messages if m.role == "user"]
        last = users[-1] if users else ""
        after_user = request.messages[-1].role
        await asyncio.sleep(self.step_s)
        if "run the command" in last and after_user == "user":
            arguments = json.dumps({"cmd": TOOL_COMMAND})
            yield ToolCallDelta(0, arguments, call_id="call_codex_1", name="exec_command")
            yield Finished("tool_calls", Usage(len(request.messages), 8))
            return
        if after_user == "tool":
            words = ["The", "command", "printed:", request.messages[-1].text.strip()]
        elif "a long answer" in last:
            words = ["word"] * 5000
        else:
            answers = sum(m.role == "assistant" and bool(m.text) for m in request.messages)
            words = [f"Answer {answers + 1}:", "you", "said", repr(last)]
        for index, word in enumerate(words):
            await asyncio.sleep(self.step_s)
            if index == 0 and len(words) > 100:
                self.streaming.set()
            yield TextDelta(word + " ")
        yield Finished("stop", Usage(len(request.messages), len(words)))
