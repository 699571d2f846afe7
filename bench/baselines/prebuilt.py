"""Prebuilt answers for the floors: every byte a floor server writes, built once at start.

A floor server (bench/baselines/floor_server.py, floor_sse_server.py) answers every turn
with the same answer: the sim's words for one fixed prompt, ``response_tokens`` long,
framed as the gateway frames them (the same events, the same fields in the same order,
ids and numbers of the same lengths), each delta already a whole WebSocket frame or a
whole HTTP chunk. What such a server does per token is then one ``transport.write`` of
bytes that exist already: the floor.

:class:`Pump` is the one loop turn of the definition: a callback that, while any stream
is active, runs once per turn of the event loop and writes each active stream's next
delta, and nothing else (no task per stream, no await per frame).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway.engines.sim import answer_tokens
from gateway.transport.wire import text_frame_header

PROMPT = "Tell me about the gateway"
RESPONSE_ID = "resp_" + "f" * 20
ITEM_ID = "item_" + "e" * 20
USER_ITEM_ID = "item_" + "d" * 20
CHAT_ID = "chatcmpl-" + "c" * 24
TAG = "f100f100"  # a Realtime session's event-id tag (eight hex digits, as the gateway's)


@dataclass(frozen=True)
class Answer:
    """One answer's bytes as written: ``head`` (one write as the answer starts),
    ``deltas`` (one write each, one per token) and ``tail`` (one write at its end)."""

    head: bytes
    deltas: tuple[bytes, ...]
    tail: bytes
    text: str


def tokens(response_tokens: int) -> list[str]:
    return answer_tokens(PROMPT, response_tokens)


def ws_frame(payload: bytes) -> bytes:
    return text_frame_header(len(payload)) + payload


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


# -- Realtime --------------------------------------------------------------------------


def _rt_item(item_id: str, role: str, text: str | None, status: str) -> dict[str, Any]:
    part = "input_text" if role == "user" else "output_text"
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": [] if text is None else [{"type": part, "text": text}],
    }


def _rt_response(status: str, output: list[Any], usage: Any) -> dict[str, Any]:
    return {
        "object": "realtime.response",
        "id": RESPONSE_ID,
        "status": status,
        "status_details": {"type": status} if status == "completed" else None,
        "output": output,
        "conversation_id": "conv_" + "b" * 20,
        "output_modalities": ["text"],
        "max_output_tokens": "inf",
        "metadata": None,
        "usage": usage,
    }


class _Numbers:
    """Realtime's event ids and sequence numbers, as a session would give them."""

    def __init__(self, first: int) -> None:
        self.seq = first - 1

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        head = {"event_id": f"event_{TAG}_{self.seq:x}", "sequence_number": self.seq}
        return ws_frame(_dumps({**head, "type": kind, **fields}))


def realtime_greeting() -> bytes:
    """``session.created`` (the frame a connection opens with)."""
    session = {"object": "realtime.session", "type": "realtime", "id": "sess_0_" + "a" * 20}
    session |= {"model": "sim", "output_modalities": ["text"], "instructions": ""}
    return _Numbers(1).event("session.created", session=session, resume_token="r" * 32)


def realtime_user_item(text: str = PROMPT) -> bytes:
    """The answer to ``conversation.item.create``: the item's added and done events."""
    item = _rt_item(USER_ITEM_ID, "user", text, "completed")
    numbers = _Numbers(2)
    return b"".join(
        numbers.event(kind, previous_item_id=None, item=item)
        for kind in ("conversation.item.added", "conversation.item.done")
    )


