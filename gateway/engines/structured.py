"""How an engine with LLGuidance (llama.cpp; TensorRT-LLM's ``llguidance`` backend) is asked
for a request's structure: one :class:`Plan` per request.

- Tools the engine's chat template renders, nothing to enforce, no response format: the
  template's own tool format, as before (``native_tools``).
- Tools otherwise (a template that cannot render them, a required or named choice, a
  strict or custom tool, tools beside a response format): the gateway's own format
  (gateway/engines/tool_format.py): the tools described in the system prompt, the answer
  under its grammar, parsed back into calls.
- A response format alone: the answer under its grammar.

Every grammar is compiled before anything is generated (gateway/engines/grammars.py), so
:func:`plan` raises the 400 an engine's ``check`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engines import grammars, tool_format
from gateway.engines.base import GenerationRequest, Message


@dataclass(frozen=True, slots=True)
class Plan:
    messages: tuple[Message, ...]  # the prompt (with the tools' instructions when generic)
    grammar: str | None = None  # the Lark grammar the answer is generated under
    generic: bool = False  # tools in the gateway's format: parse the answer with CallText
    native_tools: bool = False  # tools go to the engine's chat template as they are


def plan(request: GenerationRequest, *, template_renders_tools: bool) -> Plan:
    """The plan for ``request``; raises ``GrammarError`` (a 400) if a grammar does not
    compile."""
    if request.tools:
        if template_renders_tools and not request.asks_structure:
            return Plan(request.messages, native_tools=True)
        text = tool_format.check(request)
        messages = tool_format.with_instructions(
            request.messages, tool_format.instructions(request)
        )
        return Plan(messages, text, generic=True)
    if request.constraint is not None:
        text = grammars.grammar(request.constraint)
        grammars.check(text, grammars.subject(request.constraint))
        return Plan(request.messages, text)
    return Plan(request.messages)
