"""The OpenAI Agents SDK, unmodified: an Agent with two function tools over the Responses API.

Runs in ``.venv-sdk`` (started by the gateway's tests):
``python tests/sdk/responses_agent.py TRANSPORT BASE_URL API_KEY``, TRANSPORT ``ws`` (the
SDK's Responses WebSocket transport, ``responses_websocket_session``) or ``http`` (its
default transport, ``POST BASE_URL/responses``). The agent is asked something that needs
both tools, so the SDK runs a tool loop: a call, its output sent back, the other call, its
output, then the answer. Each model call resends the conversation so far (the SDK chains
no previous_response_id by default). Tracing is off. Prints one JSON object on its last
line: the final output, the tool calls with their arguments, and the number of model calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from agents import (
    Agent,
    OpenAIProvider,
    RunConfig,
    Runner,
    RunResult,
    function_tool,
    responses_websocket_session,
    set_tracing_disabled,
)

MODEL = os.environ.get("RESPONSES_MODEL", "gpt-4.1-mini")
calls: list[dict[str, str]] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    calls.append({"name": "get_weather", "city": city})
    return f"Sunny and 21 degrees in {city}"


@function_tool
def get_time(city: str) -> str:
    """The local time in a city."""
    calls.append({"name": "get_time", "city": city})
    return f"It is 10:30 in {city}"


AGENT = Agent(
    name="Assistant",
    instructions="Answer with the tools: call get_weather, then get_time, then answer.",
    model=MODEL,
    tools=[get_weather, get_time],
)
QUESTION = "What is the weather and the local time in Paris?"


async def run(transport: str, base_url: str, api_key: str) -> RunResult:
    if transport == "ws":
        async with responses_websocket_session(api_key=api_key, base_url=base_url) as ws:
            return await ws.run(AGENT, QUESTION, max_turns=6)
    if transport == "http":
        provider = OpenAIProvider(api_key=api_key, base_url=base_url, use_responses=True)
        config = RunConfig(model_provider=provider)
        return await Runner.run(AGENT, QUESTION, run_config=config, max_turns=6)
    raise SystemExit(f"unknown transport {transport!r}: ws or http")


async def main(transport: str, base_url: str, api_key: str) -> None:
    set_tracing_disabled(True)
    async with asyncio.timeout(60):
        result = await run(transport, base_url, api_key)
    out: dict[str, Any] = {
        "transport": transport,
        "final_output": str(result.final_output),
        "calls": calls,
        "model_calls": len(result.raw_responses),
        "response_ids": [r.response_id for r in result.raw_responses],
        "tool_call_items": [
            {"name": i.raw_item.name, "arguments": json.loads(i.raw_item.arguments)}
            for i in result.new_items
            if i.type == "tool_call_item" and getattr(i.raw_item, "type", "") == "function_call"
        ],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
