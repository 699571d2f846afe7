"""The token path's and the short session's figures, each beside its floor and its
baselines in the same run: ``python -m bench.writes`` (``make bench`` runs it). The
systems of each scenario take turns, ``--rounds`` times (default 3), each a fresh
process; the figures are medians with the range, and every ratio is taken within a round
(the systems of a round ran back to back) before its median.

- ``frame``: one token per frame on each WebSocket dialect (the sim flat out, 300-token
  answers, 50 sessions back to back): the gateway's CPU per token on Realtime and on the
  Responses WebSocket, beside the floor of each (bench/baselines/floor_server.py: the
  same frames, prebuilt, one ``transport.write`` per frame per loop turn, no task per
  stream), the bare websockets server (a task per stream, ``await ws.send`` per frame)
  and, for each ``--rev``, the gateway of that commit (an A/B: bench/other_tree.py).
- ``sse``: the same load as ``POST /v1/responses`` and ``POST /v1/chat/completions`` with
  ``stream: true`` (200 keep-alive connections): the gateway beside the SSE floor
  (bench/baselines/floor_sse_server.py), the minimal FastAPI + uvicorn app
  (bench/baselines/fastapi_server.py, httptools where installed) and vLLM's shape (the
  same app with a per-request queue and producer task, vllm_shape_server.py).
- ``short``: short sessions (connect, ``session.created``, one 10-token answer, close),
  32 clients back to back: the server's CPU per session beside the bare websockets
  server sending the same frames.
- ``memory``: the server's resident memory per Realtime session, idle (connected,
  ``session.created`` read) and after one short turn, 2,000 sessions held open, beside
  the bare websockets server.

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
from bench.loadgen import Workload, raise_nofile
from bench.procs import (
    bare_server_argv,
    gateway_argv,
    httptools_installed,
    rss_bytes,
    server_process,
)
from bench.run import Engine, run_systems
from bench.turns import PROMPT, measure, summary

RESULTS = Path(__file__).parent / "results"
SCENARIOS = ("frame", "sse", "short", "memory")
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
# Each gateway system, the floor it is measured against (the same dialect).
FLOORS = {
    "gateway": "floor",
    "responses": "floor-responses",
    "http": "floor-sse",
    "chat": "floor-chat",
}


def fastapi_systems() -> dict[str, str]:
    """Each SSE gateway system, the minimal FastAPI app answering the same requests."""
    if httptools_installed():
        return {"http": "fastapi-httptools", "chat": "fastapi-httptools-chat"}
    return {"http": "fastapi", "chat": "fastapi-chat"}


VLLM_SHAPE = {"http": "vllm-shape", "chat": "vllm-shape-chat"}


def streams(rounds: int, revs: list[str], seconds: float, only: set[str]) -> dict[str, Any]:
    """The frame and sse scenarios through bench.run's load generator: every row."""
    engine = Engine(step_ms=0, response_tokens=300)
    base = Workload(sessions=50, warmup=1.0, duration=seconds, drain=10.0, think=(0.0, 0.0))
    rows: list[dict[str, Any]] = []
    if "frame" in only:
        frame = ["floor", "bare", "gateway", *(f"gateway+{rev}" for rev in revs)]
        frame += ["floor-responses", "responses"]
        run_systems("frame", frame * rounds, engine, [base], rows, "uvloop")
    if "sse" in only:
        fastapi = fastapi_systems()
        sse = ["floor-sse", "http", fastapi["http"], VLLM_SHAPE["http"]]
        sse += ["floor-chat", "chat", fastapi["chat"], VLLM_SHAPE["chat"]]
        http = replace(base, sessions=200, chain=False)
        run_systems("sse", sse * rounds, engine, [http], rows, "uvloop")
    return {"rows": rows}


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


def short_argvs(revs: list[str], response_tokens: int = 10) -> dict[str, list[str]]:
    gateway = gateway_argv(loop="uvloop", step_ms=0, response_tokens=response_tokens)
    return {
        "bare": bare_server_argv(step_ms=0, response_tokens=response_tokens, loop="uvloop"),
        "gateway": gateway,
        **{f"gateway+{rev}": other_tree.gateway_argv(rev, gateway) for rev in revs},
    }


def short(rounds: int, seconds: float, clients: int, revs: list[str]) -> dict[str, list[float]]:
    """CPU µs per short session (10-token answers), gateway against bare websockets."""
    argvs = short_argvs(revs)
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


async def _hold(url: str, sessions: int, pid: int) -> tuple[float, float]:
    """RSS per session (KiB) with ``sessions`` idle connections, then after each ran one
    short turn (the connections stay open)."""
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> Any:
        async with gate:
            ws = await connect(
                url,
                max_size=None,
                compression=None,
                ping_interval=None,
                open_timeout=60,
                local_addr=(f"127.0.0.{2 + i % 16}", 0),
            )
            await ws.recv()
            return ws

    async def turn(ws: Any) -> None:
        async with gate:
            await ws.send(CREATE_ITEM)
            await ws.send('{"type":"response.create"}')
            while '"response.done"' not in str(await ws.recv()):
                pass

    await asyncio.gather(*(one(i) for i in range(20)))  # warm: code paths, pools
    before = rss_bytes(pid)
    held = await asyncio.gather(*(one(i) for i in range(sessions)))
    await asyncio.sleep(1.0)
    idle = rss_bytes(pid)
    await asyncio.gather(*(turn(ws) for ws in held))
    await asyncio.sleep(1.0)
    after = rss_bytes(pid)
    await asyncio.gather(*(ws.close() for ws in held), return_exceptions=True)
    return (idle - before) / sessions / 1024, (after - before) / sessions / 1024


