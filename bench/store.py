"""The Redis session store beside the memory store, in the same run: ``python -m bench.store``
(``make bench`` runs it too).

- ``ttft``: time to first token at 100 sessions (sim at 20 ms steps, 32-token answers, a
  random think time so that arrivals fall anywhere in a step), memory store against
  Redis store, alternating over rounds: the p50 and p99 of each and what the store adds.
- ``cpu``: one token per frame, the sim flat out, 50 sessions: the gateway's CPU per
  token and its saturated tokens per second, memory store (resume on, the same replay
  buffer as the store's; and off, the baseline this was first measured against)
  against Redis store, the order rotated every round.
- ``rolling``: 200 sessions streaming on gateway A, A gets SIGTERM (``--drain-timeout
  0.3``), every client resumes on gateway B: how long from the 1012 close to
  ``session.resumed`` (p50, p99), how many sessions were lost, and whether any text was
  lost or repeated (each answer's deltas joined against its final text).

Results: bench/results/store.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect

from bench import other_tree
from bench.procs import gateway_argv, server_process
from bench.stats import dist
from bench.turns import REDIS_PIDS, measure, realtime_turns, redis_url, summary

RESULTS = Path(__file__).parent / "results"
ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}
HOLD = "gateway_session_store_hold_seconds"
CREATE_ITEM = orjson.dumps({"type": "conversation.item.create", "item": ITEM}).decode()


async def _ttft_session(url: str, stop: float, out: list[float], rng: random.Random) -> None:
    async with connect(url, max_size=None, compression=None) as ws:
        await ws.recv()
        while time.monotonic() < stop:
            await asyncio.sleep(rng.uniform(0.0, 0.04))
            await ws.send(CREATE_ITEM)
            started = time.perf_counter()
            await ws.send('{"type":"response.create"}')
            first = None
            while True:
                frame = str(await ws.recv())
                if first is None and "output_text.delta" in frame:
                    first = time.perf_counter() - started
                elif '"response.done"' in frame:
                    break
            if first is not None:
                out.append(first)


async def _ttft(url: str, sessions: int, seconds: float) -> list[float]:
    out: list[float] = []
    stop = time.monotonic() + 1.0 + seconds
    rng = random.Random(7)
    await asyncio.gather(*(_ttft_session(url, stop, out, rng) for _ in range(sessions)))
    return out[len(out) // 5 :]  # the first fifth is the warm-up


def histogram_quantiles(metrics: bytes, name: str, qs: tuple[float, ...]) -> list[float]:
    """Quantiles (ms) of a Prometheus histogram in ``metrics``, linear within a bucket."""
    bounds: list[tuple[float, int]] = []
    for line in metrics.decode().splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bounds.append((float(le), int(float(line.rsplit(" ", 1)[1]))))
    total = bounds[-1][1] if bounds else 0
    out = []
    for q in qs:
        rank, lower, below = q * total, 0.0, 0
        for bound, cumulative in bounds:
            if cumulative >= rank and cumulative > below:
                upper = bound if bound != float("inf") else lower
                out.append(1000 * (lower + (upper - lower) * (rank - below) / (cumulative - below)))
                break
            lower, below = bound, cumulative
        else:
            out.append(0.0)
    return out


def ttft(rounds: int, seconds: float) -> dict[str, Any]:
    p50: dict[str, list[float]] = {"memory": [], "redis": []}
    p99: dict[str, list[float]] = {"memory": [], "redis": []}
    hold: dict[str, list[float]] = {"p50": [], "p99": []}
    with redis_url() as store:
        assert store is not None, "needs redis-server"
        for r in range(rounds):
            for name in ("memory", "redis") if r % 2 == 0 else ("redis", "memory"):
                extra = ["--session-store", store] if name == "redis" else []
                argv = gateway_argv(
                    loop="uvloop", step_ms=20, max_batch=256, response_tokens=32, extra=extra
                )
                with server_process(argv) as s:
                    d = dist(asyncio.run(_ttft(s.ws_url, 100, seconds)))
                    if name == "redis":
                        held = histogram_quantiles(s.get("/metrics"), HOLD, (0.5, 0.99))
                        hold["p50"].append(held[0])
                        hold["p99"].append(held[1])
                        print(f"hold p50 {held[0]:.2f} ms p99 {held[1]:.2f} ms", flush=True)
                p50[name].append(d["p50"])
                p99[name].append(d["p99"])
                print(f"ttft {name:6} p50 {d['p50']:.2f} ms p99 {d['p99']:.2f} ms", flush=True)
    added = [r - m for m, r in zip(p99["memory"], p99["redis"], strict=True)]
    added50 = [r - m for m, r in zip(p50["memory"], p50["redis"], strict=True)]
    return {
        "p50": {k: summary(v) for k, v in p50.items()},
        "p99": {k: summary(v) for k, v in p99.items()},
        "added_p50_ms": summary(added50),
        "added_p99_ms": summary(added),
        "hold_ms": {k: summary(v) for k, v in hold.items()},
    }


CPU_SYSTEMS = {
    "memory": [],
    "memory, resume off": ["--resume-window", "0"],
    "redis": None,  # --session-store URL
}


def cpu(rounds: int, seconds: float, sessions: int, revs: Sequence[str] = ()) -> dict[str, Any]:
    """One token per frame, the sim flat out (``--sim-step-ms 0``): the gateway's CPU per
    token (/proc) and its tokens per second (saturated: the sim waits for nothing), each
    system in turn, the order rotated every round; each ``revs`` commit's memory and
    Redis stores too (NAME+REV)."""
    rows: dict[str, dict[str, list[float]]] = {}
    names = list(CPU_SYSTEMS) + [f"{n}+{rev}" for rev in revs for n in ("memory", "redis")]
    with redis_url() as store:
        assert store is not None, "needs redis-server"
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                system, _, rev = name.partition("+")
                flags = CPU_SYSTEMS[system]
                extra = ["--session-store", store] if flags is None else flags
                argv = gateway_argv(loop="uvloop", step_ms=0, response_tokens=300, extra=extra)
                argv = other_tree.gateway_argv(rev, argv) if rev else argv
                with server_process(argv) as s:
                    clients = [
                        lambda stop, n, url=s.ws_url: realtime_turns(url, stop, n)
                    ] * sessions
                    also = {REDIS_PIDS[store]: 0.0} if flags is None else {}
                    us, rate = asyncio.run(measure(s.pid, seconds, clients, also))
                row = rows.setdefault(name, {"us_per_token": [], "tokens_per_s": []})
                row["us_per_token"].append(us)
                row["tokens_per_s"].append(rate)
                redis_us = sum(also.values())
                if also:
                    row.setdefault("redis_us_per_token", []).append(redis_us)
                print(
                    f"cpu {name:18} {us:6.1f} us/token {rate:8.0f} tokens/s"
                    f" (redis-server {redis_us:.1f} us/token)",
                    flush=True,
                )
    out: dict[str, Any] = {k: {m: summary(v) for m, v in row.items()} for k, row in rows.items()}
    pairs = [("redis", "memory"), ("redis", "memory, resume off")]
    pairs += [(f"redis+{rev}", f"memory+{rev}") for rev in revs]
    for redis_name, base in pairs:
        us = [
            b / a
            for a, b in zip(
                rows[base]["us_per_token"], rows[redis_name]["us_per_token"], strict=True
            )
        ]
        rate = [
            b / a
            for a, b in zip(
                rows[base]["tokens_per_s"], rows[redis_name]["tokens_per_s"], strict=True
            )
        ]
        out[f"{redis_name}/{base}"] = {"us_per_token": summary(us), "tokens_per_s": summary(rate)}
    return out


class _Client:
    def __init__(self) -> None:
        self.ws: ClientConnection | None = None
        self.events: list[dict[str, Any]] = []
        self.session = ""
        self.token = ""

    async def recv(self) -> dict[str, Any]:
        assert self.ws is not None
        event: dict[str, Any] = orjson.loads(await self.ws.recv())
        self.events.append(event)
        return event


async def _rolling(a_url: str, b_url: str, a_pid: int, n: int) -> dict[str, Any]:
    clients = [_Client() for _ in range(n)]

    async def start(c: _Client) -> None:
        c.ws = await connect(a_url, max_size=None, open_timeout=60)
        created = await c.recv()
        c.session, c.token = created["session"]["id"], created["resume_token"]
        await c.ws.send(CREATE_ITEM)
        await c.ws.send('{"type":"response.create"}')
        while (await c.recv())["type"] != "response.output_text.delta":
            pass

    await asyncio.gather(*(start(c) for c in clients))
    os.kill(a_pid, signal.SIGTERM)
    closed_at: dict[int, float] = {}

    async def until_closed(i: int, c: _Client) -> None:
        with contextlib.suppress(Exception):
            while True:
                await c.recv()
        closed_at[i] = time.perf_counter()

    await asyncio.gather(*(until_closed(i, c) for i, c in enumerate(clients)))
    resume_s: list[float] = []
    lost = 0

    async def resume(i: int, c: _Client) -> None:
        nonlocal lost
        async with connect(b_url, max_size=None, open_timeout=60) as ws:
            await ws.recv()
            last = c.events[-1]["sequence_number"]
            ask = {"session_id": c.session, "resume_token": c.token, "last_sequence_number": last}
            await ws.send(orjson.dumps({"type": "session.resume", **ask}).decode())
            answer = orjson.loads(await ws.recv())
            if answer["type"] != "session.resumed":
                lost += 1
                return
            resume_s.append(time.perf_counter() - closed_at[i])
            c.ws = ws
            done = any(e["type"] == "response.done" for e in c.events)
            while not done:
                done = (await c.recv())["type"] == "response.done"

    await asyncio.gather(*(resume(i, c) for i, c in enumerate(clients)))
    damaged = 0
    for c in clients:
        numbers = [e["sequence_number"] for e in c.events]
        text = "".join(e["delta"] for e in c.events if e["type"] == "response.output_text.delta")
        final = [e for e in c.events if e["type"] == "response.output_text.done"]
        if numbers != list(range(1, len(numbers) + 1)) or not final or final[0]["text"] != text:
            damaged += 1
    d = dist(resume_s) if resume_s else {"p50": 0.0, "p99": 0.0}
    return {"lost": lost, "damaged": damaged, "resume_ms_p50": d["p50"], "resume_ms_p99": d["p99"]}


def rolling(rounds: int, sessions: int) -> dict[str, Any]:
    runs = []
    with redis_url() as store:
        assert store is not None, "needs redis-server"
        flags = ["--session-store", store, "--drain-timeout", "0.3"]
        argv = gateway_argv(loop="uvloop", step_ms=20, response_tokens=200, extra=flags)
        for _ in range(rounds):
            with server_process(argv) as a, server_process(argv) as b:
                run = asyncio.run(_rolling(a.ws_url, b.ws_url, a.pid, sessions))
                runs.append(run)
                print(f"rolling {run}", flush=True)
    return {
        "sessions": sessions,
        "lost": sum(r["lost"] for r in runs),
        "damaged": sum(r["damaged"] for r in runs),
        "resume_ms_p50": summary([r["resume_ms_p50"] for r in runs]),
        "resume_ms_p99": summary([r["resume_ms_p99"] for r in runs]),
    }


def report(results: dict[str, Any]) -> str:
    lines = ["# The Redis session store beside the memory store (bench/store.py)", ""]
    if "ttft" in results:
        t = results["ttft"]
        lines += [
            "## Time to first token at 100 sessions (20 ms steps), ms, median (min–max) of "
            f"{results['rounds']} rounds",
            "",
            f"- memory store: p50 {_span(t['p50']['memory'])}, p99 {_span(t['p99']['memory'])}",
            f"- Redis store: p50 {_span(t['p50']['redis'])}, p99 {_span(t['p99']['redis'])}",
            f"- added p50: {_span(t['added_p50_ms'])}; added p99: {_span(t['added_p99_ms'])} "
            "(target: at most 2 ms at p99)",
            f"- what the store holds a socket's frames for (`{HOLD}`, the Redis "
            f"gateway's own histogram over the same run): p50 {_span(t['hold_ms']['p50'])}, "
            f"p99 {_span(t['hold_ms']['p99'])}",
            "",
        ]
    if "cpu" in results:
        c = results["cpu"]
        lines += [
            "## One token per frame, the sim flat out (50 sessions, 300-token answers), median "
            f"(min–max) of {results['rounds']} rounds, the order rotated",
            "",
            "| system | gateway CPU µs per token | tokens/s (saturated) |",
            "|---|---|---|",
        ]
        for name, row in c.items():
            if "/" in name:
                continue
            redis = row.get("redis_us_per_token")
            mine = f" (redis-server: {_span(redis)} more)" if redis else ""
            lines.append(
                f"| {name} | {_span(row['us_per_token'])}{mine} | {_span(row['tokens_per_s'], 0)} |"
            )
        for name, ratio in c.items():
            if "/" not in name:
                continue
            redis_name, _, base = name.partition("/")
            lines.append(
                f"| {redis_name} ÷ {base} (same round) | ×{_span(ratio['us_per_token'])} "
                f"(target ≤ ×1.15) | ×{_span(ratio['tokens_per_s'])} (target within 10 %) |"
            )
        lines += [
            "",
            "CPU is the gateway process's (/proc); redis-server's own, per token, beside it: "
            "on 2 cores it shares them with the gateway and the load generator.",
            "",
        ]
    if "rolling" in results:
        r = results["rolling"]
        lines += [
            f"## Rolling restart under {r['sessions']} streaming sessions",
            "",
            f"- sessions lost: {r['lost']}; answers with text lost or repeated: {r['damaged']}",
            f"- resume time (1012 close to session.resumed), ms: p50 {_span(r['resume_ms_p50'])}, "
            f"p99 {_span(r['resume_ms_p99'])}",
            "",
        ]
    return "\n".join(lines)


def _span(d: dict[str, float], digits: int = 2) -> str:
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument(
        "--only", choices=("ttft", "cpu", "rolling"), action="append", help="these scenarios"
    )
    parser.add_argument("--rev", action="append", default=[], help="also this commit's (cpu)")
    args = parser.parse_args(argv)
    only = set(args.only or ("ttft", "cpu", "rolling"))
    results: dict[str, Any] = {"rounds": args.rounds}
    if "ttft" in only:
        results["ttft"] = ttft(args.rounds, args.seconds)
    if "cpu" in only:
        results["cpu"] = cpu(args.rounds, args.seconds, 50, args.rev)
    if "rolling" in only:
        results["rolling"] = rolling(args.rounds, args.sessions)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "store.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (RESULTS / "store.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
