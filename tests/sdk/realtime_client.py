"""The official ``openai`` SDK's realtime client, unmodified, against a running gateway.

Runs in the SDK's own virtual environment (``.venv-sdk``: ``openai[realtime]`` pins an
older ``websockets`` than the gateway is tested with), started by tests/test_sdk.py:
``python tests/sdk/realtime_client.py SCENARIO BASE_URL API_KEY``. It prints what it
saw as one JSON object on its last line; the test asserts on it. It imports nothing
of the gateway.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from openai import AsyncOpenAI

Scenario = Callable[[Any], Awaitable[dict[str, Any]]]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {"type": "function", "name": "get_time", "description": "The time in a zone."}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def until_done(conn: Any) -> tuple[str, list[Any], Any]:
    """Text deltas joined, every event of the response, and its response.done."""
    text, events = "", []
    async for event in conn:
        if event.type == "error":
            raise AssertionError(event)
        events.append(event)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.done":
            return text, events, event
    raise AssertionError("connection ended before response.done")


async def multi_turn_and_cancel(conn: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"created": (await conn.recv()).type}
    await conn.session.update(
        session={"type": "realtime", "output_modalities": ["text"], "instructions": "Be kind."}
    )
    out["updated"] = (await conn.recv()).type
    await conn.conversation.item.create(item=user("Hello!"))
    await conn.response.create()
    text, _, done = await until_done(conn)
    out["first"] = {
        "status": done.response.status,
        "deltas": text,
        "stored": done.response.output[0].content[0].text,
        "input_tokens": done.response.usage.input_tokens,
    }
    await conn.conversation.item.create(item=user("Tell me more."))
    await conn.response.create()
    _, _, done = await until_done(conn)
    out["second"] = {
        "input_tokens": done.response.usage.input_tokens,
        "output_tokens": done.response.usage.output_tokens,
    }
    await conn.response.create()
    async for event in conn:
        if event.type == "response.output_text.delta":
            break
    await conn.response.cancel()
    _, _, done = await until_done(conn)
    out["cancelled"] = {
        "status": done.response.status,
        "reason": done.response.status_details.reason,
    }
    await conn.send({"type": "response.create", "response": {"output_modalities": ["audio"]}})
    error = await conn.recv()
    out["audio"] = {"type": error.type, "code": error.error.code}
    return out


async def tool_round_trip(conn: Any) -> dict[str, Any]:
    await conn.recv()
    await conn.session.update(
        session={"type": "realtime", "output_modalities": ["text"], "tools": [WEATHER]}
    )
    await conn.recv()
    await conn.conversation.item.create(item=user("Use get_weather for Paris."))
    await conn.response.create()
    _, events, done = await until_done(conn)
    call = done.response.output[0]
    arguments_done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    await conn.conversation.item.create(
        item={"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 °C"}
    )
    await conn.response.create()
    answer, _, answer_done = await until_done(conn)
    return {
        "types": [e.type for e in events],
        "call": {"type": call.type, "name": call.name, "status": call.status},
        "arguments": arguments_done.arguments,
        "deltas": deltas,
        "answer": answer,
        "answer_status": answer_done.response.status,
    }


async def several_calls(conn: Any) -> dict[str, Any]:
    await conn.recv()
    await conn.session.update(session={"type": "realtime", "tools": [WEATHER, TIME]})
    await conn.recv()
    await conn.conversation.item.create(item=user("Weather and time in Paris?"))
    await conn.response.create()
    text, _, done = await until_done(conn)
    return {
        "text": text,
        "output": [
            [item.type, getattr(item, "name", None), getattr(item, "arguments", None)]
            for item in done.response.output
        ],
    }


async def tool_choices(conn: Any) -> dict[str, Any]:
    await conn.recv()
    await conn.session.update(session={"type": "realtime", "tools": [WEATHER, TIME]})
    await conn.recv()
    await conn.conversation.item.create(item=user("Tell me a story."))
    called: dict[str, list[str]] = {}
    for choice in ("auto", "required", "none", {"type": "function", "name": "get_time"}):
        await conn.response.create(
            response={"tool_choice": choice, "conversation": "none"}  # each sees the same prompt
        )
        _, _, done = await until_done(conn)
        called[json.dumps(choice)] = [
            item.name for item in done.response.output if item.type == "function_call"
        ]
    return {"called": called}


async def bad_tools(conn: Any) -> dict[str, Any]:
    await conn.recv()
    errors = []
    for tools in ([{"type": "function", "name": "has spaces"}], [{"type": "mcp"}]):
        await conn.session.update(session={"type": "realtime", "tools": tools})
        error = await conn.recv()
        errors.append([error.type, error.error.code, error.error.param])
    await conn.session.update(session={"type": "realtime", "tools": [WEATHER]})
    return {"errors": errors, "then": (await conn.recv()).type}


SCENARIOS: dict[str, Scenario] = {
    f.__name__: f for f in (multi_turn_and_cancel, tool_round_trip, several_calls, tool_choices)
} | {"bad_tools": bad_tools}


async def main(scenario: str, base_url: str, api_key: str) -> None:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    async with client.realtime.connect(model="gpt-realtime") as conn:
        result = await asyncio.wait_for(SCENARIOS[scenario](conn), 30)
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
