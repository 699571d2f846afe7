"""The official ``openai`` SDK's realtime client, unmodified, against the gateway."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from gateway.engines.sim import SimEngine
from tests.harness import running_gateway


async def collect(connection: Any) -> tuple[str, Any]:
    """Deltas joined, and the response.done event."""
    text = ""
    async for event in connection:
        if event.type == "error":
            raise AssertionError(event)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.done":
            return text, event
    raise AssertionError("connection ended before response.done")


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def test_sdk_multi_turn_and_cancel() -> None:
    async with running_gateway(SimEngine(step_ms=5, response_tokens=24), api_keys=("k",)) as gw:
        client = AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k")
        async with client.realtime.connect(model="gpt-realtime") as conn:
            created = await conn.recv()
            assert created.type == "session.created"
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["text"],
                    "instructions": "Be kind.",
                }
            )
            assert (await conn.recv()).type == "session.updated"

            await conn.conversation.item.create(item=user("Hello!"))
            await conn.response.create()
            first, done = await collect(conn)
            assert done.response.status == "completed"
            assert done.response.output[0].content[0].text == first
            first_input = done.response.usage.input_tokens

            await conn.conversation.item.create(item=user("Tell me more."))
            await conn.response.create()
            _, done = await collect(conn)
            assert (
                done.response.usage.input_tokens > first_input + done.response.usage.output_tokens
            )

            await conn.response.create()
            async for event in conn:
                if event.type == "response.output_text.delta":
                    break
            await conn.response.cancel()
            _, done = await collect(conn)
            assert done.response.status == "cancelled"
            assert done.response.status_details.reason == "client_cancelled"

            await conn.send(
                {"type": "response.create", "response": {"output_modalities": ["audio"]}}
            )
            error = await conn.recv()
            assert error.type == "error"
            assert error.error.code == "unsupported_modality"
