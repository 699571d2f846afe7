"""The Realtime dialect: OpenAI Realtime's text subset over the session core.

Client frames are decoded by sessions/realtime/codec.py (the Realtime codec); this module
handles the decoded events against the core (session settings, the conversation's
items, responses in or out of the conversation, cancel) and encodes what the core
reports as Realtime server events. Realtime has one conversation per session, at
most one response in it at a time, and up to ``max_parallel_out_of_band``
responses beside it. Events are numbered from 1, ``session.created`` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson

from gateway.engines.base import (
    TOOL_CHOICE_MODES,
    Message,
    PromptLogprobs,
    SamplingParams,
    TokenLogprob,
    Tool,
    ToolChoice,
)
from gateway.scheduler import Outcome
from sessions import codec, errors
from sessions.conversation import Item, items_to_messages
from sessions.core import (
    CallState,
    ResponseSpec,
    ResponseState,
    Session,
    SessionConfig,
    item_status,
)
from sessions.realtime import codec as rt

# A response's text delta, as a template: its event id's tag, then (per delta) the number
# twice and the text; the ids are spliced in once per response (RealtimeFraming.delta_ids).
_DELTA = (
    b'{"type":"response.output_text.delta","event_id":"event_%b_%%x","sequence_number":%%d'
    b',"response_id":%b,"item_id":%b,"output_index":0,"content_index":0,"delta":%%b}'
)

_STATUS_REASON: dict[str, dict[str, Any]] = {
    "completed": {"type": "completed"},
    "incomplete": {"type": "incomplete", "reason": "max_output_tokens"},
}


class RealtimeFraming:
    """Realtime events carry ``event_id`` (the session's random tag and the number) and
    ``sequence_number``, first in the object; ``session.created`` is number 1."""

    __slots__ = ("_tag",)
    first_sequence_number = 1
    replays_first = False

    def __init__(self) -> None:
        self._tag = codec.random_hex(4).encode()  # event ids: unique per session

    def numbered(self, seq: int, body: bytes) -> bytes:
        # The body is an encoded JSON object: splice the two fields in after "{".
        return b'{"event_id":"event_%b_%x","sequence_number":%d,%b' % (
            self._tag,
            seq,
            seq,
            body[1:],
        )

    def delta_ids(self, response_id: str, item_id: str) -> bytes:
        return _DELTA % (self._tag, _template(response_id), _template(item_id))

    def delta(self, seq: int, ids: bytes, text: str) -> bytes:
        return ids % (seq, seq, orjson.dumps(text))  # orjson escapes the text as JSON does

    def delta_logprobs(
        self, seq: int, ids: bytes, text: str, logprobs: Sequence[TokenLogprob]
    ) -> bytes:
        """Never asked for: a Realtime response asks for no log probabilities (its text
        delta has no field for them)."""
        return self.delta(seq, ids, text)


def _template(value: str) -> bytes:
    """``value`` as a JSON string that can sit in a ``%`` template."""
    return orjson.dumps(value).replace(b"%", b"%%")


class RealtimeDialect:
    """A session's Realtime half (see the module docstring)."""

    decode = staticmethod(rt.decode)

    name = "realtime"

    def __init__(self, max_parallel_out_of_band: int = 4) -> None:
        self._core: Session | None = None
        self.max_parallel_out_of_band = max_parallel_out_of_band
        self._in_conversation: ResponseState | None = None
        self._pending_in_conversation: str | None = None  # see load()

    @property
    def core(self) -> Session:
        assert self._core is not None
        return self._core

    def expire(self) -> None:
        """Realtime connections have no maximum age (only Responses ones do)."""

    def attach(self, core: Session, greet: bool) -> None:
        self._core = core
        if not greet:
            return
        core.outbox.put(
            codec.event(
                "session.created",
                session=self.session_json(),
                resume_token=core.resume_token,
            )
        )

    def resumed(self, resume_token: str) -> bytes | None:
        return resumed_event(self.core.id, self.core.config, resume_token)

    def close(self) -> None:
        pass

    def dump(self) -> dict[str, Any]:
        r = self._in_conversation
        return {"in_conversation": r.id if r is not None and not r.cancelling else None}

    def load(self, state: dict[str, Any]) -> None:
        self._pending_in_conversation = state["in_conversation"]

    def dump_tag(self, tag: object) -> Any:
        return None

    def load_tag(self, data: Any) -> object:
        return None

    def handle(self, command: object) -> None:
        match command:
            case rt.SessionUpdate():
                self._session_update(command)
            case rt.ItemCreate():
                self._item_create(command)
            case rt.ItemDelete():
                self._item_delete(command)
            case rt.ItemRetrieve():
                self._item_retrieve(command)
            case rt.ResponseCreate():
                self._response_create(command)
            case rt.ResponseCancel():
                self._response_cancel(command)

    def error(self, err: errors.ProtocolError) -> None:
        self.core.outbox.put(codec.error_event(err))

    # -- session and conversation ----------------------------------------------

    def session_json(self) -> codec.JSON:
        return session_json(self.core.id, self.core.config)

    def _session_update(self, event: rt.SessionUpdate) -> None:
        core = self.core
        changes = {k: getattr(event.patch, k) for k in event.patch.__slots__}
        if changes["model"] != codec.UNSET:
            codec.check_model(changes["model"], core.limits.served_models, event.event_id)
        config = replace(core.config, **{k: v for k, v in changes.items() if v != codec.UNSET})
        check_named_choice(config.tools, config.tool_choice, "session", event.event_id)
        core.config = config
        core.outbox.put(codec.event("session.updated", session=self.session_json()))

    def _item_create(self, event: rt.ItemCreate) -> None:
        core = self.core
        conversation = core.conversation
        spec, previous = event.item, event.previous_item_id
        if spec.id is not None and spec.id in conversation:
            raise errors.ProtocolError(
                "duplicate_item_id",
                f"An item with id '{spec.id}' already exists.",
                param="item.id",
                event_id=event.event_id,
            )
        if previous not in (None, "root") and previous not in conversation:
            raise _not_found(previous, "previous_item_id", event.event_id)
        if isinstance(spec, codec.FunctionCallOutputSpec) and not conversation.has_call(
            spec.call_id
        ):
            raise call_not_found(spec.call_id, "item.call_id", event.event_id)
        item = item_from_spec(spec, spec.id or core.free_item_id())
        self._check_room(event.event_id, len(item.text))
        before = conversation.last_id() if previous is None else previous
        conversation.insert(item, previous)
        prev = None if before == "root" else before
        for kind in ("conversation.item.added", "conversation.item.done"):
            core.outbox.put(codec.event(kind, previous_item_id=prev, item=rt.item_json(item)))

    def _check_room(self, event_id: str | None, chars: int = 0) -> None:
        """Refuse what would take the conversation past its item or text limit."""
        limits, conversation = self.core.limits, self.core.conversation
        if len(conversation) >= limits.max_items or (
            conversation.chars + chars > limits.max_conversation_chars
        ):
            raise errors.ProtocolError(
                "conversation_full",
                f"The conversation holds at most {limits.max_items} items and "
                f"{limits.max_conversation_chars} characters; delete some items.",
                event_id=event_id,
            )

    def _item_delete(self, event: rt.ItemDelete) -> None:
        conversation = self.core.conversation
        item = conversation.get(event.item_id)
        if item is None:
            raise _not_found(event.item_id, "item_id", event.event_id)
        if item.status == "in_progress":
            raise errors.ProtocolError(
                "item_in_progress",
                "That item is still being generated; cancel the response first.",
                param="item_id",
                event_id=event.event_id,
            )
        conversation.delete(event.item_id)
        self.core.outbox.put(codec.event("conversation.item.deleted", item_id=event.item_id))

    def _item_retrieve(self, event: rt.ItemRetrieve) -> None:
        item = self.core.conversation.get(event.item_id)
        if item is None:
            raise _not_found(event.item_id, "item_id", event.event_id)
        self.core.outbox.put(codec.event("conversation.item.retrieved", item=rt.item_json(item)))

    # -- responses ---------------------------------------------------------------

    def _response_create(self, event: rt.ResponseCreate) -> None:
        core, params = self.core, event.params
        if not params.out_of_band and self._in_conversation is not None:
            raise errors.ProtocolError(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: "
                f"{self._in_conversation.id}. Wait until it is done, or cancel it.",
                event_id=event.event_id,
            )
        limit = self.max_parallel_out_of_band
        out_of_band = sum(not r.in_conversation for r in core.responses)
        if params.out_of_band and out_of_band >= limit:
            raise errors.ProtocolError(
                "too_many_parallel_responses",
                f"At most {limit} out-of-band responses may run at once per session.",
                event_id=event.event_id,
            )
        if not params.out_of_band:
            self._check_room(event.event_id)
        response = core.start_response(self._spec(params, event.event_id))
        if response is None:
            core.error(
                errors.ProtocolError(
                    "overloaded",
                    "The gateway is at capacity (every engine slot and queue place is taken); "
                    "retry shortly.",
                    event_id=event.event_id,
                    error_type="server_error",
                )
            )
            self._put_rate_limits()
            return
        if not params.out_of_band:
            self._in_conversation = response

    def _spec(self, params: rt.ResponseParams, event_id: str | None) -> ResponseSpec:
        core = self.core
        c = core.config

        instructions: str = codec.chosen(params.instructions, c.instructions)
        sampling = SamplingParams(
            max_output_tokens=codec.chosen(params.max_output_tokens, c.max_output_tokens),
            temperature=codec.chosen(params.temperature, c.temperature),
            top_p=codec.chosen(params.top_p, c.top_p),
            seed=codec.chosen(params.seed, c.seed),
            stop=codec.chosen(params.stop, c.stop),
            frequency_penalty=codec.chosen(params.frequency_penalty, c.frequency_penalty),
            presence_penalty=codec.chosen(params.presence_penalty, c.presence_penalty),
        )
        tools: tuple[Tool, ...] = codec.chosen(params.tools, c.tools)
        tool_choice: ToolChoice = codec.chosen(params.tool_choice, c.tool_choice)
        where = "response" if params.tool_choice != codec.UNSET else "session"
        check_tool_choice(tools, tool_choice, where, event_id)
        if params.input is not None:
            history = items_to_messages(input_items(params.input, "response.input", event_id))
        else:
            history = core.conversation.to_messages()
        system = [Message("system", instructions)] if instructions else []
        return ResponseSpec(
            messages=tuple(system + history),
            sampling=sampling,
            tools=tools,
            tool_choice=tool_choice,
            in_conversation=not params.out_of_band,
            affinity_key=None if params.out_of_band else core.conversation_id,
            metadata=params.metadata,
        )

    def _response_json(
        self,
        r: ResponseState,
        status: str,
        details: dict[str, Any] | None = None,
        output: list[codec.JSON] | None = None,
        usage: codec.JSON | None = None,
    ) -> codec.JSON:
        return {
            "object": "realtime.response",
            "id": r.id,
            "status": status,
            "status_details": details,
            "output": output or [],
            "conversation_id": self.core.conversation_id if r.in_conversation else None,
            "output_modalities": ["text"],
            "max_output_tokens": "inf" if r.max_output_tokens is None else r.max_output_tokens,
            "metadata": r.spec.metadata,
            "usage": usage,
        }

    def response_continued(self, r: ResponseState) -> None:
        """A response taken over from another process goes on here."""
        if r.id == self._pending_in_conversation:
            self._in_conversation = r

    def response_started(self, r: ResponseState) -> None:
        self.core.outbox.put(
            codec.event("response.created", response=self._response_json(r, "in_progress"))
        )
        self._put_rate_limits()

    def _put_rate_limits(self) -> None:
        """``rate_limits.updated``: the tenant's requests and tokens left this minute, where
        its key has such limits; else the scheduler's capacity now (docs/protocol.md)."""
        s = self.core.scheduler
        tenant_limits = s.tenants.remaining(self.core.tenant)
        if tenant_limits:
            self.core.outbox.put(codec.event("rate_limits.updated", rate_limits=tenant_limits))
            return
        limit = s.max_running + s.max_queued
        limits: list[codec.JSON] = [
            {"name": "requests", "limit": limit, "remaining": max(0, limit - s.running - s.queued)}
        ]
        window = s.engine.context_window
        if window is not None:
            limits.append({"name": "tokens", "limit": window})
        self.core.outbox.put(codec.event("rate_limits.updated", rate_limits=limits))

    def text_opened(self, r: ResponseState) -> None:
        put, ev = self.core.outbox.put, codec.event
        item_json = rt.message_item(r.item_id, "assistant", "", "in_progress")
        item_json["content"] = []
        put(
            ev(
                "response.output_item.added",
                response_id=r.id,
                output_index=r.text_index,
                item=item_json,
            )
        )
        if r.in_conversation:
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

    def prompt_logprobs(self, r: ResponseState, logprobs: PromptLogprobs) -> None:
        """Never asked for on this API."""

    def text_delta(
        self, r: ResponseState, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> None:
        self.core.outbox.put(
            codec.event(
                "response.output_text.delta",
                response_id=r.id,
                item_id=r.item_id,
                output_index=r.text_index,
                content_index=0,
                delta=text,
            )
        )

    def call_opened(self, r: ResponseState, call: CallState) -> None:
        item = Item.function_call(call.item_id, call.call_id, call.name, "", "in_progress")
        item_json = rt.item_json(item)
        put = self.core.outbox.put
        put(
            codec.event(
                "response.output_item.added",
                response_id=r.id,
                output_index=call.output_index,
                item=item_json,
            )
        )
        if r.in_conversation:
            put(
                codec.event(
                    "conversation.item.added",
                    previous_item_id=call.previous_item_id,
                    item=item_json,
                )
            )

    def call_delta(self, r: ResponseState, call: CallState, arguments: str) -> None:
        self.core.outbox.put(
            codec.event(
                "response.function_call_arguments.delta",
                response_id=r.id,
                item_id=call.item_id,
                output_index=call.output_index,
                call_id=call.call_id,
                delta=arguments,
            )
        )

    def _response_cancel(self, event: rt.ResponseCancel) -> None:
        target = self._cancel_target(event.response_id)
        if target is None:
            what = (
                f"response '{event.response_id}' is not active"
                if event.response_id
                else ("no response is active")
            )
            raise errors.ProtocolError(
                "response_cancel_not_active",
                f"Cancellation failed: {what}.",
                param="response_id" if event.response_id else None,
                event_id=event.event_id,
            )
        self.core.cancel_response(target)

    def _cancel_target(self, response_id: str | None) -> ResponseState | None:
        live = [r for r in self.core.responses if not r.cancelling]
        if response_id is not None:
            return next((r for r in live if r.id == response_id), None)
        if self._in_conversation is not None and not self._in_conversation.cancelling:
            return self._in_conversation
        return live[-1] if live else None

    def response_ended(self, r: ResponseState, outcome: Outcome) -> None:
        if r is self._in_conversation:
            self._in_conversation = None
        if outcome.error is not None:
            error = outcome.error
            self.core.error(
                errors.ProtocolError(error.code, error.message, error_type=error.error_type)
            )
        # Each output item's closing events: the message's first, then the calls'.
        status = item_status(outcome)
        closings: list[tuple[int, codec.JSON]] = []
        if r.text_index is not None:
            closings.append((r.text_index, self._close_text(r, outcome.text, status)))
        for call in r.calls.values():
            closings.append((call.output_index, self._close_call(r, call, status)))
        closings.sort(key=lambda closing: closing[0])
        details = status_details(outcome)
        usage = rt.usage_json(outcome.usage)
        output = [item for _, item in closings]
        body = self._response_json(r, outcome.status, details, output, usage)
        self.core.outbox.put(codec.event("response.done", response=body))

    def _close_text(self, r: ResponseState, text: str, status: str) -> codec.JSON:
        assert r.text_index is not None
        put, ev = self.core.outbox.put, codec.event
        ids = {
            "response_id": r.id,
            "item_id": r.item_id,
            "output_index": r.text_index,
            "content_index": 0,
        }
        put(ev("response.output_text.done", **ids, text=text))
        put(ev("response.content_part.done", **ids, part={"type": "text", "text": text}))
        item_json = rt.message_item(r.item_id, "assistant", text, status)
        put(
            ev(
                "response.output_item.done",
                response_id=r.id,
                output_index=r.text_index,
                item=item_json,
            )
        )
        if r.in_conversation:
            put(ev("conversation.item.done", previous_item_id=r.previous_item_id, item=item_json))
        return item_json

    def _close_call(self, r: ResponseState, call: CallState, status: str) -> codec.JSON:
        put, ev = self.core.outbox.put, codec.event
        arguments = call.arguments
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
        item_json = rt.function_call_item(call.item_id, call.call_id, call.name, arguments, status)
        put(
            ev(
                "response.output_item.done",
                response_id=r.id,
                output_index=call.output_index,
                item=item_json,
            )
        )
        if r.in_conversation:
            put(
                ev("conversation.item.done", previous_item_id=call.previous_item_id, item=item_json)
            )
        return item_json


def session_json(session_id: str, c: SessionConfig) -> codec.JSON:
    """The ``session`` object of ``session.created``, ``.updated`` and ``.resumed``."""
    return {
        "object": "realtime.session",
        "type": "realtime",
        "id": session_id,
        "model": c.model,
        "output_modalities": ["text"],
        "instructions": c.instructions,
        "max_output_tokens": "inf" if c.max_output_tokens is None else c.max_output_tokens,
        "temperature": c.temperature,
        "top_p": c.top_p,
        "seed": c.seed,
        "stop": list(c.stop),
        "frequency_penalty": c.frequency_penalty,
        "presence_penalty": c.presence_penalty,
        "tools": codec.tools_json(c.tools),
        "tool_choice": codec.tool_choice_json(c.tool_choice),
    }


def resumed_event(session_id: str, config: SessionConfig, resume_token: str) -> bytes:
    """``session.resumed`` (never numbered: it is not part of the session's events)."""
    return codec.encode(
        codec.event(
            "session.resumed",
            event_id=codec.new_id("event"),
            session=session_json(session_id, config),
            resume_token=resume_token,
        )
    )


def status_details(outcome: Outcome) -> dict[str, Any]:
    """A Realtime response's ``status_details`` for ``outcome``."""
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


def _not_found(item_id: str, param: str, event_id: str | None) -> errors.ProtocolError:
    return errors.ProtocolError(
        "item_not_found",
        f"No item with id '{item_id}' in the conversation.",
        param=param,
        event_id=event_id,
    )


def item_from_spec(spec: codec.AnyItemSpec, item_id: str) -> Item:
    if isinstance(spec, codec.FunctionCallSpec):
        return Item.function_call(item_id, spec.call_id, spec.name, spec.arguments, "completed")
    if isinstance(spec, codec.FunctionCallOutputSpec):
        return Item.function_call_output(item_id, spec.call_id, spec.output)
    return Item(item_id, spec.role, spec.text)


def input_items(
    specs: tuple[codec.AnyItemSpec, ...],
    param: str,
    event_id: str | None,
    history: tuple[Item, ...] = (),
) -> list[Item]:
    """A response's own ``input``: an output must answer a call in that same list (or
    in ``history``, the items it continues)."""
    items = [item_from_spec(spec, spec.id or "") for spec in specs]
    calls = {i.call_id for i in (*history, *items) if i.kind == "function_call"}
    for index, item in enumerate(items):
        if item.kind == "function_call_output" and item.call_id not in calls:
            raise call_not_found(item.call_id or "", f"{param}[{index}].call_id", event_id)
    return items


def call_not_found(call_id: str, param: str, event_id: str | None) -> errors.ProtocolError:
    return errors.ProtocolError(
        "call_not_found",
        f"No function_call with call_id '{call_id}' to answer: add the call first.",
        param=param,
        event_id=event_id,
    )


def check_named_choice(
    tools: tuple[Tool, ...], choice: ToolChoice, where: str, event_id: str | None
) -> None:
    """A ``tool_choice`` that names a function must name one of the tools."""
    if choice in TOOL_CHOICE_MODES or any(t.name == choice for t in tools):
        return
    prefix = f"{where}." if where else ""
    raise errors.ProtocolError(
        "invalid_value",
        f"'{prefix}tool_choice' names the function '{choice}', which is not in the tools.",
        param=f"{prefix}tool_choice.name",
        event_id=event_id,
    )


def check_tool_choice(
    tools: tuple[Tool, ...], choice: ToolChoice, where: str, event_id: str | None
) -> None:
    """The tools and choice a response runs with agree (``where``: the param's prefix)."""
    check_named_choice(tools, choice, where, event_id)
    if choice == "required" and not tools:
        prefix = f"{where}." if where else ""
        raise errors.ProtocolError(
            "invalid_value",
            f"'{prefix}tool_choice' is 'required' but there are no tools to call.",
            param=f"{prefix}tool_choice",
            event_id=event_id,
        )
