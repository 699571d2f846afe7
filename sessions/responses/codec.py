"""Sans-I/O codec for the OpenAI Responses API (its WebSocket events, and the create body
that ``POST /v1/responses`` takes too).

:func:`decode` turns one WebSocket frame into a typed client event; :func:`read_create`
validates a create body wherever it comes from. Both raise
:class:`~sessions.errors.ProtocolError` naming the ``param``. The ``*_json``
functions build the Responses API's objects (items, parts, the ``Response``) as
plain dicts. Nothing here does I/O.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from gateway.engines.base import MAX_TOP_LOGPROBS, Role, TokenLogprob, Tool, ToolChoice
from sessions import formats
from sessions.codec import (
    JSON,
    MAX_ID_CHARS,
    PROMPT_CACHE_KEY,
    UNSET,
    FunctionCallOutputSpec,
    FunctionCallSpec,
    ItemSpec,
    Reader,
    Unset,
    read_frame,
    read_metadata,
    read_sampling,
)
from sessions.errors import ProtocolError
from sessions.responses import tools as rtools

log = logging.getLogger(__name__)

STREAM_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_INPUT_ITEMS = 4096

AnyInput: TypeAlias = ItemSpec | FunctionCallSpec | FunctionCallOutputSpec


@dataclass(frozen=True, slots=True)
class CreateBody:
    """A validated Responses create body; absent fields stay ``UNSET`` (or None)."""

    input: tuple[AnyInput, ...] = ()
    model: str | None = None
    instructions: str | None = None
    tools: tuple[Tool, ...] | Unset = UNSET
    tool_choice: ToolChoice | Unset = UNSET
    parallel_tool_calls: bool = True
    max_output_tokens: int | Unset | None = UNSET
    temperature: float | Unset | None = UNSET
    top_p: float | Unset | None = UNSET
    # Extensions (Chat Completions' names and range): the Responses API has no penalties.
    frequency_penalty: float | Unset | None = UNSET
    presence_penalty: float | Unset | None = UNSET
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream_id: str | None = None
    generate: bool = True
    truncation: str = "disabled"
    stream: bool = False
    background: bool = False
    affinity_key: str | None = None  # from prompt_cache_key
    text_format: JSON | None = None  # text.format, when structured (sessions/formats.py)
    mapped: tuple[rtools.Mapped, ...] = ()  # which of ``tools`` are a namespace's or custom
    hosted_tools: tuple[tuple[str, str], ...] = ()  # (param, type): --hosted-tools decides
    top_logprobs: int | None = None  # as sent (the Response object echoes it)
    # ``include`` names LOGPROBS: each token's log probability with ``top_logprobs``
    # alternatives (0 when unset); None: no log probabilities.
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class Create:
    body: CreateBody


@dataclass(frozen=True, slots=True)
class Cancel:
    response_id: str | None


@dataclass(frozen=True, slots=True)
class Steer:
    previous_response_id: str
    input: tuple[ItemSpec, ...]
    raw_input: Any  # returned as sent in response.steer.failed


@dataclass(frozen=True, slots=True)
class Ignored:
    """A client event the gateway reads and drops (``response.processed``)."""


ClientEvent: TypeAlias = Create | Cancel | Steer | Ignored

SERVED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "metadata",
        "store",
        "previous_response_id",
        "text",
        "truncation",
        "stream",
        "background",
        "prompt_cache_key",  # the engine's affinity key: requests with one share a KV slot
        "include",  # LOGPROBS; its other values ask for what nothing here makes: ignored
        "top_logprobs",
    }
)
# The include value that asks for log probabilities.
LOGPROBS = "message.output_text.logprobs"
# The gateway's extensions: penalties (Chat Completions' names and range), lanes and
# generate: false (the WebSocket's).
EXTENSIONS = frozenset({"frequency_penalty", "presence_penalty", "stream_id", "generate"})
# Accepted and ignored, each for a reason a client can rely on (docs/protocol.md).
IGNORED: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; nothing here is keyed on it",
    "safety_identifier": "the same, under its newer name",
    "prompt_cache_retention": "the engine's cache keeps what it has room for",
    "prompt_cache_options": "the engine's cache keeps what it has room for",
    "service_tier": "one engine serves every request the same way",
    "reasoning": "the engines here do not reason before answering: no reasoning items",
    "stream_options": "obfuscation pads nothing here: events are sent as they are",
    "max_tool_calls": "it bounds built-in (hosted) tool calls, which are not made here",
    "moderation": "no moderation model runs here",
    "context_management": "OpenAI's server-side compaction: a long prompt is cut by 'truncation'",
    "background_options": "a background response runs at once; there are no completion windows",
    "image": "image options; the gateway is text only",
    "access_programs": "OpenAI's domain-specific programs; nothing here is gated by them",
    # Not in openai-python's types: sent by Codex on every request, and accepted by OpenAI.
    "client_metadata": "a client's own tags (Codex sends its ids); they are not kept",
}
# Refused with unsupported_value unless they ask for nothing (null, empty).
REFUSED: dict[str, str] = {
    "conversation": "OpenAI's Conversations API is not served: continue a response by "
    "'previous_response_id', or send the history in 'input'.",
    "prompt": "Stored prompt templates are not served: send 'instructions' and 'input'.",
}
_CREATE_FIELDS = SERVED | EXTENSIONS | frozenset(IGNORED) | frozenset(REFUSED)
_ROLES = ("user", "system", "developer", "assistant")
_PARTS: dict[str, tuple[str, ...]] = {
    "user": ("input_text",),
    "system": ("input_text",),
    "developer": ("input_text",),
    "assistant": ("output_text", "refusal"),
}


def read_create(obj: Mapping[str, Any], allowed_extra: frozenset[str] = frozenset()) -> CreateBody:
    """Validate a create body (the WebSocket event's fields or an HTTP request's JSON)."""
    r = Reader(obj, "", None)
    r.only(_CREATE_FIELDS | allowed_extra)
    for key, message in REFUSED.items():
        if obj.get(key) not in (None, "", {}, []):
            raise r.fail(key, message, "unsupported_value")
    fields: dict[str, Any] = {}
    if r.has("model") and obj["model"] is not None:
        fields["model"] = r.string("model", max_chars=256)
    if r.has("instructions") and obj["instructions"] is not None:
        fields["instructions"] = r.string("instructions")
    toolset = None
    if r.has("tools"):
        toolset = rtools.read_tools(r)
        fields["tools"] = toolset.tools
        fields["mapped"] = toolset.mapped
        fields["hosted_tools"] = toolset.hosted
    if r.has("tool_choice"):
        fields["tool_choice"] = rtools.read_tool_choice(r, toolset)
    for key in ("parallel_tool_calls", "store", "generate", "stream", "background"):
        if obj.get(key) is not None:
            fields[key] = r.boolean(key)
    if r.has("max_output_tokens"):
        value = r.integer("max_output_tokens", 1, 1_000_000)
        fields["max_output_tokens"] = value
    fields.update(read_sampling(r))
    if r.has("metadata"):
        fields["metadata"] = read_metadata(r)
    if r.has("previous_response_id") and obj["previous_response_id"] is not None:
        fields["previous_response_id"] = r.string("previous_response_id", max_chars=MAX_ID_CHARS)
    if r.has("stream_id") and obj["stream_id"] is not None:
        stream_id = obj["stream_id"]
        if not isinstance(stream_id, str) or not STREAM_ID.fullmatch(stream_id):
            raise r.fail(
                "stream_id",
                "'stream_id' must be 1 to 64 letters, digits or '_', '-', '.', ':'.",
                "invalid_stream_id",
            )
        fields["stream_id"] = stream_id
    if r.has("truncation") and obj["truncation"] is not None:
        if obj["truncation"] not in ("auto", "disabled"):
            raise r.fail("truncation", "'truncation' must be 'auto' or 'disabled'.")
        fields["truncation"] = obj["truncation"]
    if r.has("text") and obj["text"] is not None:
        fields["text_format"] = _text_config(r.child("text"))
    if obj.get("prompt_cache_key") is not None:
        fields["affinity_key"] = PROMPT_CACHE_KEY + r.string("prompt_cache_key", max_chars=256)
    if obj.get("top_logprobs") is not None:
        fields["top_logprobs"] = r.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if obj.get("include") is not None and LOGPROBS in _include(r):
        fields["logprobs"] = fields.get("top_logprobs") or 0
    if r.has("input"):
        fields["input"] = read_input(r, "input")
    return CreateBody(**fields)


def _include(r: Reader) -> list[str]:
    """``include``: OpenAI's includables. Only LOGPROBS asks for something made here; the
    others (encrypted reasoning, search sources, images) are accepted and ignored."""
    value = r.obj["include"]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise r.fail("include", "'include' must be a list of strings.", "invalid_type")
    return value


def _text_config(t: Reader) -> JSON | None:
    """``text``: its ``format`` (None: plain text); ``verbosity`` is accepted and ignored
    (the length is asked for with ``max_output_tokens``)."""
    t.only(frozenset({"format", "verbosity"}))
    if t.obj.get("verbosity") not in (None, "low", "medium", "high"):
        raise t.fail("verbosity", "'text.verbosity' must be 'low', 'medium' or 'high'.")
    if t.obj.get("format") is None:
        return None
    return formats.read_format(t.child("format"), nested=False)


def read_input(r: Reader, key: str) -> tuple[AnyInput, ...]:
    """``input``: a string (one user message) or a list of items."""
    value = r.obj[key]
    if value is None:
        return ()
    if isinstance(value, str):
        return (ItemSpec(None, "user", value),)
    if not isinstance(value, list):
        raise r.fail(key, f"'{r.param(key)}' must be a string or a list of items.", "invalid_type")
    if len(value) > MAX_INPUT_ITEMS:
        raise r.fail(key, f"'{r.param(key)}' holds at most {MAX_INPUT_ITEMS} items.")
    items: list[AnyInput] = []
    for index, raw in enumerate(value):
        item = _common_item(raw)
        if item is None:  # read field by field, for the error that names its param
            item = _input_item(r.child_at(key, index, raw))
        if not isinstance(item, _Reasoning):
            items.append(item)
    return tuple(items)


def _common_item(obj: object) -> AnyInput | _Reasoning | None:
    """:func:`_input_item`'s answer for a well-formed item of the kinds agents send back
    and forth (messages of text parts, function calls, their string outputs, reasoning),
    read without a :class:`Reader` per item and part; None for anything else (anything
    wrong included), which :func:`_input_item` reads, and refuses naming the param."""
    if type(obj) is not dict:
        return None
    get = obj.get
    item_id = get("id")
    if item_id is not None and (type(item_id) is not str or len(item_id) > MAX_ID_CHARS):
        return None
    kind = get("type", "message" if "role" in obj else None)
    if kind == "message":
        role = get("role")
        if role not in _ROLES:
            return None
        content = get("content")
        if type(content) is str:
            text = content
        elif type(content) is list and content:
            allowed, texts = _PARTS[role], []
            for part in content:
                if type(part) is not dict:
                    return None
                part_type = part.get("type")
                if part_type not in allowed:
                    return None
                part_text = part.get("refusal" if part_type == "refusal" else "text")
                if type(part_text) is not str:
                    return None
                texts.append(part_text)
            text = "".join(texts)
        else:
            return None
        return ItemSpec(item_id, "system" if role == "developer" else role, text)
    if kind == "function_call":
        name, call_id, arguments = get("name"), get("call_id"), get("arguments")
        if type(name) is not str or len(name) > 64 or type(arguments) is not str:
            return None
        if type(call_id) is not str or len(call_id) > MAX_ID_CHARS:
            return None
        namespace = get("namespace")
        if namespace is not None:
            if type(namespace) is not str or len(namespace) > 64:
                return None
            if namespace:
                name = f"{namespace}{rtools.NAMESPACE_SEPARATOR}{name}"
        return FunctionCallSpec(item_id, call_id, name, arguments)
    if kind in ("function_call_output", "custom_tool_call_output"):
        call_id, output = get("call_id"), get("output")
        if type(call_id) is not str or len(call_id) > MAX_ID_CHARS or type(output) is not str:
            return None
        return FunctionCallOutputSpec(item_id, call_id, output)
    return REASONING if kind == "reasoning" else None


class _Reasoning:
    """A ``reasoning`` item a client sends back (Codex sends every one it got, with
    ``encrypted_content``): accepted and left out of the prompt, since no engine here
    reasons, and an OpenAI model's encrypted reasoning means nothing to another model."""


