"""The standard benchmark set: ``python -m bench.run`` (``make bench``).

Every figure of the gateway is measured beside its baselines in the same run:

- ``engine``: the same SimEngine driven in one process with no network (the
  worker iterates ``engine.stream`` itself): the floor for latency.
- ``bare``: a bare websockets server (bench/bare_server.py) pushing the same
  frames on the same fixed step clock with no gateway logic: the ceiling for frames.
- ``gateway``: ``python -m gateway --engine sim``, coalescing on (the default).
- ``gateway-nc``: the same with ``--no-coalesce``.

The SimEngine keeps its steps on a fixed clock whatever the event loop is doing
(as a GPU does), so all of them are fed the way a real engine feeds the gateway.

Servers and load generators each run in processes of their own. Results go to
``bench/results/latest.md`` (tables), ``latest.json`` (every figure) and
``latency.png`` (latency percentiles against load). ``--quick`` is a smaller set
for a smoke run; ``--profile`` also runs the gateway under cProfile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.loadgen import LoadResult, Target, Workload, raise_nofile, run_load
from bench.procs import bare_server_argv, gateway_argv, rss_bytes, server_process
from bench.stats import dist

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Engine:
    """The sim engine's settings, shared by every system of a scenario."""

    step_ms: float
    response_tokens: int
    max_batch: int = 4096  # above every concurrency here: no queueing in the engine


SYSTEMS = {
    "engine": "bare engine (in-process, no network)",
    "bare": "bare websockets server (ceiling)",
    "gateway": "gateway",
    "gateway-nc": "gateway --no-coalesce",
}


@dataclass
class Serving:
    target: Target
    pid: int | None  # the server process to sample (None: the engine runs in the worker)
    workers: int
    http_get: Callable[[str], bytes] | None = None


@contextlib.contextmanager
def serving(system: str, engine: Engine, *, profile_to: Path | None = None) -> Iterator[Serving]:
    """Start ``system``'s server process (none for the bare engine) for a scenario."""
    if system == "engine":
        params = {
            "step_ms": engine.step_ms,
            "max_batch": engine.max_batch,
            "response_tokens": engine.response_tokens,
        }
        yield Serving(("engine", params), None, workers=1)
        return
    if system == "bare":
        argv = bare_server_argv(step_ms=engine.step_ms, response_tokens=engine.response_tokens)
    else:
        argv = gateway_argv(
            step_ms=engine.step_ms,
            max_batch=engine.max_batch,
            response_tokens=engine.response_tokens,
            coalesce=system != "gateway-nc",
            profile_to=profile_to,
        )
    with server_process(argv) as server:
        yield Serving(("ws", server.ws_url), server.pid, workers=2, http_get=server.get)


def summarize(scenario: str, system: str, w: Workload, r: LoadResult) -> dict[str, Any]:
    """One row: latency percentiles (ms), rates (per second), CPU and outcome counts."""
    t = r.tally
    tokens = t.tokens_in_window
    # The bare engine runs inside its load worker: that worker's CPU is the engine's.
    cpu = r.server_cpu_s if r.server_cpu_s is not None else t.cpu_s
    row: dict[str, Any] = {
        "scenario": scenario,
        "system": system,
        "sessions": w.sessions,
        "rate": w.rate,
        "connected": t.connected,
        "turns": t.turns,
        "completed": t.status.get("completed", 0),
        "cancelled": t.status.get("cancelled", 0),
        "refused": t.status.get("refused", 0),
        "timeouts": t.status.get("timeout", 0),
        "errors": sum(t.errors.values()),
        "error_codes": dict(t.errors),
        "text_mismatch": t.text_mismatch,
        "unfinished": t.unfinished,
        "dropped_arrivals": t.dropped_arrivals,
        "tokens_s": tokens / w.duration,
        "delta_frames_s": t.delta_frames / w.duration,
        "frames_s": t.frames / w.duration,
        "tokens_per_frame": tokens / t.delta_frames if t.delta_frames else math.nan,
        "server_cpu_s": cpu,
        "cpu_ms_per_1k_tokens": 1e6 * cpu / tokens if tokens else math.nan,
        "server_cpu_util": cpu / w.duration,
        "client_cpu_s": t.cpu_s,
        "load_avg_1m": os.getloadavg()[0],
    }
    for name, values in (
        ("ttft", t.ttft),
        ("tpot", t.tpot),
        ("gap", t.gaps),
        ("e2e", t.e2e),
        ("cancel", t.cancel_to_done),
    ):
        for key, value in dist(values).items():
            row[f"{name}_{key}"] = value
    return row


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_systems(
    scenario: str,
    systems: list[str],
    engine: Engine,
    workloads: list[Workload],
    rows: list[dict[str, Any]],
) -> None:
    """Each system in turn, every workload against one server process."""
    for system in systems:
        with serving(system, engine) as s:
            for w in workloads:
                result = run_load(s.target, w, workers=s.workers, server_pid=s.pid)
                row = summarize(scenario, system, w, result)
                row.update(step_ms=engine.step_ms, response_tokens=engine.response_tokens)
                rows.append(row)
                log(
                    f"{scenario:10} {system:12} sessions={w.sessions:<5} "
                    f"ttft_p99={row['ttft_p99']:.1f}ms gap_p99={row['gap_p99']:.1f}ms "
                    f"tok/s={row['tokens_s']:.0f} frames/s={row['delta_frames_s']:.0f} "
                    f"cancel_p99={row['cancel_p99']:.1f}ms errors={row['errors']} "
                    f"mismatch={row['text_mismatch']}"
                )


