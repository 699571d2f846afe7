"""How fast an answer moves when its upstream replica dies: ``python -m bench.failover``
(``make bench`` runs it too).

Two bench/sse_server.py replicas (a token every 10 ms a stream, and no model behind
them, so what is measured is the gateway's own failover, not an engine's prefill of the
moved prompt) behind ``--engine upstream``;
20 Realtime sessions each stream one long answer; once every session has its first
delta, one replica is frozen (SIGSTOP, so that the answers on it are the ones that then
receive nothing), then killed (SIGKILL). For each answer that was on it, the time from
the kill to its next delta: the pool sees the broken stream, marks the replica down and
continues the answer on the other one. p50 and p99 over the moved sessions,
several rounds, each a fresh set of processes. The target (issue 31): p99 at most 1.5 s.
Results: bench/results/failover.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect

from bench.procs import gateway_argv, server_process, sse_server_argv
from bench.stats import dist

RESULTS = Path(__file__).parent / "results"
SESSIONS = 20
ITEM = orjson.dumps(
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Go"}],
        },
    }
).decode()


async def session(url: str, started: asyncio.Event, marks: dict[str, float]) -> float | None:
    """Seconds from the kill to this answer's next delta, if its replica was the one that
    died (it sent nothing while frozen: see :func:`round_`); None otherwise."""
    async with connect(url, max_size=None) as ws:
        await ws.recv()
        await ws.send(ITEM)
        await ws.send('{"type":"response.create"}')
        last = 0.0
        async for frame in ws:
            if "output_text.delta" not in str(frame):
                continue
            started.set()
            now = time.perf_counter()
            if "kill" in marks and now > marks["kill"]:
                # Frozen: nothing came between the freeze's settling and the kill.
                return now - marks["kill"] if last < marks["settled"] else None
            last = now
    raise RuntimeError("the answer ended before the kill")


def moves(server: Any) -> int:
    text = server.get("/metrics").decode()
    line = next(x for x in text.splitlines() if x.startswith("gateway_upstream_moves_total"))
    return int(float(line.rsplit(" ", 1)[1]))


async def round_(upstreams: list[Any], server: Any) -> list[float]:
    """The moved answers' times from the kill to their next delta. The replica is frozen
    (SIGSTOP) first, so that what it had sent reaches the clients and the answers on it
    are the ones that then receive nothing; then killed. Checked against the gateway's
    count of moves."""
    marks: dict[str, float] = {}
    starts = [asyncio.Event() for _ in range(SESSIONS)]
    tasks = [asyncio.create_task(session(server.ws_url, starts[i], marks)) for i in range(SESSIONS)]
    for event in starts:
        await event.wait()
    await asyncio.sleep(0.2)
    os.kill(upstreams[0].pid, signal.SIGSTOP)
    await asyncio.sleep(0.3)  # what it had sent drains to the clients
    marks["settled"] = time.perf_counter()
    await asyncio.sleep(0.3)
    marks["kill"] = time.perf_counter()
    os.kill(upstreams[0].pid, signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    moved = [r for r in results if r is not None]
    count = await asyncio.to_thread(moves, server)
    assert len(moved) == count, f"{len(moved)} answers froze with the replica, {count} moved"
    return moved


def run(rounds: int, loop: str) -> dict[str, Any]:
    rows: list[dict[str, float]] = []
    for number in range(rounds):
        with contextlib.ExitStack() as stack:
            # 100 tokens a second a stream: a fast engine, and a prefix of tens of tokens
            # to continue (flat out, a stream holds megabytes of text by the kill).
            argv = sse_server_argv(response_tokens=2000, loop=loop, token_ms=10)
            upstreams = [stack.enter_context(server_process(argv)) for _ in range(2)]
            gateway = gateway_argv(loop=loop, upstream=upstreams[0].http_url)
            gateway += ["--upstream", upstreams[1].http_url]
            server = stack.enter_context(server_process(gateway))
            moved = asyncio.run(round_(upstreams, server))
        row = dist(moved) | {"moved": float(len(moved))}
        rows.append(row)
        print(
            f"[failover] round {number + 1}: {len(moved)} moved, next delta after the kill "
            f"p50 {row['p50']:.0f} ms p99 {row['p99']:.0f} ms"
        )
    return {"settings": {"rounds": rounds, "sessions": SESSIONS, "loop": loop}, "rows": rows}


def report(data: dict[str, Any]) -> str:
    rows = data["rows"]

    def med(key: str) -> tuple[float, float, float]:
        values = [r[key] for r in rows]
        return statistics.median(values), min(values), max(values)

    p50, p99, moved = med("p50"), med("p99"), med("moved")
    verdict = "met" if p99[0] <= 1500 else "**missed**"
    s = data["settings"]
    return "\n".join(
        [
            "# Mid-answer failover across upstream replicas (bench/failover.py)",
            "",
            f"Two bench/sse_server.py replicas behind --engine upstream, {s['sessions']} "
            f"Realtime sessions streaming one long answer each, SIGKILL of one replica; "
            f"{s['rounds']} rounds, loop {s['loop']}. Time from the kill to the next delta "
            "of each moved answer, ms: medians of the rounds (range).",
            "",
            "| moved answers | p50 | p99 |",
            "|---|---|---|",
            f"| {moved[0]:.0f} ({moved[1]:.0f}–{moved[2]:.0f}) | {p50[0]:.0f} "
            f"({p50[1]:.0f}–{p50[2]:.0f}) | {p99[0]:.0f} ({p99[1]:.0f}–{p99[2]:.0f}) |",
            "",
            f"Target p99 at most 1.5 s: {verdict}.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loop", default="uvloop")
    args = parser.parse_args()
    data = run(args.rounds, args.loop)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "failover.json").write_text(json.dumps(data, indent=2))
    text = report(data)
    (RESULTS / "failover.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
