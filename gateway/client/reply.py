"""What one answer came to: :class:`Reply` (text, status, usage, timings)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one answer, as the gateway reported them."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    cached_tokens: int = 0

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        if not isinstance(usage, Mapping):
            return None
        details = usage.get("input_token_details")
        cached = details.get("cached_tokens", 0) if isinstance(details, Mapping) else 0
        inp, out = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
        return cls(inp, out, int(usage.get("total_tokens", inp + out)), int(cached or 0))


@dataclass(frozen=True, slots=True)
class Reply:
    """One finished answer.

    ``text`` is everything the gateway generated (for a cancelled answer: the part kept in
    the conversation). ``status`` is ``completed``, ``incomplete`` (``reason`` says why,
    e.g. ``max_output_tokens``), ``cancelled`` or ``failed``. ``time_to_first_token`` and
    ``elapsed`` are seconds measured from sending the question; the former is ``None``
    when no text came at all.
    """

    text: str
    status: str
    usage: Usage | None
    time_to_first_token: float | None
    response_id: str | None
    reason: str | None = None
    elapsed: float = 0.0
    item_id: str | None = None
    metadata: Mapping[str, str] | None = None

    def __str__(self) -> str:
        return self.text


def reply_from_done(
    done: Mapping[str, Any], text: str, time_to_first_token: float | None, elapsed: float
) -> Reply:
    """Read a ``response.done`` event; ``text`` is what arrived as deltas."""
    response = done.get("response")
    body: Mapping[str, Any] = response if isinstance(response, Mapping) else {}
    details = body.get("status_details")
    reason = details.get("reason") if isinstance(details, Mapping) else None
    output = body.get("output")
    item = output[0] if isinstance(output, list) and output else None
    item_id = item.get("id") if isinstance(item, Mapping) else None
    metadata = body.get("metadata")
    return Reply(
        text=text,
        status=str(body.get("status", "completed")),
        usage=Usage.from_json(body.get("usage")),
        time_to_first_token=time_to_first_token,
        response_id=body.get("id") if isinstance(body.get("id"), str) else None,
        reason=reason if isinstance(reason, str) else None,
        elapsed=elapsed,
        item_id=item_id if isinstance(item_id, str) else None,
        metadata=dict(metadata) if isinstance(metadata, Mapping) else None,
    )


def failure_of(done: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(code, message)`` of a failed response, else ``None``."""
    response = done.get("response")
    if not isinstance(response, Mapping) or response.get("status") != "failed":
        return None
    details = response.get("status_details")
    error = details.get("error") if isinstance(details, Mapping) else None
    if not isinstance(error, Mapping):
        return "response_failed", "the answer failed"
    code = error.get("code") or error.get("type") or "response_failed"
    return str(code), str(error.get("message") or "the answer failed")
