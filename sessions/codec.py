"""The codec the dialects share: ids, the field readers, item specs, server event helpers.

Nothing here does I/O or knows a dialect's event names: :class:`Reader` validates one JSON
object's fields and raises :class:`~sessions.errors.ProtocolError` naming the param;
:func:`read_frame` opens any client frame; :func:`encode` and :func:`event` build server
events as dicts and bytes. Each dialect's own codec (``sessions/realtime/codec.py``,
``sessions/responses/codec.py``, ``sessions/chat/codec.py``, ``sessions/completions/codec.py``)
is built from these.
"""

from __future__ import annotations

import base64
import enum
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, TypeVar

import orjson

from gateway.engines.base import TOOL_CHOICE_MODES, Role, TokenLogprob, Tool, ToolChoice, Usage
from sessions import strict_schema
from sessions.errors import ProtocolError

JSON: TypeAlias = dict[str, Any]

MAX_STOP_SEQUENCES = 4
MAX_METADATA_PAIRS = 16
MAX_ID_CHARS = 64
MAX_TOOLS = 128
# A prompt_cache_key's engine affinity key, the same on every route: requests that send
# one share an engine slot (its KV cache), whichever API they come by.
PROMPT_CACHE_KEY = "prompt_cache_key "
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# ---------------------------------------------------------------------------
# Ids


ID_RANDOM_BYTES = 10  # 80 bits: no client guesses the id of an item it did not make
# Event ids come from the session's outbox: its random tag and the event's sequence number.
_POOL_BYTES = 4096


class _RandomPool:
    """The OS's random bytes (``os.urandom``, what :mod:`secrets` draws from), read 4 KiB
    at a time: an id used to cost a system call of its own, and a request makes several.
    Each byte is handed out once; a forked child starts with an empty pool. Used on the
    event loop's thread (the session layer's), which needs no lock."""

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._forget)

    def take(self, count: int) -> bytes:
        at = self._at
        end = at + count
        if end > len(self._pool):
            self._pool, at, end = os.urandom(max(_POOL_BYTES, count)), 0, count
        self._at = end
        return self._pool[at:end]

    def _forget(self) -> None:
        self._pool, self._at = b"", 0


_random = _RandomPool()


def random_hex(count: int) -> str:
    """``count`` random bytes as hex (``secrets.token_hex``'s)."""
    return _random.take(count).hex()


def random_token(count: int) -> str:
    """``count`` random bytes as URL-safe base64 (``secrets.token_urlsafe``'s)."""
    return base64.urlsafe_b64encode(_random.take(count)).rstrip(b"=").decode("ascii")


def new_id(prefix: str) -> str:
    """An id no client can predict, such as ``item_9c1e...``: for sessions, conversations,
    items and responses, whose ids a client may also choose (items) or must not guess."""
    return f"{prefix}_{_random.take(ID_RANDOM_BYTES).hex()}"


# ---------------------------------------------------------------------------
# Client events


class _Unset(enum.Enum):
    """Marks a field the client did not send (no string can be mistaken for it)."""

    UNSET = "unset"


Unset = Literal[_Unset.UNSET]
UNSET: Unset = _Unset.UNSET
T = TypeVar("T")


def chosen(value: T | Unset, default: T) -> T:
    """What the client sent, or ``default`` (the session's) where it sent nothing."""
    return default if value is UNSET else value


@dataclass(frozen=True, slots=True)
class ItemSpec:
    """A message item as the client described it."""

    id: str | None
    role: Role
    text: str


@dataclass(frozen=True, slots=True)
class FunctionCallSpec:
    """A ``function_call`` item a client adds (e.g. to restore a history)."""

    id: str | None
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class FunctionCallOutputSpec:
    """A ``function_call_output`` item: the result of the call ``call_id``."""

    id: str | None
    call_id: str
    output: str


AnyItemSpec: TypeAlias = ItemSpec | FunctionCallSpec | FunctionCallOutputSpec

# ---------------------------------------------------------------------------
# Field validation. Each reader takes (value, param path, event_id) and returns
# the typed value or raises ProtocolError naming the param.


