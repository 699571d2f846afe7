"""Sans-I/O codec for OpenAI Chat Completions: a request body in, chunks and completions out.

:func:`read_body` validates a ``POST /v1/chat/completions`` body into a :class:`ChatBody`
or raises :class:`~sessions.errors.ProtocolError` naming the param. Every field of
openai-python's ``CompletionCreateParams`` has its answer here (docs/protocol.md, "Chat
Completions"): served, accepted and ignored (:data:`IGNORED`, with why), or refused with
``unsupported_value`` when the gateway cannot do what it asks (:data:`REFUSED`). A field
no SDK knows gets ``unknown_parameter``, as OpenAI answers. The ``*_json`` functions build
the ``chat.completion`` and ``chat.completion.chunk`` objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.engines.base import (
    MAX_TOP_LOGPROBS,
    TOOL_CHOICE_MODES,
    Constraint,
    Message,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolChoice,
)
from sessions import formats
from sessions.codec import (
    JSON,
    MAX_ID_CHARS,
    MAX_TOOLS,
    PROMPT_CACHE_KEY,
    TOOL_NAME,
    UNSET,
    Reader,
    Unset,
    function_tool,
    json_body,
    read_completion_fields,
    read_metadata,
)
from sessions.errors import ProtocolError

MAX_MESSAGES = 4096

SERVED = frozenset(
    {
        "messages",
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "n",
        "response_format",
        "logprobs",
        "top_logprobs",
        "metadata",
        "prompt_cache_key",  # the engine's affinity key: its cache (KV slot) is kept warm
    }
)
# Accepted and ignored, each for a reason a client can rely on.
IGNORED: dict[str, str] = {
    "user": "an end-user id for abuse monitoring; this gateway keys nothing on it",
    "safety_identifier": "the same, under its newer name",
    "store": "stored completions are OpenAI's dashboard feature; nothing is kept here",
    "service_tier": "one engine serves every request the same way",
    "reasoning_effort": "the engines here do not reason before answering",
    "verbosity": "the model's length is asked for with max_completion_tokens",
    "prompt_cache_retention": "the engine's cache keeps what it has room for",
    "prompt_cache_options": "the engine's cache keeps what it has room for",
    "moderation": "no moderation model runs here",
}
# Refused with unsupported_value unless they ask for nothing (null, false, empty, text).
REFUSED: dict[str, str] = {
    "audio": "This gateway speaks text only: no audio output.",
    "modalities": "This gateway speaks text only: 'modalities' must be [\"text\"].",
    "functions": "'functions' is deprecated and not served: send 'tools' instead.",
    "function_call": "'function_call' is deprecated and not served: send 'tool_choice'.",
    "logit_bias": "The engines here take no logit bias.",
    "prediction": "Predicted outputs are not served.",
    "web_search_options": "Web search runs on OpenAI's servers; this gateway has none.",
}
_FIELDS = SERVED | frozenset(IGNORED) | frozenset(REFUSED)
# An answer's message as the SDKs hand it back for the history: openai-node's stream
# helper adds ``parsed`` (and ``parsed_arguments`` to its calls), and a message carries
# ``annotations`` and null ``audio`` / ``function_call``. Accepted; only the text and the
# calls go into the prompt.
_ASSISTANT_FIELDS = frozenset(
    {"role", "content", "name", "tool_calls", "refusal", "annotations", "audio"}
    | {"function_call", "parsed"}
)
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclass(frozen=True, slots=True)
class ChatBody:
    messages: tuple[Message, ...]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_output_tokens: int | Unset | None = UNSET
    temperature: float | Unset | None = UNSET
    top_p: float | Unset | None = UNSET
    seed: int | None = None
    stop: tuple[str, ...] | Unset = UNSET
    frequency_penalty: float | Unset | None = UNSET
    presence_penalty: float | Unset | None = UNSET
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    constraint: Constraint | None = None  # from response_format
    metadata: dict[str, str] | None = None
    affinity_key: str | None = None
    n: int = 1  # choices, each its own answer
    # ``logprobs: true``: its ``top_logprobs`` (0 when unset); None: no log probabilities.
    logprobs: int | None = None

    @property
    def has_system(self) -> bool:
        """The request brings its own system (or developer) message."""
        return any(m.role == "system" for m in self.messages)


@dataclass(frozen=True, slots=True)
class ChatCreate:
    """The one command of a Chat Completions session: answer this body."""

    body: ChatBody


def _unsupported(r: Reader, key: str, message: str) -> ProtocolError:
    return r.fail(key, message, "unsupported_value")


def decode(frame: str | bytes) -> ChatCreate:
    """A request body (JSON) as the session's command. Raises :class:`ProtocolError`."""
    return ChatCreate(read_body(json_body(frame)))


