"""The Responses dialect, the HTTP path and the session store, each beside its baseline
from the same run: ``python -m bench.dialects`` (``make bench`` runs it too).

- ``frame``: one token per frame (the sim flat out, 300-token answers, 50 sessions
  back to back), the gateway's CPU microseconds per token from /proc for: the Realtime
  dialect, the Responses dialect over WebSocket, the Responses API over HTTP (SSE, one
  event per token, keep-alive), the Realtime dialect with the Redis session store, and
  a FastAPI + uvicorn SSE endpoint streaming the same events (bench/fastapi_sse.py).
- ``tls``: one token per frame on the Realtime dialect over ``ws://`` and over the
  gateway's own TLS (``wss://``, ``--tls-self-signed``), alternating: what encryption costs.
- ``lanes``: one Responses connection at 20 ms steps, 16 lanes against 1: tokens/s.
- ``rps``: short non-streaming answers (8 tokens, 64 keep-alive connections): requests
  per second of ``POST /v1/responses`` beside the FastAPI endpoint.
- ``warmup``: on llama.cpp (the bundled model), time to first token of a turn after a
  ~1,000-token prefix, cold against warmed by ``generate: false``.

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
import sys
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


async def responses_turns(url: str, stop: float, count: list[int], lanes: int = 1) -> None:
    async with connect(url, max_size=None, compression=None) as ws:
        running = 0

        async def create(lane: int) -> None:
            body = {"type": "response.create", "input": PROMPT, "store": False}
            if lanes > 1:
                body["stream_id"] = f"l{lane}"
            await ws.send(orjson.dumps(body).decode())

        for lane in range(lanes):
            await create(lane)
            running += 1
        while running:
            frame = str(await ws.recv())
            if "output_text.delta" in frame:
                count[0] += 1
            elif '"response.completed"' in frame or '"response.incomplete"' in frame:
                running -= 1
                if time.monotonic() < stop:
                    lane = int(orjson.loads(frame).get("stream_id", "l0")[1:])
                    await create(lane)
                    running += 1


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


async def plain_requests(port: int, path: str, stop: float, count: list[int]) -> None:
    """Non-streaming POSTs back to back on one keep-alive connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = orjson.dumps({"input": PROMPT, "store": False, "max_output_tokens": 8})
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    try:
        while time.monotonic() < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            count[0] += 1
    finally:
        writer.close()


# -- servers ---------------------------------------------------------------------------


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


def fastapi_argv(tokens: int) -> list[str]:
    return [sys.executable, "-m", "bench.fastapi_sse", "--response-tokens", str(tokens)]


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
            with server_process(fastapi_argv(tokens)) as s:
                port = s.port
                fa = [lambda stop, n, p=port: sse_turns(p, "/v1/responses", stop, n)] * sessions
                record("fastapi-sse", *asyncio.run(measure(s.pid, seconds, fa)))
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


def lanes(rounds: int, seconds: float) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"1 lane": [], "16 lanes": []}
    argv = gateway_argv(loop="uvloop", step_ms=20, response_tokens=50)
    with server_process(argv) as s:
        url = s.ws_url.replace("/v1/realtime", "/v1/responses")
        for _ in range(rounds):
            for name, n in (("1 lane", 1), ("16 lanes", 16)):
                clients = [lambda stop, c, n=n: responses_turns(url, stop, c, lanes=n)]
                _, rate = asyncio.run(measure(s.pid, seconds, clients))
                rates[name].append(rate)
                print(f"lanes {name:9} {rate:7.0f} tokens/s", flush=True)
    ratio = [b / a for a, b in zip(rates["1 lane"], rates["16 lanes"], strict=True)]
    return {**{k: summary(v) for k, v in rates.items()}, "ratio": summary(ratio)}


def rps(rounds: int, seconds: float) -> dict[str, Any]:
    out: dict[str, list[float]] = {"gateway": [], "fastapi": []}
    for _ in range(rounds):
        for name, argv in (
            ("gateway", gateway_argv(loop="uvloop", step_ms=0, response_tokens=8)),
            ("fastapi", fastapi_argv(8)),
        ):
            with server_process(argv) as s:
                port = s.port
                clients = [lambda stop, n, p=port: plain_requests(p, "/v1/responses", stop, n)] * 64
                cpu, rate = asyncio.run(measure(s.pid, seconds, clients))
                out[name].append(rate)
                print(f"rps {name:8} {rate:7.0f} requests/s {cpu:7.0f} us/request", flush=True)
    return {k: summary(v) for k, v in out.items()}