def realtime(response_tokens: int) -> Answer:
    """The answer to ``response.create``, numbered as a session's first answer is."""
    words = tokens(response_tokens)
    text = "".join(words)
    n = _Numbers(4)
    added = _rt_item(ITEM_ID, "assistant", None, "in_progress")
    ids = {"response_id": RESPONSE_ID, "item_id": ITEM_ID, "output_index": 0, "content_index": 0}
    head = b"".join(
        (
            n.event("response.created", response=_rt_response("in_progress", [], None)),
            n.event(
                "rate_limits.updated",
                rate_limits=[{"name": "requests", "limit": 320, "remaining": 319}],
            ),
            n.event(
                "response.output_item.added", response_id=RESPONSE_ID, output_index=0, item=added
            ),
            n.event("conversation.item.added", previous_item_id=USER_ITEM_ID, item=added),
            n.event("response.content_part.added", **ids, part={"type": "text", "text": ""}),
        )
    )
    deltas = []
    for word in words:
        n.seq += 1
        payload = (
            b'{"type":"response.output_text.delta","event_id":"event_%b_%x","sequence_number":%d'
            b',"response_id":"%b","item_id":"%b","output_index":0,"content_index":0,"delta":%b}'
            % (TAG.encode(), n.seq, n.seq, RESPONSE_ID.encode(), ITEM_ID.encode(), _dumps(word))
        )
        deltas.append(ws_frame(payload))
    done = _rt_item(ITEM_ID, "assistant", text, "completed")
    usage = {
        "total_tokens": 10 + len(words),
        "input_tokens": 10,
        "output_tokens": len(words),
        "input_token_details": {"cached_tokens": 0, "text_tokens": 10, "audio_tokens": 0},
        "output_token_details": {"text_tokens": len(words), "audio_tokens": 0},
    }
    tail = b"".join(
        (
            n.event("response.output_text.done", **ids, text=text),
            n.event("response.content_part.done", **ids, part={"type": "text", "text": text}),
            n.event(
                "response.output_item.done", response_id=RESPONSE_ID, output_index=0, item=done
            ),
            n.event("conversation.item.done", previous_item_id=USER_ITEM_ID, item=done),
            n.event("response.done", response=_rt_response("completed", [done], usage)),
        )
    )
    return Answer(head, tuple(deltas), tail, text)


# -- Responses (WebSocket and SSE) -------------------------------------------------------


