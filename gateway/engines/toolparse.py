"""Tool calls in a model's generated text, for engines that hand back text only (trtllm).

A chat template renders the tools into the prompt (``apply_chat_template(..., tools=...)``)
and the model writes its calls as text in its own format. :func:`detect_format` tells
the format from the template; :class:`ToolCallText` turns the streamed text into text
deltas and, at the end, the calls it holds. Supported formats:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
  call (Hermes 2/3, Qwen 2.5 and Qwen 3, and the many templates derived from them);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (Mistral
  v3 templates), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (newer ones);
- ``llama3_json``: the answer is a JSON object ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>`` and several joined by ``;`` (Llama 3.1 to 3.3).

Text before a call streams as usual; from the first sign of a call on, text is held
until the end (text that may be the start of a call marker is held until it is
ruled out). Calls are parsed when the generation ends, each one delta with its whole
arguments. Text that looked like a call but does not parse is handed on as text.
Pure: no engine, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any, Literal

from gateway.engines.base import StreamEvent, TextDelta, ToolCallDelta

ToolFormat = Literal["hermes", "mistral", "llama3_json"]

_MARKERS: dict[ToolFormat, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    # A Llama 3 call is the whole answer: it starts with "{" (or the python tag).
    "llama3_json": ("<|python_tag|>", "{"),
}


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model, if this module knows it."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


class ToolCallText:
    """Feed it text deltas; it returns what can be shown now, and the calls at the end."""

    def __init__(self, fmt: ToolFormat, request_id: str) -> None:
        self.format = fmt
        self._request_id = request_id
        self._text = ""  # everything fed so far
        self._sent = 0  # characters of it handed on as text
        self._call_at: int | None = None  # where a call (probably) begins
        self.calls: list[ToolCallDelta] = []

    def feed(self, delta: str) -> list[StreamEvent]:
        self._text += delta
        if self._call_at is None:
            self._call_at = self._find_call()
        if self._call_at is not None:
            return self._take(len(self._text[: self._call_at].rstrip()))
        # Trailing blanks are held too: before a call they are dropped, not shown.
        return self._take(len(self._text[: len(self._text) - self._partial_marker()].rstrip()))

    def finish(self) -> list[StreamEvent]:
        """At the end of the generation: the held text, or the calls it holds."""
        if self._call_at is None:
            return self._take(len(self._text))
        calls = list(self._parse(self._text[self._call_at :]))
        if not calls:  # it looked like a call but is not one: it was text after all
            return self._take(len(self._text))
        head = self._text[self._sent : self._call_at].rstrip()
        events: list[StreamEvent] = [TextDelta(head)] if head else []
        for index, (name, arguments) in enumerate(calls):
            digest = hashlib.sha256(f"{self._request_id}/{index}".encode()).hexdigest()
            call = ToolCallDelta(index, arguments, call_id=f"call_{digest[:24]}", name=name)
            self.calls.append(call)
            events.append(call)
        self._sent = len(self._text)
        return events

    def _take(self, upto: int) -> list[StreamEvent]:
        if upto <= self._sent:
            return []
        text, self._sent = self._text[self._sent : upto], upto
        return [TextDelta(text)]

    def _find_call(self) -> int | None:
        if self.format == "llama3_json":
            stripped = self._text.lstrip()
            if stripped.startswith(_MARKERS["llama3_json"]):
                return len(self._text) - len(stripped)
            return None
        index = self._text.find(_MARKERS[self.format][0])
        return index if index >= 0 else None

    def _partial_marker(self) -> int:
        """Length of the text's longest suffix that may be the start of a call marker."""
        if self.format == "llama3_json":
            # Only a call at the very start counts: hold the text while it may begin one.
            stripped = self._text.lstrip()
            return len(self._text) if "<|python_tag|>".startswith(stripped) else 0
        marker = _MARKERS[self.format][0]
        for n in range(min(len(marker) - 1, len(self._text)), 0, -1):
            if self._text.endswith(marker[:n]):
                return n
        return 0

    def _parse(self, text: str) -> Iterator[tuple[str, str]]:
        if self.format == "hermes":
            blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL)
            objects = [_json(block) for block in blocks]
        elif self.format == "mistral":
            objects = _mistral(text.removeprefix("[TOOL_CALLS]").strip())
        else:
            body = text.strip().removeprefix("<|python_tag|>")
            objects = [_json(part) for part in body.split(";") if part.strip()]
        for obj in objects:
            call = _call(obj)
            if call is None:
                return  # one broken call: the whole text is handed on as text
            yield call


def _mistral(text: str) -> list[Any]:
    if "[ARGS]" in text:
        parts = text.split("[TOOL_CALLS]")
        out: list[Any] = []
        for part in parts:
            name, _, arguments = part.partition("[ARGS]")
            out.append({"name": name.strip(), "arguments": _json(arguments)})
        return out
    parsed = _json(text)
    return parsed if isinstance(parsed, list) else [parsed]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one parsed call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)