REASONING = _Reasoning()


def _input_item(r: Reader) -> AnyInput | _Reasoning:
    kind = r.obj.get("type", "message" if "role" in r.obj else None)
    if kind == "message":
        return _message(r)
    # Fields beyond these are left alone: clients send back output items as they got
    # them (with ids, statuses and annotations), and new fields keep arriving.
    if kind == "function_call":
        name = _name(r)
        namespace = r.optional_string("namespace", max_chars=64)
        if namespace:  # as the model was offered it (sessions/responses/tools.py)
            name = f"{namespace}{rtools.NAMESPACE_SEPARATOR}{name}"
        return FunctionCallSpec(
            _optional_id(r),
            _required_string(r, "call_id"),
            name,
            _required_string(r, "arguments"),
        )
    if kind == "custom_tool_call":
        # As the model was offered it: a function whose one parameter is the input.
        name = _name(r)
        namespace = r.optional_string("namespace", max_chars=64)
        if namespace:
            name = f"{namespace}{rtools.NAMESPACE_SEPARATOR}{name}"
        arguments = json.dumps({"input": _required_string(r, "input")}, ensure_ascii=False)
        return FunctionCallSpec(_optional_id(r), _required_string(r, "call_id"), name, arguments)
    if kind in ("function_call_output", "custom_tool_call_output"):
        # Its call_id names the call; a namespace beside it adds nothing.
        return FunctionCallOutputSpec(_optional_id(r), _required_string(r, "call_id"), _output(r))
    if kind == "reasoning":
        return REASONING
    raise r.fail(
        "type",
        f"Input items of type {str(kind)[:64]!r} are not supported: use 'message', "
        "'function_call', 'custom_tool_call', their outputs (or send back 'reasoning' "
        "items, which are left out of the prompt).",
        "unsupported_value" if isinstance(kind, str) else "invalid_value",
    )


