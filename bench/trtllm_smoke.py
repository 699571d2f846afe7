"""Smoke test for the TensorRT-LLM engine on a GPU machine (not part of CI).

Needs an NVIDIA GPU and ``pip install -e '.[trtllm]'``. It loads one small model once and:

1. shows TensorRT-LLM's three generation modes side by side: synchronous ``llm.generate``,
   ``generate_async`` awaited for several prompts with ``asyncio.gather``, and
   ``generate_async(..., streaming=True)`` printing only the new text (``text_diff``);
2. serves that same LLM through the gateway in-process (``--engine trtllm``'s adapter) and
   drives it with a raw ``websockets`` client: one full answer (time to first token,
   tokens/s), then one answer cancelled mid-stream (cancel-to-``response.done`` latency, and
   whether the engine still runs anything afterwards).

Run: ``python bench/trtllm_smoke.py --model TinyLlama/TinyLlama-1.1B-Chat-v1.0``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

from gateway.config import GatewayConfig
from gateway.engines.trtllm import TrtllmEngine, TrtllmSettings
from gateway.server import Gateway

QUESTIONS = [
    "Name three uses of a hash map.",
    "What does a WebSocket add over plain HTTP?",
    "Explain KV caching in one paragraph.",
    "Why does batching raise GPU throughput?",
]
LONG_ASK = "Write a long, detailed story about a lighthouse keeper. Take your time."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    parser.add_argument("--max-tokens", type=int, default=96, help="answer budget per prompt")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--kv-cache-fraction", type=float, default=0.5)
    parser.add_argument("--cancel-after", type=int, default=10, help="deltas before the cancel")
    return parser.parse_args()


# -- part 1: the three modes of the LLM API ----------------------------------------------


def settings(args: argparse.Namespace) -> TrtllmSettings:
    return TrtllmSettings(
        model=args.model,
        max_batch_size=args.max_batch_size,
        kv_cache_fraction=args.kv_cache_fraction,
    )


def load(args: argparse.Namespace) -> Any:
    """Load through the adapter's own start(): LLM(...) built in a worker thread."""
    engine = TrtllmEngine(settings(args))
    began = time.perf_counter()
    asyncio.run(engine.start())
    print(f"loaded {args.model} in {time.perf_counter() - began:.1f}s: {engine.describe()}")
    return engine.llm


def chat_prompt(llm: Any, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    prompt: str = llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return prompt


def sampling(max_tokens: int) -> Any:
    from tensorrt_llm import SamplingParams

    # Explicit: the defaults are max_tokens=32 and greedy decoding. The template holds BOS.
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.7, top_p=0.95, seed=1, add_special_tokens=False
    )


def report(label: str, outputs: list[Any], seconds: float) -> None:
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{label}] {len(outputs)} prompts, {tokens} tokens in {seconds:.2f}s", end="")
    print(f" = {tokens / seconds:.0f} tokens/s")
    for out in outputs:
        print(f"    {out.outputs[0].text.strip()[:90]!r} ({out.outputs[0].finish_reason})")


def sync_mode(llm: Any, args: argparse.Namespace) -> None:
    # Called with no event loop running: generate() then uses its blocking queues.
    prompts = [chat_prompt(llm, q) for q in QUESTIONS]
    began = time.perf_counter()
    outputs = llm.generate(prompts, sampling(args.max_tokens), use_tqdm=False)
    report("sync llm.generate", outputs, time.perf_counter() - began)


async def gather_mode(llm: Any, args: argparse.Namespace) -> None:
    prompts = [chat_prompt(llm, q) for q in QUESTIONS]
    began = time.perf_counter()
    # generate_async is called here, inside the running loop, and each RequestOutput awaited.
    outputs = await asyncio.gather(
        *(llm.generate_async(p, sampling(args.max_tokens)) for p in prompts)
    )
    report("async gather", list(outputs), time.perf_counter() - began)


