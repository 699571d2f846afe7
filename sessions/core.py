"""The session core: one actor task per session, the only code that changes its state.

The core knows no wire format. It owns the conversation, the responses in flight
(their jobs in the scheduler, their output items, cancel), the inbox and its
backpressure, and the session's life (close, detach, resume token). A *dialect*
(sessions/realtime/dialect.py, sessions/responses/dialect.py) decodes client frames into commands,
handles them against the core's operations, and encodes what the core reports
(:class:`Dialect`'s hooks) into its protocol's events in the outbox.

Its inbox receives decoded client commands (or the protocol errors found while
decoding them) and notices from the scheduler. Text and tool-call deltas are the
one thing that bypasses the inbox: the scheduler calls the sink methods
synchronously on the event loop thread and they put events straight into the
outbox, which keeps a token's trip short. They may open an output item (a
function call, or the message of a response with tools, which opens with its
first text) and insert it into the conversation; no handler of the actor is
running then (handlers never await), so the conversation still has one writer
at a time. Ordering holds because a response's opening events are put in the
outbox before the job's first step can run (``start_response`` runs within a
handler), and its closing events only after the scheduler reports that the job's
stream has ended.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

from gateway.engines.base import (
    Constraint,
    EngineError,
    GenerationRequest,
    InvalidRequestError,
    LogprobsUnsupportedError,
    Message,
    Prompt,
    PromptLogprobs,
    SamplingParams,
    TokenLogprob,
    Tool,
    ToolCallDelta,
    ToolChoice,
    Usage,
)
from gateway.metrics import Metrics
from gateway.observability import Observability, Record, TraceContext
from gateway.scheduler import CancelReason, Job, Outcome, Scheduler
from gateway.tenants import OverLimit
from sessions import codec, errors, observed
from sessions.conversation import Conversation, Item
from sessions.outbox import Outbox, Wire

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SessionLimits:
    max_items: int = 4096
    max_conversation_chars: int = 8 << 20  # bounds memory, and the prompt of every response
    max_unhandled_events: int = 64  # the reader waits beyond this: TCP backpressure
    # --served-model-name: the model names a request may name; empty: any name is served.
    served_models: tuple[str, ...] = ()
    # --hosted-tools: what a Responses request's hosted tools (web_search...) get.
    hosted_tools: str = "ignore"  # left out of the prompt; "refuse": unsupported_value
    # --max-choices: the most answers one Chat Completions or Completions request may ask
    # for (n, best_of, and a Completions request's prompts).
    max_choices: int = 16


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """The defaults of every response (what Realtime's ``session.update`` changes)."""

    model: str = "default"
    instructions: str = ""
    max_output_tokens: int | None = None  # None: "inf"
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"


@dataclass(frozen=True, slots=True)
class ResponseSpec:
    """What a dialect asks the core to generate: the whole prompt, and where it goes."""

    messages: tuple[Message, ...]
    sampling: SamplingParams
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    in_conversation: bool = True  # its output items join the session's conversation
    affinity_key: str | None = None  # the engine keeps this key's cache (its KV slot) warm
    metadata: dict[str, str] | None = None
    tag: object = None  # the dialect's own data for this response (its lane, its body...)
    constraint: Constraint | None = None  # what the answer's text must match
    parallel_tool_calls: bool = True
    # A raw prompt instead of ``messages`` (the Completions API's), and the text its
    # answer leads into (fill in the middle): see GenerationRequest.
    prompt: Prompt | None = None
    suffix: str | None = None
    # The client's field that asked for log probabilities (sampling.logprobs): the param of
    # the 400 an engine that cannot report them answers with.
    logprobs_param: str = "logprobs"
    model: str = ""  # the model the client named ("": the session's)
    # Whether its prompt's tokens count in its request's usage (and access log line): not
    # for a prompt's second and later choices (n, best_of), as OpenAI counts a prompt once.
    counts_prompt: bool = True
    operation: str = "chat"  # what it is, as the GenAI conventions' gen_ai.operation.name

    def request(
        self, response_id: str, trace_context: tuple[tuple[str, str], ...] = ()
    ) -> GenerationRequest:
        """What the engine is asked for this response (``trace_context``: the W3C fields
        that name its trace, for an engine that passes them on)."""
        return GenerationRequest(
            request_id=response_id,
            messages=self.messages,
            sampling=self.sampling,
            affinity_key=self.affinity_key,
            tools=self.tools if self.tool_choice != "none" else (),
            tool_choice=self.tool_choice,
            constraint=self.constraint,
            parallel_tool_calls=self.parallel_tool_calls,
            prompt=self.prompt,
            suffix=self.suffix,
            trace_context=trace_context,
        )


@dataclass(eq=False, slots=True)
class CallState:
    """A function call the model is making: one ``function_call`` output item."""

    item_id: str
    call_id: str
    name: str
    output_index: int
    previous_item_id: str | None
    parts: list[str] = field(default_factory=list)

    @property
    def arguments(self) -> str:
        return "".join(self.parts)


@dataclass(eq=False, slots=True)
class ResponseState:
    """A response in flight, as the dialects see it (only the core changes it)."""

    id: str
    item_id: str  # its message item (opened at creation, or with the first text)
    job: Job
    spec: ResponseSpec
    # What the outbox merges this response's text deltas by and hands to the framing's
    # delta_ids; a dialect may set it in response_started (before any delta).
    delta_key: str = ""
    cancelling: bool = False
    previous_item_id: str | None = None  # where its message item sits in the conversation
    # Output index of the message item; None until it opens. A response that may call
    # tools opens it with its first text, so a response of calls alone has no message.
    text_index: int | None = None
    calls: dict[int, CallState] = field(default_factory=dict)  # by the engine's call index
    outputs: int = 0  # output items opened so far
    last_item_id: str | None = None  # its newest output item, where the next one goes
    prefix: str = ""  # text sent before a takeover (a continued answer's first part)
    prefix_token_ids: tuple[int, ...] = ()  # its tokens, where the engine gave them
    prefix_logprobs: tuple[TokenLogprob, ...] = ()  # their log probabilities, if asked
    record: Record | None = None  # its access log line and span (gateway/observability/)
    # A takeover's: the trace parent and the span of the answer it continues.
    continues: tuple[TraceContext | None, TraceContext | None] | None = None

    @property
    def in_conversation(self) -> bool:
        return self.spec.in_conversation

    @property
    def max_output_tokens(self) -> int | None:
        return self.spec.sampling.max_output_tokens


class Dialect(Protocol):
    """One wire protocol's half of a session: commands in, events out.

    Every method runs on the actor's turn (or, for the output hooks, on the
    scheduler's fan-out call, while no handler runs), so a dialect's own state has
    one writer too. Hooks put events into ``core.outbox``.
    """

    name: str  # its name in sessions/dialects.py's registry and in a stored session

    def decode(self, frame: str | bytes) -> object:
        """One client frame as a command; raises :class:`~sessions.errors.ProtocolError`."""

    def attach(self, core: Session, greet: bool) -> None:
        """Called once, as the session is made; ``greet``: a new session (not one taken
        over from another process), whose greeting event goes first."""

    def handle(self, command: object) -> None:
        """A decoded client command; raises :class:`~sessions.errors.ProtocolError`."""

    def error(self, err: errors.ProtocolError) -> None:
        """Report a refused command (the connection goes on)."""

    def response_started(self, r: ResponseState) -> None:
        """``r`` was admitted; nothing of it was output yet."""

    def response_continued(self, r: ResponseState) -> None:
        """``r``, taken over from a stopped process, goes on here (its events so far were
        sent from there)."""

    def text_opened(self, r: ResponseState) -> None:
        """``r``'s message item opened (output ``r.text_index``)."""

    def text_delta(
        self, r: ResponseState, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> None:
        """Text of a message that is not output 0 (output 0's goes to ``put_delta``), with
        its tokens' log probabilities when the response asked for them."""

    def prompt_logprobs(self, r: ResponseState, logprobs: PromptLogprobs) -> None:
        """The prompt's own log probabilities (``r.spec.sampling.prompt_logprobs`` asked for
        them), before ``r``'s first delta."""

    def call_opened(self, r: ResponseState, call: CallState) -> None: ...

    def call_delta(self, r: ResponseState, call: CallState, arguments: str) -> None: ...

    def response_ended(self, r: ResponseState, outcome: Outcome) -> None:
        """``r`` is over: its closing events and exactly one terminal event."""

    def resumed(self, resume_token: str) -> bytes | None:
        """The encoded event that tells a resuming client it has its session (or None)."""

    def close(self) -> None:
        """The session is closing: end whatever the dialect holds that is not a response."""

    def expire(self) -> None:
        """The connection reached its maximum age (``--responses-max-age``): say so and end
        it. Only Responses connections have one."""

    def dump(self) -> dict[str, Any]:
        """The dialect's own state, as JSON, for a session store (sessions/snapshot.py)."""

    def load(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`dump` gave, on the process that takes the session over."""

    def dump_tag(self, tag: object) -> Any:
        """A response's ``spec.tag`` as JSON."""

    def load_tag(self, data: Any) -> object:
        """The tag :meth:`dump_tag` gave."""


@dataclass(frozen=True, slots=True)
class _JobDone:
    job: Job
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class _Close:
    reason: CancelReason
    code: int
    text: str


@dataclass(frozen=True, slots=True)
class _Overflow:
    """The outbox dropped events it could not hold (see ``Outbox.on_overflow``)."""


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``action`` on the actor's turn (a dialect's own timer or notice)."""

    action: Any


_Inbound = object  # client commands, ProtocolError, _JobDone, _Close, _Overflow, Call


class Inbox(Generic[T]):
    """The actor's mailbox: first in, first out, unbounded, one reader.

    What ``asyncio.Queue`` does for this use, in a list and (while the actor waits)
    one future: an idle session then holds about 3 KiB less than with the spare
    deques and Event every ``asyncio.Queue`` carries, which counts at thousands of
    idle connections. Flow control is the session's own (``deliver``).
    """

    __slots__ = ("_head", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._head = 0  # items before it are taken (dropped once all are, or many)
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> T:
        while self._head == len(self._items):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, head = self._items, self._head
        item, self._head = items[head], head + 1
        if self._head == len(items):
            items.clear()
            self._head = 0
        elif self._head >= 64 and 2 * self._head >= len(items):
            del items[: self._head]  # a busy actor may never see it empty: keep it short
            self._head = 0
        return item


class Session:
    """The protocol-neutral session: see the module docstring."""

    def __init__(
        self,
        scheduler: Scheduler,
        outbox: Outbox,
        dialect: Dialect,
        *,
        config: SessionConfig | None = None,
        limits: SessionLimits | None = None,
        metrics: Metrics | None = None,
        session_id: str | None = None,
        resume_token: str | None = None,
        greet: bool = True,
        tenant: str = "",
        observability: Observability | None = None,
        origin: Record | None = None,
    ) -> None:
        self.id = session_id or codec.new_id("sess")
        # Whose session this is (the key's tenant; "" with no keys): what it stores and
        # resumes is that tenant's alone.
        self.tenant = tenant
        self.conversation_id = codec.new_id("conv")
        self.scheduler = scheduler
        self.outbox = outbox
        self.dialect = dialect
        self.config = config or SessionConfig()
        self.limits = limits or SessionLimits()
        self.metrics = metrics
        # Where each answer's access log line and span go (sessions/observed.py), and the
        # request or connection its answers come from (the one it is on now).
        self.observability = observability
        self.origin = origin
        self._ending_response = False  # response_ended runs: its error is no refusal
        self.conversation = Conversation()
        # Not Inbox[_Inbound](): a generic alias made at run time costs a typing lookup.
        self._inbox: Inbox[_Inbound] = Inbox()
        self._unhandled = 0
        self._room: asyncio.Event | None = None  # made when a reader first has to wait
        self._responses: dict[Job, ResponseState] = {}
        self._closing: _Close | None = None
        self._close_requested = False
        # 192 bits, never logged; made when first asked (a one-shot HTTP answer never is).
        self._resume_token = resume_token
        self._previous_token: str | None = None  # see resume()
        self._expiry: asyncio.TimerHandle | None = None
        # Told after every turn of the actor (a session store saves the session then).
        self.on_change: Callable[[Session], None] | None = None
        self.outbox.on_overflow = self._overflowed
        dialect.attach(self, greet)

    @property
    def resume_token(self) -> str:
        """The secret that proves a client had this session (a resume presents it)."""
        if self._resume_token is None:
            self._resume_token = codec.random_token(24)
        return self._resume_token

    @resume_token.setter
    def resume_token(self, token: str) -> None:
        self._resume_token = token

    # -- inputs (any task) ---------------------------------------------------

    async def deliver(self, command: object) -> None:
        """Queue a client command (or a ProtocolError); waits while too many are
        unhandled (backpressure)."""
        if self._closing is not None:
            return  # nobody will handle it: the actor is ending or gone
        self._unhandled += 1
        self._inbox.put_nowait(command)
        if self._unhandled >= self.limits.max_unhandled_events:
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            await self._room.wait()

    def call_soon(self, action: Any) -> None:
        """Run ``action()`` on the actor's turn: how a dialect's timers change state."""
        self._inbox.put_nowait(Call(action))

    def close(
        self, reason: CancelReason = "disconnected", code: int = 1000, text: str = ""
    ) -> None:
        """End the session: its work is cancelled, then the outbox closes with ``code``."""
        self._close_requested = True
        self._cancel_expiry()
        self._inbox.put_nowait(_Close(reason, code, text))

    @property
    def ending(self) -> bool:
        """Closed, or asked to close: it can no longer be resumed."""
        return self._close_requested

    # -- resuming (the server calls these; no socket is needed here) -----------------

    @property
    def detached(self) -> bool:
        return self._expiry is not None

    def detach(self, window: float) -> None:
        """The socket dropped without a close frame: keep everything for ``window``
        seconds (a response in flight goes on into the outbox), then end."""
        self._cancel_expiry()
        self._expiry = asyncio.get_running_loop().call_later(window, self.close)

    def can_resume(self, token: str, last_sequence_number: int) -> str | None:
        """Why :meth:`resume` would fail now (its error code), or None."""
        if self.ending or not self._token_matches(token):
            return "session_not_found"
        if self.outbox.replay_after(last_sequence_number) is None:
            return "resume_gap"
        return None

    def resume(
        self,
        token: str,
        last_sequence_number: int,
        wire: Wire,
        *,
        rotate: bool = True,
        origin: Record | None = None,
    ) -> str | None:
        """Send to ``wire`` from now on: the dialect's resumed event (if any), then every
        event numbered above ``last_sequence_number``, then live events. None on success,
        else the error code: ``session_not_found`` (ended, or a wrong token: a guess
        learns nothing) or ``resume_gap`` (some of those events are no longer kept).
        ``rotate``: give the session a fresh token (the resumed event carries it).
        ``origin``: the connection (or request) the client resumes on: its answers in
        flight say they were resumed, and the next ones come from it."""
        code = self.can_resume(token, last_sequence_number)
        replay = self.outbox.replay_after(last_sequence_number)
        if code is not None or replay is None:
            return code or "resume_gap"
        self._cancel_expiry()
        if rotate:
            # A fresh token; the one presented stays valid beside it until the client shows
            # it has the fresh one: if this connection drops before the resumed event
            # reaches the client, its next resume (with the token it holds) must still work.
            self._previous_token, self.resume_token = token, codec.random_token(24)
        resumed = self.dialect.resumed(self.resume_token)
        self.outbox.attach(wire, replay if resumed is None else [resumed, *replay])
        if self.metrics is not None:
            self.metrics.replayed_events.inc(len(replay))
        if origin is not None:
            self.origin = origin
            for r in self._responses.values():
                if r.record is not None:
                    r.record.resumes += 1
                    r.record.note("resume")
        return None

    def _token_matches(self, token: str) -> bool:
        # Both compared, in constant time: which one matched (or whether) does not show.
        presented = token.encode()
        current = hmac.compare_digest(presented, self.resume_token.encode())
        previous = self._previous_token is not None and hmac.compare_digest(
            presented, self._previous_token.encode()
        )
        return current or previous

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    @property
    def live_responses(self) -> int:
        return len(self._responses)

    @property
    def responses(self) -> list[ResponseState]:
        """The responses in flight, oldest first."""
        return list(self._responses.values())

    # JobSink: called by the scheduler on the event loop thread.

    def on_delta(self, job: Job, text: str, token_ids: tuple[int, ...] = ()) -> None:
        response = self._responses[job]
        if response.text_index != 0:  # a response with tools: see _text_of_tool_response
            self._text_of_tool_response(response, text, None)
            return
        self.outbox.put_delta(response.delta_key, response.item_id, text, token_ids)

    def on_logprobs_delta(
        self,
        job: Job,
        text: str,
        logprobs: tuple[TokenLogprob, ...],
        token_ids: tuple[int, ...] = (),
    ) -> None:
        response = self._responses[job]
        if response.text_index != 0:
            self._text_of_tool_response(response, text, logprobs)
            return
        self.outbox.put_delta(response.delta_key, response.item_id, text, token_ids, logprobs)

    def on_prompt_logprobs(self, job: Job, logprobs: PromptLogprobs) -> None:
        self.dialect.prompt_logprobs(self._responses[job], logprobs)

    def on_tool_call_delta(self, job: Job, delta: ToolCallDelta) -> None:
        response = self._responses[job]
        call = response.calls.get(delta.index)
        if call is None:
            call = self._open_call(response, delta)
        if delta.arguments:
            call.parts.append(delta.arguments)
            self.dialect.call_delta(response, call, delta.arguments)

    def on_finish(self, job: Job, outcome: Outcome) -> None:
        self._inbox.put_nowait(_JobDone(job, outcome))

    def _overflowed(self) -> None:
        self._inbox.put_nowait(_Overflow())

    # -- the actor -------------------------------------------------------------

    async def run(self) -> None:
        """Handle the inbox until closed and every response has ended."""
        try:
            while self._closing is None or self._responses:
                item = await self._inbox.get()
                with self.scheduler.write_batch:  # its events leave in one write
                    self._handle(item)
                    if self.on_change is not None:
                        self.on_change(self)
        finally:
            # Normally a no-op; if the actor is cancelled or crashes, this is the
            # cleanup that frees its engine work.
            for job in list(self._responses):
                self.scheduler.cancel(job, "disconnected")
        assert self._closing is not None
        self.outbox.close(self._closing.code, self._closing.text)

    def _handle(self, item: _Inbound) -> None:
        if isinstance(item, _Close):
            self._begin_close(item)
            return
        if isinstance(item, _Overflow):
            # Its events were dropped: what is running can never reach the client whole.
            for job in list(self._responses):
                self.scheduler.cancel(job, "disconnected")
            return
        if not isinstance(item, _JobDone | Call):
            self._unhandled -= 1
            if self._room is not None and self._unhandled < self.limits.max_unhandled_events:
                self._room.set()
            if self._closing is not None:
                return
        try:
            if isinstance(item, _JobDone):
                self._job_done(item.job, item.outcome)
            elif isinstance(item, Call):
                item.action()
            elif isinstance(item, errors.ProtocolError):
                raise item
            else:
                self.dialect.handle(item)
        except errors.ProtocolError as err:
            self.error(err)
        except Exception:  # a bug must cost one event, not the connection
            log.exception("session %s failed to handle %r", self.id, item)
            self.error(
                errors.ProtocolError(
                    "internal_error",
                    "The gateway failed to handle this event.",
                    event_id=getattr(item, "event_id", None),
                    error_type="server_error",
                )
            )

    def error(self, err: errors.ProtocolError) -> None:
        """Count ``err`` and let the dialect report it."""
        self.note_refusal(err)
        self.dialect.error(err)

    def note_refusal(self, err: errors.ProtocolError) -> None:
        """Count ``err``, and write it to the access log (an answer's failure, reported as
        it ends, is that answer's line instead)."""
        if self.metrics is not None:
            self.metrics.errors.labels(code=err.code).inc()
        obs = self.observability
        if obs is None or self._ending_response:
            return
        record = obs.refusal(self.origin, err.code, err.param, err.event_id)
        if record is not None:
            record.session_id, record.tenant = self.id, self.tenant
            obs.release(record)

    def _begin_close(self, close: _Close) -> None:
        if self._closing is not None:
            return
        self._closing = close
        if self._room is not None:
            self._room.set()  # a reader waiting to deliver must not wait forever
        self.dialect.close()
        for job in list(self._responses):
            self.scheduler.cancel(job, close.reason)

    @property
    def closing(self) -> bool:
        """The actor has begun to close: no new response can start."""
        return self._closing is not None

    # -- operations for dialects (on the actor's turn) ------------------------------

    def free_item_id(self) -> str:
        """A new server-made item id; checked, since clients choose item ids too."""
        item_id = codec.new_id("item")
        while item_id in self.conversation:
            item_id = codec.new_id("item")
        return item_id

    def start_response(
        self, spec: ResponseSpec, *, response_id: str | None = None
    ) -> ResponseState | None:
        """Admit ``spec`` to the scheduler; None if it is full (the dialect says so).
        Raises :class:`~sessions.errors.ProtocolError` (a 400) for what the engine cannot
        do (``Engine.check``: log probabilities it does not report, ...).

        The dialect's ``response_started`` runs before this returns, and before the
        job's first step can reach the session."""
        self.check_rate_limits(max_output_tokens=spec.sampling.max_output_tokens)
        response_id = response_id or codec.new_id("resp")
        record = self._observe(spec, response_id)
        request = spec.request(response_id, self._trace_context(record))
        try:
            self.scheduler.check(request)
        except InvalidRequestError as exc:
            # Refused before anything is admitted: a 400, never unconstrained text and
            # never an answer without the log probabilities it asked for.
            param = spec.logprobs_param if isinstance(exc, LogprobsUnsupportedError) else None
            if record is not None and self.observability is not None:
                self.observability.not_admitted(record, exc.code, param)
            raise errors.ProtocolError(exc.code, exc.message, param=param) from None
        job = Job(request, session_key=self.id, sink=self, tenant=self.tenant)
        response = ResponseState(response_id, self.free_item_id(), job, spec, response_id)
        response.record = record
        if not self.scheduler.submit(job):
            if record is not None and self.observability is not None:
                self.observability.not_admitted(record, "overloaded")
            return None
        # The job may already be "running", but the engine's output reaches the session
        # only through the scheduler's fan-out task, after this handler returns: these
        # events precede every delta.
        self._responses[job] = response
        self.dialect.response_started(response)
        if not job.request.tools:
            # Without tools the answer is text: its message item opens at once, so even
            # an answer cut before its first token leaves an (incomplete) item.
            self._open_text(response)
            self._direct_text(response)
        return response

    def _direct_text(self, r: ResponseState) -> None:
        """``r``'s text is output 0 and nothing else will be: the scheduler hands its
        deltas to the outbox directly (what :meth:`on_delta` would do, a call less)."""
        r.job.on_text = functools.partial(self.outbox.put_delta, r.delta_key, r.item_id)

    def _observe(
        self,
        spec: ResponseSpec,
        response_id: str,
        continues: tuple[TraceContext | None, TraceContext | None] | None = None,
    ) -> Record | None:
        if self.observability is None:
            return None
        return observed.answer_started(
            self.observability,
            self.origin,
            session_id=self.id,
            tenant=self.tenant,
            response_id=response_id,
            model=spec.model or self.config.model,
            operation=spec.operation,
            sampling=spec.sampling,
            continues=continues,
        )

    def _trace_context(self, record: Record | None) -> tuple[tuple[str, str], ...]:
        if self.observability is None:
            return ()
        return self.observability.trace_fields(record)

    def check_rate_limits(self, answers: int = 1, max_output_tokens: int | None = None) -> None:
        """Raise ``rate_limit_exceeded`` if the session's tenant may not start ``answers``
        answers (each of at most ``max_output_tokens``) now (its key file line's limits:
        gateway/tenants.py)."""
        over = self.scheduler.tenants.refuse_request(self.tenant, answers, max_output_tokens)
        if over is None:
            return
        if self.metrics is not None:
            self.metrics.tenant_refused.labels(tenant=self.tenant, reason="request").inc()
        raise rate_limited(over)

    def affinity(self, key: str | None) -> str | None:
        """A client's cache key (``prompt_cache_key``) as the engine's affinity key: within
        the session's tenant, so that no tenant lands on (or evicts) another's cache."""
        return None if key is None else f"{self.tenant}\x00{key}"

    def continue_response(self, r: ResponseState) -> None:
        """Go on with ``r``, a response a stopped gateway was streaming (a takeover): its
        items are open and ``r.prefix`` was sent; the engine continues from there, or,
        where it cannot (Engine.continues: not every engine can, and none under a
        constraint), the response fails with ``gateway_restarted``."""
        engine = self.scheduler.engine
        self._responses[r.job] = r
        r.record = self._observe(r.spec, r.id, r.continues or (None, None))
        self.dialect.response_continued(r)
        if r.text_index == 0:
            self._direct_text(r)
        if not r.calls and r.text_index == 0 and engine.continues(r.job.request):
            r.job.request = replace(
                r.job.request,
                continuation=r.prefix,
                continuation_token_ids=r.prefix_token_ids,
                trace_context=self._trace_context(r.record),
            )
            if self.scheduler.submit(r.job):
                return
        reason = (
            "the gateway that was generating this answer stopped, and this engine cannot "
            "continue it (it cannot continue an answer, or this one was under a constraint): "
            "ask again"
        )
        error = EngineError("gateway_restarted", reason)
        self._inbox.put_nowait(_JobDone(r.job, Outcome("failed", "", Usage(0, 0), error)))

    def cancel_response(self, r: ResponseState, reason: CancelReason = "client_cancelled") -> None:
        """Stop ``r`` in the engine; its ``response_ended`` follows (status cancelled)."""
        r.cancelling = True
        self.scheduler.cancel(r.job, reason)

    # -- output items ----------------------------------------------------------------

    def _next_output(self, r: ResponseState, item: Item) -> tuple[int, str | None]:
        """Give ``r``'s next output item its index and, in the conversation, its place
        (after the response's previous item, else last). Returns (index, previous id)."""
        index, r.outputs = r.outputs, r.outputs + 1
        previous: str | None = None
        if r.in_conversation:
            anchor = r.last_item_id
            previous = anchor if anchor in self.conversation else self.conversation.last_id()
            self.conversation.insert(item, previous)
        r.last_item_id = item.id
        return index, previous

    def _open_text(self, r: ResponseState) -> None:
        item = Item(r.item_id, "assistant", "", "in_progress")
        r.text_index, r.previous_item_id = self._next_output(r, item)
        self.dialect.text_opened(r)

    def _text_of_tool_response(
        self, r: ResponseState, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> None:
        """A text delta of a response with tools: its message opens with the first one.
        When a call came first the message is not output 0, which the outbox's merged
        deltas assume, so its deltas go out one event each (a rare order)."""
        if r.text_index is None:
            self._open_text(r)
        if r.text_index == 0:
            self.outbox.put_delta(r.delta_key, r.item_id, text, (), logprobs)
            return
        self.dialect.text_delta(r, text, logprobs)

    def _open_call(self, r: ResponseState, delta: ToolCallDelta) -> CallState:
        call_id = delta.call_id or codec.new_id("call")
        name = delta.name or ""
        item = Item.function_call(self.free_item_id(), call_id, name, "", "in_progress")
        index, previous = self._next_output(r, item)
        call = CallState(item.id, call_id, name, index, previous)
        r.calls[delta.index] = call
        self.dialect.call_opened(r, call)
        return call

    def _job_done(self, job: Job, outcome: Outcome) -> None:
        r = self._responses.pop(job)
        if r.prefix:
            outcome = replace(outcome, text=r.prefix + outcome.text)
            if r.spec.sampling.logprobs is not None:
                logprobs = r.prefix_logprobs + (outcome.logprobs or ())
                outcome = replace(outcome, logprobs=logprobs)
        if r.in_conversation:
            # Every ending but a natural one leaves the items incomplete.
            status = "completed" if outcome.status == "completed" else "incomplete"
            if r.text_index is not None:
                self.conversation.finish(r.item_id, outcome.text, status)
            for call in r.calls.values():
                self.conversation.finish(call.item_id, call.arguments, status)
        self._ending_response = True
        try:
            self.dialect.response_ended(r, outcome)
        finally:
            self._ending_response = False
        if r.record is not None and self.observability is not None:
            observed.answer_ended(
                self.observability,
                r.record,
                r.job,
                outcome,
                calls=bool(r.calls),
                counts_prompt=r.spec.counts_prompt,
            )


def rate_limited(over: OverLimit) -> errors.ProtocolError:
    """A request its tenant's limits refuse (gateway/tenants.py), as the client is told."""
    return errors.ProtocolError(
        "rate_limit_exceeded",
        f"Rate limit reached: {over.message} Retry in {over.retry_after:.1f} s.",
        error_type="requests",
        retry_after=over.retry_after,
    )


def item_status(outcome: Outcome) -> str:
    """The status of a response's output items: only a natural end completes them."""
    return "completed" if outcome.status == "completed" else "incomplete"
