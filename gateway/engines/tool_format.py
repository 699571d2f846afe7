"""The gateway's own tool-call format, for calls an engine must enforce or a template lacks.

A chat template that cannot render tools (the bundled SmolLM2's) never shows them to the
model, and a model's own call format cannot be held to a tool's schema, a chosen tool or
a custom tool's grammar. So, as llama.cpp's "generic" tool format did, the tools are
described in the system prompt (:func:`instructions`) and the answer is generated under
a grammar (:func:`grammar`) that admits exactly the calls allowed::

    <tool_call name="get_weather">
    {"city": "Paris"}
    </tool_call>

The arguments of a function are JSON valid against its parameters (``%json``); a custom
(freeform) tool's input is its raw text, under its own grammar when it has one. With
``tool_choice`` ``auto`` the answer may instead be text (or the response format's JSON);
a call always starts the answer. An answer holds one call: a small model asked for
"one or more" repeats the same call until its budget runs out, so this format asks for
one (within ``parallel_tool_calls`` either way); a model whose own template renders tools
makes parallel calls in its own format.

:class:`CallText` turns the streamed text back into text deltas or call deltas, the
arguments streaming as they come. Pure: no engine, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from gateway.engines import grammars
from gateway.engines.base import (
    TOOL_CHOICE_MODES,
    GenerationRequest,
    Message,
    StreamEvent,
    TextDelta,
    Tool,
    ToolCallDelta,
)

OPEN = '<tool_call name="'
CLOSE = "\n</tool_call>"
_HEADER = re.compile(r'<tool_call name="([A-Za-z0-9_-]{1,64})">\n')
_TEXT_RULE = "answer: TEXT?\nTEXT: /[^<][\\s\\S]*/\n"  # text never starts a call


def offered(request: GenerationRequest) -> tuple[Tool, ...]:
    """The tools the model may call: the chosen one, or all of them."""
    choice = request.tool_choice
    if choice in TOOL_CHOICE_MODES:
        return request.tools
    return tuple(t for t in request.tools if t.name == choice)


def instructions(request: GenerationRequest) -> str:
    """The system prompt's part that tells the model its tools and how to call them."""
    lines = [
        "You can call tools. To call one, write exactly:",
        f'{OPEN}TOOL_NAME">',
        "ARGUMENTS",
        CLOSE.lstrip("\n"),
        "ARGUMENTS is a JSON object of the tool's parameters"
        + (
            "; for a tool that takes text input, that text as it is."
            if any(t.freeform for t in request.tools)
            else "."
        ),
        "Tools:",
    ]
    for tool in request.tools:
        lines.append(f"- {tool.name}: {tool.description}".rstrip(": "))
        if tool.freeform:
            about = tool.grammar
            lines.append(
                f"  Text input, matching this {about.kind} grammar:\n{about.definition}"
                if about is not None
                else "  Text input."
            )
        else:
            lines.append(f"  Parameters (JSON Schema): {json.dumps(dict(tool.parameters))}")
    choice = request.tool_choice
    if choice == "required":
        lines.append("Call one of these tools now.")
    elif choice not in TOOL_CHOICE_MODES:
        lines.append(f"Call {choice} now.")
    else:
        lines.append("Call a tool when it helps answer; otherwise answer in text.")
    return "\n".join(lines)


def with_instructions(messages: Sequence[Message], text: str) -> tuple[Message, ...]:
    """``messages`` with ``text`` ending the first system message (or as one, first)."""
    out = list(messages)
    for index, message in enumerate(out):
        if message.role == "system":
            out[index] = Message("system", f"{message.text}\n\n{text}".lstrip())
            return tuple(out)
    return (Message("system", text), *out)


def grammar(request: GenerationRequest) -> str:
    """The Lark grammar of the answers allowed: one call of an offered tool or, with
    ``auto``, an answer instead."""
    tools = offered(request)
    parts = [grammars.LARK_HEADER]
    if request.tool_choice == "auto":
        parts.append("start: answer | call\n")
        answer = request.constraint
        parts.append(grammars.rule("answer", answer) if answer is not None else _TEXT_RULE)
    else:
        parts.append("start: call\n")
    parts.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))) + "\n")
    for index, tool in enumerate(tools):
        parts.append(_call_rule(index, tool))
    return "".join(parts)


