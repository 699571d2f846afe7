"""The one small interface every engine implements.

An engine never sees a socket or a protocol event. The scheduler hands it a
:class:`GenerationRequest` (the conversation as plain messages plus sampling
settings, or a raw prompt that no chat template touches) with :meth:`Engine.submit`,
and may stop it with
:meth:`Engine.abort`; the engine reports what each step produced, for all its
requests at once, into :attr:`Engine.outputs`: text (and tool-call) deltas,
then exactly one :class:`Finished` or :class:`EngineError` per request. One
central scheduler task drains that channel and fans each batch out.

Log probabilities ride only on requests that ask for them, so that the common
output, a plain ``str`` (one token of text), stays the whole cost of a token:

- ``SamplingParams.logprobs = N`` (0-20) asks for every generated token's log
  probability and its ``N`` most likely alternatives. Every text output of such a
  request is then a :class:`TextDelta` whose ``logprobs`` holds one
  :class:`TokenLogprob` per token the text stands for, in order (``()`` where its
  tokens were reported with earlier text); a request that asked for none gets
  ``logprobs=None`` deltas or plain strings. Joined, a response's deltas' logprobs
  are its answer's, whatever merged them on the way (the scheduler's fan-out, a
  lagging reader's outbox): merging concatenates, in order.
- ``SamplingParams.prompt_logprobs = N`` asks for the prompt's own tokens (a legacy
  ``echo`` with ``logprobs``): one :class:`PromptLogprobs` output, before the first
  delta.
- An engine that cannot report what a request asks refuses it before admission
  (:meth:`Engine.check` raises :class:`LogprobsUnsupportedError`: the client gets a
  400 that says so), or, where it learns it only from its backend (an upstream
  replica), ends it with that error; it never answers with an empty list.

``abort`` must stop the generation inside the engine (TensorRT-LLM:
``RequestOutput.abort()``; llama.cpp: the stream callback returns ``True``;
upstream: the HTTP stream is closed; sim: dropped at the next step).
Engines whose API is one async iterator per request implement
:class:`StreamingEngine` instead, which turns those iterators into the channel.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant", "tool"]

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]
"""Why a generation ended: natural end / stop sequence, the token budget, the model ended
its turn by calling tools, or :meth:`Engine.abort` stopped it."""


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


ConstraintKind = Literal["json_object", "json_schema", "lark", "regex"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What generated text must match: any JSON object, a JSON Schema, a Lark grammar
    (LLGuidance's dialect) or a regular expression. Each engine asks its own constrained
    decoder for it (gateway/engines/grammars.py) or refuses the request; it never
    generates unconstrained text instead.

    ``definition`` is the schema as JSON text, the grammar or the regex (empty for
    ``json_object``): text, so that what the engines compile is cached by content.
    """

    kind: ConstraintKind
    definition: str = ""
    name: str = ""  # the schema's or the tool's name, for messages


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; ``parameters`` is a JSON Schema object.

    ``strict``: its arguments must be valid against ``parameters`` whenever it is called.
    ``freeform``: a custom tool, whose input is free text (its arguments are
    ``{"input": TEXT}``, as the dialects offer it); ``grammar``: what that text must match.
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    strict: bool = False
    freeform: bool = False
    grammar: Constraint | None = None


def freeform_input(arguments: str) -> str:
    """A custom (``freeform``) tool call's input: the ``input`` of its whole arguments, or
    the arguments themselves when the model wrote something else."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    found = value.get("input") if isinstance(value, dict) else None
    return found if isinstance(found, str) else arguments


ToolChoice = Literal["auto", "none", "required"] | str
"""``auto``, ``none``, ``required``, or the name of the one function the model must call."""

TOOL_CHOICE_MODES = ("auto", "none", "required")


MAX_TOP_LOGPROBS = 20  # the most alternatives a token's log probability comes with (OpenAI's)
MIN_LOGPROB = -9999.0  # OpenAI's value for a token too unlikely to rank among the top 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings, always passed explicitly (engines have surprising defaults)."""

    max_output_tokens: int | None = None  # None: as many as the engine allows ("inf")
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # OpenAI Chat Completions' penalties, -2.0..2.0 (None: the engine's own default).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # Log probabilities (see the module docstring). None asks for none; N (0 to
    # MAX_TOP_LOGPROBS): each generated token's, with its N most likely alternatives.
    logprobs: int | None = None
    # The prompt's own tokens' (a legacy echo), with N alternatives each; None: none.
    prompt_logprobs: int | None = None


