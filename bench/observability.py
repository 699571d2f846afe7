"""What following every request costs: ``python -m bench.observability`` (``make bench`` runs it).

The gateway's own CPU (/proc), while the load runs, for each system in turn, the order
rotated every round:

- ``token``: one token per frame, the sim flat out (``--sim-step-ms 0``), 50 Realtime
  sessions asking for 300-token answers back to back: CPU µs per token. What an answer's
  access log line and span cost is spread over its 300 tokens; nothing is per token.
- ``request``: short non-streaming chat completions (8 tokens, ``POST
  /v1/chat/completions``) from 32 keep-alive connections back to back: CPU µs per request,
  where a line and a span are each one per request.

The systems, all at ``--log-level info`` with the log written to a file: the access log
``off``, ``text`` (the default), ``json``; ``tracing`` (text, and every span exported to
``bench/otlp_sink.py``, a local OTLP/HTTP collector in a process of its own); and, with
``--rev REV``, that commit's gateway (before this work: no access log, no request ids).

Results: bench/results/observability.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench import other_tree
from bench.procs import free_port, gateway_argv, server_process
from bench.turns import measure, realtime_turns, summary

RESULTS = Path(__file__).parent / "results"
SYSTEMS: dict[str, list[str]] = {
    "off": ["--access-log", "off"],
    "text": ["--access-log", "text"],
    "json": ["--access-log", "json"],
    "tracing": ["--access-log", "text", "--otlp-traces-endpoint", "SINK"],
}
CHAT = orjson.dumps(
    {"model": "m", "max_completion_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
)


@contextlib.contextmanager
def otlp_sink() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.otlp_sink", str(port)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    try:
        yield f"http://127.0.0.1:{port}/v1/traces"
    finally:
        proc.terminate()
        tail = proc.communicate(timeout=10)[0].strip()
        print(f"otlp sink: {tail}", flush=True)


async def chat_requests(host: str, port: int, stop: float, count: list[int]) -> None:
    """Non-streaming chat completions back to back on one keep-alive connection."""
    reader, writer = await asyncio.open_connection(host, port)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%b" % (len(CHAT), CHAT)
    )
    try:
        while time.monotonic() < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            count[0] += 1
    finally:
        writer.close()


def run(
    scenario: str, rounds: int, seconds: float, revs: Sequence[str]
) -> dict[str, dict[str, list[float]]]:
    rows: dict[str, dict[str, list[float]]] = {}
    names = [*SYSTEMS, *(f"before {rev}" for rev in revs)]
    with otlp_sink() as sink:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                flags = [f if f != "SINK" else sink for f in SYSTEMS.get(name, [])]
                argv = gateway_argv(
                    loop="uvloop",
                    step_ms=0,
                    response_tokens=300 if scenario == "token" else 8,
                    extra=["--log-level", "INFO", *flags],
                )
                if name.startswith("before "):
                    argv = other_tree.gateway_argv(name.removeprefix("before "), argv)
                with server_process(argv) as s:
                    if scenario == "token":
                        clients: list[Any] = [
                            lambda stop, n, url=s.ws_url: realtime_turns(url, stop, n)
                        ] * 50
                    else:
                        clients = [
                            lambda stop, n, port=s.port: chat_requests("127.0.0.1", port, stop, n)
                        ] * 32
                    us, rate = asyncio.run(measure(s.pid, seconds, clients))
                row = rows.setdefault(name, {"us": [], "per_s": []})
                row["us"].append(us)
                row["per_s"].append(rate)
                unit = "token" if scenario == "token" else "request"
                print(f"{scenario} {name:14} {us:7.1f} us/{unit} {rate:8.0f}/s", flush=True)
    return rows


def report(results: dict[str, Any]) -> str:
    rounds = results["rounds"]
    lines = [
        "# What following every request costs (bench/observability.py)",
        "",
        f"The gateway's CPU (/proc), median (min–max) of {rounds} rounds, the order rotated; "
        "beside each the ratio to `off` in the same round.",
        "",
    ]
    titles = {
        "token": "One token per frame, the sim flat out, 50 Realtime sessions (300-token "
        "answers): CPU µs per token",
        "request": "Non-streaming chat completions (8 tokens), 32 keep-alive connections: "
        "CPU µs per request",
    }
    for scenario, title in titles.items():
        rows = results.get(scenario)
        if not rows:
            continue
        lines += [f"## {title}", "", "| system | CPU µs | per second | ÷ off (same round) |"]
        lines.append("|---|---|---|---|")
        base = rows["off"]["us"]
        for name, row in rows.items():
            ratio = summary([a / b for a, b in zip(row["us"], base, strict=True)])
            lines.append(
                f"| {name} | {_span(summary(row['us']))} | {_span(summary(row['per_s']), 0)} "
                f"| ×{_span(ratio)} |"
            )
        lines.append("")
    return "\n".join(lines)


def _span(d: dict[str, float], digits: int = 2) -> str:
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.observability")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--only", choices=("token", "request"), action="append")
    parser.add_argument("--rev", action="append", default=[], help="also this commit's gateway")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"rounds": args.rounds, "revs": args.rev}
    for scenario in args.only or ("token", "request"):
        results[scenario] = run(scenario, args.rounds, args.seconds, args.rev)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "observability.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (RESULTS / "observability.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
