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

``--replicas llamacpp``: the same on two real llama.cpp servers with the bundled model
(tests/support/llama_server.py, one thread and a slot per session each, greedy answers), where the
survivor must prefill every moved prompt (the question and the answer so far) before
its next token: beside each round's figure, that engine time alone, measured right
after on the survivor with the same prompts sent at once, its prompt cache off.
Results: bench/results/failover.md and .json (failover-llamacpp.* for llama.cpp).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect

from bench.procs import gateway_argv, server_process, sse_server_argv
from bench.stats import dist

RESULTS = Path(__file__).parent / "results"
SESSIONS = 20
STORY = "Write a long story about a lighthouse keeper and the storm that changed her life."


def item(text: str) -> str:
    return orjson.dumps(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": text}],
            },
        }
    ).decode()


@dataclass
class Moved:
    """An answer whose replica died: seconds from the kill to its next delta, and its
    text before the kill (what the survivor had to prefill with the question)."""

    seconds: float
    question: str
    text: str


async def session(
    url: str, question: str, create: str, started: asyncio.Event, marks: dict[str, float]
) -> Moved | None:
    """This answer's :class:`Moved`, if its replica was the one that died (it sent nothing
    while frozen: see :func:`round_`); None otherwise."""
    async with connect(url, max_size=None) as ws:
        await ws.recv()
        await ws.send(item(question))
        await ws.send(create)
        last, text = 0.0, list[str]()
        async for frame in ws:
            if "output_text.delta" not in str(frame):
                continue
            started.set()
            now = time.perf_counter()
            if "kill" in marks and now > marks["kill"]:
                # Frozen: nothing came between the freeze's settling and the kill.
                if last >= marks["settled"]:
                    return None
                return Moved(now - marks["kill"], question, "".join(text))
            last = now
            text.append(orjson.loads(frame)["delta"])
    raise RuntimeError("the answer ended before the kill")


def moves(server: Any) -> int:
    text = server.get("/metrics").decode()
    line = next(x for x in text.splitlines() if x.startswith("gateway_upstream_moves_total"))
    return int(float(line.rsplit(" ", 1)[1]))


async def round_(
    pids: list[int], server: Any, question: str = "Go", create: str = '{"type":"response.create"}'
) -> list[Moved]:
    """The moved answers' times from the kill to their next delta. The replica is frozen
    (SIGSTOP) first, so that what it had sent reaches the clients and the answers on it
    are the ones that then receive nothing; then killed. Checked against the gateway's
    count of moves."""
    marks: dict[str, float] = {}
    starts = [asyncio.Event() for _ in range(SESSIONS)]
    tasks = [
        asyncio.create_task(session(server.ws_url, f"{question} ({i})", create, starts[i], marks))
        for i in range(SESSIONS)
    ]
    for event in starts:
        await event.wait()
    await asyncio.sleep(0.2)
    os.kill(pids[0], signal.SIGSTOP)
    await asyncio.sleep(0.3)  # what it had sent drains to the clients
    marks["settled"] = time.perf_counter()
    await asyncio.sleep(0.3)
    marks["kill"] = time.perf_counter()
    os.kill(pids[0], signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
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
            moved = asyncio.run(round_([u.pid for u in upstreams], server))
        row = dist([m.seconds for m in moved]) | {"moved": float(len(moved))}
        rows.append(row)
        print(
            f"[failover] round {number + 1}: {len(moved)} moved, next delta after the kill "
            f"p50 {row['p50']:.0f} ms p99 {row['p99']:.0f} ms"
        )
    return {"settings": {"rounds": rounds, "sessions": SESSIONS, "loop": loop}, "rows": rows}


LLAMA_SLOTS = SESSIONS  # per replica: the survivor takes every answer without a queue
LLAMA_CREATE = orjson.dumps(
    {"type": "response.create", "response": {"max_output_tokens": 120, "temperature": 0}}
).decode()


def run_llamacpp(rounds: int, loop: str) -> dict[str, Any]:
    """The rounds on two llama.cpp replicas (see the module docstring)."""
    from tests.support import llama_server

    rows: list[dict[str, float]] = []
    for number in range(rounds):
        replicas = [llama_server.start(slots=LLAMA_SLOTS, ctx=512) for _ in range(2)]
        try:
            argv = gateway_argv(loop=loop, upstream=replicas[0].url)
            argv += ["--upstream", replicas[1].url]
            with server_process(argv, timeout=60) as server:
                moved = asyncio.run(round_([replicas[0].process.pid], server, STORY, LLAMA_CREATE))
            engine = asyncio.run(prefill_alone(replicas[1].url, moved))
        finally:
            for replica in replicas:
                replica.kill()
        row = dist([m.seconds for m in moved]) | {"moved": float(len(moved))}
        row |= {f"engine_{k}": v for k, v in dist(engine).items()}
        row["prefix_chars"] = statistics.median(len(m.text) for m in moved)
        rows.append(row)
        print(
            f"[failover llamacpp] round {number + 1}: {len(moved)} moved, next delta after "
            f"the kill p50 {row['p50']:.0f} ms p99 {row['p99']:.0f} ms; the survivor alone "
            f"p50 {row['engine_p50']:.0f} ms p99 {row['engine_p99']:.0f} ms"
        )
    settings = {"rounds": rounds, "sessions": SESSIONS, "loop": loop, "replicas": "llamacpp"}
    return {"settings": settings, "rows": rows}


async def prefill_alone(url: str, moved: list[Moved]) -> list[float]:
    """Seconds the survivor takes, alone, to prefill each moved prompt (question and answer
    so far, as an open assistant turn) and give one token, all sent at once, its prompt
    cache off (it holds these prompts now)."""
    import httpx

    async def one(client: httpx.AsyncClient, m: Moved) -> float:
        messages = [
            {"role": "user", "content": m.question},
            {"role": "assistant", "content": m.text},
        ]
        body = {"messages": messages, "max_tokens": 1, "temperature": 0, "cache_prompt": False}
        started = time.perf_counter()
        response = await client.post(f"{url}/v1/chat/completions", json=body)
        response.raise_for_status()
        return time.perf_counter() - started

    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(one(client, m) for m in moved)))