async def _first_delta(ws: Any, ask: dict[str, Any]) -> float:
    """Seconds from sending ``ask`` to its first text delta (read to its end)."""
    started = time.perf_counter()
    await ws.send(orjson.dumps({"type": "response.create", **ask}).decode())
    first = 0.0
    while True:
        event = orjson.loads(await ws.recv())
        if event["type"] == "response.output_text.delta" and not first:
            first = time.perf_counter() - started
        if event["type"] in ("response.completed", "response.incomplete"):
            return first


QUESTION = {"max_output_tokens": 8, "temperature": 0}


async def _warm_then_ask(url: str, prefix: str) -> float:
    """``generate: false`` with the prefix, then the question alone, continuing it."""
    async with connect(url, max_size=None) as ws:
        warm = {"type": "response.create", "input": prefix, "generate": False, "temperature": 0}
        await ws.send(orjson.dumps(warm).decode())
        while True:
            event = orjson.loads(await ws.recv())
            if event["type"] == "response.completed":
                break
        ask = {
            "input": "Summarise it in one line.",
            "previous_response_id": event["response"]["id"],
        }
        return await _first_delta(ws, {**ask, **QUESTION})


async def _cold(url: str, prefix: str) -> float:
    """The prefix and the question in one turn, on a new connection (a cold slot)."""
    async with connect(url, max_size=None) as ws:
        turns = [
            {"role": "user", "content": prefix},
            {"role": "user", "content": "Summarise it in one line."},
        ]
        return await _first_delta(ws, {"input": turns, **QUESTION})


def warmup(rounds: int) -> dict[str, Any]:
    words = [
        "gateway",
        "engine",
        "token",
        "stream",
        "session",
        "answer",
        "model",
        "cache",
        "prefix",
        "lane",
        "socket",
        "batch",
        "queue",
        "fair",
        "fast",
        "cancel",
        "resume",
        "store",
        "relay",
        "drain",
    ]
    out: dict[str, list[float]] = {"cold": [], "warm": []}
    argv = [sys.executable, "-m", "gateway", "--log-level", "WARNING", "--ctx", "4096"]
    with server_process(argv, timeout=180) as s:
        url = s.ws_url.replace("/v1/realtime", "/v1/responses")
        for r in range(rounds):
            prefix = " ".join(words[(i * 7 + r) % len(words)] for i in range(700))  # ~1,000 tokens
            out["cold"].append(asyncio.run(_cold(url, prefix + f" round {r} cold")))
            out["warm"].append(asyncio.run(_warm_then_ask(url, prefix + f" round {r} warm")))
            print(f"warmup cold {out['cold'][-1]:.3f}s warm {out['warm'][-1]:.3f}s", flush=True)
    ratio = [w / c for c, w in zip(out["cold"], out["warm"], strict=True)]
    return {**{k: summary(v) for k, v in out.items()}, "ratio": summary(ratio)}


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
        if "fastapi-sse" in cost and "responses-sse" in cost:
            ratio = cost["fastapi-sse"] / cost["responses-sse"]
            verdict = "met" if ratio >= 2 else "MISSED"
            lines.append(
                f"- FastAPI + uvicorn SSE / the gateway's SSE: {ratio:.2f}x the gateway's µs "
                f"per token (target: at least 2x): {verdict}"
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
    if "lanes" in results:
        r = results["lanes"]
        lines += [
            "## 16 lanes on one Responses connection, 20 ms steps",
            "",
            f"- tokens/s: 1 lane {span(r['1 lane'], 0)}, 16 lanes {span(r['16 lanes'], 0)}; "
            f"ratio {span(r['ratio'])} (target: at least 12x)",
            "",
        ]
    if "rps" in results:
        r = results["rps"]
        lines += [
            "## Short non-streaming answers (8 tokens, 64 keep-alive connections)",
            "",
            f"- requests/s: gateway {span(r['gateway'], 0)}, "
            f"FastAPI + uvicorn {span(r['fastapi'], 0)}",
            "",
        ]
    if "warmup" in results:
        r = results["warmup"]
        lines += [
            "## generate: false on llama.cpp (~1,000-token prefix)",
            "",
            f"- time to first token, s: cold {span(r['cold'], 3)}, after the warm-up "
            f"{span(r['warm'], 3)}; ratio {span(r['ratio'], 2)} (target: at most 0.5)",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dialects")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--sessions", type=int, default=50)
    scenarios = ["frame", "tls", "lanes", "rps", "warmup"]
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
    if "lanes" in chosen:
        results["lanes"] = lanes(args.rounds, args.seconds)
    if "rps" in chosen:
        results["rps"] = rps(args.rounds, args.seconds)
    if "warmup" in chosen:
        results["warmup"] = warmup(args.rounds)
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
