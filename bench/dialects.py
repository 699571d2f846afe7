"""What the Responses dialect, the HTTP path, the session store and TLS cost per token,
each beside its baseline from the same run: ``python -m bench.dialects`` (``make bench``
runs it too). bench.run has the rest of the Responses API's scenarios (lanes, SSE against
FastAPI + uvicorn, requests per second, ``generate: false`` on llama.cpp).

- ``frame``: one token per frame (the sim flat out, 300-token answers, 50 sessions
  back to back), the gateway's CPU microseconds per token from /proc for: the Realtime
  dialect, the Responses dialect over WebSocket, the Responses API over HTTP (SSE, one
  event per token, keep-alive) and the Realtime dialect with the Redis session store.
- ``tls``: one token per frame on the Realtime dialect over ``ws://`` and over the
  gateway's own TLS (``wss://``, ``--tls-self-signed``), alternating: what encryption costs.

Systems alternate, each run ``--rounds`` times; the tables give the median and range.
Results: bench/results/dialects.md and .json (dialects-NAME.md for a run with --only NAME).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import ssl
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect

from bench.procs import cpu_seconds, free_port, gateway_argv, server_process
from gateway.tls import self_signed

RESULTS = Path(__file__).parent / "results"
PROMPT = "Tell me about the gateway"


# -- clients ---------------------------------------------------------------------------


async def realtime_turns(
    url: str, stop: float, count: list[int], tls: ssl.SSLContext | None = None
) -> None:
    async with connect(url, max_size=None, compression=None, ssl=tls) as ws:
        await ws.recv()
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": PROMPT}],
        }
        create_item = orjson.dumps({"type": "conversation.item.create", "item": item}).decode()
        while time.monotonic() < stop:
            await ws.send(create_item)
            await ws.send('{"type":"response.create"}')
            while True:
                frame = await ws.recv()
                if (
                    b"output_text.delta" in frame
                    if isinstance(frame, bytes)
                    else "output_text.delta" in frame
                ):
                    count[0] += 1
                elif '"response.done"' in str(frame):
                    break


async def responses_turns(url: str, stop: float, count: list[int]) -> None:
    async with connect(url, max_size=None, compression=None) as ws:
        create = orjson.dumps({"type": "response.create", "input": PROMPT, "store": False})
        while time.monotonic() < stop:
            await ws.send(create.decode())
            while True:
                frame = str(await ws.recv())
                if "output_text.delta" in frame:
                    count[0] += 1
                elif '"response.completed"' in frame or '"response.incomplete"' in frame:
                    break


async def sse_turns(port: int, path: str, stop: float, count: list[int]) -> None:
    """POST stream: true over one keep-alive connection, chunked SSE read to the end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = orjson.dumps({"input": PROMPT, "stream": True, "store": False})
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    try:
        while time.monotonic() < stop:
            writer.write(request)
            await reader.readuntil(b"\r\n\r\n")
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                chunk = await reader.readexactly(size + 2)
                count[0] += chunk.count(b"event: response.output_text.delta")
    finally:
        writer.close()


@contextlib.contextmanager
def redis_url() -> Iterator[str | None]:
    if shutil.which("redis-server") is None:
        yield None
        return
    port, folder = free_port(), tempfile.mkdtemp()
    argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*argv, "--dir", folder], stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


async def measure(pid: int, seconds: float, clients: Any) -> tuple[float, float]:
    """(CPU µs per unit, units per second) of the server ``pid`` while ``clients`` run."""
    count = [0]
    warm = time.monotonic() + 1.0
    stop = warm + seconds
    tasks = [asyncio.create_task(c(stop + 0.2, count)) for c in clients]
    await asyncio.sleep(warm - time.monotonic())
    c0, n0, t0 = cpu_seconds(pid), count[0], time.monotonic()
    await asyncio.sleep(stop - time.monotonic())
    c1, n1, t1 = cpu_seconds(pid), count[0], time.monotonic()
    await asyncio.gather(*tasks, return_exceptions=True)
    units = max(1, n1 - n0)
    return 1e6 * (c1 - c0) / units, units / (t1 - t0)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# -- scenarios -------------------------------------------------------------------------


