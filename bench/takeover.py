"""How fast an answer goes on when its gateway process dies, on the llama.cpp engine:
``python -m bench.takeover`` (``make bench`` runs it too).

Two gateways with ``--engine llamacpp`` (the bundled SmolLM2-135M, one thread, a slot per
session) share a Redis store (Debian's ``redis-server``, started here); 20 Realtime
sessions on gateway A each stream a greedy answer; once every one has its first delta, A
gets SIGKILL. Each client resumes on gateway B at once, and again after each 1012 close
(B relays until the dead owner's lease runs out, then the next resume takes the session
over and B's engine continues the answer from the text already sent). For each answer:
the time from the kill to its next delta, and to the ``session.resumed`` of its takeover
(what the lease costs). Beside them, the engine's own share: a llama.cpp server with the
same settings, alone, prefilling the same prompts (question and answer so far, as an
open assistant turn) at once and giving one token, its prompt cache off.
Results: bench/results/takeover.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench.failover import SESSIONS, STORY, Moved, item, prefill_alone
from bench.procs import server_process
from bench.stats import dist
from bench.turns import redis_url

RESULTS = Path(__file__).parent / "results"
SLOTS = SESSIONS  # the survivor takes every answer without a queue
CTX = 512
ENGINE = ["--engine", "llamacpp", "--threads", "1", "--slots", str(SLOTS), "--ctx", str(CTX)]
CREATE = orjson.dumps(
    {"type": "response.create", "response": {"temperature": 0, "max_output_tokens": 300}}
).decode()


@dataclass
class Taken:
    """An answer whose gateway died: seconds from the kill to its takeover's
    ``session.resumed`` and to its next delta."""

    resumed: float
    moved: Moved


async def session(
    a_url: str, b_url: str, question: str, started: asyncio.Event, marks: dict[str, float]
) -> Taken:
    text: list[str] = []
    last = 0
    async with connect(a_url, max_size=None) as ws:
        created = orjson.loads(await ws.recv())
        session_id, token = created["session"]["id"], created["resume_token"]
        await ws.send(item(question))
        await ws.send(CREATE)
        try:
            async for frame in ws:
                event = orjson.loads(frame)
                last = event["sequence_number"]
                if event["type"] == "response.output_text.delta":
                    started.set()
                    text.append(event["delta"])
                elif event["type"] == "response.done":
                    raise RuntimeError("the answer ended before the kill")
        except ConnectionClosed:
            pass  # the kill
    if "kill" not in marks:
        raise RuntimeError("the socket closed before the kill")
    while True:  # resume on B until the takeover, then until the next delta
        try:
            async with connect(b_url, max_size=None) as ws:
                await ws.recv()  # this connection's own session.created
                resume = {"session_id": session_id, "resume_token": token}
                resume |= {"type": "session.resume", "last_sequence_number": last}
                await ws.send(orjson.dumps(resume).decode())
                answer = orjson.loads(await ws.recv())
                if answer["type"] != "session.resumed":
                    await asyncio.sleep(0.05)  # not yet (as gateway.client does)
                    continue
                token, resumed = answer["resume_token"], time.perf_counter()
                async for frame in ws:
                    event = orjson.loads(frame)
                    last = event["sequence_number"]
                    if event["type"] == "response.output_text.delta":
                        now = time.perf_counter()
                        moved = Moved(now - marks["kill"], question, "".join(text))
                        return Taken(resumed - marks["kill"], moved)
        except ConnectionClosed:
            continue  # 1012: the dead owner's lease ran out; the next resume takes over


async def round_(a: Any, b: Any) -> list[Taken]:
    marks: dict[str, float] = {}
    starts = [asyncio.Event() for _ in range(SESSIONS)]
    tasks = [
        asyncio.create_task(session(a.ws_url, b.ws_url, f"{STORY} ({i})", starts[i], marks))
        for i in range(SESSIONS)
    ]
    for event in starts:
        await event.wait()
    await asyncio.sleep(0.2)
    marks["kill"] = time.perf_counter()
    os.kill(a.pid, signal.SIGKILL)
    return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=180))


def run(rounds: int, loop: str) -> dict[str, Any]:
    from tests.support import llama_server

    rows: list[dict[str, float]] = []
    for number in range(rounds):
        with redis_url() as store:
            if store is None:
                sys.exit("bench.takeover needs redis-server")
            argv = [sys.executable, "-m", "gateway", *ENGINE, "--loop", loop]
            argv += ["--log-level", "WARNING", "--session-store", store]
            with server_process(argv, timeout=60) as a, server_process(argv, timeout=60) as b:
                taken = asyncio.run(round_(a, b))
        alone = llama_server.start(slots=SLOTS, ctx=CTX)
        try:
            engine = asyncio.run(prefill_alone(alone.url, [t.moved for t in taken]))
        finally:
            alone.kill()
        row = dist([t.moved.seconds for t in taken])
        row |= {f"resumed_{k}": v for k, v in dist([t.resumed for t in taken]).items()}
        row |= {f"engine_{k}": v for k, v in dist(engine).items()}
        row["prefix_chars"] = statistics.median(len(t.moved.text) for t in taken)
        rows.append(row)
        print(
            f"[takeover llamacpp] round {number + 1}: next delta after the kill p50 "
            f"{row['p50']:.0f} ms p99 {row['p99']:.0f} ms (taken over p50 "
            f"{row['resumed_p50']:.0f} ms); the engine alone p50 {row['engine_p50']:.0f} ms "
            f"p99 {row['engine_p99']:.0f} ms"
        )
    return {"settings": {"rounds": rounds, "sessions": SESSIONS, "loop": loop}, "rows": rows}


def report(data: dict[str, Any]) -> str:
    rows, s = data["rows"], data["settings"]

    def cell(key: str) -> str:
        values = [r[key] for r in rows]
        return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"

    return "\n".join(
        [
            "# A takeover on the llama.cpp engine (bench/takeover.py)",
            "",
            f"Two gateways with --engine llamacpp (bundled SmolLM2-135M, 1 thread, {SLOTS} "
            f"slots each) and the Redis store, {s['sessions']} Realtime sessions streaming a "
            f"greedy answer on gateway A, SIGKILL of A, each client resuming on B; "
            f"{s['rounds']} rounds, loop {s['loop']}. Time from the kill to each answer's "
            "takeover (session.resumed: the dead owner's 3 s lease) and to its next delta, "
            "beside a llama.cpp server's own time to prefill the same prompts at once and "
            "give one token (prompt cache off), ms: medians of the rounds (range).",
            "",
            "| answer so far, chars | taken over p50 | next delta p50 | next delta p99 "
            "| engine alone p50 | engine alone p99 |",
            "|---|---|---|---|---|---|",
            f"| {cell('prefix_chars')} | {cell('resumed_p50')} | {cell('p50')} | {cell('p99')} "
            f"| {cell('engine_p50')} | {cell('engine_p99')} |",
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
    (RESULTS / "takeover.json").write_text(json.dumps(data, indent=2))
    text = report(data)
    (RESULTS / "takeover.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
