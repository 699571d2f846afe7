"""Measure the llamacpp engine alone (no gateway): tokens/s and multi-turn time to first token.

    python -m bench.llamacpp_engine [--model PATH.gguf] [--ctx 2048] [--slots 4] [--threads N]

Prints load time, decode tokens/s for one conversation and for ``--slots``
conversations at once (total and per stream), and the time to first token of
each turn of one growing conversation (it should stay flat: the slot's cached
prefix is reused).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from gateway.engines.base import GenerationRequest, Message, SamplingParams, TextDelta, Usage
from gateway.engines.llamacpp import DEFAULT_CTX, DEFAULT_SLOTS, LlamaCppEngine, bundled_model_path

SYSTEM = Message("system", "You are a helpful assistant.")
PROMPTS = [
    "Tell me a long story about a lighthouse keeper.",
    "Describe how bread is made, step by step.",
    "Write a long letter to a friend about a trip to the mountains.",
    "Explain why the sky is blue, in detail.",
]


async def generate(
    engine: LlamaCppEngine, request: GenerationRequest
) -> tuple[float, float, str, Usage]:
    """(seconds to first token, seconds in all, text, usage) of one generation."""
    began = time.perf_counter()
    first = 0.0
    text: list[str] = []
    usage = Usage(0, 0)
    async for event in engine.stream(request):
        if isinstance(event, TextDelta):
            first = first or time.perf_counter() - began
            text.append(event.text)
        else:
            usage = event.usage
    return first, time.perf_counter() - began, "".join(text), usage


def request(i: int, prompt: str, tokens: int) -> GenerationRequest:
    # temperature 1 with a fixed seed: long answers (greedy SmolLM2 tends to stop early).
    sampling = SamplingParams(max_output_tokens=tokens, temperature=1.0, seed=i)
    return GenerationRequest(f"bench-{i}", (SYSTEM, Message("user", prompt)), sampling, f"c{i}")


async def throughput(engine: LlamaCppEngine, streams: int, tokens: int) -> None:
    began = time.perf_counter()
    results = await asyncio.gather(
        *(generate(engine, request(i, PROMPTS[i % len(PROMPTS)], tokens)) for i in range(streams))
    )
    wall = time.perf_counter() - began
    generated = sum(usage.output_tokens for *_, usage in results)
    decode = [u.output_tokens / (total - first) for first, total, _, u in results if total > first]
    rate = generated / wall
    print(
        f"{streams} stream(s): {generated} tokens in {wall:.2f} s = {rate:.0f} tokens/s total; "
        f"per stream decode {min(decode):.0f}-{max(decode):.0f} tokens/s; "
        f"first token {max(r[0] for r in results) * 1000:.0f} ms (slowest)"
    )


async def multi_turn(engine: LlamaCppEngine, turns: int) -> None:
    history: list[Message] = [SYSTEM]
    line = []
    for turn in range(turns):
        history.append(Message("user", f"Question {turn + 1}: {PROMPTS[turn % len(PROMPTS)]}"))
        sampling = SamplingParams(max_output_tokens=48, temperature=0.0, seed=1)
        first, _, text, usage = await generate(
            engine, GenerationRequest(f"turn-{turn}", tuple(history), sampling, "multi")
        )
        history.append(Message("assistant", text))
        line.append(
            f"{first * 1000:.0f} ms ({usage.input_tokens} in, {usage.cached_tokens} cached)"
        )
    print("time to first token per turn: " + ", ".join(line))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--ctx", type=int, default=DEFAULT_CTX)
    parser.add_argument("--slots", type=int, default=DEFAULT_SLOTS)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=128, help="answer budget per stream")
    args = parser.parse_args()
    engine = LlamaCppEngine(
        args.model or bundled_model_path(), ctx=args.ctx, slots=args.slots, threads=args.threads
    )
    began = time.perf_counter()
    await engine.start()
    print(f"model {engine.model_name}: loaded in {time.perf_counter() - began:.2f} s")
    try:
        await generate(engine, request(99, "Hello!", 8))  # warm-up
        await throughput(engine, 1, args.tokens)
        await throughput(engine, args.slots, args.tokens)
        await multi_turn(engine, 6)
    finally:
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