def frame(rounds: int, seconds: float, sessions: int) -> dict[str, Any]:
    tokens = 300
    results: dict[str, dict[str, list[float]]] = {}

    def record(name: str, cpu: float, rate: float) -> None:
        row = results.setdefault(name, {"us_per_token": [], "tokens_per_s": []})
        row["us_per_token"].append(cpu)
        row["tokens_per_s"].append(rate)
        print(f"frame {name:14} {cpu:7.1f} us/token {rate:9.0f} tokens/s", flush=True)

    base = gateway_argv(
        loop="uvloop", step_ms=0, response_tokens=tokens, extra=["--resume-window", "0"]
    )
    with redis_url() as store:
        for _ in range(rounds):
            with server_process(base) as s:
                url = s.ws_url
                rt = [lambda stop, n, url=url: realtime_turns(url, stop, n)] * sessions
                record("realtime", *asyncio.run(measure(s.pid, seconds, rt)))
                rurl = url.replace("/v1/realtime", "/v1/responses")
                rs = [lambda stop, n, u=rurl: responses_turns(u, stop, n)] * sessions
                record("responses-ws", *asyncio.run(measure(s.pid, seconds, rs)))
                port = s.port
                sse = [lambda stop, n, p=port: sse_turns(p, "/v1/responses", stop, n)] * sessions
                record("responses-sse", *asyncio.run(measure(s.pid, seconds, sse)))
            if store is not None:
                argv = [*base[:-2], "--session-store", store]
                with server_process(argv) as s:
                    url = s.ws_url
                    rt = [lambda stop, n, url=url: realtime_turns(url, stop, n)] * sessions
                    record("realtime+redis", *asyncio.run(measure(s.pid, seconds, rt)))
    return {k: {m: summary(v) for m, v in row.items()} for k, row in results.items()}


def tls_frame(rounds: int, seconds: float, sessions: int) -> dict[str, Any]:
    """One token per frame on the Realtime dialect, plain WebSocket against wss:// (the
    gateway's own TLS, a self-signed certificate), alternating: what encryption costs."""
    results: dict[str, list[float]] = {"ws": [], "wss": []}
    base = gateway_argv(loop="uvloop", step_ms=0, response_tokens=300)
    folder = Path(tempfile.mkdtemp())
    try:
        trust = ssl.create_default_context(cafile=self_signed(folder).cert)  # the gateway's
        for _ in range(rounds):
            for name in results:
                argv, tls = (
                    (base, None)
                    if name == "ws"
                    else ([*base, "--tls-self-signed", str(folder)], trust)
                )
                with server_process(argv, tls=tls) as s:
                    url = s.ws_url
                    clients = [
                        lambda stop, n, u=url, c=tls: realtime_turns(u, stop, n, c)
                    ] * sessions
                    cpu, rate = asyncio.run(measure(s.pid, seconds, clients))
                results[name].append(cpu)
                print(f"tls {name:4} {cpu:7.1f} us/token {rate:9.0f} tokens/s", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ratios = [t / p for p, t in zip(results["ws"], results["wss"], strict=True)]
    return {
        **{k: summary(v) for k, v in results.items()},
        "ratio": summary(ratios),
        "rounds": rounds,
        "sessions": sessions,
    }


def span(d: dict[str, float], digits: int = 1) -> str:
    """``median (min–max)``."""
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


TARGETS = (  # (system, its baseline, the most its µs/token may be, in baseline's)
    ("responses-ws", "realtime", 1.1),
    ("responses-sse", "responses-ws", 1.3),
    ("realtime+redis", "realtime", 1.3),
)


def report(results: dict[str, Any]) -> str:
    lines = ["# Dialects, HTTP and the session store (bench/dialects.py)", ""]
    rounds = results.get("rounds")
    frame_ = results.get("frame")
    if frame_:
        lines += [
            f"## One token per frame: gateway CPU per token ({rounds} rounds)",
            "",
            "| system | µs/token median (min–max) | tokens/s median |",
            "|---|---|---|",
        ]
        for name, row in frame_.items():
            rate = row["tokens_per_s"]["median"]
            lines.append(f"| {name} | {span(row['us_per_token'])} | {rate:.0f} |")
        lines.append("")
        cost = {name: row["us_per_token"]["median"] for name, row in frame_.items()}
        for name, base, target in TARGETS:
            if name in cost and base in cost:
                ratio = cost[name] / cost[base]
                verdict = "met" if ratio <= target else "MISSED"
                lines.append(
                    f"- {name} / {base}: {ratio:.2f}x (target: at most {target}x): {verdict}"
                )
        lines.append("")
    if "tls" in results:
        r = results["tls"]
        lines += [
            f"## One token per frame over TLS (Realtime, {r['sessions']} sessions, "
            f"{r['rounds']} rounds alternating)",
            "",
            f"- µs/token: ws:// {span(r['ws'])}, wss:// {span(r['wss'])}; "
            f"wss/ws {span(r['ratio'], 2)} (reported, no target)",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dialects")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--sessions", type=int, default=50)
    scenarios = ["frame", "tls"]
    parser.add_argument("--only", action="append", choices=scenarios)
    args = parser.parse_args(argv)
    chosen = args.only or scenarios
    results: dict[str, Any] = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
    }
    if "frame" in chosen:
        results["frame"] = frame(args.rounds, args.seconds, args.sessions)
    if "tls" in chosen:
        results["tls"] = tls_frame(args.rounds, args.seconds, args.sessions)
    RESULTS.mkdir(exist_ok=True)
    # A run of some scenarios (--only) is kept apart from the whole run's results.
    name = "dialects" + "".join(f"-{s}" for s in args.only or ())
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