def report(data: dict[str, Any]) -> str:
    rows = data["rows"]

    def med(key: str) -> tuple[float, float, float]:
        values = [r[key] for r in rows]
        return statistics.median(values), min(values), max(values)

    p50, p99, moved = med("p50"), med("p99"), med("moved")
    verdict = "met" if p99[0] <= 1500 else "**missed**"
    s = data["settings"]
    if s.get("replicas") == "llamacpp":
        e50, e99, prefix = med("engine_p50"), med("engine_p99"), med("prefix_chars")
        return "\n".join(
            [
                "# Mid-answer failover across llama.cpp replicas (bench/failover.py)",
                "",
                f"Two llama.cpp servers (bundled SmolLM2-135M, 1 thread, {LLAMA_SLOTS} slots "
                f"each) behind --engine upstream, {s['sessions']} Realtime sessions streaming "
                f"a greedy answer each, SIGKILL of one replica; {s['rounds']} rounds, loop "
                f"{s['loop']}. Time from the kill to the next delta of each moved answer, "
                "beside the survivor's own time to prefill the same prompts at once and give "
                "one token (prompt cache off), ms: medians of the rounds (range).",
                "",
                "| moved answers | answer so far, chars | p50 | p99 | survivor alone p50 "
                "| survivor alone p99 |",
                "|---|---|---|---|---|---|",
                f"| {moved[0]:.0f} ({moved[1]:.0f}–{moved[2]:.0f}) | {prefix[0]:.0f} "
                f"| {p50[0]:.0f} ({p50[1]:.0f}–{p50[2]:.0f}) "
                f"| {p99[0]:.0f} ({p99[1]:.0f}–{p99[2]:.0f}) "
                f"| {e50[0]:.0f} ({e50[1]:.0f}–{e50[2]:.0f}) "
                f"| {e99[0]:.0f} ({e99[1]:.0f}–{e99[2]:.0f}) |",
                "",
            ]
        )
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
    parser.add_argument(
        "--replicas", choices=("sse", "llamacpp"), default="sse", help="what the replicas are"
    )
    args = parser.parse_args()
    if args.replicas == "llamacpp":
        data, name = run_llamacpp(args.rounds, args.loop), "failover-llamacpp"
    else:
        data, name = run(args.rounds, args.loop), "failover"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2))
    text = report(data)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