async def streaming_mode(llm: Any, args: argparse.Namespace) -> None:
    prompt = chat_prompt(llm, QUESTIONS[0])
    began = time.perf_counter()
    first: float | None = None
    print("[async streaming] ", end="", flush=True)
    request_output = llm.generate_async(prompt, sampling(args.max_tokens), streaming=True)
    async for out in request_output:
        if first is None and out.outputs[0].text_diff:
            first = time.perf_counter() - began
        print(out.outputs[0].text_diff, end="", flush=True)
    total = time.perf_counter() - began
    tokens = len(out.outputs[0].token_ids)
    print(f"\n    first text after {(first or total) * 1000:.0f} ms, {tokens} tokens", end="")
    print(f" in {total:.2f}s ({out.outputs[0].finish_reason})")


# -- part 2: the gateway on the same LLM, over a real socket -----------------------------


async def send(ws: ClientConnection, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


async def next_event(ws: ClientConnection, *types: str) -> dict[str, Any]:
    while True:
        event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if event["type"] == "error":
            raise RuntimeError(f"gateway error: {event['error']}")
        if not types or event["type"] in types:
            return event


async def say(ws: ClientConnection, text: str) -> None:
    await send(
        ws,
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": text}],
            },
        },
    )
    await next_event(ws, "conversation.item.done")


async def full_turn(ws: ClientConnection) -> None:
    await say(ws, QUESTIONS[2])
    began = time.perf_counter()
    await send(ws, {"type": "response.create"})
    first: float | None = None
    while True:
        event = await next_event(ws, "response.output_text.delta", "response.done")
        now = time.perf_counter()
        if event["type"] == "response.output_text.delta":
            first = first or now
            continue
        usage = event["response"]["usage"]
        status = event["response"]["status"]
        break
    first = first or now
    rate = usage["output_tokens"] / max(now - first, 1e-9)
    print(f"[gateway] full answer: {status}, first token after {(first - began) * 1000:.0f} ms,")
    print(f"    {usage['output_tokens']} tokens at {rate:.0f} tokens/s, usage {usage}")


async def cancelled_turn(ws: ClientConnection, gateway: Gateway, cancel_after: int) -> None:
    await say(ws, LONG_ASK)
    await send(ws, {"type": "response.create", "response": {"max_output_tokens": 1024}})
    seen = 0
    while seen < cancel_after:
        event = await next_event(ws, "response.output_text.delta", "response.done")
        if event["type"] == "response.done":
            print("[gateway] the answer ended before the cancel; raise --max-tokens")
            return
        seen += 1
    cancel_at = time.perf_counter()
    await send(ws, {"type": "response.cancel"})
    late = 0
    while True:
        event = await next_event(ws, "response.output_text.delta", "response.done")
        if event["type"] == "response.done":
            break
        late += 1
    latency = (time.perf_counter() - cancel_at) * 1000
    status = event["response"]["status"]
    print(f"[gateway] cancel after {seen} deltas: {status} {latency:.1f} ms after the cancel,")
    print(f"    {late} delta frames in flight, engine running now: {gateway.scheduler.running}")


async def gateway_mode(llm: Any, args: argparse.Namespace) -> None:
    engine = TrtllmEngine(settings(args), llm=llm)  # the LLM loaded above, on a new loop
    gateway = Gateway(engine, GatewayConfig(host="127.0.0.1", port=0))
    await gateway.start()
    try:
        await gateway.wait_ready()
        url = f"ws://127.0.0.1:{gateway.port}/v1/realtime"
        async with connect(url, subprotocols=[Subprotocol("realtime")]) as ws:
            await next_event(ws, "session.created")
            await send(
                ws,
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "output_modalities": ["text"],
                        "max_output_tokens": args.max_tokens * 2,
                        "temperature": 0.7,
                    },
                },
            )
            await next_event(ws, "session.updated")
            await full_turn(ws)
            await cancelled_turn(ws, gateway, args.cancel_after)
    finally:
        await gateway.stop()  # also shuts the LLM down


async def async_modes(llm: Any, args: argparse.Namespace) -> None:
    await gather_mode(llm, args)
    await streaming_mode(llm, args)
    await gateway_mode(llm, args)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    llm = load(args)  # its loop is gone now: the LLM must not depend on it
    sync_mode(llm, args)  # no loop running here, as llm.generate expects
    asyncio.run(async_modes(llm, args))


if __name__ == "__main__":
    main()
