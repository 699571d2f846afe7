"""Function calling through a real gateway, over raw WebSockets (the official SDK and the
Agents SDK drive the same flows in tests/test_sdk.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.engines.sim import TOOL_ANSWER_PREFIX, SimEngine
from tests.support.harness import RawClient, RunningGateway, running_gateway
from tests.support.scripted_engine import ScriptedEngine, text_then_two_calls

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
TIME = {"type": "function", "name": "get_time", "description": "The time in a zone."}


def output_item(call_id: str, output: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {"type": "function_call_output", "call_id": call_id, "output": output},
    }


async def respond_all(c: RawClient, **response: Any) -> list[dict[str, Any]]:
    """``response.create``, then every event up to ``response.done`` (item events too)."""
    start = len(c.events)
    await c.send({"type": "response.create", "response": response})
    await c.recv_until("response.done")
    return c.events[start:]


async def set_tools(c: RawClient, tools: list[Any], **session: Any) -> dict[str, Any]:
    await c.send({"type": "session.update", "session": {"tools": tools, **session}})
    return await c.recv_until("session.updated")


async def test_a_tool_call_and_its_output_round_trip(gw: RunningGateway) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        updated = await set_tools(c, [WEATHER])
        assert updated["session"]["tools"] == [WEATHER]
        question = "Please use get_weather for Paris."
        user = await c.say(question)
        events = await respond_all(c)
        types = [e["type"] for e in events]
        n = types.count("response.function_call_arguments.delta")
        assert n >= 2  # the arguments stream in several pieces
        assert types == [
            "response.created",
            "rate_limits.updated",
            "response.output_item.added",
            "conversation.item.added",
            *["response.function_call_arguments.delta"] * n,
            "response.function_call_arguments.done",
            "response.output_item.done",
            "conversation.item.done",
            "response.done",
        ]
        added = events[2]["item"]
        assert added["type"] == "function_call"
        assert (added["name"], added["arguments"], added["status"]) == (
            "get_weather",
            "",
            "in_progress",
        )
        assert events[3]["previous_item_id"] == user["item"]["id"]
        assert events[3]["item"] == added
        done = events[types.index("response.function_call_arguments.done")]
        pieces = [e["delta"] for e in events if "arguments.delta" in e["type"]]
        assert "".join(pieces) == done["arguments"]
        assert json.loads(done["arguments"]) == {"city": question}  # valid for its schema
        assert (done["call_id"], done["name"]) == (added["call_id"], "get_weather")
        assert {e["call_id"] for e in events if "arguments.delta" in e["type"]} == {
            added["call_id"]
        }
        call = events[types.index("response.output_item.done")]["item"]
        assert call["status"] == "completed" and call["arguments"] == done["arguments"]
        assert events[types.index("conversation.item.done")]["item"] == call
        assert events[-1]["response"]["status"] == "completed"
        assert events[-1]["response"]["output"] == [call]

        # The client runs the tool and answers; the next answer quotes the output.
        await c.send(output_item(call["call_id"], "Sunny, 21 °C 🌞"))
        stored = await c.recv_until("conversation.item.done")
        assert stored["previous_item_id"] == call["id"]
        assert stored["item"]["type"] == "function_call_output"
        answer = await c.respond()
        assert answer.text == answer.final_text == f"{TOOL_ANSWER_PREFIX}Sunny, 21 °C 🌞"
        assert answer.response["output"][0]["type"] == "message"

        # The call and its output are items like any other.
        for item in (call, stored["item"]):
            await c.send({"type": "conversation.item.retrieve", "item_id": item["id"]})
            assert (await c.recv_until("conversation.item.retrieved"))["item"] == item
        await c.send({"type": "conversation.item.delete", "item_id": stored["item"]["id"]})
        assert (await c.recv_until("conversation.item.deleted"))["item_id"] == stored["item"]["id"]


async def test_an_output_must_answer_a_call(gw: RunningGateway) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        await c.send({**output_item("call_nobody_made", "42"), "event_id": "e9"})
        error = (await c.recv_until("error"))["error"]
        assert (error["code"], error["param"], error["event_id"]) == (
            "call_not_found",
            "item.call_id",
            "e9",
        )
        # A call the client adds itself (a restored history) can be answered.
        await c.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
            }
        )
        await c.recv_until("conversation.item.done")
        await c.send(output_item("call_1", "Snow"))
        assert (await c.recv_until("conversation.item.done"))["item"]["output"] == "Snow"
        assert "Snow" in (await c.respond()).text


@pytest.mark.parametrize(
    ("choice", "message", "called"),
    [
        ("auto", "Tell me a story.", None),  # no tool named: a text answer
        ("auto", "get_time and get_weather, please", "get_weather"),  # the first in the list
        ("required", "Tell me a story.", "get_weather"),
        ({"type": "function", "name": "get_time"}, "Tell me about get_weather.", "get_time"),
        ("none", "Use get_weather now.", None),
    ],
)
async def test_tool_choice(
    gw: RunningGateway, choice: Any, message: str, called: str | None
) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        await set_tools(c, [WEATHER, TIME], tool_choice=choice)
        await c.say(message)
        turn = await c.respond()
        calls = [i for i in turn.response["output"] if i["type"] == "function_call"]
        assert [i["name"] for i in calls] == ([called] if called else [])
        assert bool(turn.text) == (called is None)


async def test_a_response_overrides_the_sessions_tools(gw: RunningGateway) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        await set_tools(c, [WEATHER], tool_choice="required")
        await c.say("Hello.")
        turn = await c.respond(tools=[TIME], tool_choice={"type": "function", "name": "get_time"})
        assert [i["name"] for i in turn.response["output"]] == ["get_time"]
        turn = await c.respond(tool_choice="none")
        assert turn.response["output"][0]["type"] == "message"


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        ({"tools": {"name": "x"}}, "invalid_type", "session.tools"),
        ({"tools": [{"type": "function"}]}, "missing_required_parameter", "session.tools[0].name"),
        ({"tools": [{"name": "no spaces"}]}, "invalid_value", "session.tools[0].name"),
        ({"tools": [WEATHER, WEATHER]}, "invalid_value", "session.tools[1].name"),
        ({"tools": [{**WEATHER, "parameters": []}]}, "invalid_type", "session.tools[0].parameters"),
        (
            {"tools": [{**WEATHER, "parameters": {"type": "string"}}]},
            "invalid_value",
            "session.tools[0].parameters",
        ),
        ({"tools": [{**WEATHER, "strict": True}]}, "unknown_parameter", "session.tools[0].strict"),
        (
            {"tools": [{"type": "mcp", "server_label": "x"}]},
            "unsupported_tool_type",
            "session.tools[0].type",
        ),
        ({"tool_choice": "always"}, "invalid_value", "session.tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
            "invalid_value",
            "session.tool_choice.name",
        ),
    ],
)
async def test_bad_tool_definitions_get_errors_with_param(
    gw: RunningGateway, session: dict[str, Any], code: str, param: str
) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        await c.send({"type": "session.update", "event_id": "bad", "session": session})
        error = (await c.recv_until("error"))["error"]
        assert (error["code"], error["param"], error["event_id"]) == (code, param, "bad")
        # The session is unchanged and the connection keeps working.
        await c.send({"type": "session.update", "session": {}})
        assert (await c.recv_until("session.updated"))["session"]["tools"] == []


async def test_bad_tools_in_a_response_get_errors_with_param(gw: RunningGateway) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        await c.send({"type": "response.create", "response": {"tools": [{"name": ""}]}})
        error = (await c.recv_until("error"))["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "response.tools[0].name")
        await c.send({"type": "response.create", "response": {"tool_choice": "required"}})
        error = (await c.recv_until("error"))["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "response.tool_choice")
        await c.say("still here")
        assert (await c.respond()).status == "completed"


async def test_text_and_several_calls_in_one_response() -> None:
    engine = ScriptedEngine(text_then_two_calls())
    async with running_gateway(engine) as gw, RawClient.connect(gw.ws_url) as c:
        await set_tools(c, [WEATHER, TIME])
        await c.say("Weather and time in Paris?")
        turn = await c.respond()
        opened = [
            (e["output_index"], e["item"]["type"])
            for e in turn.events
            if e["type"] == "response.output_item.added"
        ]
        assert opened == [(0, "message"), (1, "function_call"), (2, "function_call")]
        assert turn.text == "Let me check both."
        args = {
            e["call_id"]: e["arguments"]
            for e in turn.events
            if e["type"] == "response.function_call_arguments.done"
        }
        assert args == {"call_weather": '{"city": "Paris"}', "call_time": '{"zone": "CET"}'}
        deltas = [
            (e["output_index"], e["delta"])
            for e in turn.events
            if e["type"] == "response.function_call_arguments.delta"
        ]
        assert deltas == [(1, '{"city": '), (1, '"Paris"}'), (2, '{"zone": '), (2, '"CET"}')]
        output = turn.response["output"]
        assert [(i["type"], i["status"]) for i in output] == [
            ("message", "completed"),
            ("function_call", "completed"),
            ("function_call", "completed"),
        ]
        # Both outputs, then the next answer: the model sees one assistant turn with
        # its text and both calls, then both outputs.
        await c.send(output_item("call_weather", "Sunny"))
        await c.send(output_item("call_time", "12:00"))
        await c.recv_until("conversation.item.done")
        await c.recv_until("conversation.item.done")
        await c.respond()
        seen = engine.requests[-1].messages
        assert [(m.role, m.text) for m in seen] == [
            ("user", "Weather and time in Paris?"),
            ("assistant", "Let me check both."),
            ("tool", "Sunny"),
            ("tool", "12:00"),
        ]
        assert [(t.call_id, t.name) for t in seen[1].tool_calls] == [
            ("call_weather", "get_weather"),
            ("call_time", "get_time"),
        ]
        assert [m.tool_call_id for m in seen[2:]] == ["call_weather", "call_time"]


async def test_a_cancelled_call_is_incomplete_and_left_out_of_the_prompt() -> None:
    engine = SimEngine(step_ms=20)
    async with running_gateway(engine) as gw, RawClient.connect(gw.ws_url) as c:
        await set_tools(c, [WEATHER], tool_choice="required")
        await c.say("A long question " * 8)
        start = len(c.events)
        await c.send({"type": "response.create"})
        first = await c.recv_until("response.function_call_arguments.delta")
        await c.send({"type": "response.cancel"})
        response = (await c.recv_until("response.done"))["response"]
        events = c.events[start:]
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert done["arguments"].startswith(first["delta"])
        with pytest.raises(json.JSONDecodeError):
            json.loads(done["arguments"])  # cut short
        assert response["status"] == "cancelled"
        assert response["output"][0]["status"] == "incomplete"
        assert response["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        (session,) = gw.gateway.sessions
        item = session.conversation.get(done["item_id"])
        assert item is not None and item.status == "incomplete"  # kept, as sent...
        assert not any(m.tool_calls for m in session.conversation.to_messages())  # ...not sent on


async def test_out_of_band_input_with_a_call_and_its_output(gw: RunningGateway) -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "Rain"}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "?"}]}
    async with RawClient.connect(gw.ws_url) as c:
        turn = await c.respond(conversation="none", input=[user, call, output], metadata={"k": "v"})
        assert turn.text == f"{TOOL_ANSWER_PREFIX}Rain"
        assert turn.events[0]["response"]["metadata"] == turn.response["metadata"] == {"k": "v"}
        await c.send(
            {"type": "response.create", "response": {"conversation": "none", "input": [output]}}
        )
        error = (await c.recv_until("error"))["error"]
        assert (error["code"], error["param"]) == ("call_not_found", "response.input[0].call_id")


async def test_rate_limits_after_each_response_create() -> None:
    engine = SimEngine(step_ms=50, context_tokens=4096)
    async with (
        running_gateway(engine, max_running=1, max_queued=1) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await c.send({"type": "response.create", "response": {"conversation": "none"}})
        limits = (await c.recv_until("rate_limits.updated"))["rate_limits"]
        assert limits == [
            {"name": "requests", "limit": 2, "remaining": 1},
            {"name": "tokens", "limit": 4096},
        ]
        await c.send({"type": "response.create", "response": {"conversation": "none"}})
        limits = (await c.recv_until("rate_limits.updated"))["rate_limits"]
        assert limits[0]["remaining"] == 0
        await c.send({"type": "response.create", "response": {"conversation": "none"}})
        refused = await c.recv_until("error")
        assert refused["error"]["code"] == "overloaded"
        after = await c.recv()
        assert after["type"] == "rate_limits.updated"
        assert after["rate_limits"][0]["remaining"] == 0


async def test_an_agent_frameworks_audio_settings_are_accepted_with_text_output(
    gw: RunningGateway,
) -> None:
    # What the Agents SDK sends by default (voice, formats, transcription, turn detection).
    session = {
        "type": "realtime",
        "model": "gpt-realtime",
        "output_modalities": ["text"],
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "transcription": {"model": "gpt-4o-mini-transcribe"},
                "turn_detection": {"type": "semantic_vad", "interrupt_response": True},
            },
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "ash"},
        },
        "tools": [WEATHER],
        "tracing": "auto",
    }
    async with RawClient.connect(gw.ws_url) as c:
        await c.send({"type": "session.update", "session": session})
        updated = await c.recv()
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["output_modalities"] == ["text"]
        # What really needs audio is still refused.
        await c.send({"type": "session.update", "session": {"output_modalities": ["audio"]}})
        assert (await c.recv())["error"]["code"] == "unsupported_modality"


async def test_truncate_gets_a_clear_error(gw: RunningGateway) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        await c.send(
            {
                "type": "conversation.item.truncate",
                "event_id": "t1",
                "item_id": "item_1",
                "content_index": 0,
                "audio_end_ms": 1500,
            }
        )
        error = (await c.recv())["error"]
        assert (error["code"], error["event_id"]) == ("unsupported_modality", "t1")
        assert "truncate" in error["message"] and "text only" in error["message"]
        await c.say("still here")
