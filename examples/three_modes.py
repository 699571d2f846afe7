"""The three ways to call the gateway from Python: sync, async (many at once), async streaming.

Start the gateway first, in another terminal: ``make run`` serves the bundled model
(``make run ARGS="--engine sim"``: a simulated engine, no model, made-up answers, instant).
Then, from the checkout::

    .venv/bin/python examples/three_modes.py

``GATEWAY_URL=ws://HOST:PORT/v1/realtime`` points it at a gateway elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import time

import gateway.client

URL = os.environ.get("GATEWAY_URL", "ws://127.0.0.1:8765/v1/realtime")

QUESTIONS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "The best thing about GPUs is",
]


def synchronous() -> None:
    """One blocking call per question, like ``llm.generate``."""
    print("== synchronous")
    with gateway.client.connect_sync(URL, max_output_tokens=32) as chat:
        for question in QUESTIONS[:2]:
            reply = chat.ask(question)
            print(f"{question!r} -> {reply.text!r} ({reply.usage})")


async def asynchronous() -> None:
    """Many conversations at once: one connection each, gathered."""
    print("== asynchronous (asyncio.gather)")

    async def one(question: str) -> gateway.client.Reply:
        async with gateway.client.connect(URL, max_output_tokens=32) as chat:
            return await chat.ask(question)

    started = time.monotonic()
    replies = await asyncio.gather(*(one(q) for q in QUESTIONS))
    for question, reply in zip(QUESTIONS, replies, strict=True):
        print(f"{question!r} -> {reply.text!r}")
    print(f"{len(QUESTIONS)} answers in {time.monotonic() - started:.2f} s")


async def asynchronous_streaming() -> None:
    """Print only the new text as it is generated; stop one answer half-way."""
    print("== asynchronous streaming")
    async with gateway.client.connect(URL) as chat:
        async for delta in chat.stream(QUESTIONS[2]):
            print(delta, end="", flush=True)
        print()
        stream = chat.stream(QUESTIONS[3])
        received = 0
        async for delta in stream:
            print(delta, end="", flush=True)
            received += 1
            if received == 5:
                await stream.cancel()  # stops the answer on the gateway; no more deltas
        assert stream.reply is not None
        print(f" ... ({stream.reply.status})")


def main() -> None:
    synchronous()
    asyncio.run(asynchronous())
    asyncio.run(asynchronous_streaming())


if __name__ == "__main__":
    main()
