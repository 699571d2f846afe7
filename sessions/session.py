"""The session actor: one task per session, the only code that changes its state.

Its inbox receives decoded client events (or the protocol errors found while
decoding them) and notices from the scheduler; it answers by putting server
events into its :class:`~sessions.outbox.Outbox`. Text deltas are the one thing
that bypasses the inbox: the scheduler's fan-out task puts them straight into
the outbox (they change no session state), which keeps a token's trip short.
Ordering still holds because ``response.created`` and friends are put in the
outbox in the same handler that submits the job, before the engine can report
anything for it, and ``response.done`` is put only after the scheduler reports
that the job has ended, after which it delivers nothing more for it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

from gateway import protocol as p
from gateway.engines.base import GenerationRequest, Message, SamplingParams, ToolCallDelta
from gateway.metrics import Metrics
from gateway.scheduler import CancelReason, Job, Outcome, Scheduler
from sessions.conversation import Conversation, Item
from sessions.outbox import Outbox

log = logging.getLogger(__name__)


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


@dataclass(eq=False, slots=True)
class _Response:
    id: str
    item_id: str
    job: Job
    out_of_band: bool
    metadata: dict[str, str] | None
    max_output_tokens: int | None
    cancelling: bool = False
    previous_item_id: str | None = None  # where its item sits in the conversation


@dataclass(frozen=True, slots=True)
class _JobDone:
    job: Job
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class _Close:
    reason: CancelReason
    code: int
    text: str


_Inbound = p.ClientEvent | p.ProtocolError | _JobDone | _Close

_STATUS_REASON: dict[str, dict[str, Any]] = {
    "completed": {"type": "completed"},
    "incomplete": {"type": "incomplete", "reason": "max_output_tokens"},
}


class Session:
    def __init__(
        self,
        scheduler: Scheduler,
        outbox: Outbox,
        *,
        config: SessionConfig | None = None,
        limits: SessionLimits | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.id = p.new_id("sess")
        self.conversation_id = p.new_id("conv")
        self.scheduler = scheduler
        self.outbox = outbox
        self.config = config or SessionConfig()
        self.limits = limits or SessionLimits()
        self.metrics = metrics
        self.conversation = Conversation()
        self._inbox: asyncio.Queue[_Inbound] = asyncio.Queue()
        self._unhandled = 0
        self._room = asyncio.Event()
        self._room.set()
        self._responses: dict[Job, _Response] = {}
        self._in_conversation: _Response | None = None
        self._closing: _Close | None = None
        self.outbox.put(p.event("session.created", session=self._session_json()))

    # -- inputs (any task) ---------------------------------------------------

    async def deliver(self, event: p.ClientEvent | p.ProtocolError) -> None:
        """Queue a client event; waits while too many are unhandled (backpressure)."""
        if self._closing is not None:
            return  # nobody will handle it: the actor is ending or gone
        self._unhandled += 1
        self._inbox.put_nowait(event)
        if self._unhandled >= self.limits.max_unhandled_events:
            self._room.clear()
            await self._room.wait()

    def close(
        self, reason: CancelReason = "disconnected", code: int = 1000, text: str = ""
    ) -> None:
        """End the session: its work is cancelled, then the outbox closes with ``code``."""
        self._inbox.put_nowait(_Close(reason, code, text))

    @property
    def live_responses(self) -> int:
        return len(self._responses)

    # JobSink: called by the scheduler on the event loop thread.

    def on_delta(self, job: Job, text: str) -> None:
        response = self._responses[job]
        self.outbox.put_delta(response.id, response.item_id, text)

    def on_tool_call_delta(self, job: Job, delta: ToolCallDelta) -> None:
        pass  # function calls reach the protocol with issue 13's session changes

    def on_finish(self, job: Job, outcome: Outcome) -> None:
        self._inbox.put_nowait(_JobDone(job, outcome))

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
        if not isinstance(item, _JobDone):
            self._unhandled -= 1
            if self._unhandled < self.limits.max_unhandled_events:
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
        self._room.set()  # a reader waiting to deliver must not wait forever
        for job in list(self._responses):
            self.scheduler.cancel(job, close.reason)

    # -- session and conversation ----------------------------------------------

    def _session_json(self) -> p.JSON:
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
            "tools": [],
            "tool_choice": "auto",
        }

    def _session_update(self, event: p.SessionUpdate) -> None:
        changes = {k: getattr(event.patch, k) for k in event.patch.__slots__}
        self.config = replace(self.config, **{k: v for k, v in changes.items() if v != p.UNSET})
        self.outbox.put(p.event("session.updated", session=self._session_json()))

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
        self._check_room(event.event_id, len(spec.text))
        item = Item(spec.id or self._free_item_id(), spec.role, spec.text)
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
        response = self._new_response(params)
        if not params.out_of_band:
            # Into the conversation before the engine gets it: whatever refuses the
            # response must do so before it starts (one response.create, one outcome).
            response.previous_item_id = self.conversation.last_id()
            self.conversation.insert(Item(response.item_id, "assistant", "", "in_progress"))
        if not self.scheduler.submit(response.job):
            if not params.out_of_band:
                self.conversation.delete(response.item_id)
            raise p.ProtocolError(
                "overloaded",
                "The gateway is at capacity (every engine slot and queue place is taken); "
                "retry shortly.",
                event_id=event.event_id,
                error_type="server_error",
            )
        # The job may already be "running", but its task gets its first step only
        # after this handler returns, so these events precede every delta.
        self._responses[response.job] = response
        if not params.out_of_band:
            self._in_conversation = response
        self._put_response_opening(response)

    def _out_of_band_count(self) -> int:
        return sum(r.out_of_band for r in self._responses.values())

    def _new_response(self, params: p.ResponseParams) -> _Response:
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
        if params.input is not None:
            history = [Message(i.role, i.text) for i in params.input]
        else:
            history = self.conversation.to_messages()
        system = [Message("system", instructions)] if instructions else []
        response_id = p.new_id("resp")
        request = GenerationRequest(
            request_id=response_id,
            messages=tuple(system + history),
            sampling=sampling,
            affinity_key=None if params.out_of_band else self.conversation_id,
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
        put, ev = self.outbox.put, p.event
        put(ev("response.created", response=self._response_json(r, "in_progress")))
        item = p.message_item(r.item_id, "assistant", "", "in_progress")
        item["content"] = []
        put(ev("response.output_item.added", response_id=r.id, output_index=0, item=item))
        if not r.out_of_band:
            put(ev("conversation.item.added", previous_item_id=r.previous_item_id, item=item))
        put(
            ev(
                "response.content_part.added",
                response_id=r.id,
                item_id=r.item_id,
                output_index=0,
                content_index=0,
                part={"type": "text", "text": ""},
            )
        )

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
        text = outcome.text
        # Every ending but a natural one leaves the item incomplete.
        item_status = "completed" if outcome.status == "completed" else "incomplete"
        if not r.out_of_band:
            self._in_conversation = None
            self.conversation.finish(r.item_id, text, item_status)
        if outcome.error is not None:
            error = outcome.error
            self._error(p.ProtocolError(error.code, error.message, error_type=error.error_type))
        put, ev = self.outbox.put, p.event
        ids = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
        put(ev("response.output_text.done", **ids, text=text))
        put(ev("response.content_part.done", **ids, part={"type": "text", "text": text}))
        item_json = p.message_item(r.item_id, "assistant", text, item_status)
        put(ev("response.output_item.done", response_id=r.id, output_index=0, item=item_json))
        if not r.out_of_band:
            previous = r.previous_item_id
            put(ev("conversation.item.done", previous_item_id=previous, item=item_json))
        details = self._status_details(outcome)
        usage = p.usage_json(outcome.usage)
        body = self._response_json(r, outcome.status, details, [item_json], usage)
        put(ev("response.done", response=body))

    @staticmethod
    def _status_details(outcome: Outcome) -> dict[str, Any]:
        if outcome.status == "cancelled":
            return {"type": "cancelled", "reason": outcome.cancel_reason}
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
