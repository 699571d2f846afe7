"""What log probabilities cost, each figure beside its baseline from the same run:
``python -m bench.logprobs`` (``make bench`` runs it). The systems of each scenario take
turns, ``--rounds`` times (default 3), each a fresh process; figures are medians (range).

- ``path``: one token's trip through the gateway's own code with no socket (the
  scheduler's fan-out, the session, the outbox, the Chat Completions chunk template:
  bench/token_path.py), nanoseconds per token, in a process of its own each: a plain
  ``str`` output (asking for none), a ``TextDelta`` with its token's log probability, and
  one with 5 alternatives; and, for each ``--rev``, the ``str`` path of that commit (its
  sources on ``PYTHONPATH``): the cleanest A/B, free of the sim and the sockets.
- ``sim``: Chat Completions over SSE (``stream: true``), the sim flat out (300-token
  answers, 64 keep-alive connections asking back to back): the gateway's CPU µs per token
  without log probabilities, with ``logprobs: true`` (no alternatives) and with
  ``top_logprobs: 5``; and, for each ``--rev``, the gateway of that commit without them
  (an A/B: asking for none must cost what it did before). The sim makes each token's
  ``TokenLogprob`` in the gateway process, so that work is in the figure: a real engine
  makes them in its own.
- ``llamacpp``: the bundled model through ``python -m gateway --engine llamacpp`` (one
  thread, one conversation at a time, greedy 96-token answers, not streamed): the server
  process's CPU µs per token and tokens per second without log probabilities, with
  ``logprobs: true`` and with ``top_logprobs: 5`` (llama.cpp ranks the vocabulary for each
  token it reports).

Results: bench/results/logprobs.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench import other_tree
from bench.loadgen import Workload
from bench.procs import cpu_seconds, server_process
from bench.run import Engine, run_systems
from bench.turns import summary

RESULTS = Path(__file__).parent / "results"
TOKEN_PATH = Path(__file__).parent / "token_path.py"
SCENARIOS = ("path", "sim", "llamacpp")
VARIANTS: dict[str, int | None] = {"none": None, "logprobs": 0, "top 5": 5}
QUESTION = "Tell me a long story about a lighthouse keeper."


def path(rounds: int, revs: list[str]) -> dict[str, list[float]]:
    """Nanoseconds per token of bench/token_path.py, per system, one value a round."""
    here = str(Path(__file__).resolve().parent.parent)
    runs = [(name, here, logprobs) for name, logprobs in VARIANTS.items()]
    runs += [(f"none at {rev}", str(other_tree.worktree(rev)), None) for rev in revs]
    results: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(rounds):
        for name, tree, logprobs in runs:
            argv = [sys.executable, str(TOKEN_PATH)]
            argv += [] if logprobs is None else ["--logprobs", str(logprobs)]
            env = {**os.environ, "PYTHONPATH": tree}
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            results[name].append(float(done.stdout))
            print(f"path {name:20} {float(done.stdout):6.0f} ns/token", flush=True)
    return results


def sim(rounds: int, revs: list[str], seconds: float) -> list[dict[str, Any]]:
    """Every row of the sim scenario, each tagged with its variant."""
    engine = Engine(step_ms=0, response_tokens=300)
    base = Workload(sessions=64, warmup=1.0, duration=seconds, drain=10.0, think=(0.0, 0.0))
    rows: list[dict[str, Any]] = []
    for _ in range(rounds):
        for variant, logprobs in VARIANTS.items():
            w = replace(base, logprobs=logprobs)
            run_systems("logprobs", ["chat"], engine, [w], rows, "uvloop")
            rows[-1]["variant"] = variant
        for rev in revs:
            run_systems("logprobs", [f"chat+{rev}"], engine, [base], rows, "uvloop")
            rows[-1]["variant"] = "none"
    return rows


def llamacpp(rounds: int, answers: int) -> dict[str, dict[str, list[float]]]:
    """Per variant: the server's CPU µs per token and tokens/s, one value a round."""
    argv = [sys.executable, "-m", "gateway", "--engine", "llamacpp", "--threads", "1"]
    argv += ["--slots", "1", "--log-level", "WARNING"]
    results: dict[str, dict[str, list[float]]] = {
        v: {"cpu_us_per_token": [], "tokens_s": []} for v in VARIANTS
    }
    for _ in range(rounds):
        for variant, logprobs in VARIANTS.items():
            with server_process(argv, timeout=60) as server:
                cpu, rate = _answers(server.http_url, server.pid, answers, logprobs)
            results[variant]["cpu_us_per_token"].append(cpu)
            results[variant]["tokens_s"].append(rate)
            print(f"llamacpp {variant:8} {cpu:8.0f} us/token {rate:6.1f} tokens/s", flush=True)
    return results


