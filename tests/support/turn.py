"""One response as a client saw it: its events, from its first to its terminal one.

Both raw clients collect into it: the Realtime one (tests/support/harness.py), whose
responses end in ``response.done``, and the Responses one
(tests/support/responses_harness.py), whose end in ``response.completed``,
``response.incomplete`` or ``response.failed``. Both dialects stream text as
``response.output_text.delta`` events and end a text part with
``response.output_text.done``, and both terminal events carry the response object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DELTA = "response.output_text.delta"
TEXT_DONE = "response.output_text.done"


@dataclass
class Turn:
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def terminal(self) -> dict[str, Any]:
        """The response's last event: its ``response.done`` (Realtime) or its
        ``response.completed`` / ``incomplete`` / ``failed`` (Responses)."""
        return self.events[-1]

    @property
    def response(self) -> dict[str, Any]:
        response: dict[str, Any] = self.terminal["response"]
        return response

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def status(self) -> str:
        return str(self.response["status"])

    @property
    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    @property
    def deltas(self) -> list[str]:
        """Each text delta, in the order received."""
        return [e["delta"] for e in self.events if e["type"] == DELTA]

    @property
    def text(self) -> str:
        """The deltas joined."""
        return "".join(self.deltas)

    @property
    def final_text(self) -> str:
        """The text of the response's first ``response.output_text.done``; there must be one."""
        texts = [e["text"] for e in self.events if e["type"] == TEXT_DONE]
        assert texts, f"no {TEXT_DONE} in {self.types}"
        return str(texts[0])

    @property
    def done_text(self) -> str:
        """The texts of every ``response.output_text.done``, joined ("" without one)."""
        return "".join(e["text"] for e in self.events if e["type"] == TEXT_DONE)

    @property
    def output_text(self) -> str:
        """The text of the message items of the terminal event's response object."""
        return "".join(
            part["text"]
            for item in self.response["output"]
            if item["type"] == "message"
            for part in item["content"]
        )
