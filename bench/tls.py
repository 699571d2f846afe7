"""What TLS costs: one token per frame on the Realtime dialect (the sim flat out,
300-token answers, 50 sessions back to back) over ``ws://`` and over the gateway's own
TLS (``wss://``, ``--tls-self-signed``), alternating, ``--rounds`` times; the gateway's
CPU microseconds per token from /proc: ``python -m bench.tls`` (``make bench`` runs it).
``--rev REV`` runs the gateway of commit REV too, in the same rounds (bench/other_tree.py).
Results: bench/results/tls.md and .json."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import ssl
import tempfile
from pathlib import Path
from typing import Any

from bench import other_tree
from bench.procs import gateway_argv, server_process
from bench.turns import measure, realtime_turns, summary
from gateway.transport.tls import self_signed

RESULTS = Path(__file__).parent / "results"


def run(rounds: int, seconds: float, sessions: int, revs: list[str]) -> dict[str, Any]:
    """One token per frame on the Realtime dialect, plain WebSocket against wss:// (the
    gateway's own TLS, a self-signed certificate), alternating: what encryption costs."""
    suffixes = ["", *(f"+{rev}" for rev in revs)]
    results: dict[str, list[float]] = {f"{n}{x}": [] for x in suffixes for n in ("ws", "wss")}
    base = gateway_argv(loop="uvloop", step_ms=0, response_tokens=300)
    folder = Path(tempfile.mkdtemp())
    try:
        trust = ssl.create_default_context(cafile=self_signed(folder).cert)  # the gateway's
        for _ in range(rounds):
            for name in results:
                scheme, _, rev = name.partition("+")
                argv, tls = (
                    (base, None)
                    if scheme == "ws"
                    else ([*base, "--tls-self-signed", str(folder)], trust)
                )
                argv = other_tree.gateway_argv(rev, argv) if rev else argv
                with server_process(argv, tls=tls) as s:
                    url = s.ws_url
                    clients = [
                        lambda stop, n, u=url, c=tls: realtime_turns(u, stop, n, c)
                    ] * sessions
                    cpu, rate = asyncio.run(measure(s.pid, seconds, clients))
                results[name].append(cpu)
                print(f"tls {name:12} {cpu:7.1f} us/token {rate:9.0f} tokens/s", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out: dict[str, Any] = {k: summary(v) for k, v in results.items()}
    for x in suffixes:
        plain, tls = results[f"ws{x}"], results[f"wss{x}"]
        out[f"ratio{x}"] = summary([t / p for p, t in zip(plain, tls, strict=True)])
    return out | {"rounds": rounds, "sessions": sessions, "revs": revs}


def span(d: dict[str, float], digits: int = 1) -> str:
    """``median (min–max)``."""
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


def report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            "# One token per frame over TLS (bench/tls.py)",
            "",
            f"Realtime dialect, {r['sessions']} sessions x 300 tokens, the sim flat out, "
            f"{r['rounds']} rounds alternating; the gateway's CPU per token; uvloop; "
            f"{r['cpus']} CPUs.",
            "",
            *(
                f"- {'this tree' if not x else 'commit ' + x[1:]}: µs/token ws:// "
                f"{span(r[f'ws{x}'])}, wss:// {span(r[f'wss{x}'])}; wss/ws "
                f"{span(r[f'ratio{x}'], 2)} (target: at most 1.25)"
                for x in ["", *(f"+{rev}" for rev in r.get("revs", []))]
            ),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tls")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--rev", action="append", default=[], help="also this commit's gateway")
    args = parser.parse_args(argv)
    results = {**run(args.rounds, args.seconds, args.sessions, args.rev), "cpus": os.cpu_count()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tls.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (RESULTS / "tls.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
