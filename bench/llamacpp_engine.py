"""Measure the llamacpp engine alone, then the same load through the gateway, in one run.

    python -m bench.llamacpp_engine [--model PATH.gguf] [--ctx 2048] [--slots 4] [--threads N]

Prints load time, tokens/s for one conversation and for ``--slots``
conversations at once (total and per stream), and the time to first token of
each turn of one growing conversation (it should stay flat: the slot's cached
prefix is reused). Then it starts ``python -m gateway --engine llamacpp`` in a
process of its own and sends the same requests (same prompts, seeds and
budgets) over WebSocket, so the gateway's figures sit beside the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import gateway.client
from gateway.engines.base import (
    Finished,
    GenerationRequest,
    Message,
    SamplingParams,
    TextDelta,
    Usage,
)
from gateway.engines.driver import EngineDriver
from gateway.engines.llamacpp import DEFAULT_CTX, DEFAULT_SLOTS, LlamaCppEngine, bundled_model_path

SYSTEM = Message("system", "You are a helpful assistant.")
PROMPTS = [
    "Tell me a long story about a lighthouse keeper.",
    "Describe how bread is made, step by step.",
    "Write a long letter to a friend about a trip to the mountains.",
    "Explain why the sky is blue, in detail.",
]


async def generate(
    engine: EngineDriver, request: GenerationRequest
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
        elif isinstance(event, Finished):
            usage = event.usage
    return first, time.perf_counter() - began, "".join(text), usage


def request(i: int, prompt: str, tokens: int) -> GenerationRequest:
    # temperature 1 with a fixed seed: long answers (greedy SmolLM2 tends to stop early).
    sampling = SamplingParams(max_output_tokens=tokens, temperature=1.0, seed=i)
    return GenerationRequest(f"bench-{i}", (SYSTEM, Message("user", prompt)), sampling, f"c{i}")


async def throughput(engine: EngineDriver, streams: int, tokens: int) -> None:
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


async def multi_turn(engine: EngineDriver, turns: int) -> None:
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


async def ask_gateway(url: str, i: int, prompt: str, tokens: int) -> gateway.client.Reply:
    options = {"max_output_tokens": tokens, "temperature": 1.0, "seed": i}
    async with gateway.client.connect(url, instructions=SYSTEM.text, **options) as chat:
        return await chat.ask(prompt)


async def throughput_via_gateway(url: str, streams: int, tokens: int) -> None:
    began = time.perf_counter()
    replies = await asyncio.gather(
        *(ask_gateway(url, i, PROMPTS[i % len(PROMPTS)], tokens) for i in range(streams))
    )
    wall = time.perf_counter() - began
    generated = sum(r.usage.output_tokens for r in replies if r.usage)
    first = max(r.time_to_first_token or 0.0 for r in replies)
    print(
        f"{streams} stream(s) via gateway: {generated} tokens in {wall:.2f} s = "
        f"{generated / wall:.0f} tokens/s total; first token {first * 1000:.0f} ms (slowest)"
    )


def start_gateway(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "gateway", "--engine", "llamacpp", "--port", str(port)]
    argv += ["--ctx", str(args.ctx), "--slots", str(args.slots), "--log-level", "WARNING"]
    argv += ["--model", str(args.model)] if args.model else []
    argv += ["--threads", str(args.threads)] if args.threads else []
    process = subprocess.Popen(argv)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1):
                return process, f"ws://127.0.0.1:{port}/v1/realtime"
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the gateway did not become ready within 60 s")


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
        async with EngineDriver(engine) as driver:
            await generate(driver, request(99, "Hello!", 8))  # warm-up
            await throughput(driver, 1, args.tokens)
            await throughput(driver, args.slots, args.tokens)
            await multi_turn(driver, 6)
    finally:
        await engine.close()
    process, url = start_gateway(args)
    try:
        await ask_gateway(url, 99, "Hello!", 8)  # warm-up
        await throughput_via_gateway(url, 1, args.tokens)
        await throughput_via_gateway(url, args.slots, args.tokens)
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    asyncio.run(main())