def read_body(obj: Mapping[str, Any]) -> ChatBody:
    r = Reader(obj, "", None)
    r.only(_FIELDS)
    _refuse_what_is_not_served(r)
    r.required("messages")
    fields: dict[str, Any] = {"messages": _messages(r), **read_completion_fields(r)}
    for key in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        if obj.get(key) is not None and "max_output_tokens" not in fields:
            fields["max_output_tokens"] = r.integer(key, 1, 1_000_000)
    if obj.get("tools") is not None:
        fields["tools"] = _tools(r)
    if obj.get("tool_choice") is not None:
        fields["tool_choice"] = _tool_choice(r, fields.get("tools", ()))
    if obj.get("parallel_tool_calls") is not None:
        fields["parallel_tool_calls"] = r.boolean("parallel_tool_calls")
    if obj.get("response_format") is not None:
        fmt = formats.read_format(r.child("response_format"), nested=True)
        fields["constraint"] = formats.constraint(fmt) if fmt is not None else None
    if r.has("metadata"):
        fields["metadata"] = read_metadata(r)
    if obj.get("prompt_cache_key") is not None:
        fields["affinity_key"] = PROMPT_CACHE_KEY + r.string("prompt_cache_key", max_chars=256)
    fields["logprobs"] = read_logprobs(r)
    for key in IGNORED:
        if obj.get(key) is not None and key in ("user", "safety_identifier"):
            r.string(key, max_chars=256)
    return ChatBody(**fields)


def read_logprobs(r: Reader) -> int | None:
    """``logprobs`` (a boolean) and ``top_logprobs`` (0-20, only with ``logprobs: true``,
    as OpenAI has it): how many alternatives each token comes with, or None for none."""
    asked = bool(r.optional_boolean("logprobs"))
    top = r.obj.get("top_logprobs")
    if top is None:
        return 0 if asked else None
    if isinstance(top, bool) or not isinstance(top, int):
        raise r.fail("top_logprobs", "'top_logprobs' must be an integer.", "invalid_type")
    if top < 0:
        raise r.fail(
            "top_logprobs",
            "Invalid 'top_logprobs': integer below minimum value. Expected a value >= 0, "
            f"but got {top} instead.",
            "integer_below_min_value",
        )
    if top > MAX_TOP_LOGPROBS:
        raise r.fail(
            "top_logprobs",
            "Invalid 'top_logprobs': integer above maximum value. Expected a value <= "
            f"{MAX_TOP_LOGPROBS}, but got {top} instead.",
            "integer_above_max_value",
        )
    if not asked:
        if top == 0:
            return None  # asks for nothing
        raise r.fail(
            "top_logprobs",
            "The 'top_logprobs' parameter is only allowed when 'logprobs' is enabled.",
        )
    return top


def _refuse_what_is_not_served(r: Reader) -> None:
    obj = r.obj
    for key, message in REFUSED.items():
        value = obj.get(key)
        if key == "modalities" and value in (["text"], None):
            continue
        if value not in (None, False, [], {}):
            raise _unsupported(r, key, message)


def _messages(r: Reader) -> tuple[Message, ...]:
    raw = r.obj["messages"]
    if not isinstance(raw, list) or not raw:
        raise r.fail("messages", "'messages' must be a non-empty list.", "invalid_type")
    if len(raw) > MAX_MESSAGES:
        raise r.fail("messages", f"'messages' holds at most {MAX_MESSAGES} messages.")
    return tuple(_message(r.child_at("messages", i, value)) for i, value in enumerate(raw))


def _message(m: Reader) -> Message:
    role = m.required("role")
    if role not in _ROLES:
        raise m.fail("role", f"'{m.param('role')}' must be one of {', '.join(_ROLES[:-1])}.")
    if role == "function":
        raise _unsupported(m, "role", "'function' messages are deprecated: send 'tool' ones.")
    if role == "tool":
        m.only(frozenset({"role", "content", "tool_call_id"}))
        m.required("tool_call_id")
        call_id = m.string("tool_call_id", max_chars=MAX_ID_CHARS)
        return Message("tool", _content(m, ("text",)), tool_call_id=call_id)
    if role == "assistant":
        m.only(_ASSISTANT_FIELDS)
        for key in ("audio", "function_call"):
            if m.obj.get(key) is not None:
                raise _unsupported(m, key, REFUSED[key])
        text = _content(m, ("text", "refusal"), optional=True)
        calls = _tool_calls(m) if m.obj.get("tool_calls") else ()
        return Message("assistant", text, calls)
    m.only(frozenset({"role", "content", "name"}))
    if m.obj.get("name") is not None:
        m.string("name", max_chars=256)
    return Message("user" if role == "user" else "system", _content(m, ("text",)))


