"""A session as JSON, for a session store: what another gateway process needs to take
the session over when the one that held it is gone.

:func:`dump` is called on the owner's event loop between the actor's turns (so it sees
a consistent state); :func:`restore` builds the session again on the process that takes
it over, and :func:`continue_responses` picks its answers in flight up. The text such
an answer had sent is not in the snapshot but in the event log (the frames that reached
the client, with the token ids an engine gave for them, and the log probabilities a
response that asked for them carries in them): :func:`sent_text` reads it back.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import orjson

from gateway.engines.base import (
    Constraint,
    Message,
    SamplingParams,
    TokenLogprob,
    Tool,
    ToolCall,
)
from gateway.metrics import Metrics
from gateway.observability import Observability, Record, TraceContext, trace_context
from gateway.scheduler import Job, Scheduler
from sessions.codec import text_logprobs_from
from sessions.conversation import Item
from sessions.core import (
    CallState,
    Dialect,
    ResponseSpec,
    ResponseState,
    Session,
    SessionConfig,
    SessionLimits,
)
from sessions.outbox import Outbox

VERSION = 1
JSON = dict[str, Any]


def token_digest(token: str) -> str:
    """What the store keeps of a resume token: its SHA-256 (the token is never stored)."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str, digest: str) -> bool:
    return hmac.compare_digest(token_digest(token), digest)


# -- the parts ---------------------------------------------------------------------


def item_json(item: Item) -> JSON:
    return asdict(item)


def item_from(data: JSON) -> Item:
    return Item(**data)


def tool_json(tool: Tool) -> JSON:
    return {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
        "freeform": tool.freeform,
        "grammar": constraint_json(tool.grammar),
    }


def tool_from(data: JSON) -> Tool:
    return Tool(
        data["name"],
        data["description"],
        data["parameters"],
        strict=data.get("strict", False),
        freeform=data.get("freeform", False),
        grammar=constraint_from(data.get("grammar")),
    )


def constraint_json(constraint: Constraint | None) -> JSON | None:
    return None if constraint is None else asdict(constraint)


def constraint_from(data: JSON | None) -> Constraint | None:
    return None if data is None else Constraint(**data)


def _message_json(m: Message) -> JSON:
    return {
        "role": m.role,
        "text": m.text,
        "tool_calls": [asdict(c) for c in m.tool_calls],
        "tool_call_id": m.tool_call_id,
    }


def _message_from(data: JSON) -> Message:
    calls = tuple(ToolCall(**c) for c in data["tool_calls"])
    return Message(data["role"], data["text"], calls, tool_call_id=data["tool_call_id"])


_CONFIG_FIELDS = tuple(f.name for f in fields(SessionConfig))


def _config_json(c: SessionConfig) -> JSON:
    # Field by field, not asdict(): its deep copy is most of a snapshot's cost.
    data = {name: getattr(c, name) for name in _CONFIG_FIELDS}
    data["tools"] = [tool_json(t) for t in c.tools]
    return data


def config_from(data: JSON) -> SessionConfig:
    data = dict(data)
    data["tools"] = tuple(tool_from(t) for t in data["tools"])
    data["stop"] = tuple(data["stop"])
    return SessionConfig(**data)


def _spec_json(spec: ResponseSpec, dialect: Dialect) -> JSON:
    return {
        "messages": [_message_json(m) for m in spec.messages],
        "sampling": spec.sampling,  # orjson writes a dataclass as asdict() would
        "tools": [tool_json(t) for t in spec.tools],
        "tool_choice": spec.tool_choice,
        "in_conversation": spec.in_conversation,
        "affinity_key": spec.affinity_key,
        "metadata": spec.metadata,
        "tag": dialect.dump_tag(spec.tag),
        "constraint": constraint_json(spec.constraint),
        "parallel_tool_calls": spec.parallel_tool_calls,
    }


def _spec_from(data: JSON, dialect: Dialect) -> ResponseSpec:
    sampling = dict(data["sampling"])
    sampling["stop"] = tuple(sampling["stop"])
    return ResponseSpec(
        messages=tuple(_message_from(m) for m in data["messages"]),
        sampling=SamplingParams(**sampling),
        tools=tuple(tool_from(t) for t in data["tools"]),
        tool_choice=data["tool_choice"],
        in_conversation=data["in_conversation"],
        affinity_key=data["affinity_key"],
        metadata=data["metadata"],
        tag=dialect.load_tag(data["tag"]),
        constraint=constraint_from(data.get("constraint")),
        parallel_tool_calls=data.get("parallel_tool_calls", True),
    )


def _trace_json(record: Record | None) -> JSON | None:
    """Where an answer's trace goes on after a takeover: its parent (the client's context)
    and its own span, which the continued answer's span links to."""
    if record is None or (record.parent is None and record.own is None):
        return None
    return {
        "parent": _context_json(record.parent),
        "span": _context_json(record.own),
    }


