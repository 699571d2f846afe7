"""The one small interface every engine implements.

An engine never sees a socket or a protocol event: it receives a
:class:`GenerationRequest` (the conversation as plain messages plus sampling
settings) and yields :class:`TextDelta` chunks followed by exactly one
:class:`Finished`. Cancelling the task that iterates :meth:`Engine.stream`
must stop the generation inside the engine (TensorRT-LLM: ``abort()``;
llama.cpp: the stream callback returns ``True``; sim: dropped at the next step).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]

FinishReason = Literal["stop", "length", "tool_calls"]
"""Why a generation ended on its own: natural end / stop sequence, the token budget, or the
model ended its turn by calling tools."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model made: ``arguments`` is its JSON text, as generated."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of the conversation as an engine sees it.

    ``assistant`` turns may carry the tool calls the model made (``text`` may then be
    empty); a ``tool`` turn is the output of one call, ``tool_call_id`` says which.
    """

    role: Role
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; ``parameters`` is a JSON Schema object."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)


ToolChoice = Literal["auto", "none", "required"] | str
"""``auto``, ``none``, ``required``, or the name of the one function the model must call."""

TOOL_CHOICE_MODES = ("auto", "none", "required")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings, always passed explicitly (engines have surprising defaults)."""

    max_output_tokens: int | None = None  # None: as many as the engine allows ("inf")
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    messages: tuple[Message, ...]  # instructions, if any, are the first system message
    sampling: SamplingParams = field(default_factory=SamplingParams)
    affinity_key: str | None = None  # the conversation, for prefix-cache / slot reuse
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int  # tokens of the whole rendered prompt
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    tokens: int = 1  # tokens this text stands for, for usage when a stream is cut short


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a function call's arguments. The first piece of each call (by ``index``,
    counted from 0 within the response) carries its ``call_id`` and ``name``."""

    index: int
    arguments: str
    call_id: str | None = None
    name: str | None = None
    tokens: int = 1


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    usage: Usage


StreamEvent = TextDelta | ToolCallDelta | Finished


class EngineError(Exception):
    """A generation that cannot run or broke; ``code`` is what a program matches on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ContextOverflowError(EngineError):
    """Even the newest message alone does not fit in the context window."""

    def __init__(self, message: str) -> None:
        super().__init__("context_length_exceeded", message)


class EngineUnavailableError(EngineError):
    """The chosen engine cannot run here as configured (a missing package or a required flag).

    Raised by an engine's ``from_args`` or ``start``; the CLI prints the one-line
    message, which says what to install or pass, and exits with status 2.
    """

    def __init__(self, message: str) -> None:
        super().__init__("engine_unavailable", message)


class Engine(abc.ABC):
    """A shared LLM engine. Only the scheduler calls :meth:`stream`."""

    name: str = "engine"
    default_instructions: str = ""  # a session's instructions until it sets its own

    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """How many generations the engine runs at once (the default ``--max-running``)."""

    @property
    def ready(self) -> bool:
        """True once :meth:`start` has finished loading; ``/readyz`` reports it."""
        return self._ready

    _ready: bool = False

    async def start(self) -> None:
        """Load the model. May take long; ``/readyz`` stays 503 until it returns."""
        self._ready = True

    async def close(self) -> None:
        """Release the model; no thread or task of the engine outlives this."""
        self._ready = False

    @abc.abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """Yield deltas then one :class:`Finished`; raise :class:`EngineError` on failure."""

    def describe(self) -> dict[str, object]:
        """Extra facts for logs and ``/healthz`` (model name, context size...)."""
        return {}

    @property
    def context_window(self) -> int | None:
        """Tokens one conversation's prompt and answer may hold, where the engine knows it
        (reported to clients in ``rate_limits.updated``)."""
        return None


def chat_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The messages as OpenAI-style chat dicts, the shape chat templates and servers take.

    An assistant turn with calls carries ``tool_calls`` (``content`` null when it has no
    text); a ``tool`` turn carries the ``tool_call_id`` it answers.
    """
    return [_chat_message(m) for m in messages]


def _chat_message(m: Message) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "tool", "tool_call_id": m.tool_call_id or "", "content": m.text}
    if not m.tool_calls:
        return {"role": m.role, "content": m.text}
    return {
        "role": m.role,
        "content": m.text or None,
        "tool_calls": [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in m.tool_calls
        ],
    }


def fit_to_context(
    messages: Sequence[Message],
    count_tokens: Callable[[Sequence[Message]], int],
    limit: int,
) -> tuple[tuple[Message, ...], int]:
    """Drop the oldest non-system turns until ``messages`` fit in ``limit`` tokens.

    Returns the kept messages and how many were dropped. System messages (the
    instructions) are always kept; the newest message is never dropped, and if it
    cannot fit even alone a :class:`ContextOverflowError` is raised.
    """
    kept = list(messages)
    dropped = 0
    while count_tokens(kept) > limit:
        droppable = [i for i, m in enumerate(kept[:-1]) if m.role != "system"]
        if not droppable:
            raise ContextOverflowError(
                f"the conversation needs {count_tokens(kept)} tokens but only {limit} fit "
                "in the context window after reserving the answer budget"
            )
        # A turn with calls leaves with the outputs that answer them: an output
        # without its call is a prompt that chat templates refuse.
        first = droppable[0]
        end = first + 1
        while end < len(kept) - 1 and kept[end].role == "tool":
            end += 1
        del kept[first:end]
        dropped += end - first
    return tuple(kept), dropped