def _answers(url: str, pid: int, answers: int, logprobs: int | None) -> tuple[float, float]:
    """(CPU µs per token, tokens/s) of ``answers`` greedy answers, after one to warm up."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 96,
        "temperature": 0,
    }
    if logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": logprobs}
    with httpx.Client(base_url=url, timeout=120) as http:

        def ask() -> int:
            reply = http.post("/v1/chat/completions", json=body)
            reply.raise_for_status()
            tokens: int = reply.json()["usage"]["completion_tokens"]
            return tokens

        ask()
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        tokens = sum(ask() for _ in range(answers))
        cpu1, t1 = cpu_seconds(pid), time.perf_counter()
    return 1e6 * (cpu1 - cpu0) / tokens, tokens / (t1 - t0)


def span(d: dict[str, float], digits: int = 1) -> str:
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


def report(r: dict[str, Any]) -> str:
    lines = [
        "# Log probabilities (bench/logprobs.py)",
        "",
        f"{r['cpus']} CPUs, {r['rounds']} rounds ({max(r['rounds'], 5)} for the in-process "
        "path), each system a fresh process, systems alternating within a round; medians "
        "(range).",
        "",
    ]
    token_path = r.get("path")
    if token_path:
        lines += [
            "## One token's trip through the gateway's code (bench/token_path.py: fan-out, "
            "session, outbox, Chat chunk; no socket, no engine)",
            "",
            "| system | ns/token | ÷ the same round's none |",
            "|---|---|---|",
        ]
        none = token_path["none"]
        for name, values in token_path.items():
            ratio = summary([a / b for a, b in zip(values, none, strict=False)])
            lines.append(f"| {name} | {span(summary(values), 0)} | {span(ratio, 2)} |")
        lines.append("")
    rows = r.get("sim")
    if rows:
        lines += [
            "## The token path (Chat Completions SSE, the sim flat out, 64 connections x "
            "300 tokens)",
            "",
            "| system | asks for | CPU µs/token | tokens/s | ÷ the same round's none |",
            "|---|---|---|---|---|",
        ]
        by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for row in rows:
            by.setdefault((row["system"], row["variant"]), []).append(row)
        baseline = [x["cpu_us_per_token"] for x in by[("chat", "none")]]
        for (system, variant), runs in by.items():
            cpu = [x["cpu_us_per_token"] for x in runs]
            rate = summary([x["tokens_s"] for x in runs])["median"]
            ratio = summary([a / b for a, b in zip(cpu, baseline, strict=False)])
            name = "gateway" if system == "chat" else f"gateway at {system.partition('+')[2]}"
            lines.append(
                f"| {name} | {variant} | {span(summary(cpu))} | {rate:,.0f} | {span(ratio, 2)} |"
            )
        lines.append("")
    llama = r.get("llamacpp")
    if llama:
        lines += [
            "## The bundled model (llama.cpp, one thread, greedy 96-token answers, one at a time)",
            "",
            "| asks for | server CPU µs/token | tokens/s | CPU ÷ the same round's none |",
            "|---|---|---|---|",
        ]
        none = llama["none"]["cpu_us_per_token"]
        for variant, figures in llama.items():
            cpu = figures["cpu_us_per_token"]
            ratio = summary([a / b for a, b in zip(cpu, none, strict=False)])
            lines.append(
                f"| {variant} | {span(summary(cpu), 0)} | {span(summary(figures['tokens_s']))} "
                f"| {span(ratio, 2)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.logprobs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="the sim's window")
    parser.add_argument("--answers", type=int, default=6, help="llama.cpp answers per figure")
    parser.add_argument(
        "--rev",
        action="append",
        default=[],
        help="also the gateway of this commit, asking for none (repeatable)",
    )
    parser.add_argument(
        "--only", choices=SCENARIOS, action="append", help="these scenarios (default: both)"
    )
    args = parser.parse_args(argv)
    only = set(args.only or SCENARIOS)
    results: dict[str, Any] = {"rounds": args.rounds, "cpus": os.cpu_count(), "revs": args.rev}
    if "path" in only:
        results["path"] = path(max(args.rounds, 5), args.rev)
    if "sim" in only:
        results["sim"] = sim(args.rounds, args.rev, args.seconds)
    if "llamacpp" in only:
        results["llamacpp"] = llamacpp(args.rounds, args.answers)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "logprobs.json").write_text(json.dumps(results, indent=2, default=str))
    text = report(results)
    (RESULTS / "logprobs.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
