"""The official ``openai`` SDK's Responses API clients, unmodified, against a running gateway.

Runs in ``.venv-sdk`` (started by the gateway's tests):
``python tests/sdk/responses_client.py SCENARIO BASE_URL API_KEY``, BASE_URL like
``http://127.0.0.1:PORT/v1``. WebSocket scenarios use ``client.responses.connect()``
(which dials ``BASE_URL/responses`` as ws://), HTTP ones ``client.responses.*``. Every
event received is validated with openai-python's own union (``ResponsesServerEvent`` on
the socket, ``ResponseStreamEvent`` over SSE) in strict mode, and every invalid one is
listed under ``invalid``. Prints one JSON object on its last line; exits non-zero on an
exception. It imports nothing of the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import typing
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from openai import AsyncOpenAI, OpenAI
from openai.resources.responses.responses import AsyncResponsesConnection
from openai.types.responses import Response, ResponsesServerEvent, ResponseStreamEvent
from openai.types.websocket_reconnection import ReconnectingEvent, ReconnectingOverrides
from pydantic import TypeAdapter, ValidationError

MODEL = os.environ.get("RESPONSES_MODEL", "gpt-4.1-mini")
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


class Validator:
    """Strict validation of received events against one of the SDK's event unions."""

    def __init__(self, union: Any) -> None:
        self.union: TypeAdapter[Any] = TypeAdapter(union)
        members = typing.get_args(typing.get_args(union)[0])  # Annotated[Union[...], ...]
        self.members = {
            typing.get_args(m.model_fields["type"].annotation)[0]: TypeAdapter(m) for m in members
        }
        self.invalid: list[dict[str, Any]] = []

    def check(self, event: Any) -> Any:
        data = event.model_dump(warnings=False)
        try:
            self.union.validate_python(data, strict=True)
        except ValidationError:
            member = self.members.get(data.get("type"))
            errors: Any = "type not in the union"
            if member is not None:
                try:
                    member.validate_python(data, strict=True)
                except ValidationError as exc:
                    errors = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            self.invalid.append(
                {"type": data.get("type"), "seq": data.get("sequence_number"), "errors": errors}
            )
        return event


def check_response(response: Response, invalid: list[dict[str, Any]]) -> None:
    try:
        TypeAdapter(Response).validate_python(response.model_dump(warnings=False), strict=True)
    except ValidationError as exc:
        errors = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        invalid.append({"type": "Response", "id": response.id, "errors": errors})


def contiguous(seqs: list[int]) -> bool:
    return bool(seqs) and seqs == list(range(seqs[0], seqs[0] + len(seqs)))


class Turn:
    """What one response's events added up to."""

    def __init__(self) -> None:
        self.types: list[str] = []
        self.seqs: list[int] = []
        self.deltas = ""
        self.arguments = ""
        self.response: Response | None = None
        self.error: dict[str, Any] | None = None
        self.response_id: str | None = None  # from the first lifecycle event

    def feed(self, event: Any) -> bool:
        """Take one event; True once the response is over (a terminal event or an error)."""
        self.types.append(event.type)
        if self.response_id is None and getattr(event, "response", None) is not None:
            self.response_id = event.response.id
        if isinstance(getattr(event, "sequence_number", None), int):
            self.seqs.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            self.deltas += event.delta
        elif event.type == "response.function_call_arguments.delta":
            self.arguments += event.delta
        elif event.type == "error":
            self.error = event.model_dump(warnings=False, exclude_none=True)
            return True
        elif event.type in TERMINAL:
            self.response = event.response
            return True
        return False

    def report(self) -> dict[str, Any]:
        r = self.response
        calls = [
            {"name": i.name, "arguments": i.arguments, "call_id": i.call_id}
            for i in (r.output if r else [])
            if i.type == "function_call"
        ]
        return {
            "id": r.id if r else self.response_id,
            "status": r.status if r else None,
            "previous_response_id": r.previous_response_id if r else None,
            "deltas": self.deltas,
            "text": r.output_text if r else None,
            "arguments": self.arguments,
            "calls": calls,
            "types": self.types,
            "first_seq": self.seqs[0] if self.seqs else None,
            "contiguous": contiguous(self.seqs),
            "usage": r.usage.model_dump() if r and r.usage else None,
            "error": self.error,
        }