def _call_rule(index: int, tool: Tool) -> str:
    header = json.dumps(f'{OPEN}{tool.name}">\n')
    close = json.dumps(CLOSE)
    if tool.freeform and tool.grammar is None:
        # Free text up to the closing tag (lazy: the first one ends it).
        return (
            f"call_{index}: {header} free_{index}\n"
            f"free_{index}[lazy]: /[\\s\\S]*\\n<\\/tool_call>/\n"
        )
    body = (
        grammars.rule(f"args_{index}", tool.grammar)
        if tool.grammar is not None
        else f"args_{index}: %json {grammars.json_text(dict(tool.parameters))}\n"
    )
    return f"call_{index}: {header} args_{index} {close}\n{body}"


def check(request: GenerationRequest) -> str:
    """The request's tool grammar, compiled (raises GrammarError if it does not)."""
    text = grammar(request)
    grammars.check(text, _subject(request))
    return text


def _subject(request: GenerationRequest) -> str:
    names = ", ".join(t.name for t in offered(request))
    return f"the tools ({names})"


class CallText:
    """Feed it the generated text; it returns text deltas, or the calls' deltas as their
    arguments stream. A call is recognised only at the start of the answer (the grammar
    makes it so)."""

    def __init__(self, request: GenerationRequest) -> None:
        self._request_id = request.request_id
        self._freeform = {t.name for t in request.tools if t.freeform}
        self._buffer = ""
        self._mode: str | None = None  # "text", "calls"; None until the first character
        self._call: ToolCallDelta | None = None  # the call being streamed
        self.calls = 0

    def feed(self, text: str) -> list[StreamEvent]:
        if self._mode == "text":
            return [TextDelta(text)] if text else []
        self._buffer += text
        if self._mode is None:
            start = self._buffer.lstrip()
            if not start:
                return []
            if not OPEN.startswith(start[: len(OPEN)]):
                self._mode, text, self._buffer = "text", self._buffer, ""
                return [TextDelta(text)]
            if len(start) < len(OPEN):
                return []
            self._mode, self._buffer = "calls", start
        return self._calls()

    def finish(self) -> list[StreamEvent]:
        """At the end: text held back, or the rest of a call cut short."""
        if self._mode != "calls":
            rest, self._buffer = self._buffer, ""
            return [TextDelta(rest)] if rest else []
        events = self._calls()
        if self._call is not None and self._buffer:
            events.append(self._piece(self._buffer))
            self._buffer = ""
        return events

    def _calls(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            if self._call is None:
                found = _HEADER.match(self._buffer.lstrip("\n"))
                if found is None:
                    return events
                self._buffer = self._buffer.lstrip("\n")[found.end() :]
                events.append(self._open(found.group(1)))
            end = self._buffer.find(CLOSE)
            if end < 0:
                keep = _partial_suffix(self._buffer, CLOSE)
                body, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                if body:
                    events.append(self._piece(body))
                return events
            if end:
                events.append(self._piece(self._buffer[:end]))
            events.append(self._close())
            self._buffer = self._buffer[end + len(CLOSE) :]

    def _open(self, name: str) -> ToolCallDelta:
        index = self.calls
        self.calls += 1
        digest = hashlib.sha256(f"{self._request_id}/{index}".encode()).hexdigest()
        opening = '{"input": "' if name in self._freeform else ""
        self._call = ToolCallDelta(index, opening, call_id=f"call_{digest[:24]}", name=name)
        return self._call

    def _piece(self, text: str) -> ToolCallDelta:
        assert self._call is not None
        if self._call.name in self._freeform:
            text = json.dumps(text, ensure_ascii=False)[1:-1]
        return ToolCallDelta(self._call.index, text, tokens=0)

    def _close(self) -> ToolCallDelta:
        assert self._call is not None
        call, self._call = self._call, None
        return ToolCallDelta(call.index, '"}' if call.name in self._freeform else "", tokens=0)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