def response_object(status: str, output: list[Any], usage: Any) -> dict[str, Any]:
    """The ``Response`` object, with the fields (and their order) the gateway's has."""
    return {
        "id": RESPONSE_ID,
        "object": "response",
        "created_at": 1_800_000_000,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "metadata": {},
        "model": "sim",
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "truncation": "disabled",
        "usage": usage,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message(status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {
        "id": ITEM_ID,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def responses_usage(output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10 + output_tokens,
    }


def _responses_events(response_tokens: int) -> tuple[list[bytes], list[bytes], list[bytes], str]:
    """The Responses API's events of one answer, as JSON: opening, deltas, closing."""
    words = tokens(response_tokens)
    text = "".join(words)
    seq = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> bytes:
        return _dumps({"sequence_number": next(seq), "type": kind, **fields})

    started = response_object("in_progress", [], None)
    ids = {"item_id": ITEM_ID, "output_index": 0, "content_index": 0}
    opening = [
        event("response.created", response=started),
        event("response.in_progress", response=started),
        event("response.output_item.added", output_index=0, item=message("in_progress", None)),
        event("response.content_part.added", **ids, part=text_part("")),
    ]
    deltas = [
        b'{"type":"response.output_text.delta","sequence_number":%d,"item_id":"%b"'
        b',"output_index":0,"content_index":0,"logprobs":[],"delta":%b}'
        % (next(seq), ITEM_ID.encode(), _dumps(word))
        for word in words
    ]
    done = message("completed", text)
    final = response_object("completed", [done], responses_usage(len(words)))
    closing = [
        event("response.output_text.done", **ids, text=text, logprobs=[]),
        event("response.content_part.done", **ids, part=text_part(text)),
        event("response.output_item.done", output_index=0, item=done),
        event("response.completed", response=final),
    ]
    return opening, deltas, closing, text


def responses_ws(response_tokens: int) -> Answer:
    opening, deltas, closing, text = _responses_events(response_tokens)
    return Answer(
        b"".join(map(ws_frame, opening)),
        tuple(map(ws_frame, deltas)),
        b"".join(map(ws_frame, closing)),
        text,
    )


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def _sse_event(data: bytes) -> bytes:
    start = data.index(b'"type":"') + 8
    kind = data[start : data.index(b'"', start)]
    return b"event: %b\ndata: %b\n\n" % (kind, data)


def responses_sse(response_tokens: int) -> Answer:
    """``POST /v1/responses`` with ``stream: true``: the response head and every event one
    HTTP chunk, the body's end with the last."""
    opening, deltas, closing, text = _responses_events(response_tokens)
    head = SSE_HEAD + b"".join(http_chunk(_sse_event(e)) for e in opening)
    tail = b"".join(http_chunk(_sse_event(e)) for e in closing) + b"0\r\n\r\n"
    return Answer(head, tuple(http_chunk(_sse_event(e)) for e in deltas), tail, text)


# -- Chat Completions --------------------------------------------------------------------


def chat_head() -> dict[str, Any]:
    return {
        "id": CHAT_ID,
        "object": "chat.completion.chunk",
        "created": 1_800_000_000,
        "model": "default",
    }


def chat_usage(output_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": 10,
        "completion_tokens": output_tokens,
        "total_tokens": 10 + output_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def chat_sse(response_tokens: int) -> Answer:
    """``POST /v1/chat/completions`` with ``stream: true`` and ``include_usage``."""
    words = tokens(response_tokens)
    head = chat_head()
    prefix = _dumps(head)[:-1]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return http_chunk(b"data: %b\n\n" % _dumps({**head, "choices": [choice]}))

    deltas = tuple(
        http_chunk(
            b'data: %b,"choices":[{"index":0,"delta":{"content":%b},"logprobs":null'
            b',"finish_reason":null}]}\n\n' % (prefix, _dumps(word))
        )
        for word in words
    )
    last = _dumps({**head, "choices": [], "usage": chat_usage(len(words))})
    tail = chunk({}, "stop") + http_chunk(b"data: %b\n\ndata: [DONE]\n\n" % last) + b"0\r\n\r\n"
    return Answer(
        SSE_HEAD + chunk({"role": "assistant", "content": ""}), deltas, tail, "".join(words)
    )


# -- the one loop turn -------------------------------------------------------------------


class Owner(Protocol):
    """The protocol a stream's transport belongs to: its flow control says whether the
    transport pushes back (websockets' connection and the floors' own protocols)."""

    paused: bool


@dataclass(eq=False, slots=True)
class Stream:
    """One answer being written: its transport, its deltas, the next one's index."""

    owner: Owner
    transport: asyncio.WriteTransport
    deltas: tuple[bytes, ...]
    tail: bytes
    done: Callable[[], None] | None = None  # after the tail is written
    next: int = 0

    @property
    def end(self) -> int:
        return len(self.deltas)

    def gone(self) -> None:
        """The client went away: nothing more is written."""
        self.next = len(self.deltas) + 1


class Pump:
    """Every active stream's next delta, one ``transport.write`` each, once per loop turn."""

    def __init__(self) -> None:
        self.active: list[Stream] = []
        self._scheduled = False

    def add(self, stream: Stream) -> None:
        self.active.append(stream)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.turn)

    def turn(self) -> None:
        ended = False
        for s in self.active:
            if s.owner.paused:
                continue  # the client reads slowly: its next delta waits for a later turn
            i = s.next
            if i < len(s.deltas):
                s.transport.write(s.deltas[i])
                s.next = i = i + 1
                if i < len(s.deltas):
                    continue
                s.transport.write(s.tail)
                if s.done is not None:
                    s.done()
            ended = True
        if ended:
            self.active = [s for s in self.active if s.next < len(s.deltas)]
        if self.active:
            asyncio.get_running_loop().call_soon(self.turn)
        else:
            self._scheduled = False
