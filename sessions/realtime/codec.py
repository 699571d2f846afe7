"""Sans-I/O codec for the text subset of the OpenAI Realtime API (GA event names).

:func:`decode` turns one WebSocket frame into a typed client event or raises
:class:`~sessions.errors.ProtocolError`, which carries everything an ``error`` event needs.
The item and usage builders make the Realtime shapes of the server events. Nothing here does
I/O, so every rule of the wire format is testable with strings alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from gateway.engines.base import Role, Tool, ToolChoice, Usage
from sessions.codec import (
    JSON,
    MAX_ID_CHARS,
    TOOL_NAME,
    UNSET,
    AnyItemSpec,
    FunctionCallOutputSpec,
    FunctionCallSpec,
    ItemSpec,
    Reader,
    Unset,
    read_frame,
    read_metadata,
    read_sampling,
    read_tool_choice,
    read_tools,
)
from sessions.conversation import Item
from sessions.errors import ProtocolError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionPatch:
    """The validated fields of a ``session.update``; absent ones stay ``UNSET``."""

    instructions: str | Unset = UNSET
    max_output_tokens: int | Unset | None = UNSET  # None means "inf"
    temperature: float | Unset | None = UNSET
    top_p: float | Unset | None = UNSET
    seed: int | Unset | None = UNSET
    stop: tuple[str, ...] | Unset = UNSET
    frequency_penalty: float | Unset | None = UNSET
    presence_penalty: float | Unset | None = UNSET
    model: str | Unset = UNSET
    tools: tuple[Tool, ...] | Unset = UNSET
    tool_choice: ToolChoice | Unset = UNSET


@dataclass(frozen=True, slots=True)
class ResponseParams:
    instructions: str | Unset = UNSET
    max_output_tokens: int | Unset | None = UNSET
    temperature: float | Unset | None = UNSET
    top_p: float | Unset | None = UNSET
    seed: int | Unset | None = UNSET
    stop: tuple[str, ...] | Unset = UNSET
    frequency_penalty: float | Unset | None = UNSET
    presence_penalty: float | Unset | None = UNSET
    tools: tuple[Tool, ...] | Unset = UNSET
    tool_choice: ToolChoice | Unset = UNSET
    metadata: dict[str, str] | None = None
    out_of_band: bool = False  # conversation: "none"
    input: tuple[AnyItemSpec, ...] | None = None


@dataclass(frozen=True, slots=True)
class SessionUpdate:
    event_id: str | None
    patch: SessionPatch


@dataclass(frozen=True, slots=True)
class ItemCreate:
    event_id: str | None
    item: AnyItemSpec
    previous_item_id: str | None = None  # None: append; "root": insert first


@dataclass(frozen=True, slots=True)
class ItemDelete:
    event_id: str | None
    item_id: str


@dataclass(frozen=True, slots=True)
class ItemRetrieve:
    event_id: str | None
    item_id: str


@dataclass(frozen=True, slots=True)
class ResponseCreate:
    event_id: str | None
    params: ResponseParams = field(default_factory=ResponseParams)


@dataclass(frozen=True, slots=True)
class ResponseCancel:
    event_id: str | None
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class SessionResume:
    """``session.resume``: the first event of a new connection that takes over a session
    whose connection dropped (a gateway extension; docs/protocol.md, "Resuming")."""

    event_id: str | None
    session_id: str
    resume_token: str = field(repr=False)  # a secret: never in a log line
    last_sequence_number: int = 0


ClientEvent: TypeAlias = (
    SessionUpdate
    | ItemCreate
    | ItemDelete
    | ItemRetrieve
    | ResponseCreate
    | ResponseCancel
    | SessionResume
)


_SAMPLING = frozenset(
    {"temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty"}
)
# Fields the SDK may send (or echo back from session.created) that a text-only gateway
# can accept as long as they ask for nothing it lacks. ``parallel_tool_calls`` is
# accepted and ignored: how many calls a response holds is the model's choice.
_IGNORED = frozenset(
    {"tracing", "truncation", "include", "prompt", "expires_at", "parallel_tool_calls"}
)
# Audio settings that agent frameworks send in their default session setup. With text
# output they configure nothing that happens, so they are accepted and ignored; what
# would really need audio (audio output, audio input events and parts) is refused.
_AUDIO_SETTINGS = frozenset(
    {
        "audio",
        "voice",
        "input_audio_format",
        "output_audio_format",
        "turn_detection",
        "input_audio_transcription",
        "input_audio_noise_reduction",
        "speed",
    }
)
_SESSION_FIELDS = frozenset(
    {"type", "model", "instructions", "output_modalities", "max_output_tokens", "object", "id"}
    | {"tools", "tool_choice"}
    | _IGNORED
    | _AUDIO_SETTINGS
    | _SAMPLING
)


def _sampling(r: Reader) -> dict[str, Any]:
    """The fields shared by ``session`` and ``response``: sampling, instructions, tools."""
    out: dict[str, Any] = dict(read_sampling(r))
    if r.has("seed"):
        # Unsigned 64-bit for every engine: TensorRT-LLM fails a request whose seed is not.
        out["seed"] = r.integer("seed", 0, 2**64 - 1)
    if r.has("stop"):
        out["stop"] = r.stop("stop")
    if r.has("max_output_tokens"):
        out["max_output_tokens"] = r.max_tokens("max_output_tokens")
    if r.has("instructions"):
        out["instructions"] = r.string("instructions")
    if r.has("output_modalities"):
        r.modalities("output_modalities")
    if r.has("tools"):
        out["tools"] = read_tools(r)
    if r.has("tool_choice"):
        out["tool_choice"] = read_tool_choice(r)
    r.optional_boolean("parallel_tool_calls")
    return out


def _audio_settings(r: Reader) -> None:
    """Accept the audio settings (text output: nothing to configure) if they are well formed."""
    value = r.obj.get("audio")
    if value is not None and not isinstance(value, dict):
        raise r.fail("audio", f"'{r.param('audio')}' must be an object.", "invalid_type")


def _session_update(r: Reader) -> SessionUpdate:
    s = r.child("session") if r.has("session") else Reader({}, "session", r.event_id)
    s.only(_SESSION_FIELDS)
    if s.has("type") and s.obj["type"] != "realtime":
        raise s.fail("type", "Only session type 'realtime' is supported.")
    _audio_settings(s)
    fields = _sampling(s)
    if s.has("model"):
        fields["model"] = s.string("model", max_chars=256)
    return SessionUpdate(r.event_id, SessionPatch(**fields))


_ROLE_PART = {"user": "input_text", "system": "input_text", "assistant": "output_text"}
_ROLE_NAMES = tuple(_ROLE_PART)
_ITEM_FIELDS = frozenset({"id", "type", "role", "content", "object", "status"})
_CALL_FIELDS = frozenset({"id", "type", "object", "status", "call_id", "name", "arguments"})
_OUTPUT_FIELDS = frozenset({"id", "type", "object", "status", "call_id", "output"})


def _item(r: Reader) -> AnyItemSpec:
    item_type = r.required("type")
    if item_type == "function_call":
        return _function_call(r)
    if item_type == "function_call_output":
        return _function_call_output(r)
    if item_type != "message":
        raise r.fail("type", "'type' must be 'message', 'function_call' or 'function_call_output'.")
    r.only(_ITEM_FIELDS)
    role = r.required("role")
    if role not in _ROLE_NAMES:  # a tuple: an unhashable role (a list) is no TypeError
        raise r.fail("role", "'role' must be one of 'user', 'system', 'assistant'.")
    content = r.required("content")
    if not isinstance(content, list) or not content:
        raise r.fail("content", "'content' must be a non-empty list of parts.", "invalid_type")
    texts = []
    for index, part in enumerate(content):
        p = Reader(part, f"{r.param('content')}[{index}]", r.event_id)
        if not isinstance(part, dict):
            raise r.fail(
                f"content[{index}]", "Each content part must be an object.", "invalid_type"
            )
        part_type = p.required("type")
        if part_type not in (_ROLE_PART[role], "text"):
            code = "unsupported_modality" if "audio" in str(part_type) else "invalid_value"
            raise p.fail("type", f"A {role} message part must be '{_ROLE_PART[role]}'.", code)
        p.only(frozenset({"type", "text"}))
        p.required("text")
        texts.append(p.string("text"))
    return ItemSpec(r.optional_string("id", max_chars=MAX_ID_CHARS), role, "".join(texts))


def _call_id(r: Reader) -> str:
    r.required("call_id")
    call_id = r.string("call_id", max_chars=MAX_ID_CHARS)
    if not call_id:
        raise r.fail("call_id", f"'{r.param('call_id')}' must not be empty.")
    return call_id


def _function_call(r: Reader) -> FunctionCallSpec:
    r.only(_CALL_FIELDS)
    call_id = _call_id(r)
    r.required("name")
    name = r.string("name")
    if not TOOL_NAME.fullmatch(name):
        raise r.fail("name", f"'{r.param('name')}' must be 1 to 64 letters, digits, '_' or '-'.")
    r.required("arguments")
    arguments = r.string("arguments")
    return FunctionCallSpec(
        r.optional_string("id", max_chars=MAX_ID_CHARS), call_id, name, arguments
    )


def _function_call_output(r: Reader) -> FunctionCallOutputSpec:
    r.only(_OUTPUT_FIELDS)
    call_id = _call_id(r)
    r.required("output")
    output = r.string("output")
    return FunctionCallOutputSpec(r.optional_string("id", max_chars=MAX_ID_CHARS), call_id, output)


def _item_create(r: Reader) -> ItemCreate:
    r.only(frozenset({"type", "event_id", "item", "previous_item_id"}))
    r.required("item")
    previous = r.optional_string("previous_item_id", max_chars=MAX_ID_CHARS)
    return ItemCreate(r.event_id, _item(r.child("item")), previous)


def _item_id_event(r: Reader) -> str:
    r.only(frozenset({"type", "event_id", "item_id"}))
    r.required("item_id")
    return r.string("item_id", max_chars=MAX_ID_CHARS)


def _item_truncate(r: Reader) -> ClientEvent:
    raise ProtocolError(
        "unsupported_modality",
        "conversation.item.truncate cuts the audio of an item; this gateway speaks text only, "
        "so there is no audio to truncate (delete the item, or add a shorter one, instead).",
        param="type",
        event_id=r.event_id,
    )


_RESPONSE_FIELDS = frozenset(
    {"instructions", "max_output_tokens", "metadata", "conversation", "input", "output_modalities"}
    | {"tools", "tool_choice", "prompt", "parallel_tool_calls"}
    | {"audio", "voice", "output_audio_format"}
    | _SAMPLING
)


def _response_create(r: Reader) -> ResponseCreate:
    r.only(frozenset({"type", "event_id", "response"}))
    if not r.has("response") or r.obj["response"] is None:
        return ResponseCreate(r.event_id)
    p = r.child("response")
    p.only(_RESPONSE_FIELDS)
    _audio_settings(p)
    fields = _sampling(p)
    metadata = read_metadata(p) if p.has("metadata") else None
    out_of_band = False
    if p.has("conversation"):
        if p.obj["conversation"] not in ("auto", "none"):
            raise p.fail("conversation", "'conversation' must be 'auto' or 'none'.")
        out_of_band = p.obj["conversation"] == "none"
    items: tuple[AnyItemSpec, ...] | None = None
    if p.has("input"):
        raw = p.obj["input"]
        if not isinstance(raw, list):
            raise p.fail("input", "'input' must be a list of items.", "invalid_type")
        items = tuple(_item(p.child_at("input", i, value)) for i, value in enumerate(raw))
    return ResponseCreate(
        r.event_id,
        ResponseParams(metadata=metadata, out_of_band=out_of_band, input=items, **fields),
    )


def _response_cancel(r: Reader) -> ResponseCancel:
    r.only(frozenset({"type", "event_id", "response_id"}))
    return ResponseCancel(r.event_id, r.optional_string("response_id", max_chars=MAX_ID_CHARS))


def _session_resume(r: Reader) -> SessionResume:
    r.only(frozenset({"type", "event_id", "session_id", "resume_token", "last_sequence_number"}))
    r.required("session_id")
    r.required("resume_token")
    r.required("last_sequence_number")
    last = r.integer("last_sequence_number", 0, 2**53)
    if last is None:
        raise r.fail("last_sequence_number", "'last_sequence_number' must be an integer.")
    return SessionResume(
        r.event_id,
        r.string("session_id", max_chars=MAX_ID_CHARS),
        r.string("resume_token", max_chars=256),
        last,
    )


_DECODERS: dict[str, Callable[[Reader], ClientEvent]] = {
    "session.update": _session_update,
    "session.resume": _session_resume,
    "conversation.item.create": _item_create,
    "conversation.item.delete": lambda r: ItemDelete(r.event_id, _item_id_event(r)),
    "conversation.item.retrieve": lambda r: ItemRetrieve(r.event_id, _item_id_event(r)),
    "conversation.item.truncate": _item_truncate,
    "response.create": _response_create,
    "response.cancel": _response_cancel,
}
_AUDIO_EVENTS = ("input_audio_buffer.", "output_audio_buffer.")


def decode(frame: str | bytes) -> ClientEvent:
    """Parse and validate one client frame. Raises :class:`ProtocolError`."""
    obj, event_id, event_type = read_frame(frame)
    decoder = _DECODERS.get(event_type)
    if decoder is None:
        if event_type.startswith(_AUDIO_EVENTS):
            raise ProtocolError(
                "unsupported_modality",
                "Audio is not supported: this gateway speaks text only.",
                param="type",
                event_id=event_id,
            )
        raise ProtocolError(
            "unknown_event_type",
            f"Unknown event type '{event_type[:64]}'.",
            param="type",
            event_id=event_id,
        )
    reader = Reader(obj, "", event_id)
    if event_type == "session.update":
        reader.only(frozenset({"type", "event_id", "session"}))
    try:
        return decoder(reader)
    except ProtocolError:
        raise
    except Exception:  # a validator's bug must cost one event, not the connection
        log.exception("failed to decode a %s event", event_type)
        raise ProtocolError(
            "invalid_event",
            "The gateway could not read this event.",
            event_id=event_id,
            error_type="server_error",
        ) from None


def message_item(item_id: str, role: Role, text: str, status: str = "completed") -> JSON:
    part_type = _ROLE_PART[role]
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": [{"type": part_type, "text": text}],
    }


def item_json(item: Item) -> JSON:
    """A conversation item as the Realtime API shows it (``realtime.item``)."""
    if item.kind == "function_call":
        return function_call_item(
            item.id, item.call_id or "", item.name or "", item.text, item.status
        )
    if item.kind == "function_call_output":
        return function_call_output_item(item.id, item.call_id or "", item.text)
    return message_item(item.id, item.role, item.text, item.status)


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> JSON:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def function_call_output_item(item_id: str, call_id: str, output: str) -> JSON:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call_output",
        "status": "completed",
        "call_id": call_id,
        "output": output,
    }


def usage_json(usage: Usage | None) -> JSON | None:
    if usage is None:
        return None
    return {
        "total_tokens": usage.total_tokens,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "input_token_details": {
            "cached_tokens": usage.cached_tokens,
            "text_tokens": usage.input_tokens,
            "audio_tokens": 0,
        },
        "output_token_details": {"text_tokens": usage.output_tokens, "audio_tokens": 0},
    }
