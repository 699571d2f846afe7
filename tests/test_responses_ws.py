"""The Responses dialect over WebSocket (`/v1/responses`), with a raw client that
validates every event against openai-python's types (tests/support/responses_harness.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.engines.base import ToolCallDelta
from gateway.engines.sim import TOOL_ANSWER_PREFIX, SimEngine
from sessions import errors
from sessions.responses import codec as rp
from sessions.responses import dialect
from tests.support.harness import RunningGateway, gateway_on_a_thread, running_gateway
from tests.support.responses_harness import TERMINAL, ResponsesClient
from tests.support.scripted_engine import ScriptedEngine, ToolLoopEngine

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def responses_url(gw: RunningGateway) -> str:
    return gw.ws_url.replace("/v1/realtime", "/v1/responses")


@asynccontextmanager
async def client(
    engine: Any = None, **settings: Any
) -> AsyncIterator[tuple[RunningGateway, ResponsesClient]]:
    engine = engine or SimEngine(step_ms=1, response_tokens=8)
    async with (
        running_gateway(engine, **settings) as gw,
        ResponsesClient.connect(responses_url(gw)) as c,
    ):
        yield gw, c


async def test_a_turn_streams_the_responses_events_in_order() -> None:
    async with client() as (gw, c):
        turn = await c.respond(model="anything", input="Hello")
        types = turn.types
        assert types[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert types[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert set(types[4:-4]) == {"response.output_text.delta"}
        assert turn.text == turn.done_text == turn.output_text != ""
        numbers = [e["sequence_number"] for e in turn.events]
        assert numbers == list(range(len(numbers)))  # from 0, no gap
        usage = turn.response["usage"]
        assert usage["output_tokens"] == 8 and usage["input_tokens"] > 0
        assert turn.response["model"] == gw.gateway.model


async def test_previous_response_id_continues_the_conversation_with_only_new_input() -> None:
    engine = SimEngine(step_ms=1, response_tokens=4)
    seen: list[Any] = []
    submit = engine.submit

    def record(request: Any) -> None:
        seen.append(request)
        submit(request)

    engine.submit = record  # type: ignore[method-assign]
    async with client(engine) as (_, c):
        first = await c.respond(input="My name is Ada.", instructions="Be brief.")
        second = await c.respond(input="What is my name?", previous_response_id=first.id)
        assert second.response["previous_response_id"] == first.id
        texts = [(m.role, m.text) for m in seen[-1].messages]
        assert texts == [
            ("user", "My name is Ada."),
            ("assistant", first.text),
            ("user", "What is my name?"),
        ]  # instructions are not carried over, as OpenAI's
        assert seen[0].messages[0].text == "Be brief."


async def test_an_unknown_previous_response_is_refused_with_its_param() -> None:
    async with client() as (_, c):
        await c.create(input="Hi", previous_response_id="resp_nope")
        error = await c.error()
        assert error["status"] == 400
        assert error["error"]["code"] == "previous_response_not_found"
        assert error["error"]["param"] == "previous_response_id"
        assert error["error"]["type"] == "invalid_request_error"
        turn = await c.respond(input="Still here?")  # the connection goes on
        assert turn.response["status"] == "completed"


async def test_stored_responses_continue_on_a_new_connection_unstored_ones_do_not() -> None:
    async with client() as (gw, c):
        stored = await c.respond(input="Remember this.")
        unstored = await c.respond(input="Forget this.", store=False)
        # The same connection keeps its lane's latest, stored or not.
        again = await c.respond(input="And?", previous_response_id=unstored.id, store=False)
        assert again.response["status"] == "completed"
        async with ResponsesClient.connect(responses_url(gw)) as other:
            turn = await other.respond(input="Go on.", previous_response_id=stored.id)
            assert turn.response["previous_response_id"] == stored.id
            await other.create(input="Go on.", previous_response_id=unstored.id)
            assert (await other.error())["error"]["code"] == "previous_response_not_found"


async def test_lanes_run_at_once_and_their_events_carry_the_stream_id() -> None:
    async with client(SimEngine(step_ms=5, response_tokens=20)) as (_, c):
        for lane in ("a", "b", "c"):
            await c.create(input=f"lane {lane}", stream_id=lane)
        turns = {lane: await c.collect(lane) for lane in ("a", "b", "c")}
        for lane, turn in turns.items():
            assert {e["stream_id"] for e in turn.events} == {lane}
            assert turn.text == turn.output_text
        # Interleaved on the wire: they ran side by side, not one after another.
        lanes = [e["stream_id"] for e in c.events if e["type"] == "response.output_text.delta"]
        first_c = lanes.index("c")
        assert "a" in lanes[first_c:] or "b" in lanes[first_c:]


async def test_a_lane_runs_its_turns_in_order_and_forks_from_another_lane() -> None:
    async with client() as (_, c):
        await c.create(input="one", stream_id="x")
        await c.create(input="two", stream_id="x")
        first, second = await c.collect("x"), await c.collect("x")
        created = [e["response"]["id"] for e in c.events if e["type"] == "response.created"]
        assert created == [first.id, second.id]
        fork = await c.respond(input="fork", stream_id="y", previous_response_id=second.id)
        assert fork.response["previous_response_id"] == second.id


async def test_at_most_16_run_per_connection_and_the_rest_wait_not_fail() -> None:
    engine = SimEngine(step_ms=2, response_tokens=30)
    async with client(engine) as (gw, c):
        lanes = [f"l{i}" for i in range(20)]
        for lane in lanes:
            await c.create(input="go", stream_id=lane)
        await c.recv_until("response.output_text.delta")
        assert gw.gateway.scheduler.running <= dialect.MAX_IN_FLIGHT
        turns = [await c.collect(lane, timeout=30) for lane in lanes]
        assert all(t.response["status"] == "completed" for t in turns)
        assert not [e for e in c.events if e["type"] == "error"]


async def test_lane_limits_and_malformed_stream_ids_are_refused() -> None:
    async with client(SimEngine(step_ms=1, response_tokens=1)) as (_, c):
        await c.create(input="x", stream_id="not valid!")
        error = await c.error()
        assert (error["error"]["code"], error["error"]["param"]) == (
            "invalid_stream_id",
            "stream_id",
        )
        for i in range(dialect.MAX_LANES):
            await c.create(input="x", stream_id=f"s{i}")
        await c.create(input="x", stream_id="one-too-many")
        assert (await c.error())["error"]["code"] == "websocket_stream_limit_reached"


async def test_a_function_call_and_its_output_chain_like_openai() -> None:
    async with client() as (_, c):
        turn = await c.respond(input="Use get_weather for Paris.", tools=[WEATHER])
        call = next(i for i in turn.response["output"] if i["type"] == "function_call")
        assert call["name"] == "get_weather"
        assert "response.function_call_arguments.done" in turn.types
        args = "".join(
            e["delta"] for e in turn.events if e["type"] == "response.function_call_arguments.delta"
        )
        assert args == call["arguments"]
        answer = await c.respond(
            previous_response_id=turn.id,
            tools=[WEATHER],
            input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}],
        )
        assert answer.text == TOOL_ANSWER_PREFIX + "Sunny"


async def test_an_output_for_a_call_that_is_not_there_is_refused() -> None:
    async with client() as (_, c):
        await c.create(input=[{"type": "function_call_output", "call_id": "c1", "output": "x"}])
        error = await c.error()
        assert error["error"]["code"] == "call_not_found"
        assert error["error"]["param"] == "input[0].call_id"


async def test_response_cancel_ends_the_answer_incomplete_and_cancelled() -> None:
    engine = SimEngine(step_ms=5, response_tokens=10_000)
    async with client(engine) as (_, c):
        await c.create(input="Talk forever")
        created = await c.recv_until("response.created")
        await c.recv_until("response.output_text.delta")
        await c.send({"type": "response.cancel", "response_id": created["response"]["id"]})
        end = await c.recv_until("response.incomplete")
        assert end["response"]["status"] == "cancelled"
        text = "".join(e["delta"] for e in c.events if e["type"] == "response.output_text.delta")
        done = next(e for e in c.events if e["type"] == "response.output_text.done")
        assert done["text"] == text


async def test_closing_the_socket_aborts_every_response_in_the_engine() -> None:
    engine = SimEngine(step_ms=5, response_tokens=10_000)
    async with running_gateway(engine) as gw:
        async with ResponsesClient.connect(responses_url(gw)) as c:
            for lane in ("a", "b"):
                await c.create(input="go", stream_id=lane)
            await c.recv_until("response.output_text.delta")
        await gw.wait_idle()
        generated = engine.tokens_generated
        await asyncio.sleep(0.05)  # steps that would come if anything still ran
        assert engine.tokens_generated == generated


async def test_unknown_events_are_refused_and_response_processed_is_ignored() -> None:
    async with client() as (_, c):
        await c.send({"type": "response.processed", "response_id": "x"})
        await c.send({"type": "session.update"})
        error = await c.error()
        assert error["error"]["code"] == "unknown_event_type"
        assert not [e for e in c.events if e["type"] == "error"][1:]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"input": 3}, "invalid_type", "input"),
        ({"input": "x", "temperature": 9}, "invalid_value", "temperature"),
        (
            {
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "a", "strict": True}},
            },
            "invalid_json_schema",
            "text.format.schema",
        ),
        ({"input": "x", "frobnicate": 1}, "unknown_parameter", "frobnicate"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "unsupported_value", None),
        ({"input": "x", "tool_choice": "required"}, "invalid_value", "tool_choice"),
    ],
)
async def test_bad_bodies_get_a_clear_error_and_the_socket_goes_on(
    body: dict[str, Any], code: str, param: str | None
) -> None:
    async with client() as (_, c):
        await c.create(**body)
        error = await c.error()
        assert error["error"]["code"] == code, error
        if param is not None:
            assert error["error"]["param"] == param
        assert (await c.respond(input="ok")).response["status"] == "completed"


async def test_stream_and_background_are_accepted_and_ignored() -> None:
    async with client() as (_, c):
        turn = await c.respond(input="hi", stream=True, background=False, include=[])
        assert turn.response["status"] == "completed"


async def test_generate_false_stores_the_input_without_output() -> None:
    async with client() as (_, c):
        warm = await c.respond(input="A long document to prefill.", generate=False)
        assert warm.types == ["response.created", "response.completed"]
        assert warm.response["output"] == []
        turn = await c.respond(input="Summarise it.", previous_response_id=warm.id)
        assert turn.response["status"] == "completed"


async def test_steer_stops_the_answer_steered_and_starts_its_successor() -> None:
    engine = SimEngine(step_ms=5, response_tokens=10_000)
    async with client(engine) as (_, c):
        await c.create(input="Tell me about cats")
        created = await c.recv_until("response.created")
        first = created["response"]["id"]
        await c.recv_until("response.output_text.delta")
        await c.send(
            {"type": "response.steer", "previous_response_id": first, "input": "Dogs instead"}
        )
        accepted = await c.recv_until("response.steer.accepted")
        assert accepted["steer"]["previous_response_id"] == first
        end = await c.recv_until("response.incomplete")
        assert end["response"]["incomplete_details"] == {"reason": "steered"}
        successor = await c.recv_until("response.created")
        assert successor["response"]["previous_response_id"] == first
        await c.send({"type": "response.cancel", "response_id": successor["response"]["id"]})
        await c.recv_until("response.incomplete")


async def test_steering_an_unknown_response_fails_and_returns_the_input() -> None:
    async with client() as (_, c):
        await c.send({"type": "response.steer", "previous_response_id": "resp_x", "input": "hi"})
        failed = await c.recv_until("response.steer.failed")
        assert failed["error"]["code"] == "response_not_found"
        assert failed["steer"]["input"] == "hi"


async def test_steering_a_response_waiting_for_tool_output_is_pending() -> None:
    async with client() as (_, c):
        turn = await c.respond(input="get_weather for Paris?", tools=[WEATHER])
        call = next(i for i in turn.response["output"] if i["type"] == "function_call")
        await c.send({"type": "response.steer", "previous_response_id": turn.id, "input": "Hurry"})
        await c.recv_until("response.steer.accepted")
        pending = await c.recv_until("response.steer.pending")
        assert pending["required_input"] == [
            {"type": "function_call_output", "call_id": call["call_id"], "name": "get_weather"}
        ]
        answer = await c.respond(
            previous_response_id=turn.id,
            tools=[WEATHER],
            input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "Rain"}],
        )
        assert answer.response["status"] == "completed"


async def test_the_connection_ends_at_its_max_age() -> None:
    async with client(responses_max_age=0.2) as (_, c):
        error = await c.error(timeout=5)
        assert error["error"]["code"] == "websocket_connection_limit_reached"
        with pytest.raises(ConnectionClosed):
            await c.recv(timeout=5)


async def test_a_dropped_connection_resumes_by_headers_with_nothing_lost() -> None:
    engine = SimEngine(step_ms=5, response_tokens=60)
    async with running_gateway(engine) as gw:
        async with ResponsesClient.connect(responses_url(gw)) as c:
            session, token = c.session_id, c.resume_token
            await c.create(input="A long answer")
            seen = [await c.recv() for _ in range(8)]
            c.ws.transport.abort()  # a network drop: no close frame
        last = seen[-1]["sequence_number"]
        headers = {
            "x-session-id": session,
            "x-resume-token": token,
            "x-last-sequence-number": str(last),
        }
        async with ResponsesClient.connect(responses_url(gw), additional_headers=headers) as r:
            assert r.session_id == session
            rest = await r.collect()
            events = seen + rest.events
            numbers = [e["sequence_number"] for e in events]
            assert numbers == list(range(len(numbers)))
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == rest.done_text


async def test_a_resume_with_a_wrong_token_is_refused_at_the_upgrade() -> None:
    async with client() as (gw, c):
        headers = {"x-session-id": c.session_id, "x-resume-token": "wrong"}
        with pytest.raises(InvalidStatus) as refused:
            async with ResponsesClient.connect(responses_url(gw), additional_headers=headers):
                pass
        assert refused.value.response.status_code == 404


async def test_the_responses_socket_keeps_the_realtime_handshake_rules() -> None:
    async with running_gateway(SimEngine(step_ms=1), api_keys=("k",)) as gw:
        with pytest.raises(InvalidStatus) as refused:
            async with ResponsesClient.connect(responses_url(gw)):
                pass
        assert refused.value.response.status_code == 401
        auth = {"Authorization": "Bearer k"}
        async with ResponsesClient.connect(responses_url(gw), additional_headers=auth) as c:
            assert (await c.respond(input="hi")).response["status"] == "completed"
        status, _ = await gw.get("/v1/responses")
        assert status in (405, 426)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "x"]),
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", 1]),
        "content": _json | st.just([{"type": "input_text", "text": "hi"}]),
        "call_id": _json,
        "name": _json,
        "arguments": _json,
        "output": _json,
    },
)
_body = st.fixed_dictionaries(
    {},
    optional={
        "input": st.text(max_size=8) | st.lists(_item, max_size=3) | _json,
        "model": _json,
        "tools": _json,
        "tool_choice": _json,
        "stream_id": st.sampled_from(["a", "b", "", "bad id", None]) | _json,
        "previous_response_id": _json,
        "max_output_tokens": _json,
        "temperature": _json,
        "text": _json,
        "generate": _json,
        "metadata": _json,
    },
)


@settings(max_examples=400, deadline=None)
@given(
    event_type=st.sampled_from(["response.create", "response.cancel", "response.steer"]), body=_body
)
def test_random_events_decode_or_raise_protocol_error(
    event_type: str, body: dict[str, Any]
) -> None:
    try:
        rp.decode(json.dumps({**body, "type": event_type}))
    except errors.ProtocolError as error:
        assert error.code and error.message and error.error_type == "invalid_request_error"


@pytest.fixture(scope="module")
def threaded_gateway() -> Iterator[str]:
    with gateway_on_a_thread(SimEngine(step_ms=0, response_tokens=4)) as gw:
        yield responses_url(gw)


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(
        st.builds(
            lambda t, b: {**b, "type": t},
            st.sampled_from(["response.create", "response.cancel", "response.steer", "x"]),
            _body,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_random_events_never_break_the_connection(
    threaded_gateway: str, events: list[dict[str, Any]]
) -> None:
    async def scenario() -> dict[str, Any]:
        async with ResponsesClient.connect(threaded_gateway) as c:
            for event in events:
                await c.ws.send(json.dumps(event))
            await c.create(input="probe", metadata={"probe": "1"}, stream_id="probe")
            async with asyncio.timeout(10):
                while True:
                    event = await c.recv()
                    if event["type"] in TERMINAL and event["response"]["metadata"]:
                        return event

    assert asyncio.run(scenario())["response"]["status"] == "completed"


async def test_chaos_keeps_every_invariant() -> None:
    """Random creates, cancels and steers over four lanes, then a close mid-stream: each
    response started ends exactly once, nothing of it follows its end, its deltas join to
    its final text, and the engine is left with nothing."""
    rng = random.Random(7)
    engine = SimEngine(step_ms=1, response_tokens=30)
    async with running_gateway(engine) as gw:
        async with ResponsesClient.connect(responses_url(gw)) as c:
            live: list[str] = []
            for _ in range(60):
                action = rng.random()
                lane = rng.choice(["a", "b", "c", None])
                if action < 0.5:
                    await c.create(input="go", stream_id=lane, max_output_tokens=rng.randint(1, 40))
                elif action < 0.7 and live:
                    await c.send({"type": "response.cancel", "response_id": rng.choice(live)})
                elif action < 0.8 and live:
                    await c.send(
                        {
                            "type": "response.steer",
                            "previous_response_id": rng.choice(live),
                            "input": "x",
                        }
                    )
                with contextlib.suppress(TimeoutError):
                    event = await c.recv(timeout=0.01)
                    if event["type"] == "response.created":
                        live.append(event["response"]["id"])
            with contextlib.suppress(TimeoutError):
                while True:
                    await c.recv(timeout=0.3)
        await gw.wait_idle()
    check_invariants(c.events)


def check_invariants(events: list[dict[str, Any]]) -> None:
    numbers = [e["sequence_number"] for e in events]
    assert numbers == list(range(len(numbers)))
    open_by_lane: dict[str | None, dict[str, Any]] = {}
    ended: set[str] = set()
    for event in events:
        lane, kind = event.get("stream_id"), event["type"]
        if kind in ("error",) or kind.startswith("response.steer"):
            continue
        if kind == "response.created":
            assert lane not in open_by_lane, "two responses at once on one lane"
            open_by_lane[lane] = {"id": event["response"]["id"], "deltas": [], "done": []}
            continue
        current = open_by_lane.get(lane)
        assert current is not None, f"{kind} outside a response on lane {lane}"
        if kind == "response.output_text.delta":
            current["deltas"].append(event["delta"])
        elif kind == "response.output_text.done":
            current["done"].append(event["text"])
        elif kind in TERMINAL:
            rid = event["response"]["id"]
            assert rid == current["id"] and rid not in ended
            ended.add(rid)
            assert "".join(current["deltas"]) == "".join(current["done"])
            texts = [
                part["text"]
                for item in event["response"]["output"]
                if item["type"] == "message"
                for part in item["content"]
            ]
            assert "".join(texts) == "".join(current["done"])
            del open_by_lane[lane]
    assert not open_by_lane, "a response that never ended"


# -- Codex's tools: namespaces and hosted tools (sessions/responses/tools.py) ---------------

AGENTS = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents.",
    "tools": [{"type": "function", "name": "spawn", "description": "Start one.", "strict": False}],
}


async def test_a_namespace_function_is_called_by_its_own_name_and_namespace() -> None:
    engine = ToolLoopEngine()
    async with client(engine) as (_gw, c):
        turn = await c.respond(input="go", tools=[AGENTS, {"type": "web_search"}])
        calls = [i for i in turn.response["output"] if i["type"] == "function_call"]
        assert [(i["namespace"], i["name"]) for i in calls] == [("agents", "spawn")]
        added = [e for e in turn.events if e["type"] == "response.output_item.added"]
        assert added[0]["item"]["namespace"] == "agents"
        assert [t["type"] for t in turn.response["tools"]] == ["namespace"]
        assert [t.name for t in engine.requests[-1].tools] == ["agents__spawn"]
        # The output goes back with its namespace, as Codex sends it.
        output = {
            "type": "function_call_output",
            "call_id": calls[0]["call_id"],
            "namespace": "agents",
            "output": "spawned",
        }
        answer = await c.respond(previous_response_id=turn.id, input=[output], tools=[AGENTS])
        assert answer.status == "completed" and "spawned" in answer.output_text
        # The history as a client sends it again (store: false): the call with its namespace.
        again = await c.respond(input=[{**calls[0]}, output], tools=[AGENTS], store=False)
        assert again.status == "completed"
        assert engine.requests[-1].messages[-2].tool_calls[0].name == "agents__spawn"


async def test_hosted_tools_are_left_out_or_refused_as_the_flag_says() -> None:
    tools = [{"type": "function", "name": "f"}, {"type": "web_search"}]
    async with client() as (_gw, c):
        turn = await c.respond(input="hi", tools=tools)
        assert turn.status == "completed"
        assert [t["name"] for t in turn.response["tools"]] == ["f"]
        await c.create(input="hi", tools=tools, tool_choice={"type": "web_search"})
        error = await c.error()
        assert (error["error"]["code"], error["error"]["param"]) == (
            "unsupported_value",
            "tool_choice.type",
        )
    async with client(hosted_tools="refuse") as (_gw, c):
        await c.create(input="hi", tools=tools)
        error = await c.error()
        assert (error["error"]["code"], error["error"]["param"]) == (
            "unsupported_value",
            "tools[1]",
        )
        assert (await c.respond(input="hi", tools=tools[:1])).status == "completed"


async def test_a_custom_tool_call_streams_its_input_and_takes_its_output() -> None:
    script = [
        ToolCallDelta(0, '{"inp', call_id="call_patch", name="apply_patch"),
        ToolCallDelta(0, 'ut": "line one\\nli'),
        ToolCallDelta(0, 'ne two"}'),
    ]
    engine = ScriptedEngine(script)
    patch = {"type": "custom", "name": "apply_patch", "description": "Patch files."}
    async with client(engine) as (_gw, c):
        turn = await c.respond(input="patch it", tools=[patch])
        kinds = [e["type"] for e in turn.events if "custom_tool_call" in e["type"]]
        assert kinds == ["response.custom_tool_call_input.delta"] * 2 + [
            "response.custom_tool_call_input.done"
        ]
        deltas = [e["delta"] for e in turn.events if e["type"].endswith("input.delta")]
        assert deltas == ["line one\nli", "ne two"]
        (item,) = turn.response["output"]
        assert item["type"] == "custom_tool_call" and item["input"] == "line one\nline two"
        assert turn.response["tools"][0]["type"] == "custom"
        output = {"type": "custom_tool_call_output", "call_id": "call_patch", "output": "ok"}
        await c.respond(previous_response_id=turn.id, input=[output], tools=[patch])
        assert engine.requests[-1].messages[-1].role == "tool"
        assert engine.requests[-1].messages[-1].text == "ok"