def _message(r: Reader) -> ItemSpec:
    role = r.required("role")
    if role not in _ROLES:
        raise r.fail("role", "'role' must be one of 'user', 'system', 'developer', 'assistant'.")
    content = r.required("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and content:
        texts = []
        for index, raw in enumerate(content):
            part = r.child_at("content", index, raw)
            kind = part.required("type")
            if kind not in _PARTS[role]:
                code = "unsupported_value" if kind in ("input_image", "input_file") else None
                raise part.fail(
                    "type",
                    f"A {role} message's parts must be {' or '.join(_PARTS[role])} "
                    "(this gateway is text only).",
                    code or "invalid_value",
                )
            key = "refusal" if kind == "refusal" else "text"
            part.required(key)
            texts.append(part.string(key))
        text = "".join(texts)
    else:
        raise r.fail(
            "content", "'content' must be a string or a non-empty list of parts.", "invalid_type"
        )
    chat_role: Role = "system" if role == "developer" else role
    return ItemSpec(_optional_id(r), chat_role, text)


def _output(r: Reader) -> str:
    value = r.required("output")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, raw in enumerate(value):
            part = r.child_at("output", index, raw)
            if part.required("type") != "input_text":
                raise part.fail("type", "Tool output parts must be 'input_text' (text only).")
            part.required("text")
            texts.append(part.string("text"))
        return "".join(texts)
    raise r.fail("output", "'output' must be a string or a list of parts.", "invalid_type")


def _optional_id(r: Reader) -> str | None:
    return r.optional_string("id", max_chars=MAX_ID_CHARS)


def _required_string(r: Reader, key: str) -> str:
    r.required(key)
    return r.string(key, max_chars=MAX_ID_CHARS if key == "call_id" else None)


def _name(r: Reader) -> str:
    r.required("name")
    return r.string("name", max_chars=64)


def _steer(r: Reader) -> Steer:
    r.only(frozenset({"type", "previous_response_id", "input"}))
    r.required("previous_response_id")
    target = r.string("previous_response_id", max_chars=MAX_ID_CHARS)
    r.required("input")
    items = read_input(r, "input")
    if not items:
        raise r.fail("input", "'input' must not be empty.")
    for index, item in enumerate(items):
        if not isinstance(item, ItemSpec) or item.role != "user":
            raise r.fail(f"input[{index}]", "Steering input must be user messages.")
    return Steer(target, tuple(i for i in items if isinstance(i, ItemSpec)), r.obj["input"])


def decode(frame: str | bytes) -> ClientEvent:
    """Parse and validate one client frame of the Responses WebSocket."""
    obj, _, event_type = read_frame(frame)
    try:
        if event_type == "response.create":
            body = {k: v for k, v in obj.items() if k != "type"}
            return Create(read_create(body))
        if event_type == "response.cancel":
            r = Reader(obj, "", None)
            r.only(frozenset({"type", "response_id"}))
            return Cancel(r.optional_string("response_id", max_chars=MAX_ID_CHARS))
        if event_type == "response.steer":
            return _steer(Reader(obj, "", None))
        if event_type == "response.processed":
            return Ignored()
    except ProtocolError:
        raise
    except Exception:  # a validator's bug must cost one event, not the connection
        log.exception("failed to decode a %s event", event_type)
        raise ProtocolError(
            "invalid_event", "The gateway could not read this event.", error_type="server_error"
        ) from None
    raise ProtocolError(
        "unknown_event_type",
        f"Unknown event type '{event_type[:64]}': this socket takes response.create, "
        "response.cancel and response.steer.",
        param="type",
    )


# ---------------------------------------------------------------------------
# Objects


def text_part(text: str, logprobs: Sequence[TokenLogprob] | None = None) -> JSON:
    """An ``output_text`` part; its ``logprobs`` with their bytes (the part's shape)."""
    return {
        "type": "output_text",
        "text": text,
        "annotations": [],
        "logprobs": [] if logprobs is None else [_part_logprob(lp) for lp in logprobs],
    }


def _part_logprob(lp: TokenLogprob) -> JSON:
    return {
        "token": lp.token,
        "bytes": list(lp.bytes),
        "logprob": lp.logprob,
        "top_logprobs": [
            {"token": t.token, "bytes": list(t.bytes), "logprob": t.logprob} for t in lp.top
        ],
    }


def message_json(
    item_id: str,
    text: str | None,
    status: str,
    logprobs: Sequence[TokenLogprob] | None = None,
) -> JSON:
    """An assistant output message (``text`` None: opened, no part yet)."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [text_part(text, logprobs)],
    }


def function_call_json(item_id: str, call_id: str, name: str, arguments: str, status: str) -> JSON:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def usage_json(input_tokens: int, output_tokens: int, cached_tokens: int) -> JSON:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def error_json(err: ProtocolError, status: int) -> JSON:
    """The WebSocket error envelope: ``{type: error, status, error: {...}}``."""
    return {
        "type": "error",
        "status": status,
        "error": {
            "type": err.error_type,
            "code": err.code,
            "message": err.message,
            "param": err.param,
        },
    }
