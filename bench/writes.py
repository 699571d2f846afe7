"""The write path's figures, each beside its baseline and its floor in the same run:
``python -m bench.writes`` (``make bench`` runs it). The systems of each scenario take
turns, ``--rounds`` times (default 3), each a fresh process; the figures are medians
with the range.

- ``frame``: one token per frame on the Realtime dialect (the sim flat out, 300-token
  answers, 100 sessions back to back): the gateway's CPU per token beside the bare
  websockets server (``ws.send`` per frame), the floor (bench/baselines/bare_server.py
  ``--floor``: the same frames' bytes by ``transport.write`` alone) and, for each
  ``--rev``, the gateway of that commit (an A/B: bench/other_tree.py).
- ``sse``: the same load as ``POST /v1/responses`` with ``stream: true`` (200 keep-alive
  connections): the gateway beside FastAPI + uvicorn (httptools where installed, else
  h11; orjson per event) and the floor (bench/baselines/floor_sse_server.py: each
  templated event one chunk by ``transport.write``).
- ``short``: short sessions (connect, ``session.created``, one 10-token answer, close),
  32 clients back to back: the server's CPU per session beside the bare websockets
  server sending the same frames.

Results: bench/results/writes.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect

from bench import other_tree
from bench.loadgen import Workload
from bench.procs import bare_server_argv, gateway_argv, httptools_installed, server_process
from bench.run import Engine, run_systems
from bench.turns import PROMPT, measure, summary

RESULTS = Path(__file__).parent / "results"
SCENARIOS = ("frame", "sse", "short")
CREATE_ITEM = orjson.dumps(
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": PROMPT}],
        },
    }
).decode()


def streams(rounds: int, revs: list[str], seconds: float, only: set[str]) -> dict[str, Any]:
    """The frame and sse scenarios through bench.run's load generator: every row."""
    engine = Engine(step_ms=0, response_tokens=300)
    base = Workload(sessions=100, warmup=1.0, duration=seconds, drain=10.0, think=(0.0, 0.0))
    rows: list[dict[str, Any]] = []
    if "frame" in only:
        frame = ["floor", "bare", "gateway", *(f"gateway+{rev}" for rev in revs)]
        run_systems("frame", frame * rounds, engine, [base], rows, "uvloop")
    fastapi = "fastapi-httptools" if httptools_installed() else "fastapi"
    if "sse" in only:
        sse = ["floor-sse", "http", fastapi]
        http = replace(base, sessions=200, chain=False)
        run_systems("sse", sse * rounds, engine, [http], rows, "uvloop")
    return {"rows": rows, "fastapi": fastapi}


async def short_session(url: str, stop: float, count: list[int]) -> None:
    """Sessions one after another: connect, one answer, close."""
    while time.monotonic() < stop:
        async with connect(url, max_size=None, compression=None) as ws:
            await ws.recv()  # session.created
            await ws.send(CREATE_ITEM)
            await ws.send('{"type":"response.create"}')
            while '"response.done"' not in str(await ws.recv()):
                pass
        count[0] += 1


def short(rounds: int, seconds: float, clients: int, revs: list[str]) -> dict[str, list[float]]:
    """CPU µs per short session (10-token answers), gateway against bare websockets."""
    gateway = gateway_argv(loop="uvloop", step_ms=0, response_tokens=10)
    argvs = {
        "bare": bare_server_argv(step_ms=0, response_tokens=10, loop="uvloop"),
        "gateway": gateway,
        **{f"gateway+{rev}": other_tree.gateway_argv(rev, gateway) for rev in revs},
    }
    results: dict[str, list[float]] = {name: [] for name in argvs}
    for _ in range(rounds):
        for name, argv in argvs.items():
            with server_process(argv) as s:
                url = s.ws_url
                runs = [lambda stop, n, u=url: short_session(u, stop, n)] * clients
                cpu, rate = asyncio.run(measure(s.pid, seconds, runs))
            results[name].append(cpu)
            print(f"short {name:8} {cpu:8.1f} us/session {rate:7.0f} sessions/s", flush=True)
    return results