class Reader:
    """Validates one JSON object's fields, remembering the event_id for errors.

    A child's path (``tools[3].name``) is spelled out only when an error needs it: a long
    input list is read without a string made per item."""

    __slots__ = ("_index", "_key", "_parent", "_path", "event_id", "obj")

    def __init__(
        self,
        obj: Mapping[str, Any],
        path: str | None,
        event_id: str | None,
        parent: Reader | None = None,
        key: str = "",
        index: int = -1,
    ) -> None:
        self.obj = obj
        self._path = path  # None: the parent's ``key`` (and ``[index]``), when asked
        self._parent = parent
        self._key = key
        self._index = index
        self.event_id = event_id

    @property
    def path(self) -> str:
        if self._path is None:
            assert self._parent is not None
            path = self._parent.param(self._key)
            self._path = path if self._index < 0 else f"{path}[{self._index}]"
        return self._path

    def param(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str, code: str = "invalid_value") -> ProtocolError:
        return ProtocolError(code, message, param=self.param(key), event_id=self.event_id)

    def only(self, allowed: frozenset[str]) -> None:
        for key in self.obj:
            if key not in allowed:
                raise self.fail(
                    key, f"Unknown parameter: '{self.param(key)}'.", "unknown_parameter"
                )

    def has(self, key: str) -> bool:
        return key in self.obj

    def required(self, key: str) -> Any:
        if key not in self.obj:
            raise self.fail(
                key,
                f"Missing required parameter: '{self.param(key)}'.",
                "missing_required_parameter",
            )
        return self.obj[key]

    def string(self, key: str, *, max_chars: int | None = None) -> str:
        value = self.obj[key]
        if not isinstance(value, str):
            raise self.fail(key, f"'{self.param(key)}' must be a string.", "invalid_type")
        if max_chars is not None and len(value) > max_chars:
            raise self.fail(key, f"'{self.param(key)}' is longer than {max_chars} characters.")
        return value

    def optional_string(self, key: str, *, max_chars: int | None = None) -> str | None:
        return None if self.obj.get(key) is None else self.string(key, max_chars=max_chars)

    def boolean(self, key: str) -> bool:
        value = self.obj[key]
        if not isinstance(value, bool):
            raise self.fail(key, f"'{self.param(key)}' must be a boolean.", "invalid_type")
        return value

    def optional_boolean(self, key: str) -> bool | None:
        return None if self.obj.get(key) is None else self.boolean(key)

    def number(self, key: str, low: float, high: float) -> float | None:
        value = self.obj[key]
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise self.fail(key, f"'{self.param(key)}' must be a number.", "invalid_type")
        if not low <= value <= high:
            raise self.fail(key, f"'{self.param(key)}' must be between {low} and {high}.")
        return float(value)

    def integer(self, key: str, low: int, high: int) -> int | None:
        value = self.obj[key]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"'{self.param(key)}' must be an integer.", "invalid_type")
        if not low <= value <= high:
            raise self.fail(key, f"'{self.param(key)}' must be between {low} and {high}.")
        return value

    def max_tokens(self, key: str) -> int | None:
        if self.obj[key] == "inf":
            return None
        value = self.obj[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
            raise self.fail(
                key, f"'{self.param(key)}' must be an integer from 1 to 1000000, or \"inf\"."
            )
        return value

    def stop(self, key: str) -> tuple[str, ...]:
        value = self.obj[key]
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise self.fail(
                key, f"'{self.param(key)}' must be a non-empty string or a list of them."
            )
        if len(items) > MAX_STOP_SEQUENCES:
            raise self.fail(
                key, f"'{self.param(key)}' holds at most {MAX_STOP_SEQUENCES} sequences."
            )
        return tuple(items)

    def modalities(self, key: str) -> None:
        value = self.obj[key]
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise self.fail(key, f"'{self.param(key)}' must be a list of strings.", "invalid_type")
        if value != ["text"]:
            raise self.fail(
                key,
                "This gateway is text only: 'output_modalities' must be [\"text\"].",
                "unsupported_modality",
            )

    def child(self, key: str) -> Reader:
        value = self.obj[key]
        if not isinstance(value, dict):
            raise self.fail(key, f"'{self.param(key)}' must be an object.", "invalid_type")
        return Reader(value, None, self.event_id, self, key)

    def child_at(self, key: str, index: int, value: Any) -> Reader:
        if not isinstance(value, dict):
            raise self.fail(f"{key}[{index}]", "Each item must be an object.", "invalid_type")
        return Reader(value, None, self.event_id, self, key, index)


# Chat Completions' range for both penalties.
PENALTY_RANGE = (-2.0, 2.0)
MAX_CHOICES = 128  # OpenAI's bound on n (and best_of); --max-choices is the gateway's own


def json_body(body: str | bytes) -> dict[str, Any]:
    """An HTTP request's JSON body, which must be an object. Raises :class:`ProtocolError`."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"The body is not valid JSON: {exc}.") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_value", "The body must be a JSON object.")
    return obj


def read_sampling(r: Reader) -> dict[str, float | None]:
    """The sampling fields every dialect reads alike, in OpenAI's ranges: ``temperature``,
    ``top_p`` and the two penalties."""
    fields: dict[str, float | None] = {}
    if r.has("temperature"):
        fields["temperature"] = r.number("temperature", 0.0, 2.0)
    if r.has("top_p"):
        fields["top_p"] = r.number("top_p", 0.0, 1.0)
    for penalty in ("frequency_penalty", "presence_penalty"):
        if r.has(penalty):
            fields[penalty] = r.number(penalty, *PENALTY_RANGE)
    return fields


def read_completion_fields(r: Reader) -> dict[str, Any]:
    """What both completion APIs (Chat Completions, Completions) read alike, by their
    bodies' field names: ``model``, ``stream`` and ``stream_options``
    (``include_usage``), the sampling fields, ``seed``, ``stop`` and ``n``."""
    obj = r.obj
    fields: dict[str, Any] = {}
    if obj.get("model") is not None:
        fields["model"] = r.string("model", max_chars=256)
    if obj.get("stream") is not None:
        fields["stream"] = r.boolean("stream")
    if obj.get("stream_options") is not None:
        options = r.child("stream_options")
        options.only(frozenset({"include_usage", "include_obfuscation"}))
        if options.obj.get("include_usage") is not None:
            fields["include_usage"] = options.boolean("include_usage")
        options.optional_boolean("include_obfuscation")  # no obfuscation: nothing to pad
    fields.update(read_sampling(r))
    if r.has("seed"):
        fields["seed"] = r.integer("seed", 0, 2**64 - 1)
    if r.has("stop"):
        fields["stop"] = r.stop("stop")
    if obj.get("n") is not None:
        fields["n"] = r.integer("n", 1, MAX_CHOICES)  # and at most --max-choices
    return fields


def completion_usage_json(usage: Usage) -> JSON:
    """The ``usage`` of a ``chat.completion`` and of a ``text_completion``."""
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


_TOOL_FIELDS = frozenset({"type", "name", "description", "parameters"})


def read_tools(r: Reader, extra_fields: frozenset[str] = frozenset()) -> tuple[Tool, ...]:
    """Function tools: ``[{type: "function", name, description?, parameters?}]``."""
    value = r.obj["tools"]
    if value is None:
        return ()
    if not isinstance(value, list):
        raise r.fail("tools", f"'{r.param('tools')}' must be a list of tools.", "invalid_type")
    if len(value) > MAX_TOOLS:
        raise r.fail("tools", f"'{r.param('tools')}' holds at most {MAX_TOOLS} tools.")
    tools: list[Tool] = []
    for index, raw in enumerate(value):
        t = r.child_at("tools", index, raw)
        if t.obj.get("type", "function") != "function":
            raise t.fail(
                "type",
                "Only function tools (type 'function') are supported.",
                "unsupported_tool_type",
            )
        t.only(_TOOL_FIELDS | extra_fields)
        t.required("name")
        name = t.string("name")
        if not TOOL_NAME.fullmatch(name):
            raise t.fail(
                "name",
                f"'{t.param('name')}' must be 1 to 64 letters, digits, '_' or '-'.",
            )
        if any(tool.name == name for tool in tools):
            raise t.fail("name", f"Two tools are named '{name}': tool names must be unique.")
        tools.append(function_tool(t, name))
    return tuple(tools)


def function_tool(t: Reader, name: str) -> Tool:
    """A function tool's description, JSON Schema ``parameters`` (an object's) and
    ``strict``: a strict tool's parameters must be inside OpenAI's strict subset."""
    description = t.optional_string("description") or ""
    strict = t.optional_boolean("strict")
    parameters = t.obj.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
        if strict:
            parameters |= {"required": [], "additionalProperties": False}
    elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise t.fail(
            "parameters",
            f"'{t.param('parameters')}' must be a JSON Schema object with type 'object'.",
            "invalid_type" if not isinstance(parameters, dict) else "invalid_value",
        )
    if strict and (why := strict_schema.violation(parameters)) is not None:
        raise ProtocolError(
            "invalid_function_parameters",
            f"Invalid schema for function '{name}': {why}",
            param=t.param("parameters"),
            event_id=t.event_id,
        )
    return Tool(name, description, parameters, strict=bool(strict))


def read_tool_choice(r: Reader) -> ToolChoice:
    """``auto``, ``none``, ``required``, or ``{type: "function", name}`` (the name, returned)."""
    value = r.obj["tool_choice"]
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise r.fail(
                "tool_choice",
                f"'{r.param('tool_choice')}' must be 'auto', 'none', 'required' or "
                '{"type": "function", "name": ...}.',
            )
        return value
    c = r.child("tool_choice")
    c.only(frozenset({"type", "name"}))
    if c.required("type") != "function":
        raise c.fail(
            "type", "Only function tools can be chosen (type 'function').", "unsupported_tool_type"
        )
    c.required("name")
    name = c.string("name", max_chars=64)
    if name in TOOL_CHOICE_MODES:
        # The engines take the chosen name in the same field as the three modes.
        raise c.fail("name", f"A function named '{name}' cannot be chosen by name.")
    return name


def read_metadata(r: Reader) -> dict[str, str] | None:
    value = r.obj["metadata"]
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) <= 512 for k, v in value.items()
        )
    ):
        raise r.fail(
            "metadata", f"'metadata' must map at most {MAX_METADATA_PAIRS} keys to strings."
        )
    return dict(value)


def read_frame(frame: str | bytes) -> tuple[dict[str, Any], str | None, str]:
    """A client frame's JSON object, its ``event_id`` and its ``type`` (any dialect).
    Raises :class:`ProtocolError`."""
    if isinstance(frame, bytes):
        raise ProtocolError(
            "binary_frame_not_supported", "Send client events as JSON in text frames, not binary."
        )
    try:
        obj = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"The frame is not valid JSON: {exc}.") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_event", "A client event must be a JSON object.")
    raw_id = obj.get("event_id")
    event_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= MAX_ID_CHARS else None
    if "event_id" in obj and raw_id is not None and event_id is None:
        raise ProtocolError(
            "invalid_value",
            "'event_id' must be a string of at most 64 characters.",
            param="event_id",
        )
    event_type = obj.get("type")
    if event_type is None:
        raise ProtocolError(
            "missing_required_parameter",
            "Missing required parameter: 'type'.",
            param="type",
            event_id=event_id,
        )
    if not isinstance(event_type, str):
        raise ProtocolError(
            "invalid_type", "'type' must be a string.", param="type", event_id=event_id
        )
    return obj, event_id, event_type


# ---------------------------------------------------------------------------
# Server events


def encode(event: JSON) -> bytes:
    return orjson.dumps(event)


def event(event_type: str, **fields: Any) -> JSON:
    """Any server event: its ``type`` and the given fields. The session's outbox adds
    ``event_id`` and ``sequence_number`` when it writes the event."""
    return {"type": event_type, **fields}


def error_event(err: ProtocolError) -> JSON:
    return event(
        "error",
        error={
            "type": err.error_type,
            "code": err.code,
            "message": err.message,
            "param": err.param,
            "event_id": err.event_id,
        },
    )


def text_logprobs_json(logprobs: Sequence[TokenLogprob]) -> list[JSON]:
    """The ``logprobs`` of a Responses text delta (and of ``response.output_text.done``):
    a shape without bytes. A takeover reads them back from the event log
    (:func:`text_logprobs_from`)."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top],
        }
        for lp in logprobs
    ]


