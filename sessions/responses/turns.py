"""A Responses turn: its data, the events that tell a client about it, and its snapshot.

sessions/responses/dialect.py decides when a turn starts and what becomes of it; this module only
says what it looks like: the ``Response`` object, the output items' events, the steering
events (each a JSON dict for the outbox, which numbers it), and the JSON a session store
keeps of a turn that is running or waiting. Nothing here sends, schedules or holds state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gateway.engines.base import TokenLogprob, Tool, ToolChoice, freeform_input
from gateway.scheduler import Job, Outcome
from sessions import codec, snapshot
from sessions.conversation import Item
from sessions.core import CallState, ResponseState, SessionConfig
from sessions.response_store import StoredResponse
from sessions.responses import codec as rp
from sessions.responses import tools as rtools


@dataclass(eq=False, slots=True)
class Turn:
    """A turn's own data, beside the core's ResponseState (its ``spec.tag``)."""

    body: rp.CreateBody
    lane: Lane
    history: tuple[Item, ...]
    input: tuple[Item, ...]
    created_at: int
    instructions: str | None
    tools: tuple[Tool, ...]
    tool_choice: ToolChoice
    steers: list[tuple[str, rp.Steer]] = field(default_factory=list)  # accepted, queued
    # A custom tool call's input so far, by its item id (its deltas stream from this).
    inputs: dict[str, rtools.InputDecoder] = field(default_factory=dict)
    # Its tools as the Response object echoes them: made once for all its Response
    # objects (created, completed...), which only serialize them.
    echoed: list[codec.JSON] | None = None

    @property
    def tools_echo(self) -> list[codec.JSON]:
        if self.echoed is None:
            self.echoed = rtools.tools_echo(self.tools, self.body.mapped)
        return self.echoed


@dataclass(eq=False, slots=True)
class Lane:
    stream_id: str | None
    affinity_key: str
    waiting: deque[rp.CreateBody] = field(default_factory=deque)
    running: ResponseState | None = None
    warming: Job | None = None  # a generate: false turn's prefill
    latest: StoredResponse | None = None
    # Steering accepted while the latest response waits for tool output: prepended to
    # the next create that continues it.
    pending_steers: list[tuple[str, rp.Steer]] = field(default_factory=list)

    @property
    def busy(self) -> bool:
        return self.running is not None or self.warming is not None


# -- the Response object and its output items --------------------------------------------


def response_json(
    response_id: str,
    turn: Turn,
    config: SessionConfig,
    status: str,
    output: list[codec.JSON] | None = None,
    usage: codec.JSON | None = None,
    incomplete: str | None = None,
    error: codec.JSON | None = None,
) -> codec.JSON:
    body, c = turn.body, config
    echo: codec.JSON = {} if body.top_logprobs is None else {"top_logprobs": body.top_logprobs}
    return {
        **echo,
        "id": response_id,
        "object": "response",
        "created_at": turn.created_at,
        "status": status,
        "background": body.background,
        "error": error,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": turn.instructions,
        "max_output_tokens": None
        if body.max_output_tokens == codec.UNSET
        else body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": c.model,
        "output": output or [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "temperature": c.temperature if body.temperature == codec.UNSET else body.temperature,
        "text": {"format": body.text_format or {"type": "text"}},
        "tool_choice": codec.tool_choice_json(turn.tool_choice),
        "tools": turn.tools_echo,
        "top_p": c.top_p if body.top_p == codec.UNSET else body.top_p,
        "truncation": body.truncation,
        "usage": usage,
    }


def text_opened(r: ResponseState) -> list[codec.JSON]:
    index = r.text_index
    return [
        {
            "type": "response.output_item.added",
            "output_index": index,
            "item": rp.message_json(r.item_id, None, "in_progress"),
        },
        {
            "type": "response.content_part.added",
            "item_id": r.item_id,
            "output_index": index,
            "content_index": 0,
            "part": rp.text_part(""),
        },
    ]


def text_delta(
    r: ResponseState, text: str, logprobs: tuple[TokenLogprob, ...] | None = None
) -> codec.JSON:
    return {
        "type": "response.output_text.delta",
        "item_id": r.item_id,
        "output_index": r.text_index,
        "content_index": 0,
        "delta": text,
        "logprobs": [] if logprobs is None else codec.text_logprobs_json(logprobs),
    }


def text_closed(
    r: ResponseState, text: str, status: str, logprobs: tuple[TokenLogprob, ...] | None = None
) -> tuple[list[codec.JSON], codec.JSON]:
    """The text's closing events, and its output item (with the answer's log
    probabilities, for a response that asked for them)."""
    ids = {"item_id": r.item_id, "output_index": r.text_index, "content_index": 0}
    item = rp.message_json(r.item_id, text, status, logprobs)
    done_logprobs = [] if logprobs is None else codec.text_logprobs_json(logprobs)
    return [
        {"type": "response.output_text.done", **ids, "text": text, "logprobs": done_logprobs},
        {"type": "response.content_part.done", **ids, "part": item["content"][0]},
        {"type": "response.output_item.done", "output_index": r.text_index, "item": item},
    ], item


def _mapped(turn: Turn, call: CallState) -> rtools.Mapped | None:
    for m in turn.body.mapped:
        if m.flat == call.name:
            return m
    return None


def call_json(turn: Turn, call: CallState, arguments: str, status: str) -> codec.JSON:
    """A call's output item: a ``function_call``, or a custom tool's ``custom_tool_call``
    (its input decoded from the arguments); a namespace's by its own name, with the
    namespace beside it."""
    m = _mapped(turn, call)
    if m is not None and m.custom_format is not None:
        item: codec.JSON = {
            "id": call.item_id,
            "type": "custom_tool_call",
            "call_id": call.call_id,
            "name": m.name,
            "input": freeform_input(arguments) if arguments else "",
        }
    else:
        item = rp.function_call_json(call.item_id, call.call_id, call.name, arguments, status)
    if m is not None:
        item["name"] = m.name
        if m.namespace:
            item["namespace"] = m.namespace
    return item


def call_opened(turn: Turn, call: CallState) -> codec.JSON:
    item = call_json(turn, call, "", "in_progress")
    return {"type": "response.output_item.added", "output_index": call.output_index, "item": item}


def call_delta(turn: Turn, call: CallState, arguments: str) -> codec.JSON | None:
    """A piece of a call's arguments; of a custom tool's, what it adds to the decoded
    input (None: nothing yet, e.g. the ``{"input": "`` that opens it)."""
    m = _mapped(turn, call)
    if m is None or m.custom_format is None:
        return {
            "type": "response.function_call_arguments.delta",
            "item_id": call.item_id,
            "output_index": call.output_index,
            "delta": arguments,
        }
    decoder = turn.inputs.get(call.item_id)
    if decoder is None:
        decoder = turn.inputs[call.item_id] = rtools.InputDecoder()
    added = decoder.feed(arguments)
    if not added:
        return None
    return {
        "type": "response.custom_tool_call_input.delta",
        "item_id": call.item_id,
        "output_index": call.output_index,
        "delta": added,
    }


def call_closed(turn: Turn, call: CallState, status: str) -> tuple[list[codec.JSON], codec.JSON]:
    """The call's closing events, and its output item."""
    item = call_json(turn, call, call.arguments, status)
    if item["type"] == "custom_tool_call":
        done: codec.JSON = {
            "type": "response.custom_tool_call_input.done",
            "item_id": call.item_id,
            "output_index": call.output_index,
            "input": item["input"],
        }
    else:
        done = {
            "type": "response.function_call_arguments.done",
            "item_id": call.item_id,
            "output_index": call.output_index,
            "arguments": call.arguments,
        }
    return [
        done,
        {"type": "response.output_item.done", "output_index": call.output_index, "item": item},
    ], item


def ending(turn: Turn, outcome: Outcome) -> tuple[str, str, str | None, codec.JSON | None]:
    """The terminal event's type, the response's status, incomplete reason, error."""
    if outcome.status == "completed":
        return "response.completed", "completed", None, None
    if outcome.status == "incomplete":
        return "response.incomplete", "incomplete", "max_output_tokens", None
    if outcome.status == "cancelled":
        if turn.steers:  # stopped by response.steer (the successor follows)
            return "response.incomplete", "incomplete", "steered", None
        # A cancelled response ends with response.incomplete, which every official
        # client takes as a terminal event (docs/protocol.md).
        return "response.incomplete", "cancelled", None, None
    error = outcome.error
    code = error.code if error is not None else "engine_error"
    message = error.message if error is not None else "the engine failed"
    return (
        "response.failed",
        "failed",
        None,
        {"code": _response_error_code(code), "message": message},
    )


def _response_error_code(code: str) -> str:
    """A ``Response.error.code`` the official types know for an engine's error code."""
    return (
        "invalid_prompt"
        if code in ("context_length_exceeded", "invalid_request")
        else "server_error"
    )


# -- steering --------------------------------------------------------------------------


def steer_accepted(steer_id: str, previous_response_id: str) -> codec.JSON:
    return {
        "type": "response.steer.accepted",
        "steer": {"id": steer_id, "previous_response_id": previous_response_id},
    }


def steer_pending(steer_id: str, latest: StoredResponse) -> codec.JSON:
    """The steering input waits for the tool output the latest response asked for."""
    required = [
        {"type": "function_call_output", "call_id": call_id, "name": name}
        for call_id, name in latest.pending_calls
    ]
    return {
        "type": "response.steer.pending",
        "reason": "waiting_for_required_input",
        "required_input": required,
        "steer": {"id": steer_id, "previous_response_id": latest.id},
    }


def steer_failed(steer: rp.Steer, steer_id: str | None, code: str, message: str) -> codec.JSON:
    return {
        "type": "response.steer.failed",
        "error": {"type": "invalid_request_error", "code": code, "message": message},
        "steer": {
            "input": steer.raw_input,
            "previous_response_id": steer.previous_response_id,
            **({"id": steer_id} if steer_id else {}),
        },
    }


# -- a session store's snapshot (sessions/snapshot.py) -----------------------------------


def turn_json(turn: Turn) -> dict[str, Any]:
    """A running turn, for a takeover to continue it."""
    return {
        "body": _set_fields(turn.body),
        "lane": turn.lane.stream_id,
        "history": [snapshot.item_json(i) for i in turn.history],
        "input": [snapshot.item_json(i) for i in turn.input],
        "created_at": turn.created_at,
        "instructions": turn.instructions,
        "tools": [snapshot.tool_json(t) for t in turn.tools],
        "tool_choice": turn.tool_choice,
    }


def turn_from(data: Any, lane: Lane) -> Turn:
    tools = tuple(snapshot.tool_from(t) for t in data["tools"])
    return Turn(
        replace(rp.CreateBody(**_tuples(data["body"])), tools=tools),
        lane,
        tuple(snapshot.item_from(i) for i in data["history"]),
        tuple(snapshot.item_from(i) for i in data["input"]),
        data["created_at"],
        data["instructions"],
        tools,
        data["tool_choice"],
    )


_INPUT_KINDS: dict[str, type[rp.AnyInput]] = {
    "message": codec.ItemSpec,
    "function_call": codec.FunctionCallSpec,
    "function_call_output": codec.FunctionCallOutputSpec,
}


def body_json(body: rp.CreateBody) -> dict[str, Any]:
    """A waiting turn's create body as JSON (its fields that were set)."""
    data = _set_fields(body)
    kinds = {v: k for k, v in _INPUT_KINDS.items()}
    data["input"] = [[kinds[type(i)], asdict(i)] for i in body.input]
    if isinstance(body.tools, tuple):
        data["tools"] = [snapshot.tool_json(t) for t in body.tools]
    return data


def _set_fields(body: rp.CreateBody) -> dict[str, Any]:
    """The body's fields that were set, but its input and tools."""
    return {
        k: getattr(body, k)
        for k in rp.CreateBody.__slots__
        if k not in ("input", "tools") and getattr(body, k) != codec.UNSET
    }


def _tuples(data: dict[str, Any]) -> dict[str, Any]:
    """The body's tuple fields as a snapshot's JSON gave them back (lists)."""
    data = dict(data)
    if "mapped" in data:  # orjson wrote each as a dict
        data["mapped"] = tuple(rtools.Mapped(**m) for m in data["mapped"])
    if "hosted_tools" in data:
        data["hosted_tools"] = tuple(tuple(h) for h in data["hosted_tools"])
    return data


def body_from(data: dict[str, Any]) -> rp.CreateBody:
    data = _tuples(data)
    data["input"] = tuple(_INPUT_KINDS[kind](**fields) for kind, fields in data["input"])
    if "tools" in data:
        data["tools"] = tuple(snapshot.tool_from(t) for t in data["tools"])
    return rp.CreateBody(**data)
