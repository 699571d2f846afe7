"""The OpenAI Agents SDK, unmodified: a RealtimeAgent with one tool against a running gateway.

Runs in ``.venv-sdk`` (started by tests/test_sdk.py):
``python tests/sdk/agent.py WS_URL API_KEY``. The agent speaks text; it is asked
something that makes the model call its tool, the SDK runs the tool and sends its
output back, and the model's next answer must carry it. Prints one JSON object on
its last line: what the tool was called with, what it returned, the agent's
answers, and every error the SDK reported (it validates every server event with
openai-python's types and reports an invalid one as an error).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner

calls: list[str] = []


@function_tool
def get_weather(text: str) -> str:
    """The weather for what the user asked about."""
    calls.append(text)
    return f"Sunny and 21 degrees (asked: {len(calls)})"


async def main(url: str, api_key: str) -> None:
    agent = RealtimeAgent(name="Assistant", instructions="Use your tools.", tools=[get_weather])
    runner = RealtimeRunner(
        agent,
        config={"model_settings": {"model_name": "gpt-realtime", "output_modalities": ["text"]}},
    )
    out: dict[str, Any] = {"errors": [], "tool_outputs": [], "answers": []}
    history: list[Any] = []
    session = await runner.run(model_config={"url": url, "api_key": api_key})
    async with session:
        await session.send_message("What is the weather today? Please use get_weather.")
        turns = 0
        async with asyncio.timeout(30):
            async for event in session:
                if event.type == "error":
                    out["errors"].append(str(event.error))
                elif event.type == "tool_end":
                    out["tool_outputs"].append(str(event.output))
                elif event.type == "history_updated":
                    history = event.history
                elif event.type == "agent_end":
                    turns += 1
                    if turns == 2:  # the call, then the answer to its output
                        break
    for item in history:  # the SDK's view of the conversation
        if item.type == "message" and item.role == "assistant":
            out["answers"].append("".join(getattr(c, "text", None) or "" for c in item.content))
    out["calls"] = calls
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