def text_logprobs_from(data: list[JSON]) -> tuple[TokenLogprob, ...]:
    """:func:`text_logprobs_json`'s list back as log probabilities; each token's bytes are
    its text's UTF-8 (exact but for a token that is part of a character)."""
    return tuple(
        TokenLogprob(
            lp["token"],
            lp["logprob"],
            lp["token"].encode(),
            tuple(
                TokenLogprob(t["token"], t["logprob"], t["token"].encode())
                for t in lp.get("top_logprobs") or ()
            ),
        )
        for lp in data
    )


def tools_json(tools: tuple[Tool, ...]) -> list[JSON]:
    return [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": dict(t.parameters),
        }
        for t in tools
    ]


def tool_choice_json(choice: ToolChoice) -> str | JSON:
    return choice if choice in TOOL_CHOICE_MODES else {"type": "function", "name": choice}


def check_model(name: str | None, served: tuple[str, ...], event_id: str | None = None) -> None:
    """Refuse a model name outside ``served`` (``--served-model-name``), as OpenAI refuses
    a model that does not exist; with no names served, any name is (code written for
    another model's name keeps working)."""
    if served and name is not None and name not in served:
        raise ProtocolError(
            "model_not_found",
            f"The model '{name}' does not exist or you do not have access to it.",
            param="model",
            event_id=event_id,
        )


def error_json(err: ProtocolError) -> JSON:
    """OpenAI's error object: an HTTP error's body, or a stream's last ``data:`` (which the
    SDK raises as an ``APIError``)."""
    return {
        "error": {
            "message": err.message,
            "type": err.error_type,
            "param": err.param,
            "code": err.code,
        }
    }


def http_status(err: ProtocolError) -> int:
    """The HTTP status an error stands for (an HTTP answer's, and the Responses WebSocket
    error envelope's ``status``)."""
    return _STATUS_BY_CODE.get(err.code, 500 if err.error_type == "server_error" else 400)


_STATUS_BY_CODE = {
    "previous_response_not_found": 400,
    "response_not_found": 404,
    "model_not_found": 404,
    "overloaded": 429,
    "rate_limit_exceeded": 429,
    "websocket_connection_limit_reached": 400,
    "internal_error": 500,
    "engine_error": 500,
    "engine_unavailable": 503,
}
