"""Guided decoding on TensorRT-LLM: a request's structure as ``GuidedDecodingParams``.

TensorRT-LLM constrains an answer through ``SamplingParams(guided_decoding=
GuidedDecodingParams(json=... | json_object=True | regex=... | grammar=...))``, and only
when the ``LLM`` was built with ``guided_decoding_backend`` (``xgrammar`` or
``llguidance``, tensorrt_llm/llmapi/llm_args.py): without one it answers unconstrained
(NVIDIA/TensorRT#4855), so the adapter refuses such a request itself, with a 400.

- ``llguidance`` (the default of ``--guided-decoding-backend``): its grammar guide is Lark
  (``LLMatcher.grammar_from_lark``, tensorrt_llm/_torch/pyexecutor/grammar_matcher.py), so
  it takes the gateway's own grammars (gateway/engines/structured.py): response formats,
  enforced tool calls in the gateway's tool format, custom tools' grammars, each compiled
  here first.
- ``xgrammar``: JSON response formats only (``json``, ``json_object``); its grammar guide
  is EBNF, so tool calls cannot be enforced and custom tools' Lark grammars not kept:
  such a request is refused with a 400 that names ``llguidance``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.engines.base import Constraint, GenerationRequest, InvalidRequestError
from gateway.engines.structured import Plan, plan

BACKENDS = ("llguidance", "xgrammar", "none")
DEFAULT_BACKEND = "llguidance"


@dataclass(frozen=True, slots=True)
class Guided:
    """How a request goes to TensorRT-LLM: its prompt plan and its guide's fields."""

    plan: Plan
    guide: dict[str, Any] = field(default_factory=dict)  # GuidedDecodingParams(**guide)


def guided(
    request: GenerationRequest, backend: str | None, *, template_renders_tools: bool
) -> Guided:
    """The request's plan and guide; raises :class:`InvalidRequestError` (a 400) when
    the backend cannot constrain what it asks."""
    structured = request.constraint is not None or (
        bool(request.tools) and (request.enforces_tools or not template_renders_tools)
    )
    if not structured:
        return Guided(Plan(request.messages, native_tools=bool(request.tools)))
    if backend is None:
        raise InvalidRequestError(
            "structured_output_unsupported",
            "the trtllm engine was started with --guided-decoding-backend none, so "
            "TensorRT-LLM cannot constrain its output (a response format, a required or "
            "strict tool call, a custom tool's grammar); it would answer unconstrained",
        )
    if backend == "llguidance":
        the_plan = plan(request, template_renders_tools=template_renders_tools)
        return Guided(the_plan, {"grammar": the_plan.grammar} if the_plan.grammar else {})
    if request.tools:
        raise InvalidRequestError(
            "structured_output_unsupported",
            "with --guided-decoding-backend xgrammar the trtllm engine constrains JSON "
            "response formats without tools only; tools beside a response format, enforced "
            "tool calls and custom tools' grammars need --guided-decoding-backend llguidance",
        )
    assert request.constraint is not None
    return Guided(Plan(request.messages), _json_guide(request.constraint))


def _json_guide(constraint: Constraint) -> dict[str, Any]:
    if constraint.kind == "json_object":
        return {"json_object": True}
    if constraint.kind == "json_schema":
        return {"json": constraint.definition}  # a JSON Schema as text: the real API takes it
    raise InvalidRequestError(
        "structured_output_unsupported",
        "with --guided-decoding-backend xgrammar the trtllm engine takes JSON formats only",
    )