def _content(m: Reader, parts: tuple[str, ...], *, optional: bool = False) -> str:
    """A message's text: a string, or a list of text parts joined."""
    if optional and m.obj.get("content") is None:
        return ""
    content = m.required("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise m.fail(
            "content", f"'{m.param('content')}' must be a string or parts.", "invalid_type"
        )
    texts = []
    for index, raw in enumerate(content):
        p = m.child_at("content", index, raw)
        kind = p.required("type")
        if kind not in parts:
            if kind in ("image_url", "input_audio", "file"):
                raise _unsupported(p, "type", "This gateway speaks text only: send text parts.")
            raise p.fail("type", f"'{p.param('type')}' must be one of {', '.join(parts)}.")
        p.only(frozenset({"type", kind}))
        p.required(kind)
        texts.append(p.string(kind))
    return "".join(texts)


def _tool_calls(m: Reader) -> tuple[ToolCall, ...]:
    raw = m.obj["tool_calls"]
    if not isinstance(raw, list):
        raise m.fail("tool_calls", "'tool_calls' must be a list.", "invalid_type")
    calls = []
    for index, value in enumerate(raw):
        c = m.child_at("tool_calls", index, value)
        c.only(frozenset({"id", "type", "function"}))
        if c.obj.get("type", "function") != "function":
            raise _unsupported(c, "type", "Only function tool calls are served.")
        c.required("id")
        call_id = c.string("id", max_chars=MAX_ID_CHARS)
        c.required("function")
        f = c.child("function")
        f.only(frozenset({"name", "arguments", "parsed_arguments"}))  # see _ASSISTANT_FIELDS
        f.required("name")
        f.required("arguments")
        calls.append(ToolCall(call_id, f.string("name", max_chars=64), f.string("arguments")))
    return tuple(calls)


def _tools(r: Reader) -> tuple[Tool, ...]:
    raw = r.obj["tools"]
    if not isinstance(raw, list):
        raise r.fail("tools", "'tools' must be a list of tools.", "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise r.fail("tools", f"'tools' holds at most {MAX_TOOLS} tools.")
    tools: list[Tool] = []
    for index, value in enumerate(raw):
        t = r.child_at("tools", index, value)
        t.only(frozenset({"type", "function", "custom"}))
        if t.obj.get("type") != "function":
            raise _unsupported(t, "type", "Only function tools (type 'function') are served.")
        t.required("function")
        f = t.child("function")
        f.only(frozenset({"name", "description", "parameters", "strict"}))
        f.required("name")
        name = f.string("name")
        if not TOOL_NAME.fullmatch(name):
            raise f.fail(
                "name", f"'{f.param('name')}' must be 1 to 64 letters, digits, '_' or '-'."
            )
        if any(tool.name == name for tool in tools):
            raise f.fail("name", f"Two tools are named '{name}': tool names must be unique.")
        tools.append(function_tool(f, name))
    return tuple(tools)


def _tool_choice(r: Reader, tools: tuple[Tool, ...]) -> ToolChoice:
    value = r.obj["tool_choice"]
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise r.fail("tool_choice", "'tool_choice' must be 'auto', 'none' or 'required'.")
        return value
    c = r.child("tool_choice")
    if c.required("type") != "function":
        raise _unsupported(c, "type", "Only a function can be chosen (type 'function').")
    c.only(frozenset({"type", "function"}))
    c.required("function")
    f = c.child("function")
    f.only(frozenset({"name"}))
    f.required("name")
    name = f.string("name", max_chars=64)
    if name in TOOL_CHOICE_MODES or all(tool.name != name for tool in tools):
        raise f.fail("name", f"'tool_choice' names '{name}', which is not in 'tools'.")
    return name


# -- what the gateway sends -------------------------------------------------------------


def chunk_json(
    head: JSON,
    delta: JSON,
    finish_reason: str | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    index: int = 0,
) -> JSON:
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else logprobs_json(logprobs),
        "finish_reason": finish_reason,
    }
    return {**head, "choices": [choice]}


def logprobs_json(logprobs: Sequence[TokenLogprob]) -> JSON:
    """A choice's ``logprobs`` (a chunk's, or the whole message's)."""
    return {"content": [token_logprob_json(lp) for lp in logprobs], "refusal": None}


def token_logprob_json(lp: TokenLogprob) -> JSON:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.bytes),
        "top_logprobs": [
            {"token": top.token, "logprob": top.logprob, "bytes": list(top.bytes)} for top in lp.top
        ],
    }