Prompt: TypeAlias = str | tuple[int, ...]
"""A raw prompt: text the engine tokenizes as it is, or the token ids themselves."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    messages: tuple[Message, ...]  # instructions, if any, are the first system message
    sampling: SamplingParams = field(default_factory=SamplingParams)
    affinity_key: str | None = None  # the conversation, for prefix-cache / slot reuse
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    # The answer so far, sent by a gateway that has since stopped (a takeover: see
    # sessions/snapshot.py): the engine continues it, its deltas are only what follows.
    # Only an engine whose ``continues`` says so is given one.
    continuation: str = ""
    # The token ids that text was generated from, where the engine reported them
    # (TextDelta.token_ids: TensorRT-LLM), so that it continues from exactly those tokens.
    continuation_token_ids: tuple[int, ...] = ()
    # A raw prompt (the Completions API's): sent as it is, with no chat template, no
    # instructions and nothing dropped to fit; ``messages`` is then empty. A prompt that
    # does not fit the context window fails with ContextOverflowError.
    prompt: Prompt | None = None
    # Text the answer must lead into (fill in the middle, after ``prompt``); only engines
    # whose ``can_fill_in_middle`` is true are given one.
    suffix: str | None = None
    # W3C Trace Context fields (traceparent, tracestate) naming the gateway's span for this
    # answer (or the client's, when the gateway exports no traces): an engine that sends
    # the generation to a server passes them on, so that its trace joins the client's.
    trace_context: tuple[tuple[str, str], ...] = ()
    # What the answer's text must match (a response format), or None: free text.
    constraint: Constraint | None = None
    parallel_tool_calls: bool = True  # False: at most one call

    @property
    def enforces_tools(self) -> bool:
        """Whether a call must be made, or made valid, by constrained decoding: a required
        or named choice, a strict tool, or a custom tool's grammar."""
        if not self.tools:
            return False
        return self.tool_choice != "auto" or any(
            t.strict or t.grammar is not None for t in self.tools
        )

    @property
    def asks_structure(self) -> bool:
        """Whether the answer must be constrained: a response format, or enforced tools."""
        return self.constraint is not None or self.enforces_tools


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int  # tokens of the whole rendered prompt
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token with its log probability (``logprob``, natural log, at least
    :data:`MIN_LOGPROB`), as the engine decoded it: ``token`` its text, ``bytes`` its
    UTF-8 bytes (a token that is part of a character has bytes that are no text of their
    own), and ``top`` the most likely tokens at its position, most likely first, as many
    as the request asked for (each a ``TokenLogprob`` with no ``top`` of its own)."""

    token: str
    logprob: float
    bytes: bytes
    top: tuple[TokenLogprob, ...] = ()


def clamp_logprob(value: float) -> float:
    """``value`` as OpenAI reports it: never below :data:`MIN_LOGPROB` (-inf, a zero
    probability, has no JSON form; NaN becomes it too)."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    tokens: int = 1  # tokens this text stands for, for usage when a stream is cut short
    # The ids of the tokens this text was decoded from, from an engine that continues an
    # answer from its token ids (TensorRT-LLM); kept in the store's log with the delta.
    token_ids: tuple[int, ...] = ()
    # The log probabilities of the tokens this text stands for, in order, when the request
    # asked for them (SamplingParams.logprobs); None when it did not. Their tokens' texts,
    # joined, are ``text`` where the engine reports a token per piece of text.
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt's own tokens (SamplingParams.prompt_logprobs), reported once, before the
    first delta: ``first`` is the prompt's first token, which nothing before it predicts
    (it has no log probability: the legacy shape's ``null``); ``tokens`` are the others,
    in order, each with its log probability given the tokens before it."""

    first: str
    tokens: tuple[TokenLogprob, ...]


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


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """The prompt's token counts, reported as soon as the engine knows them, so that an
    answer cut short (cancelled, failed) still reports what its prompt cost."""

    input_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Moved:
    """The answer moved to another replica mid-stream (an engine with replicas): it goes
    on there from its text so far. The scheduler counts it; the answer's log line and
    span say so."""


StreamEvent = TextDelta | ToolCallDelta | PromptTokens | PromptLogprobs | Moved | Finished
"""What :meth:`StreamingEngine.stream` yields."""


class EngineError(Exception):
    """A generation that cannot run or broke; ``code`` is what a program matches on.

    ``error_type`` is the protocol error type the client sees: ``server_error`` unless
    the request itself was at fault (see :class:`InvalidRequestError`).
    """

    error_type: str = "server_error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Output: TypeAlias = (
    str | TextDelta | ToolCallDelta | PromptTokens | PromptLogprobs | Moved | Finished | EngineError
)
"""What an engine reports for one request. A plain ``str`` is one token of text (the
common case, kept cheap); every request ends with one ``Finished`` or ``EngineError``."""

StepOutput: TypeAlias = tuple[str, Output]
"""``(request_id, output)``."""


class InvalidRequestError(EngineError):
    """The engine refused what the client asked for (e.g. a conversation the model's chat
    template rejects); the client can fix it, so it is an ``invalid_request_error``."""

    error_type = "invalid_request_error"


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Refuse a prompt's token id that the model has no embedding for: an engine would
    fail on it (or worse: a GPU kernel's out-of-range read)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            "invalid_value",
            f"The prompt's token id {bad} is outside the model's vocabulary "
            f"(0 to {vocab_size - 1}).",
        )


class LogprobsUnsupportedError(InvalidRequestError):
    """The engine (or the replica it asked) cannot report the log probabilities the request
    asks for: a 400 that says so, never an answer with an empty list."""

    def __init__(self, message: str) -> None:
        super().__init__("unsupported_value", message)


class ContextOverflowError(InvalidRequestError):
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
    """A shared LLM engine, driven by the scheduler alone.

    :meth:`submit` and :meth:`abort` are called on the event loop thread and never
    block; everything the engine produces goes into :attr:`outputs`, in batches.
    """

    name: str = "engine"
    can_continue: bool = False  # takes GenerationRequest.continuation
    can_fill_in_middle: bool = False  # takes GenerationRequest.suffix
    reports_logprobs: bool = False  # fills TextDelta.logprobs when a request asks
    reports_prompt_logprobs: bool = False  # reports PromptLogprobs when a request asks
    default_instructions: str = ""  # a session's instructions until it sets its own
    # A session's temperature and top_p until it sets its own (None: the engine's own default).
    default_sampling: SamplingParams = SamplingParams()

    def __init__(self) -> None:
        self.outputs = OutputChannel()
        self._ready = False

    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """How many generations the engine runs at once (the default ``--max-running``)."""

    @property
    def ready(self) -> bool:
        """True once :meth:`start` has finished loading; ``/readyz`` reports it."""
        return self._ready

    _failure: str | None = None
    on_failure: Callable[[str], None] | None = None
    """Called once, on the event loop, when the engine fails for good (see :meth:`_fail`)."""

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer serve at all (a fatal engine error), else None."""
        return self._failure

    def _fail(self, reason: str) -> None:
        """For engines: a fatal error. ``ready`` turns False for good and ``on_failure``
        is told once; ending the engine's live streams is the engine's own job."""
        if self._failure is not None:
            return
        self._failure = reason
        self._ready = False
        if self.on_failure is not None:
            self.on_failure(reason)

    async def start(self) -> None:
        """Load the model. May take long; ``/readyz`` stays 503 until it returns.

        It binds :attr:`outputs` to the running loop, which engines that report from
        threads need before their first ``submit``: overrides call it (or ``bind``).
        """
        self.outputs.bind(asyncio.get_running_loop())
        self._ready = True

    async def close(self) -> None:
        """Release the model; no thread or task of the engine outlives this."""
        self._ready = False

    def check(self, request: GenerationRequest) -> None:
        """Refuse, before it is admitted, what this engine cannot do for ``request``:
        raise :class:`InvalidRequestError` (the client gets a 400 with its message).
        Called on the event loop thread; must not block. The default refuses log
        probabilities an engine does not report (its ``reports_*`` flags), and what
        :meth:`check_structure` refuses."""
        self.check_structure(request)
        sampling = request.sampling
        if sampling.logprobs is not None and not self.reports_logprobs:
            raise LogprobsUnsupportedError(
                f"The {self.name} engine does not report log probabilities."
            )
        if sampling.prompt_logprobs is not None and not self.reports_prompt_logprobs:
            raise LogprobsUnsupportedError(
                f"The {self.name} engine does not report the prompt's log probabilities."
            )

    def continues(self, request: GenerationRequest) -> bool:
        """Whether this engine can go on with ``request``'s answer from the text a stopped
        gateway sent (GenerationRequest.continuation). Never one generated under a grammar:
        the engine's grammar would start again after that text, and the answer, spliced,
        would not hold to it (``{"a": {"a": 1}``)."""
        return self.can_continue and not request.asks_structure

    def check_structure(self, request: GenerationRequest) -> None:
        """Refuse the structure ``request`` asks for (a response format, an enforced tool
        call, a custom tool's grammar) that the engine cannot constrain: an engine must
        refuse, never answer unconstrained. Engines that constrain override it and compile
        what they will be given here (cached by content). This default constrains nothing."""
        if request.asks_structure:
            raise InvalidRequestError(
                "structured_output_unsupported",
                f"the {self.name} engine cannot constrain its output (a response format, "
                "a required or strict tool call, a custom tool's grammar)",
            )

    @abc.abstractmethod
    def submit(self, request: GenerationRequest) -> None:
        """Start generating ``request``. Its outputs follow in :attr:`outputs`: deltas,
        then exactly one terminal :class:`Finished` or :class:`EngineError`."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop generating ``request_id`` at the next step. Its terminal output still
        follows (``Finished("cancelled", ...)`` unless it ended first); unknown ids are
        ignored."""

    def describe(self) -> dict[str, object]:
        """Extra facts for logs and ``/healthz`` (model name, context size...)."""
        return {}

    async def embeddings(self, body: bytes) -> tuple[int, bytes] | None:
        """``POST /v1/embeddings`` passed on as the client sent it: the status and JSON body
        of the answer, or None where the engine serves no embeddings (the default)."""
        return None

    @property
    def context_window(self) -> int | None:
        """Tokens one conversation's prompt and answer may hold, where the engine knows it
        (reported to clients in ``rate_limits.updated``)."""
        return None


class OutputChannel:
    """Where an engine puts what its steps produced; the scheduler's one task drains it.

    Whatever arrives between two wake-ups of that task is handed over as one batch,
    so a step that advances a thousand streams costs one wake-up, not a thousand.
    Engine threads use :meth:`put_threadsafe`, which costs one loop callback per
    burst rather than one per token.
    """

    def __init__(self) -> None:
        self._batch: list[StepOutput] = []
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._from_threads: list[StepOutput] = []
        self._flush_scheduled = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Threads report to ``loop`` from now on (an engine can outlive a loop, as in
        tests: a flush scheduled on a previous loop would never run)."""
        if loop is not self._loop:
            self._loop = loop
            self._flush_threads()

    def put(self, request_id: str, output: Output) -> None:
        """Report one output (event loop thread), after whatever threads reported before."""
        if self._from_threads:
            self._flush_threads()
        self._batch.append((request_id, output))
        self._wake()

    def put_step(self, outputs: list[StepOutput]) -> None:
        """Report a whole step (event loop thread); the list is handed over, not copied."""
        if self._from_threads:
            self._flush_threads()
        if self._batch:
            self._batch += outputs
        else:
            self._batch = outputs
        self._wake()

    def put_threadsafe(self, request_id: str, output: Output) -> bool:
        """Report from any thread. False once the event loop is gone (nobody listens)."""
        with self._lock:
            self._from_threads.append((request_id, output))
            if self._flush_scheduled:
                return True  # one flush per burst, however many threads and tokens
            self._flush_scheduled = True
            loop = self._loop
        assert loop is not None, "start() binds the channel before any submit"
        try:
            loop.call_soon_threadsafe(self._flush_threads)
        except RuntimeError:  # the loop closed under us
            with self._lock:
                self._flush_scheduled = False
            return False
        return True

    async def get(self) -> list[StepOutput]:
        """Everything reported since the last call (waits while there is nothing)."""
        loop = asyncio.get_running_loop()
        self.bind(loop)
        while not self._batch:
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, self._batch = self._batch, []
        return batch

    def _flush_threads(self) -> None:
        # Also called from put(), so that a terminal output the loop puts after a
        # thread's last delta cannot overtake that delta's pending flush.
        with self._lock:
            outputs, self._from_threads = self._from_threads, []
            self._flush_scheduled = False
        if outputs:
            self._batch += outputs
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class StreamingEngine(Engine):
    """Base for engines whose API is one async iterator per request (TensorRT-LLM's
    ``RequestOutput``, an HTTP stream): implement :meth:`stream`.

    Each request is iterated by a task of its own that reports into :attr:`outputs`;
    :meth:`abort` cancels that task, and the stream's cleanup (``finally``) is where
    the engine's own abort must happen.
    """

    def __init__(self) -> None:
        super().__init__()
        self._streams: dict[str, asyncio.Task[None]] = {}

    @abc.abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """Yield deltas then one :class:`Finished`; raise :class:`EngineError` on failure."""

    def submit(self, request: GenerationRequest) -> None:
        rid = request.request_id
        task = asyncio.get_running_loop().create_task(
            self._pump(request), name=f"{self.name}-{rid}"
        )
        self._streams[rid] = task
        task.add_done_callback(lambda _: self._never_ran(rid))

    def _never_ran(self, request_id: str) -> None:
        # abort() before the task's first step: its coroutine never started, so neither
        # did _pump's cleanup. The terminal output is still owed.
        if self._streams.pop(request_id, None) is not None:
            self.outputs.put(request_id, Finished("cancelled", Usage(0, 0)))

    def abort(self, request_id: str) -> None:
        task = self._streams.get(request_id)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Cancel every stream still running and wait until each has cleaned up."""
        tasks = list(self._streams.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await super().close()

    async def _pump(self, request: GenerationRequest) -> None:
        rid, put = request.request_id, self.outputs.put
        terminal: Output = EngineError(
            "engine_error", "the engine stream ended without a finish reason"
        )
        events = self.stream(request)
        try:
            try:
                async for event in events:
                    if isinstance(event, Finished):
                        terminal = event
                        break
                    put(rid, event)
            finally:
                # The stream's cleanup (its engine abort) runs here and now, even when
                # this task is cancelled or the stream is left at Finished.
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()
        except asyncio.CancelledError:
            # abort(): the stream is closed (which aborted it in the engine); say so.
            terminal = Finished("cancelled", Usage(0, 0))
        except EngineError as exc:
            terminal = exc
        except Exception as exc:  # an engine bug must not take the gateway down
            log.exception("%s stream for %s crashed", self.name, rid)
            terminal = EngineError("engine_error", f"the engine failed: {exc!r}")
        finally:
            del self._streams[rid]
            put(rid, terminal)


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
