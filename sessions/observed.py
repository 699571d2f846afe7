"""What the session core tells gateway/observability/ of an answer: where it came from as it
is admitted, and how it went as it ends. Called twice per answer (never per token), from
the core's response lifecycle (sessions/core.py): the one place every answer of every
dialect begins and ends.
"""

from __future__ import annotations

from typing import Any

from gateway.engines.base import SamplingParams
from gateway.observability import Observability, Record, TraceContext
from gateway.scheduler import Job, Outcome

# An answer's finish reason as the GenAI conventions' gen_ai.response.finish_reasons.
_FINISH = {"completed": "stop", "incomplete": "length", "cancelled": "cancelled", "failed": "error"}


def answer_started(
    observability: Observability,
    origin: Record | None,
    *,
    session_id: str,
    tenant: str,
    response_id: str,
    model: str,
    operation: str,
    sampling: SamplingParams,
    continues: tuple[TraceContext | None, TraceContext | None] | None = None,
) -> Record:
    """The record of an answer admitted now (``continues``: the parent and the span of the
    answer it takes over from a stopped gateway). The choices of one HTTP request share its
    record, named for the first (whose id is the request's answer's)."""
    parent, link = continues if continues is not None else (None, None)
    record = observability.answer(origin, parent=parent, link=link, own=continues is not None)
    record.session_id, record.tenant = session_id, tenant
    record.model, record.operation = model, operation
    if record.response_id is None:
        record.response_id = response_id
        record.request_attributes = request_attributes(sampling)
    if continues is not None:
        record.takeover = True
        record.note("takeover")
    return record


def answer_ended(
    observability: Observability,
    record: Record,
    job: Job,
    outcome: Outcome,
    *,
    calls: bool,
    counts_prompt: bool = True,
) -> None:
    """``record``'s answer is over: its figures, then (the last part to let go) its line.
    The figures add up over a request's choices: every choice's output tokens, the prompt
    tokens of those that count them (``counts_prompt``: as the client's usage counts them),
    the first token and slot of any, each one's finish reason, the worst status."""
    record.answered(outcome.status)
    usage = outcome.usage
    record.output_tokens = (record.output_tokens or 0) + usage.output_tokens
    if counts_prompt:
        record.input_tokens = (record.input_tokens or 0) + usage.input_tokens
        record.cached_tokens = (record.cached_tokens or 0) + usage.cached_tokens
    record.submitted_at = _earliest(record.submitted_at, job.submitted_at)
    record.first_token_at = _earliest(record.first_token_at, job.first_token_at)
    record.slot_at = _earliest(record.slot_at, job.started_at)
    finish = "tool_calls" if calls and outcome.status == "completed" else _FINISH[outcome.status]
    record.finish_reasons += (finish,)
    if outcome.error is not None:
        record.refused(outcome.error.code, None, outcome.error.error_type)
    if outcome.cancel_reason is not None and record.cancel_reason is None:
        record.cancel_reason = outcome.cancel_reason
        at = job.ended_at or job.last_token_at
        record.notes.append(("cancel", at, {"gateway.cancel_reason": outcome.cancel_reason}))
    record.moves += len(job.moves)
    record.notes += [("replica_move", at, {}) for at in job.moves]
    observability.release(record)


def _earliest(a: float, b: float) -> float:
    """The earlier of two times, where 0.0 is "never"."""
    return min(a, b) if a and b else a or b


def request_attributes(s: SamplingParams) -> dict[str, Any]:
    """The sampling fields as the GenAI conventions' ``gen_ai.request.*`` attributes."""
    fields = {
        "gen_ai.request.max_tokens": s.max_output_tokens,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_p": s.top_p,
        "gen_ai.request.seed": s.seed,
        "gen_ai.request.stop_sequences": list(s.stop) or None,
        "gen_ai.request.frequency_penalty": s.frequency_penalty,
        "gen_ai.request.presence_penalty": s.presence_penalty,
    }
    return {k: v for k, v in fields.items() if v is not None}
