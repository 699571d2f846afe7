"""``n`` choices on the bundled model: one Completions request with ``n: 4`` against four
requests with one choice each, sent at once: ``python -m bench.choices [--rounds N]``.

A gateway on its default engine (llama.cpp, the bundled SmolLM2, 4 slots) in a process of
its own. Each round sends the same prompt both ways (the arms alternate which goes first;
``temperature: 1`` and a seed, at most 64 tokens per choice: an answer may end early, and
the usage says how many tokens each arm generated): the time from
sending to the end of the last choice (the whole answer, streamed: its ``[DONE]``), and the
gateway process's CPU time per generated token (llama.cpp's threads are in that process:
this is mostly the model's). Writes bench/results/choices.md and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.procs import cpu_seconds, server_process

PROMPT = "Once upon a time, in a small village by the sea,"
TOKENS = 64
CHOICES = 4
OUT = Path(__file__).resolve().parent / "results" / "choices.md"


def gateway_argv() -> list[str]:
    # One llama.cpp thread: on a shared 2-core machine more threads spin against each other.
    return [
        sys.executable,
        "-m",
        "gateway",
        "--slots",
        str(CHOICES),
        "--threads",
        "1",
        "--log-level",
        "WARNING",
    ]


async def _stream(http: httpx.AsyncClient, body: dict[str, Any]) -> int:
    """Stream one request to its end; its completion tokens."""
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                usage = orjson.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def arm(http: httpx.AsyncClient, pid: int, name: str, seed: int) -> dict[str, Any]:
    base = {
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    cpu, began = cpu_seconds(pid), time.perf_counter()
    if name == "n=4":
        tokens = await _stream(http, {**base, "n": CHOICES})
    else:  # the same choices' seeds, one request each
        bodies = [{**base, "seed": seed + i} for i in range(CHOICES)]
        tokens = sum(await asyncio.gather(*(_stream(http, b) for b in bodies)))
    elapsed = time.perf_counter() - began
    used = cpu_seconds(pid) - cpu
    return {
        "arm": name,
        "last_end_s": elapsed,
        "tokens": tokens,
        "cpu_ms_per_token": 1e3 * used / max(tokens, 1),
    }


async def measure(rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with server_process(gateway_argv(), timeout=300) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=300) as http:
            await _stream(http, {"prompt": PROMPT, "max_tokens": 4, "stream": True})  # warm
            for number in range(rounds):
                arms = ["n=4", "4 requests"] if number % 2 == 0 else ["4 requests", "n=4"]
                for name in arms:
                    row = await arm(http, server.pid, name, seed=100 + number)
                    rows.append({"round": number + 1, **row})
                    print(row, flush=True)
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    def summary(name: str, key: str, digits: int) -> str:
        values = [r[key] for r in rows if r["arm"] == name]
        mean = statistics.fmean(values)
        return f"{mean:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"

    lines = [
        "# n=4 choices against four requests, on the bundled model",
        "",
        f"bench/choices.py: a gateway on llama.cpp (the bundled SmolLM2, {CHOICES} slots, "
        f"one thread), the prompt {PROMPT!r}, {TOKENS} tokens per choice at most, "
        "temperature 1 with a seed (choice i's: the seed + i, both arms), streamed; "
        f"{len(rows) // 2} rounds, the arms alternating which goes first. *last end*: from "
        "sending to the last choice's end (the stream's [DONE]); *CPU/token*: the gateway "
        "process's CPU time (llama.cpp's thread included) per generated token.",
        "",
        "| arm | last end, s | tokens | CPU ms/token |",
        "|---|---|---|---|",
    ]
    for name in ("n=4", "4 requests"):
        lines.append(
            f"| {name} | {summary(name, 'last_end_s', 2)} | {summary(name, 'tokens', 0)} | "
            f"{summary(name, 'cpu_ms_per_token', 2)} |"
        )
    lines += ["", "| round | arm | last end, s | tokens | CPU ms/token |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['round']} | {r['arm']} | {r['last_end_s']:.2f} | {r['tokens']} | "
            f"{r['cpu_ms_per_token']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    text = report(asyncio.run(measure(args.rounds)))
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