def run_idle(systems: list[str], sessions: int, engine: Engine, rows: list[dict[str, Any]]) -> None:
    """RSS of the server before and while ``sessions`` idle connections are open."""
    for system in systems:
        with serving(system, engine) as s:
            assert s.pid is not None and s.http_get is not None
            # Warm up: the first connections load code paths and grow pools once.
            run_load(s.target, Workload(sessions=20, mode="idle"), workers=1)
            time.sleep(0.3)
            before = rss_bytes(s.pid)
            http_get = s.http_get
            pid = s.pid

            def measure(
                pid: int = pid, http_get: Callable[[str], bytes] = http_get, system: str = system
            ) -> dict[str, Any]:
                if system.startswith("gateway"):  # wait until every session actor exists
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        if json.loads(http_get("/healthz"))["sessions"] >= sessions:
                            break
                        time.sleep(0.1)
                time.sleep(0.5)
                return {"rss": rss_bytes(pid)}

            w = Workload(sessions=sessions, mode="idle")
            result = run_load(s.target, w, workers=2, on_ready=measure)
            held = result.tally.connected
            after = result.extra["rss"]
            row = {
                "scenario": "idle",
                "system": system,
                "sessions": sessions,
                "connected": held,
                "connect_failed": result.tally.connect_failed,
                "rss_before_mib": before / 2**20,
                "rss_after_mib": after / 2**20,
                "kib_per_session": (after - before) / 1024 / held if held else math.nan,
            }
            rows.append(row)
            log(
                f"idle       {system:12} sessions={held:<5} "
                f"{row['kib_per_session']:.1f} KiB/session (RSS {row['rss_before_mib']:.0f} -> "
                f"{row['rss_after_mib']:.0f} MiB, {row['connect_failed']} failed)"
            )


# What ``--profile`` runs: the gateway at the 1,000-session sweep point and at the
# throughput scenario (where coalescing should engage), each under cProfile.
PROFILES = {
    "gateway": (Engine(20, 32), Workload(sessions=1000, duration=4.0, think=(0.0, 0.04))),
    "gateway-throughput": (Engine(5, 64), Workload(sessions=400, duration=4.0, think=(0.0, 0.0))),
}