def _context_json(context: TraceContext | None) -> list[str] | None:
    return None if context is None else [context.traceparent, context.tracestate]


def _trace_from(data: JSON | None) -> tuple[TraceContext | None, TraceContext | None] | None:
    if not data:
        return None

    def context(value: list[str] | None) -> TraceContext | None:
        return None if value is None else trace_context.parse(value[0], [value[1]])

    return context(data.get("parent")), context(data.get("span"))


# -- a whole session ---------------------------------------------------------------


def dump(session: Session, dialect_name: str) -> bytes:
    """The session as JSON bytes (its conversation, settings, answers in flight)."""
    responses = [
        {
            "id": r.id,
            "item_id": r.item_id,
            "text_index": r.text_index,
            "previous_item_id": r.previous_item_id,
            "outputs": r.outputs,
            "last_item_id": r.last_item_id,
            "delta_key": r.delta_key,
            "calls": len(r.calls),
            "spec": _spec_json(r.spec, session.dialect),
            "trace": _trace_json(r.record),
        }
        for r in session.responses
        if not r.cancelling
    ]
    data = {
        "v": VERSION,
        "dialect": dialect_name,
        "id": session.id,
        "tenant": session.tenant,
        "conversation_id": session.conversation_id,
        "token": token_digest(session.resume_token),
        "config": _config_json(session.config),
        # orjson writes each item as item_json() would, without asdict()'s deep copy.
        "items": session.conversation.items(),
        "responses": responses,
        "dialect_state": session.dialect.dump(),
    }
    return orjson.dumps(data)


def restore(
    data: JSON,
    scheduler: Scheduler,
    outbox: Outbox,
    dialect: Dialect,
    *,
    token: str,
    limits: SessionLimits | None = None,
    metrics: Metrics | None = None,
    observability: Observability | None = None,
) -> tuple[Session, list[ResponseState]]:
    """The session ``data`` describes, on this process, and its answers in flight (not
    yet started: see :func:`continue_responses`). ``token``: the one its client showed."""
    session = Session(
        scheduler,
        outbox,
        dialect,
        config=config_from(data["config"]),
        limits=limits,
        metrics=metrics,
        session_id=data["id"],
        resume_token=token,
        greet=False,
        tenant=data.get("tenant", ""),
        observability=observability,
    )
    session.conversation_id = data["conversation_id"]
    for item in data["items"]:
        session.conversation.insert(item_from(item))
    in_flight = []
    for saved in data["responses"]:
        spec = _spec_from(saved["spec"], dialect)
        job = Job(spec.request(saved["id"]), session.id, session, tenant=session.tenant)
        r = ResponseState(saved["id"], saved["item_id"], job, spec, saved["delta_key"])
        r.text_index = saved["text_index"]
        r.previous_item_id = saved["previous_item_id"]
        r.outputs = saved["outputs"]
        r.last_item_id = saved["last_item_id"]
        if saved["calls"]:
            # Calls cannot be continued half-way: it ends (see continue_response).
            r.calls[0] = CallState("", "", "", -1, None)
        r.continues = _trace_from(saved.get("trace"))
        in_flight.append(r)
    dialect.load(data["dialect_state"])
    return session, in_flight


@dataclass(frozen=True, slots=True)
class SentText:
    """What a response's text deltas among an event log carried."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]


def sent_text(
    frames: list[tuple[int, bytes]],
    item_id: str,
    token_ids: Mapping[int, tuple[int, ...]] | None = None,
) -> SentText:
    """The text deltas of output item ``item_id`` among ``frames`` (an event log:
    numbered frames), joined; the token ids logged with them (``token_ids``, by frame
    number), where the engine gave them; and the log probabilities they carry (a Responses
    delta's, for a response that asked: see sessions/responses/codec.py)."""
    needle = orjson.dumps(item_id)
    parts: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    for seq, frame in frames:
        if b'"response.output_text.delta"' in frame and needle in frame:
            event = orjson.loads(frame)
            if event.get("item_id") == item_id:
                parts.append(event["delta"])
                if token_ids:
                    ids += token_ids.get(seq, ())
                if event.get("logprobs"):
                    logprobs += text_logprobs_from(event["logprobs"])
    return SentText("".join(parts), tuple(ids), tuple(logprobs))


def continue_responses(
    session: Session,
    in_flight: list[ResponseState],
    log: list[tuple[int, bytes]],
    token_ids: Mapping[int, tuple[int, ...]] | None = None,
) -> None:
    """Go on with the answers in flight, each from the text its client already has (and
    the tokens it was generated from, where the log has them)."""
    for r in in_flight:
        sent = sent_text(log, r.item_id, token_ids)
        r.prefix, r.prefix_token_ids, r.prefix_logprobs = sent.text, sent.token_ids, sent.logprobs
        session.continue_response(r)
