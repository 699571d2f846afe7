"""Fair share across tenants: ``python -m bench.tenants`` (``make bench`` runs it too).

A gateway on the sim engine (20 ms steps, 64 slots, 32-token answers) with a key file
of two tenants. Tenant *alice* runs 200 Realtime sessions flat out (each sends its next
``response.create`` as soon as the last answer is done), far more than the engine's
slots. One session of tenant *bob* asks a question at a time, with a random pause, and
measures its time to first token (``response.create`` sent to its first delta):

- *alone*: no other load (the sim then steps the moment a request comes: no step to
  wait for);
- *busy engine*: beside 32 of alice's sessions, fewer than the slots (the engine steps
  every 20 ms, nothing waits for a slot: the floor a loaded engine can give);
- *other tenant*: with alice's 200 sessions running;
- *same tenant*: the same, but the measured session uses alice's key (what every
  session got before tenants were shared first: one more session among 201).

The target (issue: keys are tenants): bob's time to first token under alice's load at
most about 2x what it is alone. Several rounds, each a fresh gateway, medians and
ranges. Results: bench/results/tenants.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect

from bench.procs import gateway_argv, server_process
from bench.stats import dist

RESULTS = Path(__file__).parent / "results"
ALICE, BOB = "bench-alice-key", "bench-bob-key"
ITEM = orjson.dumps(
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi"}],
        },
    }
).decode()


async def flat_out(url: str, key: str, stop: float) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.recv()
        while time.monotonic() < stop:
            await ws.send(ITEM)
            await ws.send('{"type":"response.create"}')
            async for frame in ws:
                if '"response.done"' in str(frame):
                    break


async def first_tokens(url: str, key: str, turns: int) -> list[float]:
    """Seconds from each ``response.create`` to its first delta, one turn at a time."""
    headers = {"Authorization": f"Bearer {key}"}
    times: list[float] = []
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.recv()
        for _ in range(turns):
            await asyncio.sleep(random.uniform(0.0, 0.04))  # land anywhere in a step
            await ws.send(ITEM)
            sent = time.perf_counter()
            await ws.send('{"type":"response.create"}')
            first = None
            async for frame in ws:
                text = str(frame)
                if first is None and "output_text.delta" in text:
                    first = time.perf_counter() - sent
                elif '"response.done"' in text:
                    break
            assert first is not None, "an answer without a delta"
            times.append(first)
    return times


async def arm(url: str, measured_key: str, load: int, turns: int) -> dict[str, float]:
    stop = time.monotonic() + 120
    loaders = [asyncio.create_task(flat_out(url, ALICE, stop)) for _ in range(load)]
    try:
        if loaders:
            await asyncio.sleep(2.0)  # every loader connected and queued up
        times = await first_tokens(url, measured_key, turns)
    finally:
        for task in loaders:
            task.cancel()
        await asyncio.gather(*loaders, return_exceptions=True)
    return {k: v for k, v in dist(times).items() if k in ("p50", "p90", "p99")}


def run(rounds: int, load: int, turns: int, loop: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as keys:
        keys.write(f"{ALICE} name=alice\n{BOB} name=bob\n")
    argv = gateway_argv(loop=loop, step_ms=20, max_batch=64, response_tokens=32)
    argv += ["--api-key-file", keys.name]
    results: dict[str, list[dict[str, float]]] = {"alone": [], "busy": [], "other": [], "same": []}
    for number in range(rounds):
        arms = (("alone", BOB, 0), ("busy", BOB, 32), ("other", BOB, load), ("same", ALICE, load))
        for name, key, clients in arms:
            with server_process(argv) as server:
                row = asyncio.run(arm(server.ws_url, key, clients, turns))
            results[name].append(row)
            print(
                f"[tenants] round {number + 1} {name:6} "
                f"ttft p50 {row['p50']:.1f} ms p99 {row['p99']:.1f} ms"
            )
    Path(keys.name).unlink()
    return {
        "settings": {"rounds": rounds, "load": load, "turns": turns, "loop": loop},
        "rows": results,
    }


def report(data: dict[str, Any]) -> str:
    rows = data["rows"]

    def med(name: str, key: str) -> tuple[float, float, float]:
        values = [r[key] for r in rows[name]]
        return statistics.median(values), min(values), max(values)

    s = data["settings"]
    lines = [
        "# Fair share across tenants (bench/tenants.py)",
        "",
        f"Sim engine, 20 ms steps, 64 slots, 32-token answers; tenant alice runs {s['load']} "
        f"Realtime sessions flat out; one session measures {s['turns']} turns' time to first "
        f"token. {s['rounds']} rounds, each arm a fresh gateway, loop {s['loop']}; medians "
        "(range) of each round's percentile, ms.",
        "",
        "| arm | TTFT p50 | TTFT p99 | p50 vs alone | p50 vs busy engine |",
        "|---|---|---|---|---|",
    ]
    alone = med("alone", "p50")[0]
    busy = med("busy", "p50")[0]
    labels = {
        "alone": "bob alone",
        "busy": "bob beside 32 of alice's sessions (engine busy, slots free)",
        "other": "bob (another tenant) beside alice's load",
        "same": "a session of alice's tenant beside alice's load (no tenant share)",
    }
    for name in ("alone", "busy", "other", "same"):
        p50, p99 = med(name, "p50"), med(name, "p99")
        lines.append(
            f"| {labels[name]} | {p50[0]:.1f} ({p50[1]:.1f}–{p50[2]:.1f}) | "
            f"{p99[0]:.1f} ({p99[1]:.1f}–{p99[2]:.1f}) | x{p50[0] / alone:.2f} | "
            f"x{p50[0] / busy:.2f} |"
        )
    other = med("other", "p50")[0]
    lines += [
        "",
        f"Target, bob's p50 beside alice's load at most 2x alone: "
        f"{'met' if other <= 2 * alone else '**missed**'} against the idle engine "
        f"(x{other / alone:.1f}), {'met' if other <= 2 * busy else '**missed**'} against "
        f"the busy one (x{other / busy:.2f}). Alone, the sim steps the moment a request "
        "comes; under any load a first token waits for the next 20 ms step, the floor "
        "that no admission policy lowers.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", type=int, default=200)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--loop", default="uvloop")
    args = parser.parse_args()
    data = run(args.rounds, args.load, args.turns, args.loop)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tenants.json").write_text(json.dumps(data, indent=2))
    text = report(data)
    (RESULTS / "tenants.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
