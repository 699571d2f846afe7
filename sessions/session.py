"""The session actor: one task per session, the only code that changes its state.

Its inbox receives decoded client events (or the protocol errors found while
decoding them) and notices from the scheduler; it answers by putting server
events into its :class:`~sessions.outbox.Outbox`. Text and tool-call deltas are
the one thing that bypasses the inbox: the scheduler calls the sink methods
synchronously on the event loop thread and they put events straight into the
outbox, which keeps a token's trip short. They may open an output item (a
function call, or the message of a response with tools, which opens with its
first text) and insert it into the conversation; no handler of the actor is
running then (handlers never await), so the conversation still has one writer
at a time. Ordering holds because ``response.created`` and friends are put in
the outbox before the job's first step can run, and ``response.done`` is put
only after the scheduler reports that the job's stream has ended.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from gateway import protocol as p
from gateway.engines.base import (
    TOOL_CHOICE_MODES,
    GenerationRequest,
    Message,
    SamplingParams,
    Tool,
    ToolCallDelta,
    ToolChoice,
)
from gateway.metrics import Metrics
from gateway.scheduler import CancelReason, Job, Outcome, Scheduler
from sessions.conversation import Conversation, Item, items_to_messages
from sessions.outbox import Outbox, Wire

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SessionLimits:
    max_parallel_out_of_band: int = 4
    max_items: int = 4096
    max_conversation_chars: int = 8 << 20  # bounds memory, and the prompt of every response
    max_unhandled_events: int = 64  # the reader waits beyond this: TCP backpressure


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """What ``session.update`` changes; the defaults of every response."""

    model: str = "default"
    instructions: str = ""
    max_output_tokens: int | None = None  # None: "inf"
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"


@dataclass(eq=False, slots=True)
class _Call:
    """A function call the model is making: one ``function_call`` output item."""

    item_id: str
    call_id: str
    name: str
    output_index: int
    previous_item_id: str | None
    parts: list[str] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _Response:
    id: str
    item_id: str  # its message item (opened at creation, or with the first text)
    job: Job
    out_of_band: bool
    metadata: dict[str, str] | None
    max_output_tokens: int | None
    cancelling: bool = False
    previous_item_id: str | None = None  # where its message item sits in the conversation
    # Output index of the message item; None until it opens. A response that may call
    # tools opens it with its first text, so a response of calls alone has no message.
    text_index: int | None = None
    calls: dict[int, _Call] = field(default_factory=dict)  # by the engine's call index
    outputs: int = 0  # output items opened so far
    last_item_id: str | None = None  # its newest output item, where the next one goes


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


_Inbound = p.ClientEvent | p.ProtocolError | _JobDone | _Close | _Overflow

_STATUS_REASON: dict[str, dict[str, Any]] = {
    "completed": {"type": "completed"},
    "incomplete": {"type": "incomplete", "reason": "max_output_tokens"},
}


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
    def __init__(
        self,
        scheduler: Scheduler,
        outbox: Outbox,
        *,
        config: SessionConfig | None = None,
        limits: SessionLimits | None = None,
        metrics: Metrics | None = None,
        session_id: str | None = None,
    ) -> None:
        self.id = session_id or p.new_id("sess")
        self.conversation_id = p.new_id("conv")
        self.scheduler = scheduler
        self.outbox = outbox
        self.config = config or SessionConfig()
        self.limits = limits or SessionLimits()
        self.metrics = metrics
        self.conversation = Conversation()
        self._inbox = Inbox[_Inbound]()
        self._unhandled = 0
        self._room: asyncio.Event | None = None  # made when a reader first has to wait
        self._responses: dict[Job, _Response] = {}
        self._in_conversation: _Response | None = None
        self._closing: _Close | None = None
        self._close_requested = False
        self._resume_token = secrets.token_urlsafe(24)  # 192 bits; never logged
        self._previous_token: str | None = None  # see resume()
        self._expiry: asyncio.TimerHandle | None = None
        self.outbox.on_overflow = self._overflowed
        self.outbox.put(
            p.event(
                "session.created",
                session=self.session_json(),
                resume_token=self._resume_token,
            )
        )

    # -- inputs (any task) ---------------------------------------------------

    async def deliver(self, event: p.ClientEvent | p.ProtocolError) -> None:
        """Queue a client event; waits while too many are unhandled (backpressure)."""
        if self._closing is not None:
            return  # nobody will handle it: the actor is ending or gone
        self._unhandled += 1
        self._inbox.put_nowait(event)
        if self._unhandled >= self.limits.max_unhandled_events:
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            await self._room.wait()

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

    def resume(self, token: str, last_sequence_number: int, wire: Wire) -> str | None:
        """Send to ``wire`` from now on: ``session.resumed``, then every event numbered
        above ``last_sequence_number``, then live events. None on success, else the
        error code: ``session_not_found`` (ended, or a wrong token: a guess learns
        nothing) or ``resume_gap`` (some of those events are no longer kept)."""
        if self.ending or not self._token_matches(token):
            return "session_not_found"
        replay = self.outbox.replay_after(last_sequence_number)
        if replay is None:
            return "resume_gap"
        self._cancel_expiry()
        # A fresh token; the one presented stays valid beside it until the client shows it
        # has the fresh one: if this connection drops before session.resumed reaches the
        # client, its next resume (with the token it holds) must still work.
        self._previous_token, self._resume_token = token, secrets.token_urlsafe(24)
        resumed = p.encode(
            p.event(
                "session.resumed",
                event_id=p.new_id("event"),
                session=self.session_json(),
                resume_token=self._resume_token,
            )
        )
        self.outbox.attach(wire, [resumed, *replay])
        if self.metrics is not None:
            self.metrics.replayed_events.inc(len(replay))
        return None

    def _token_matches(self, token: str) -> bool:
        # Both compared, in constant time: which one matched (or whether) does not show.
        presented = token.encode()
        current = hmac.compare_digest(presented, self._resume_token.encode())
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

    # JobSink: called by the scheduler on the event loop thread.

    def on_delta(self, job: Job, text: str) -> None:
        response = self._responses[job]
        if response.text_index != 0:  # a response with tools: see _text_of_tool_response
            self._text_of_tool_response(response, text)
            return
        self.outbox.put_delta(response.id, response.item_id, text)

    def on_tool_call_delta(self, job: Job, delta: ToolCallDelta) -> None:
        response = self._responses[job]
        call = response.calls.get(delta.index)
        if call is None:
            call = self._open_call(response, delta)
        if delta.arguments:
            call.parts.append(delta.arguments)
            self.outbox.put(
                p.event(
                    "response.function_call_arguments.delta",
                    response_id=response.id,
                    item_id=call.item_id,
                    output_index=call.output_index,
                    call_id=call.call_id,
                    delta=delta.arguments,
                )
            )

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
                self._handle(item)
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
        if not isinstance(item, _JobDone):
            self._unhandled -= 1
            if self._room is not None and self._unhandled < self.limits.max_unhandled_events:
                self._room.set()
            if self._closing is not None:
                return
        try:
            if isinstance(item, _JobDone):
                self._job_done(item.job, item.outcome)
            elif isinstance(item, p.ProtocolError):
                raise item
            else:
                self._client_event(item)
        except p.ProtocolError as err:
            self._error(err)
        except Exception:  # a bug must cost one event, not the connection
            log.exception("session %s failed to handle %r", self.id, item)
            self._error(
                p.ProtocolError(
                    "internal_error",
                    "The gateway failed to handle this event.",
                    event_id=getattr(item, "event_id", None),
                    error_type="server_error",
                )
            )

    def _client_event(self, event: p.ClientEvent) -> None:
        match event:
            case p.SessionUpdate():
                self._session_update(event)
            case p.ItemCreate():
                self._item_create(event)
            case p.ItemDelete():
                self._item_delete(event)
            case p.ItemRetrieve():
                self._item_retrieve(event)
            case p.ResponseCreate():
                self._response_create(event)
            case p.ResponseCancel():
                self._response_cancel(event)

    def _error(self, err: p.ProtocolError) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(code=err.code).inc()
        self.outbox.put(p.error_event(err))

    def _begin_close(self, close: _Close) -> None:
        if self._closing is not None:
            return
        self._closing = close
        if self._room is not None:
            self._room.set()  # a reader waiting to deliver must not wait forever
        for job in list(self._responses):
            self.scheduler.cancel(job, close.reason)

    # -- session and conversation ----------------------------------------------

    def session_json(self) -> p.JSON:
        c = self.config
        return {
            "object": "realtime.session",
            "type": "realtime",
            "id": self.id,
            "model": c.model,
            "output_modalities": ["text"],
            "instructions": c.instructions,
            "max_output_tokens": "inf" if c.max_output_tokens is None else c.max_output_tokens,
            "temperature": c.temperature,
            "top_p": c.top_p,
            "seed": c.seed,
            "stop": list(c.stop),
            "tools": p.tools_json(c.tools),
            "tool_choice": p.tool_choice_json(c.tool_choice),
        }

    def _session_update(self, event: p.SessionUpdate) -> None:
        changes = {k: getattr(event.patch, k) for k in event.patch.__slots__}
        config = replace(self.config, **{k: v for k, v in changes.items() if v != p.UNSET})
        _check_named_choice(config.tools, config.tool_choice, "session", event.event_id)
        self.config = config
        self.outbox.put(p.event("session.updated", session=self.session_json()))

    def _item_create(self, event: p.ItemCreate) -> None:
        spec, previous = event.item, event.previous_item_id
        if spec.id is not None and spec.id in self.conversation:
            raise p.ProtocolError(
                "duplicate_item_id",
                f"An item with id '{spec.id}' already exists.",
                param="item.id",
                event_id=event.event_id,
            )
        if previous not in (None, "root") and previous not in self.conversation:
            raise self._not_found(previous, "previous_item_id", event.event_id)
        if isinstance(spec, p.FunctionCallOutputSpec) and not self.conversation.has_call(
            spec.call_id
        ):
            raise _call_not_found(spec.call_id, "item.call_id", event.event_id)
        item = _item_from_spec(spec, spec.id or self._free_item_id())
        self._check_room(event.event_id, len(item.text))
        before = self.conversation.last_id() if previous is None else previous
        self.conversation.insert(item, previous)
        prev = None if before == "root" else before
        for kind in ("conversation.item.added", "conversation.item.done"):
            self.outbox.put(p.event(kind, previous_item_id=prev, item=item.to_json()))

    def _check_room(self, event_id: str | None, chars: int = 0) -> None:
        """Refuse what would take the conversation past its item or text limit."""
        limits, conversation = self.limits, self.conversation
        if len(conversation) >= limits.max_items or (
            conversation.chars + chars > limits.max_conversation_chars
        ):
            raise p.ProtocolError(
                "conversation_full",
                f"The conversation holds at most {limits.max_items} items and "
                f"{limits.max_conversation_chars} characters; delete some items.",
                event_id=event_id,
            )

    def _not_found(self, item_id: str, param: str, event_id: str | None) -> p.ProtocolError:
        return p.ProtocolError(
            "item_not_found",
            f"No item with id '{item_id}' in the conversation.",
            param=param,
            event_id=event_id,
        )

    def _item_delete(self, event: p.ItemDelete) -> None:
        item = self.conversation.get(event.item_id)
        if item is None:
            raise self._not_found(event.item_id, "item_id", event.event_id)
        if item.status == "in_progress":
            raise p.ProtocolError(
                "item_in_progress",
                "That item is still being generated; cancel the response first.",
                param="item_id",
                event_id=event.event_id,
            )
        self.conversation.delete(event.item_id)
        self.outbox.put(p.event("conversation.item.deleted", item_id=event.item_id))

    def _item_retrieve(self, event: p.ItemRetrieve) -> None:
        item = self.conversation.get(event.item_id)
        if item is None:
            raise self._not_found(event.item_id, "item_id", event.event_id)
        self.outbox.put(p.event("conversation.item.retrieved", item=item.to_json()))

    # -- responses ---------------------------------------------------------------

    def _response_create(self, event: p.ResponseCreate) -> None:
        params = event.params
        if not params.out_of_band and self._in_conversation is not None:
            raise p.ProtocolError(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: "
                f"{self._in_conversation.id}. Wait until it is done, or cancel it.",
                event_id=event.event_id,
            )
        limit = self.limits.max_parallel_out_of_band
        if params.out_of_band and self._out_of_band_count() >= limit:
            raise p.ProtocolError(
                "too_many_parallel_responses",
                f"At most {limit} out-of-band responses may run at once per session.",
                event_id=event.event_id,
            )
        if not params.out_of_band:
            self._check_room(event.event_id)
        response = self._new_response(params, event.event_id)
        if not self.scheduler.submit(response.job):
            self._error(
                p.ProtocolError(
                    "overloaded",
                    "The gateway is at capacity (every engine slot and queue place is taken); "
                    "retry shortly.",
                    event_id=event.event_id,
                    error_type="server_error",
                )
            )
            self._put_rate_limits()
            return
        # The job may already be "running", but the engine's output reaches the session
        # only through the scheduler's fan-out task, after this handler returns: these
        # events precede every delta.
        self._responses[response.job] = response
        if not params.out_of_band:
            self._in_conversation = response
        self._put_response_opening(response)

    def _out_of_band_count(self) -> int:
        return sum(r.out_of_band for r in self._responses.values())

    def _new_response(self, params: p.ResponseParams, event_id: str | None) -> _Response:
        c = self.config

        def pick(value: Any, default: Any) -> Any:
            return default if value == p.UNSET else value

        instructions: str = pick(params.instructions, c.instructions)
        max_tokens: int | None = pick(params.max_output_tokens, c.max_output_tokens)
        sampling = SamplingParams(
            max_output_tokens=max_tokens,
            temperature=pick(params.temperature, c.temperature),
            top_p=pick(params.top_p, c.top_p),
            seed=pick(params.seed, c.seed),
            stop=pick(params.stop, c.stop),
        )
        tools: tuple[Tool, ...] = pick(params.tools, c.tools)
        tool_choice: ToolChoice = pick(params.tool_choice, c.tool_choice)
        _check_tool_choice(tools, tool_choice, params, event_id)
        if params.input is not None:
            history = items_to_messages(_input_items(params.input, event_id))
        else:
            history = self.conversation.to_messages()
        system = [Message("system", instructions)] if instructions else []
        response_id = p.new_id("resp")
        request = GenerationRequest(
            request_id=response_id,
            messages=tuple(system + history),
            sampling=sampling,
            affinity_key=None if params.out_of_band else self.conversation_id,
            tools=tools if tool_choice != "none" else (),
            tool_choice=tool_choice,
        )
        job = Job(request, session_key=self.id, sink=self)
        return _Response(
            response_id, self._free_item_id(), job, params.out_of_band, params.metadata, max_tokens
        )

    def _free_item_id(self) -> str:
        """A new server-made item id; checked, since clients choose item ids too."""
        item_id = p.new_id("item")
        while item_id in self.conversation:
            item_id = p.new_id("item")
        return item_id

    def _response_json(
        self,
        r: _Response,
        status: str,
        details: dict[str, Any] | None = None,
        output: list[p.JSON] | None = None,
        usage: p.JSON | None = None,
    ) -> p.JSON:
        return {
            "object": "realtime.response",
            "id": r.id,
            "status": status,
            "status_details": details,
            "output": output or [],
            "conversation_id": None if r.out_of_band else self.conversation_id,
            "output_modalities": ["text"],
            "max_output_tokens": "inf" if r.max_output_tokens is None else r.max_output_tokens,
            "metadata": r.metadata,
            "usage": usage,
        }

    def _put_response_opening(self, r: _Response) -> None:
        self.outbox.put(p.event("response.created", response=self._response_json(r, "in_progress")))
        self._put_rate_limits()
        if not r.job.request.tools:
            # Without tools the answer is text: its message item opens at once, so even
            # an answer cut before its first token leaves an (incomplete) item.
            self._open_text(r)

    def _put_rate_limits(self) -> None:
        """``rate_limits.updated``: the scheduler's capacity now (docs/protocol.md)."""
        s = self.scheduler
        limit = s.max_running + s.max_queued
        limits: list[p.JSON] = [
            {"name": "requests", "limit": limit, "remaining": max(0, limit - s.running - s.queued)}
        ]
        window = s.engine.context_window
        if window is not None:
            limits.append({"name": "tokens", "limit": window})
        self.outbox.put(p.event("rate_limits.updated", rate_limits=limits))

    def _next_output(self, r: _Response, item: Item) -> tuple[int, str | None]:
        """Give ``r``'s next output item its index and, in the conversation, its place
        (after the response's previous item, else last). Returns (index, previous id)."""
        index, r.outputs = r.outputs, r.outputs + 1
        previous: str | None = None
        if not r.out_of_band:
            anchor = r.last_item_id
            previous = anchor if anchor in self.conversation else self.conversation.last_id()
            self.conversation.insert(item, previous)
        r.last_item_id = item.id
        return index, previous

    def _open_text(self, r: _Response) -> None:
        item = Item(r.item_id, "assistant", "", "in_progress")
        r.text_index, r.previous_item_id = self._next_output(r, item)
        put, ev = self.outbox.put, p.event
        item_json = p.message_item(r.item_id, "assistant", "", "in_progress")
        item_json["content"] = []
        put(
            ev(
                "response.output_item.added",
                response_id=r.id,
                output_index=r.text_index,
                item=item_json,
            )
        )
        if not r.out_of_band:
            put(ev("conversation.item.added", previous_item_id=r.previous_item_id, item=item_json))
        put(
            ev(
                "response.content_part.added",
                response_id=r.id,
                item_id=r.item_id,
                output_index=r.text_index,
                content_index=0,
                part={"type": "text", "text": ""},
            )
        )

    def _text_of_tool_response(self, r: _Response, text: str) -> None:
        """A text delta of a response with tools: its message opens with the first one.
        When a call came first the message is not output 0, which the outbox's merged
        deltas assume, so its deltas go out one event each (a rare order)."""
        if r.text_index is None:
            self._open_text(r)
        if r.text_index == 0:
            self.outbox.put_delta(r.id, r.item_id, text)
            return
        self.outbox.put(
            p.event(
                "response.output_text.delta",
                response_id=r.id,
                item_id=r.item_id,
                output_index=r.text_index,
                content_index=0,
                delta=text,
            )
        )

    def _open_call(self, r: _Response, delta: ToolCallDelta) -> _Call:
        call_id = delta.call_id or p.new_id("call")
        name = delta.name or ""
        item = Item.function_call(self._free_item_id(), call_id, name, "", "in_progress")
        index, previous = self._next_output(r, item)
        call = _Call(item.id, call_id, name, index, previous)
        r.calls[delta.index] = call
        item_json = item.to_json()
        self.outbox.put(
            p.event(
                "response.output_item.added", response_id=r.id, output_index=index, item=item_json
            )
        )
        if not r.out_of_band:
            self.outbox.put(
                p.event("conversation.item.added", previous_item_id=previous, item=item_json)
            )
        return call

    def _response_cancel(self, event: p.ResponseCancel) -> None:
        target = self._cancel_target(event.response_id)
        if target is None:
            what = (
                f"response '{event.response_id}' is not active"
                if event.response_id
                else ("no response is active")
            )
            raise p.ProtocolError(
                "response_cancel_not_active",
                f"Cancellation failed: {what}.",
                param="response_id" if event.response_id else None,
                event_id=event.event_id,
            )
        target.cancelling = True
        self.scheduler.cancel(target.job, "client_cancelled")

    def _cancel_target(self, response_id: str | None) -> _Response | None:
        live = [r for r in self._responses.values() if not r.cancelling]
        if response_id is not None:
            return next((r for r in live if r.id == response_id), None)
        if self._in_conversation is not None and not self._in_conversation.cancelling:
            return self._in_conversation
        return live[-1] if live else None

    def _job_done(self, job: Job, outcome: Outcome) -> None:
        r = self._responses.pop(job)
        # Every ending but a natural one leaves the items incomplete.
        item_status = "completed" if outcome.status == "completed" else "incomplete"
        if not r.out_of_band:
            self._in_conversation = None
        if outcome.error is not None:
            error = outcome.error
            self._error(p.ProtocolError(error.code, error.message, error_type=error.error_type))
        # Each output item's closing events, in output order.
        closings: list[tuple[int, p.JSON]] = []
        if r.text_index is not None:
            closings.append((r.text_index, self._close_text(r, outcome.text, item_status)))
        for call in r.calls.values():
            closings.append((call.output_index, self._close_call(r, call, item_status)))
        closings.sort(key=lambda closing: closing[0])
        details = self._status_details(outcome)
        usage = p.usage_json(outcome.usage)
        output = [item for _, item in closings]
        body = self._response_json(r, outcome.status, details, output, usage)
        self.outbox.put(p.event("response.done", response=body))

    def _close_text(self, r: _Response, text: str, status: str) -> p.JSON:
        assert r.text_index is not None
        put, ev = self.outbox.put, p.event
        if not r.out_of_band:
            self.conversation.finish(r.item_id, text, status)
        ids = {
            "response_id": r.id,
            "item_id": r.item_id,
            "output_index": r.text_index,
            "content_index": 0,
        }
        put(ev("response.output_text.done", **ids, text=text))
        put(ev("response.content_part.done", **ids, part={"type": "text", "text": text}))
        item_json = p.message_item(r.item_id, "assistant", text, status)
        put(
            ev(
                "response.output_item.done",
                response_id=r.id,
                output_index=r.text_index,
                item=item_json,
            )
        )
        if not r.out_of_band:
            put(ev("conversation.item.done", previous_item_id=r.previous_item_id, item=item_json))
        return item_json

    def _close_call(self, r: _Response, call: _Call, status: str) -> p.JSON:
        put, ev = self.outbox.put, p.event
        arguments = "".join(call.parts)
        if not r.out_of_band:
            self.conversation.finish(call.item_id, arguments, status)
        put(
            ev(
                "response.function_call_arguments.done",
                response_id=r.id,
                item_id=call.item_id,
                output_index=call.output_index,
                call_id=call.call_id,
                name=call.name,
                arguments=arguments,
            )
        )
        item_json = p.function_call_item(call.item_id, call.call_id, call.name, arguments, status)
        put(
            ev(
                "response.output_item.done",
                response_id=r.id,
                output_index=call.output_index,
                item=item_json,
            )
        )
        if not r.out_of_band:
            put(
                ev("conversation.item.done", previous_item_id=call.previous_item_id, item=item_json)
            )
        return item_json

    @staticmethod
    def _status_details(outcome: Outcome) -> dict[str, Any]:
        if outcome.status == "cancelled":
            # The official types know one cancel reason, "client_cancelled"; the gateway's
            # others (a dropped socket, shutdown) go in a field of its own.
            if outcome.cancel_reason == "client_cancelled":
                return {"type": "cancelled", "reason": "client_cancelled"}
            return {"type": "cancelled", "gateway_reason": outcome.cancel_reason}
        if outcome.status == "failed":
            error = outcome.error
            return {
                "type": "failed",
                "error": {
                    "type": error.error_type if error else "server_error",
                    "code": error.code if error else "engine_error",
                    "message": error.message if error else "the engine failed",
                },
            }
        return _STATUS_REASON[outcome.status]