def user(text: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def call_output(call_id: str, output: str) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": call_id, "output": output}]


# ---------------------------------------------------------------- WebSocket


async def async_turn(conn: AsyncResponsesConnection, v: Validator, **create: Any) -> Turn:
    await conn.response.create(model=MODEL, **create)
    turn = Turn()
    async for event in conn:
        if turn.feed(v.check(event)):
            return turn
    raise AssertionError("the socket closed before the response ended")


async def ws_async(client: AsyncOpenAI) -> dict[str, Any]:
    v = Validator(ResponsesServerEvent)
    async with client.responses.connect() as conn:
        first = await async_turn(conn, v, input=user("Hello! My name is Ada."))
        assert first.response is not None, first.error
        second = await async_turn(
            conn, v, input=user("What is my name?"), previous_response_id=first.response.id
        )
    return {"turns": [first.report(), second.report()], "invalid": v.invalid}


def ws_sync(client: OpenAI) -> dict[str, Any]:
    v = Validator(ResponsesServerEvent)
    turns: list[dict[str, Any]] = []
    with client.responses.connect() as conn:
        previous: str | None = None
        for text in ("Hello! My name is Ada.", "What is my name?"):
            extra = {"previous_response_id": previous} if previous else {}
            conn.response.create(model=MODEL, input=user(text), **extra)
            turn = Turn()
            for event in conn:
                if turn.feed(v.check(event)):
                    break
            assert turn.response is not None, turn.error
            previous = turn.response.id
            turns.append(turn.report())
    return {"turns": turns, "invalid": v.invalid}


async def ws_lanes(client: AsyncOpenAI) -> dict[str, Any]:
    """Two responses at once on one socket, on lanes "a" and "b"."""
    v = Validator(ResponsesServerEvent)
    lanes = {"a": Turn(), "b": Turn()}
    order: list[str | None] = []  # the lane of each event, in arrival order
    async with client.responses.connect() as conn:
        await conn.response.create(model=MODEL, input=user("Count to five."), stream_id="a")
        await conn.response.create(model=MODEL, input=user("Name five colours."), stream_id="b")
        done: set[str] = set()
        async for event in conn:
            lane = getattr(v.check(event), "stream_id", None)
            order.append(lane)
            if lane not in lanes:
                raise AssertionError(f"an event without a known stream_id: {event}")
            if lanes[lane].feed(event):
                done.add(lane)
                if done == set(lanes):
                    break
    switches = sum(1 for a, b in itertools.pairwise(order) if a != b)
    return {
        "lanes": {k: t.report() for k, t in lanes.items()},
        "lane_switches": switches,
        "invalid": v.invalid,
    }


async def ws_tools(client: AsyncOpenAI) -> dict[str, Any]:
    v = Validator(ResponsesServerEvent)
    async with client.responses.connect() as conn:
        first = await async_turn(
            conn, v, input=user("Use get_weather: what is the weather in Paris?"), tools=[WEATHER]
        )
        report = first.report()
        assert report["calls"], report
        call = report["calls"][0]
        second = await async_turn(
            conn,
            v,
            input=call_output(call["call_id"], "Sunny, 21 degrees"),
            previous_response_id=report["id"],
            tools=[WEATHER],
        )
    return {"turns": [report, second.report()], "invalid": v.invalid}


async def ws_reconnect(client: AsyncOpenAI) -> dict[str, Any]:
    """Drop the socket mid-response (as a network failure would) and resume on a new one.

    The gateway names the session and a resume token in its upgrade response headers; the
    SDK's reconnect hook sends them back, with the last sequence number received, as request
    headers on a new connection to the same URL. The hook cannot read response headers, so
    they are read from the SDK's underlying websockets connection. The socket is aborted
    after the first text delta; frames already buffered are still delivered first, so the
    response must be long enough not to have been buffered whole by then.
    """
    v = Validator(ResponsesServerEvent)
    state: dict[str, Any] = {"last_seq": -1, "hooks": [], "sessions": []}

    def remember(conn: AsyncResponsesConnection) -> None:
        headers = conn._connection.response.headers  # the upgrade response of this socket
        state["session"] = headers.get("x-session-id")
        state["token"] = headers.get("x-resume-token")
        state["sessions"].append(state["session"])

    def on_reconnecting(event: ReconnectingEvent) -> ReconnectingOverrides:
        sent = {
            "x-session-id": state["session"] or "",
            "x-resume-token": state["token"] or "",
            "x-last-sequence-number": str(state["last_seq"]),
        }
        state["hooks"].append({"attempt": event.attempt, "close_code": event.close_code, **sent})
        return {"extra_headers": sent}

    manager = client.responses.connect(on_reconnecting=on_reconnecting, initial_delay=0.05)
    async with manager as conn:
        remember(conn)
        socket = conn._connection
        await conn.response.create(model=MODEL, input=user("Tell me a long story."))
        turn, dropped_after, before_reconnect = Turn(), None, 0
        async for event in conn:
            if conn._connection is not socket:  # reconnected: read the new socket's headers
                socket = conn._connection
                remember(conn)
            seq = getattr(event, "sequence_number", None)
            if isinstance(seq, int):
                state["last_seq"] = seq
            if not state["hooks"]:
                before_reconnect += 1
            if turn.feed(v.check(event)):
                break
            if event.type == "response.output_text.delta" and dropped_after is None:
                dropped_after = seq
                socket.transport.abort()  # no close frame: the SDK sees 1006
    report = turn.report()
    report["duplicates"] = len(turn.seqs) - len(set(turn.seqs))
    return {
        "turn": report,
        "dropped_after_seq": dropped_after,
        "events_before_reconnect": before_reconnect,
        "hooks": state["hooks"],
        "sessions": state["sessions"],
        "invalid": v.invalid,
    }


# ---------------------------------------------------------------- HTTP


def stream_turn(events: Iterable[Any], v: Validator, stop_after: int | None = None) -> Turn:
    turn = Turn()
    for n, event in enumerate(events, 1):
        if turn.feed(v.check(event)) or n == stop_after:
            break
    return turn


def http_create(client: OpenAI) -> dict[str, Any]:
    invalid: list[dict[str, Any]] = []
    r = client.responses.create(model=MODEL, input=user("Hello!"))
    check_response(r, invalid)
    out: dict[str, Any] = {
        "id": r.id,
        "object": r.object,
        "status": r.status,
        "text": r.output_text,
        "usage": r.usage.model_dump() if r.usage else None,
    }
    got = client.responses.retrieve(r.id)
    check_response(got, invalid)
    out["retrieved"] = {"id": got.id, "status": got.status, "text": got.output_text}
    try:
        page = client.responses.input_items.list(r.id, order="asc")
        out["input_items"] = [i.type for i in page.data]
    except Exception as exc:
        out["input_items"] = {"error": repr(exc)}
    try:
        client.responses.delete(r.id)
        client.responses.retrieve(r.id)
        out["deleted"] = {"error": "still retrievable after delete"}
    except Exception as exc:
        out["deleted"] = {"retrieve_after_delete": type(exc).__name__}
    out["invalid"] = invalid
    return out


def http_stream(client: OpenAI) -> dict[str, Any]:
    v = Validator(ResponseStreamEvent)
    stream = client.responses.create(model=MODEL, input=user("Hello!"), stream=True)
    with stream:
        turn = stream_turn(stream, v)
    return {"turn": turn.report(), "invalid": v.invalid}


def http_stream_helper(client: OpenAI) -> dict[str, Any]:
    v = Validator(ResponseStreamEvent)
    with client.responses.stream(model=MODEL, input=user("Hello!")) as stream:
        turn = stream_turn(stream, v)
        final = stream.get_final_response()
    check_response(final, v.invalid)
    return {
        "turn": turn.report(),
        "final": {"id": final.id, "status": final.status, "text": final.output_text},
        "invalid": v.invalid,
    }


def http_background_resume(client: OpenAI) -> dict[str, Any]:
    """Start a background stream, drop it after a few events, resume by sequence number."""
    v = Validator(ResponseStreamEvent)
    stream = client.responses.create(
        model=MODEL, input=user("Tell me a long story."), background=True, stream=True
    )
    with stream:
        head = stream_turn(stream, v, stop_after=5)
    assert head.response is None and head.seqs, head.report()  # not over yet
    rid, after = head.response_id, head.seqs[-1]
    assert rid is not None, head.report()
    resumed = client.responses.retrieve(rid, stream=True, starting_after=after)
    with resumed:
        tail = stream_turn(resumed, v)
    seqs = head.seqs + tail.seqs
    out: dict[str, Any] = {
        "id": rid,
        "starting_after": after,
        "head_types": head.types,
        "tail_first_seq": tail.seqs[0] if tail.seqs else None,
        "deltas": head.deltas + tail.deltas,
        "text": tail.response.output_text if tail.response else None,
        "status": tail.response.status if tail.response else None,
        "contiguous": contiguous(seqs),
        "sequence_numbers": seqs,
    }
    try:  # the SDK's helper replays from the start and filters by sequence number itself
        with client.responses.stream(response_id=rid, starting_after=after) as helper:
            helped = stream_turn(helper, v)
            final = helper.get_final_response()
        out["helper"] = {"first_seq": helped.seqs[0], "text": final.output_text}
    except Exception as exc:
        out["helper"] = {"error": repr(exc)}
    out["invalid"] = v.invalid
    return out


def http_cancel(client: OpenAI) -> dict[str, Any]:
    invalid: list[dict[str, Any]] = []
    started = client.responses.create(
        model=MODEL, input=user("Tell me a very long story."), background=True
    )
    check_response(started, invalid)
    cancelled = client.responses.cancel(started.id)
    check_response(cancelled, invalid)
    after = client.responses.retrieve(started.id)
    return {
        "id": started.id,
        "started": started.status,
        "background": started.background,
        "cancelled": cancelled.status,
        "retrieved": after.status,
        "invalid": invalid,
    }


def http_chain(client: OpenAI) -> dict[str, Any]:
    invalid: list[dict[str, Any]] = []
    first = client.responses.create(model=MODEL, input=user("Hello! My name is Ada."))
    second = client.responses.create(
        model=MODEL, input=user("What is my name?"), previous_response_id=first.id
    )
    for r in (first, second):
        check_response(r, invalid)
    return {
        "turns": [
            {
                "id": r.id,
                "status": r.status,
                "text": r.output_text,
                "previous_response_id": r.previous_response_id,
                "input_tokens": r.usage.input_tokens if r.usage else None,
            }
            for r in (first, second)
        ],
        "invalid": invalid,
    }


ASYNC: dict[str, Callable[[AsyncOpenAI], Awaitable[dict[str, Any]]]] = {
    "ws_async": ws_async,
    "ws_lanes": ws_lanes,
    "ws_tools": ws_tools,
    "ws_reconnect": ws_reconnect,
}
SYNC: dict[str, Callable[[OpenAI], dict[str, Any]]] = {
    "ws_sync": ws_sync,
    "http_create": http_create,
    "http_stream": http_stream,
    "http_stream_helper": http_stream_helper,
    "http_background_resume": http_background_resume,
    "http_cancel": http_cancel,
    "http_chain": http_chain,
}


async def run_async(scenario: str, base_url: str, api_key: str) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        async with asyncio.timeout(60):
            return await ASYNC[scenario](client)


def main(scenario: str, base_url: str, api_key: str) -> None:
    if scenario in ASYNC:
        out = asyncio.run(run_async(scenario, base_url, api_key))
    else:
        with OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60) as client:
            out = SYNC[scenario](client)
    print(json.dumps({"scenario": scenario, **out}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
