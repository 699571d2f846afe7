"""``generate: false`` on llama.cpp: time to first token after a long prefix, cold
against warmed: ``python -m bench.warmup [--rounds N]`` (``bench.run`` runs it too).

A gateway on the default engine (llamacpp, the bundled SmolLM2 model) in a process of
its own, and a prefix of about 1,000 tokens (a text made from a seed). Each round:

- **cold**: on a new connection, one ``response.create`` whose input is the prefix and
  a short question (two user messages);
- **warm**: on another new connection, ``generate: false`` with the prefix, wait for
  its ``response.completed`` (the engine has prefilled it into the lane's KV slot),
  then a ``response.create`` with only the question and ``previous_response_id``:
  the same conversation, so the only difference is the cache.

Time to first token is from sending that ``response.create`` to its first
``response.output_text.delta``. Every round and every arm has a prefix of its own
(no two share more than the chat template's first tokens), so neither arm finds the
other's prompt, or an earlier round's, in a slot; the arms alternate which goes
first. ``temperature: 0``, 8 output tokens. The usage of each answer says how many
prompt tokens llama.cpp found cached (``input_tokens_details.cached_tokens``): near
zero for the cold arm, near the prefix for the warm one, else the round is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from typing import Any

import orjson

from bench.procs import server_process

QUESTION = "In one short sentence: what is the text above about?"
ANSWER = {"max_output_tokens": 8, "temperature": 0}


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "river keeper lighthouse harbour engine station garden market letter bridge "
    "mountain village baker teacher window signal lantern island valley storm "
    "orchard ferry clock library painter kettle meadow tower road forest"
)
_VERBS = _words(
    "watches builds carries follows answers repairs paints remembers opens crosses "
    "measures gathers counts waits for sings about writes to"
)
_ADJECTIVES = _words(
    "old quiet bright narrow patient early distant small golden careful wooden "
    "northern green heavy gentle busy"
)


def prefix(seed: int, words: int = 760) -> str:
    """A deterministic text of about ``words`` words (~1,000 SmolLM2 tokens): sentences
    of a small vocabulary, each round's drawn from its own seed."""
    rng = random.Random(seed)
    out: list[str] = []
    count = 0
    while count < words:
        sentence = (
            f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
            f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} near the "
            f"{rng.choice(_NOUNS)} number {rng.randrange(1000)}."
        )
        out.append(sentence)
        count += len(sentence.split())
    return f"Story {seed}: " + " ".join(out)


async def _connect(url: str) -> Any:
    from websockets.asyncio.client import connect

    return await connect(url, max_size=None, compression=None, open_timeout=60)


async def _until(ws: Any, kinds: tuple[str, ...]) -> dict[str, Any]:
    while True:
        event: dict[str, Any] = orjson.loads(await ws.recv())
        if event["type"] in kinds:
            return event
        if event["type"] == "error":
            raise RuntimeError(f"the gateway refused: {event['error']}")


async def _ask(ws: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Send one ``response.create``; time to its first delta, and its usage."""
    started = time.perf_counter()
    await ws.send(orjson.dumps({"type": "response.create", **body, **ANSWER}).decode())
    first = 0.0
    while True:
        event = orjson.loads(await ws.recv())
        kind = event["type"]
        if kind == "response.output_text.delta" and not first:
            first = time.perf_counter() - started
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            usage = event["response"].get("usage") or {}
            return {
                "ttft_s": first or math.nan,
                "total_s": time.perf_counter() - started,
                "status": event["response"]["status"],
                "input_tokens": usage.get("input_tokens"),
                "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens"),
                "output_tokens": usage.get("output_tokens"),
            }
        elif kind == "error":
            raise RuntimeError(f"the gateway refused: {event['error']}")


async def cold(url: str, text: str) -> dict[str, Any]:
    ws = await _connect(url)
    try:
        turns = [
            {"type": "message", "role": "user", "content": text},
            {"type": "message", "role": "user", "content": QUESTION},
        ]
        return await _ask(ws, {"input": turns})
    finally:
        await ws.close()


async def warm(url: str, text: str) -> dict[str, Any]:
    ws = await _connect(url)
    try:
        started = time.perf_counter()
        store = {"type": "response.create", "input": text, "generate": False, "temperature": 0}
        await ws.send(orjson.dumps(store).decode())
        done = await _until(ws, ("response.completed", "response.incomplete", "response.failed"))
        if done["response"]["status"] != "completed":
            raise RuntimeError(f"generate: false ended {done['response']['status']}")
        prefill = time.perf_counter() - started
        asked = await _ask(ws, {"input": QUESTION, "previous_response_id": done["response"]["id"]})
        return asked | {"prefill_s": prefill}
    finally:
        await ws.close()


def gateway_argv(threads: int | None = None) -> list[str]:
    """``python -m gateway`` on its default engine (llamacpp, the bundled model)."""
    argv = [sys.executable, "-m", "gateway", "--engine", "llamacpp", "--log-level", "WARNING"]
    return argv + (["--threads", str(threads)] if threads else [])


def run(rounds: int, log: Any = print) -> dict[str, Any]:
    """``rounds`` rounds of both arms against one gateway; every measurement and the
    medians and ranges."""
    out: list[dict[str, Any]] = []
    started = time.monotonic()
    with server_process(gateway_argv(), timeout=300) as server:
        url = server.responses_url
        loaded = time.monotonic() - started
        asyncio.run(cold(url, "Say hello."))  # the first request pays one-off costs
        for r in range(rounds):
            arms = [("cold", cold), ("warm", warm)]
            if r % 2:
                arms.reverse()
            for name, arm in arms:
                seed = 2 * r + (name == "warm")
                result = asyncio.run(arm(url, prefix(seed))) | {"round": r + 1, "arm": name}
                out.append(result)
                log(
                    f"warmup     round {r + 1} {name}: TTFT {1000 * result['ttft_s']:.0f} ms "
                    f"({result['input_tokens']} prompt tokens, {result['cached_tokens']} "
                    "cached"
                    + (f"; prefill {result['prefill_s']:.2f} s" if name == "warm" else "")
                    + ")"
                )
    return {"runs": out, "summary": summarise(out), "model_load_s": loaded, "rounds": rounds}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(values: list[float]) -> dict[str, float]:
        return {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "n": len(values),
        }

    by_arm = {a: [r for r in runs if r["arm"] == a] for a in ("cold", "warm")}
    summary: dict[str, Any] = {
        arm: {
            "ttft_s": spread([r["ttft_s"] for r in rs]),
            "input_tokens": spread([r["input_tokens"] or 0 for r in rs]),
            "cached_tokens": spread([r["cached_tokens"] or 0 for r in rs]),
        }
        for arm, rs in by_arm.items()
        if rs
    }
    rounds = sorted({r["round"] for r in runs})
    ratios = []
    for n in rounds:
        pair = {r["arm"]: r["ttft_s"] for r in runs if r["round"] == n}
        if "cold" in pair and "warm" in pair:
            ratios.append(pair["warm"] / pair["cold"])
    if ratios:
        summary["ratio"] = spread(ratios)  # warm / cold, per round
    if "warm" in summary:
        summary["warm"]["prefill_s"] = spread([r["prefill_s"] for r in by_arm["warm"]])
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.warmup", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    result = run(args.rounds)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