def _item_from_spec(spec: p.AnyItemSpec, item_id: str) -> Item:
    if isinstance(spec, p.FunctionCallSpec):
        return Item.function_call(item_id, spec.call_id, spec.name, spec.arguments, "completed")
    if isinstance(spec, p.FunctionCallOutputSpec):
        return Item.function_call_output(item_id, spec.call_id, spec.output)
    return Item(item_id, spec.role, spec.text)


def _input_items(specs: tuple[p.AnyItemSpec, ...], event_id: str | None) -> list[Item]:
    """A response's own ``input``: an output must answer a call in that same list."""
    items = [_item_from_spec(spec, spec.id or "") for spec in specs]
    calls = {i.call_id for i in items if i.kind == "function_call"}
    for index, item in enumerate(items):
        if item.kind == "function_call_output" and item.call_id not in calls:
            raise _call_not_found(item.call_id or "", f"response.input[{index}].call_id", event_id)
    return items


def _call_not_found(call_id: str, param: str, event_id: str | None) -> p.ProtocolError:
    return p.ProtocolError(
        "call_not_found",
        f"No function_call with call_id '{call_id}' to answer: add the call first.",
        param=param,
        event_id=event_id,
    )


def _check_named_choice(
    tools: tuple[Tool, ...], choice: ToolChoice, where: str, event_id: str | None
) -> None:
    """A ``tool_choice`` that names a function must name one of the tools."""
    if choice in TOOL_CHOICE_MODES or any(t.name == choice for t in tools):
        return
    raise p.ProtocolError(
        "invalid_value",
        f"'{where}.tool_choice' names the function '{choice}', which is not in the tools.",
        param=f"{where}.tool_choice.name",
        event_id=event_id,
    )


def _check_tool_choice(
    tools: tuple[Tool, ...],
    choice: ToolChoice,
    params: p.ResponseParams,
    event_id: str | None,
) -> None:
    """The tools and choice a response runs with (its own, else the session's) agree."""
    where = "response" if params.tool_choice != p.UNSET else "session"
    _check_named_choice(tools, choice, where, event_id)
    if choice == "required" and not tools:
        raise p.ProtocolError(
            "invalid_value",
            f"'{where}.tool_choice' is 'required' but there are no tools to call.",
            param=f"{where}.tool_choice",
            event_id=event_id,
        )