def memory(rounds: int, sessions: int, revs: list[str]) -> dict[str, dict[str, list[float]]]:
    """KiB per Realtime session, idle and after one short turn, for each server."""
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for name, argv in short_argvs(revs).items():
            with server_process(argv) as s:
                idle, after = asyncio.run(_hold(s.ws_url, sessions, s.pid))
            entry = results.setdefault(name, {"idle": [], "after_turn": []})
            entry["idle"].append(idle)
            entry["after_turn"].append(after)
            print(f"memory {name:8} idle {idle:6.1f} KiB after a turn {after:6.1f} KiB", flush=True)
    return results


def per_round(rows: list[dict[str, Any]], scenario: str, system: str) -> list[float]:
    return [
        r["cpu_us_per_token"] for r in rows if r["scenario"] == scenario and r["system"] == system
    ]


def span(d: dict[str, float], digits: int = 1) -> str:
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


def ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """Round-by-round ``a / b`` (the systems of a round ran back to back)."""
    return summary([x / y for x, y in zip(a, b, strict=False)])


def _floor_of(system: str) -> str | None:
    name = system.partition("+")[0]
    if name in FLOORS:
        return FLOORS[name]
    for gateway, fastapi in (*fastapi_systems().items(), *VLLM_SHAPE.items()):
        if system == fastapi:
            return FLOORS[gateway]
    return "floor" if system == "bare" else None


def _table(rows: list[dict[str, Any]], scenario: str) -> list[str]:
    lines = [
        "| system | CPU µs/token | tokens/s | × its floor (same round) |",
        "|---|---|---|---|",
    ]
    systems = list(dict.fromkeys(r["system"] for r in rows if r["scenario"] == scenario))
    for system in systems:
        cpu = per_round(rows, scenario, system)
        rate = statistics.median(
            x["tokens_s"] for x in rows if x["scenario"] == scenario and x["system"] == system
        )
        floor = _floor_of(system)
        x_floor = (
            "1.00"
            if floor in (None, system)
            else span(ratio(cpu, per_round(rows, scenario, floor or "")), 2)
        )
        lines.append(f"| {system} | {span(summary(cpu))} | {rate:,.0f} | {x_floor} |")
    return lines


def report(r: dict[str, Any]) -> str:
    rows = r["rows"]
    lines = [
        "# The token path and short sessions (bench/writes.py)",
        "",
        f"uvloop, {r['cpus']} CPUs, {r['rounds']} rounds, each system a fresh process, "
        "systems alternating within a round; medians (range). CPU µs of the server "
        "process per token (per session for short sessions). The floors write prebuilt "
        "frames with one `transport.write` per frame per loop turn and nothing else.",
        "",
    ]
    if any(x["scenario"] == "frame" for x in rows):
        lines += [
            "## One token per frame (WebSocket, 50 sessions x 300 tokens, the sim flat out)",
            "",
            *_table(rows, "frame"),
            "",
            "- targets: gateway (Realtime) and responses (Responses WebSocket) at most 2.0x "
            "their floor",
            "",
        ]
    if any(x["scenario"] == "sse" for x in rows):
        lines += [
            "## SSE (stream: true; 200 connections x 300 tokens, the sim flat out)",
            "",
            *_table(rows, "sse"),
            "",
        ]
        for gateway, fastapi in fastapi_systems().items():
            mine = per_round(rows, "sse", gateway)
            fewer = ratio(per_round(rows, "sse", fastapi), mine)
            vllm = ratio(per_round(rows, "sse", VLLM_SHAPE[gateway]), mine)
            lines.append(
                f"- {fastapi} ÷ {gateway}: {span(fewer, 2)}x the gateway's CPU per token "
                f"(target: at least 1.3x); vLLM's shape ÷ {gateway}: {span(vllm, 2)}x"
            )
        lines += ["- targets: http and chat at most 2.0x their floor", ""]
    if "short" in r:
        s = r["short"]
        lines += ["## Short sessions (connect, one 10-token answer, close; 32 clients)", ""]
        for name, values in s.items():
            if name != "bare":
                lines.append(
                    f"- {name}: {span(summary(values))} µs/session; ÷ bare websockets "
                    f"({span(summary(s['bare']))}): {span(ratio(values, s['bare']), 2)} "
                    "(target: at most 1.3x)"
                )
        lines.append("")
    if "memory" in r:
        m = r["memory"]
        lines += [
            f"## Memory per Realtime session ({r['memory_sessions']:,} sessions held open)",
            "",
            "| server | idle KiB/session | after one short turn KiB/session |",
            "|---|---|---|",
        ]
        for name, d in m.items():
            idle, after = summary(d["idle"]), summary(d["after_turn"])
            lines.append(f"| {name} | {span(idle)} | {span(after)} |")
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
        help="also the gateway of this commit in the frame, short and memory scenarios "
        "(repeatable)",
    )
    parser.add_argument(
        "--only", choices=SCENARIOS, action="append", help="these scenarios (default: all)"
    )
    parser.add_argument("--memory-sessions", type=int, default=2000)
    args = parser.parse_args(argv)
    raise_nofile()
    only = set(args.only or SCENARIOS)
    results = streams(args.rounds, args.rev, args.seconds, only)
    if "short" in only:
        results["short"] = short(args.rounds, args.seconds, 32, args.rev)
    if "memory" in only:
        results["memory"] = memory(args.rounds, args.memory_sessions, args.rev)
        results["memory_sessions"] = args.memory_sessions
    results |= {"rounds": args.rounds, "cpus": os.cpu_count(), "revs": args.rev}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "writes.json").write_text(json.dumps(results, indent=2, default=str))
    text = report(results)
    (RESULTS / "writes.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