def profile_gateway(engine: Engine, w: Workload, name: str, out: Path) -> str:
    """Run ``w`` against the gateway under cProfile; the top functions by own time."""
    with tempfile.TemporaryDirectory() as tmp:
        prof = Path(tmp) / "gateway.prof"
        with serving("gateway", engine, profile_to=prof) as s:
            result = run_load(s.target, w, workers=s.workers, server_pid=s.pid)
        t = result.tally
        stats = pstats.Stats(str(prof))
        total = stats.total_tt  # type: ignore[attr-defined]
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
        per_frame = t.tokens_in_window / t.delta_frames if t.delta_frames else math.nan
        lines = [
            f"# {name}: {w.sessions} sessions, step {engine.step_ms} ms, "
            f"{engine.response_tokens}-token answers, think {w.think[0]}-{w.think[1]} s",
            f"# under cProfile: {t.tokens_in_window / w.duration:.0f} tokens/s, "
            f"{t.delta_frames / w.duration:.0f} delta frames/s ({per_frame:.2f} tokens/frame)",
            "",
        ]
        lines.append(f"{'own %':>6} {'cum %':>6} {'calls':>10}  function")
        for (file, line, func), (_, calls, own, cum, _) in rows[:30]:
            where = f"{Path(file).name}:{line}({func})" if line else func
            lines.append(f"{100 * own / total:6.1f} {100 * cum / total:6.1f} {calls:10d}  {where}")
        text = "\n".join(lines) + "\n"
        out.write_text(text)
        return text


def run_profiles(out: Path) -> dict[str, str]:
    profiles = {}
    for name, (engine, w) in PROFILES.items():
        path = out / f"profile-{name}.txt"
        profiles[name] = profile_gateway(engine, w, name, path)
        log(f"profile written to {path}")
    return profiles


def standard(quick: bool) -> dict[str, Any]:
    """The standard set. Returns every row and the settings used."""
    rows: list[dict[str, Any]] = []
    base = Workload(sessions=1, warmup=1.0, duration=2.0 if quick else 4.0, drain=10.0)
    four = ["engine", "bare", "gateway", "gateway-nc"]

    # 1. Latency against load: closed loop, a random think time so that arrivals
    #    fall at random points of the engine's step (else the step phase decides TTFT).
    sweep_engine = Engine(step_ms=20, response_tokens=32)
    levels = [10, 100] if quick else [10, 100, 300, 1000]
    sweep = [replace(base, sessions=c, think=(0.0, 0.04)) for c in levels]
    run_systems("sweep", four, sweep_engine, sweep, rows)

    # 2. Throughput: an engine that offers more tokens than one core can frame.
    tput_engine = Engine(step_ms=5, response_tokens=64)
    tput = [replace(base, sessions=100 if quick else 400, think=(0.0, 0.0))]
    run_systems("throughput", four, tput_engine, tput, rows)

    # 3. Cancel: each turn is cancelled after 1-8 delta frames.
    cancel_engine = Engine(step_ms=20, response_tokens=64)
    cancel = [replace(base, sessions=100, think=(0.0, 0.04), cancel_after=(1, 8))]
    run_systems("cancel", ["engine", "bare", "gateway"], cancel_engine, cancel, rows)

    # 4. Open loop: Poisson arrivals at a fixed rate, each on a free session.
    open_loop = [replace(base, sessions=300, mode="open", rate=150.0)]
    run_systems("open", ["engine", "gateway"], sweep_engine, open_loop, rows)

    # 5. Memory per idle session.
    run_idle(["bare", "gateway"], 500 if quick else 5000, sweep_engine, rows)

    settings = {
        "sweep": asdict(sweep_engine),
        "throughput": asdict(tput_engine),
        "cancel": asdict(cancel_engine),
        "quick": quick,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    return {"rows": rows, "settings": settings}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller set (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where results go")
    parser.add_argument(
        "--profile", action="store_true", help="also profile the gateway (cProfile)"
    )
    parser.add_argument(
        "--profile-only",
        action="store_true",
        help="only the profiles (latest.md and latest.json are left as they are)",
    )
    args = parser.parse_args(argv)
    raise_nofile()  # inherited by every server and worker process
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.profile_only:
        run_profiles(args.out)
        return 0
    results = standard(args.quick)
    results["settings"].update(
        wall_s=time.monotonic() - started,
        finished_at=time.strftime("%Y-%m-%d %H:%M"),
        load_avg=os.getloadavg()[0],
    )
    if args.profile:
        results["profiles"] = run_profiles(args.out)
    from bench.report import write_report

    write_report(results, args.out)
    log(f"done in {time.monotonic() - started:.0f}s: {args.out / 'latest.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