def medians(rows: list[dict[str, Any]], scenario: str) -> dict[str, dict[str, float]]:
    """Each system's CPU µs per token over its rounds: median, min, max."""
    by: dict[str, list[float]] = {}
    for row in rows:
        if row["scenario"] == scenario:
            by.setdefault(row["system"], []).append(row["cpu_us_per_token"])
    return {system: summary(values) for system, values in by.items()}


def span(d: dict[str, float], digits: int = 1) -> str:
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


def ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """Round-by-round ``a / b`` (the systems of a round ran back to back)."""
    return summary([x / y for x, y in zip(a, b, strict=False)])


def per_round(rows: list[dict[str, Any]], scenario: str, system: str) -> list[float]:
    return [
        r["cpu_us_per_token"] for r in rows if r["scenario"] == scenario and r["system"] == system
    ]


def _table(rows: list[dict[str, Any]], scenario: str, floor: str) -> list[str]:
    lines = ["| system | CPU µs/token | tokens/s | x floor (same round) |", "|---|---|---|---|"]
    floors = per_round(rows, scenario, floor)
    for system, d in medians(rows, scenario).items():
        rate = statistics.median(
            x["tokens_s"] for x in rows if x["scenario"] == scenario and x["system"] == system
        )
        x_floor = span(ratio(per_round(rows, scenario, system), floors), 2)
        lines.append(f"| {system} | {span(d)} | {rate:,.0f} | {x_floor} |")
    return lines


def report(r: dict[str, Any]) -> str:
    rows, fastapi = r["rows"], r["fastapi"]
    lines = [
        "# The write path (bench/writes.py)",
        "",
        f"uvloop, {r['cpus']} CPUs, {r['rounds']} rounds, each system a fresh process, "
        "systems alternating within a round; medians (range). CPU µs of the server "
        "process per token (per session for short sessions).",
        "",
    ]
    if any(x["scenario"] == "frame" for x in rows):
        lines += [
            "## One token per frame (Realtime, 100 sessions x 300 tokens, the sim flat out)",
            "",
            *_table(rows, "frame", "floor"),
            "",
        ]
    if any(x["scenario"] == "sse" for x in rows):
        fewer = ratio(per_round(rows, "sse", fastapi), per_round(rows, "sse", "http"))
        lines += [
            "## SSE (POST /v1/responses, stream: true; 200 connections x 300 tokens)",
            "",
            *_table(rows, "sse", "floor-sse"),
            "",
            f"- {fastapi} ÷ gateway (http): {span(fewer, 2)}x the gateway's CPU per token "
            "(target: at least 1.6x)",
            "",
        ]
    if "short" in r:
        s = r["short"]
        lines += ["## Short sessions (connect, one 10-token answer, close; 32 clients)", ""]
        for name, values in s.items():
            if name != "bare":
                lines.append(
                    f"- {name}: {span(summary(values))} µs/session; ÷ bare websockets "
                    f"({span(summary(s['bare']))}): {span(ratio(values, s['bare']), 2)} "
                    "(target: at most 1.5x)"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.writes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument(
        "--rev",
        action="append",
        default=[],
        help="also the gateway of this commit in the frame scenario (repeatable)",
    )
    parser.add_argument(
        "--only", choices=SCENARIOS, action="append", help="these scenarios (default: all)"
    )
    args = parser.parse_args(argv)
    only = set(args.only or SCENARIOS)
    results = streams(args.rounds, args.rev, args.seconds, only)
    if "short" in only:
        results["short"] = short(args.rounds, args.seconds, 32, args.rev)
    results |= {"rounds": args.rounds, "cpus": os.cpu_count(), "revs": args.rev}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "writes.json").write_text(json.dumps(results, indent=2, default=str))
    text = report(results)
    (RESULTS / "writes.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
