"""The standard benchmark set: ``python -m bench.run`` (``make bench``).

Every figure of the gateway is measured beside its baselines in the same run:

- ``engine``: the same SimEngine driven in one process with no network (an
  EngineDriver in the load worker): the floor for latency.
- ``bare``: a bare websockets server (bench/baselines/bare_server.py): a task per stream
  sending the same frames with ``await ws.send``, on the sim's step clock when it has one,
  no gateway logic.
- ``gateway``: ``python -m gateway --engine sim``, coalescing on (the default).
- ``gateway-nc``: the same with ``--no-coalesce``.
- ``upstream``: ``python -m gateway --engine upstream`` in front of
  bench/sse_server.py (another process streaming OpenAI chat-completion chunks
  as fast as it can, one token per chunk).
- ``responses``: the same gateway process as ``gateway``, the client speaking the
  Responses WebSocket dialect (``/v1/responses``) instead of the Realtime one.
- ``http``: the same gateway, ``POST /v1/responses`` over keep-alive HTTP/1.1
  (``stream: true``: server-sent events; or a JSON ``Response``).
- ``fastapi`` / ``fastapi-httptools``: bench/baselines/fastapi_server.py, a minimal
  FastAPI + uvicorn app answering the same Responses events (a plain async generator;
  on the sim's step clock when it has one) and words, no gateway logic (uvicorn's h11
  parser, or httptools where installed); ``vllm-shape``: the same app with vLLM's
  per-request queue and producer task (bench/baselines/vllm_shape_server.py).
- ``floor`` / ``floor-sse``: what no server can go below (bench/baselines/floor_server.py,
  floor_sse_server.py): prebuilt frames, one ``transport.write`` per frame per loop turn.

Servers and load generators run on the event loop ``--loop`` names (default:
the gateway's default, uvloop where installed); a system written ``NAME@asyncio``
runs on asyncio's loop instead, to show what the loop is worth. Every row
records its loop.

The scenarios: latency against load (sweep), one token per frame (the sim flat
out; Realtime and Responses dialects), the upstream path, capacity (sessions at
20 ms steps with inter-token gap p99 <= 30 ms), throughput, saturated, cancel,
open loop, idle memory, lanes (16 lanes of one Responses connection against 1),
http (the Responses API over SSE beside the WebSocket and FastAPI + uvicorn), rps
(short non-streaming answers per second) and, on llama.cpp, warmup (bench/warmup.py:
``generate: false`` against a cold prompt); see docs/performance.md.
``--only NAME`` (repeatable) runs some of them and merges their rows into the
``latest.json`` already there. Results go to ``bench/results/latest.md`` (tables),
``latest.json`` (every figure) and ``latency.png``; ``--profile`` also samples
the gateway with py-spy under the one-token-per-frame load, on the sim engine
and on the upstream path (``profile-*.txt``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import other_tree
from bench.loadgen import LoadResult, Target, Workload, raise_nofile, run_load
from bench.procs import (
    bare_server_argv,
    fastapi_server_argv,
    floor_server_argv,
    floor_sse_server_argv,
    gateway_argv,
    httptools_installed,
    rss_bytes,
    server_process,
    sse_server_argv,
)
from bench.stats import dist
from gateway.__main__ import LOOPS, default_loop

RESULTS = Path(__file__).parent / "results"

GAP_LIMIT_MS = 30.0  # the capacity criterion: inter-token gap p99 at most this


@dataclass(frozen=True)
class Engine:
    """The sim engine's settings (or the SSE server's answer length), shared by every
    system of a scenario. ``step_ms`` 0: flat out, a step per loop turn."""

    step_ms: float
    response_tokens: int
    max_batch: int = 4096  # above every concurrency here: no queueing in the engine


SYSTEMS = {
    "engine": "bare engine (in-process, no network)",
    "bare": "bare websockets server (a task per stream, await ws.send per frame)",
    "floor": "the floor (bench/baselines/floor_server.py): prebuilt frames, transport.write "
    "per frame per loop turn",
    "floor-responses": "the floor, its Responses WebSocket (/v1/responses)",
    "floor-sse": "the SSE floor (bench/baselines/floor_sse_server.py), POST /v1/responses",
    "floor-chat": "the SSE floor, POST /v1/chat/completions",
    "gateway": "gateway",
    "gateway-nc": "gateway --no-coalesce",
    "upstream": "gateway --engine upstream, in front of bench/sse_server.py",
    "responses": "gateway, Responses WebSocket dialect",
    "http": "gateway, POST /v1/responses",
    "chat": "gateway, POST /v1/chat/completions",
    "completions": "gateway, POST /v1/completions",
    "fastapi": "minimal FastAPI + uvicorn (h11), bench/baselines/fastapi_server.py",
    "fastapi-httptools": "minimal FastAPI + uvicorn (httptools), bench/baselines/fastapi_server.py",
    "fastapi-chat": "minimal FastAPI + uvicorn (h11), its POST /v1/chat/completions",
    "fastapi-httptools-chat": "minimal FastAPI + uvicorn (httptools), POST /v1/chat/completions",
    "vllm-shape": "vLLM's shape: FastAPI + a per-request queue and producer task "
    "(bench/baselines/vllm_shape_server.py)",
    "vllm-shape-chat": "vLLM's shape, its POST /v1/chat/completions",
}


@dataclass
class Serving:
    target: Target
    pid: int | None  # the server process to sample (None: the engine runs in the worker)
    workers: int
    loop: str
    http_get: Callable[[str], bytes] | None = None
    also_sample: list[int] = field(default_factory=list)  # an upstream behind the gateway


def split(system: str, loop: str) -> tuple[str, str]:
    """``gateway@asyncio`` -> ("gateway", "asyncio"); a plain name runs on ``loop``."""
    name, _, override = system.partition("@")
    return name, override or loop


@contextlib.contextmanager
def serving(system: str, engine: Engine, loop: str) -> Iterator[Serving]:
    """Start ``system``'s server process(es) (none for the bare engine) for a scenario."""
    name, loop = split(system, loop)
    if name == "engine":
        params = {
            "step_ms": engine.step_ms,
            "max_batch": engine.max_batch,
            "response_tokens": engine.response_tokens,
        }
        yield Serving(("engine", params), None, workers=1, loop=loop)
        return
    if name == "upstream":
        sse = sse_server_argv(response_tokens=engine.response_tokens, loop=loop)
        with server_process(sse) as upstream:
            argv = gateway_argv(loop=loop, upstream=upstream.http_url)
            with server_process(argv) as server:
                yield Serving(
                    ("ws", server.ws_url),
                    server.pid,
                    workers=2,
                    loop=loop,
                    http_get=server.get,
                    also_sample=[upstream.pid],
                )
        return
    if name.startswith(("fastapi", "vllm-shape")):
        argv = fastapi_server_argv(
            step_ms=engine.step_ms,
            response_tokens=engine.response_tokens,
            loop=loop,
            http="h11" if name in ("fastapi", "fastapi-chat") else "httptools",
            vllm=name.startswith("vllm-shape"),
        )
        with server_process(argv) as server:
            http: Target = ("chat" if name.endswith("-chat") else "http", server.http_url)
            yield Serving(http, server.pid, workers=2, loop=loop, http_get=server.get)
        return
    if name in ("floor-sse", "floor-chat"):
        argv = floor_sse_server_argv(response_tokens=engine.response_tokens, loop=loop)
        with server_process(argv) as server:
            sse: Target = ("chat" if name == "floor-chat" else "http", server.http_url)
            yield Serving(sse, server.pid, workers=2, loop=loop)
        return
    if name in ("floor", "floor-responses"):
        with server_process(
            floor_server_argv(response_tokens=engine.response_tokens, loop=loop)
        ) as server:
            ws: Target = ("ws", server.ws_url)
            if name == "floor-responses":
                ws = ("responses", server.responses_url)
            yield Serving(ws, server.pid, workers=2, loop=loop, http_get=server.get)
        return
    # NAME+REV: the gateway system NAME, run from commit REV's sources (an A/B).
    name, _, rev = name.partition("+")
    if name == "bare":
        argv = bare_server_argv(
            step_ms=engine.step_ms, response_tokens=engine.response_tokens, loop=loop
        )
    else:
        argv = gateway_argv(
            step_ms=engine.step_ms,
            max_batch=engine.max_batch,
            response_tokens=engine.response_tokens,
            coalesce=name != "gateway-nc",
            loop=loop,
        )
        argv = other_tree.gateway_argv(rev, argv) if rev else argv
    with server_process(argv) as server:
        target: Target = ("ws", server.ws_url)
        if name == "responses":
            target = ("responses", server.responses_url)
        elif name in ("http", "chat", "completions"):
            target = (name, server.http_url)
        yield Serving(target, server.pid, workers=2, loop=loop, http_get=server.get)


def load(s: Serving, w: Workload, **kwargs: Any) -> LoadResult:
    return run_load(
        s.target,
        w,
        workers=s.workers,
        server_pid=s.pid,
        also_sample=s.also_sample,
        loop=s.loop,
        **kwargs,
    )


def summarize(scenario: str, system: str, w: Workload, r: LoadResult, s: Serving) -> dict[str, Any]:
    """One row: latency percentiles (ms), rates (per second), CPU and outcome counts."""
    t = r.tally
    tokens = t.tokens_in_window
    # The bare engine runs inside its load worker: that worker's CPU is the engine's.
    cpu = r.server_cpu_s if r.server_cpu_s is not None else t.cpu_s
    row: dict[str, Any] = {
        "scenario": scenario,
        "system": system,
        "loop": s.loop,
        "sessions": w.sessions,
        "lanes": w.lanes,
        "rate": w.rate,
        "duration_s": w.duration,
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
        "completed_s": t.status.get("completed", 0) / w.duration,
        "delta_frames_s": t.delta_frames / w.duration,
        "frames_s": t.frames / w.duration,
        "tokens_per_frame": tokens / t.delta_frames if t.delta_frames else math.nan,
        "server_cpu_s": cpu,
        # CPU microseconds of the serving process per token delivered to a client.
        "cpu_us_per_token": 1e6 * cpu / tokens if tokens else math.nan,
        "server_cpu_util": cpu / w.duration,
        # ... and per response completed (the requests-per-second scenario's figure).
        "cpu_us_per_request": (
            1e6 * cpu / t.status["completed"] if t.status.get("completed") else math.nan
        ),
        "client_cpu_s": t.cpu_s,
        "load_avg_1m": os.getloadavg()[0],
    }
    upstream_cpu = 0.0
    if s.also_sample:
        upstream_cpu = r.extra["cpu_s"][s.also_sample[0]]
        row["upstream_cpu_util"] = upstream_cpu / w.duration
        row["upstream_cpu_us_per_token"] = 1e6 * upstream_cpu / tokens if tokens else math.nan
    if "machine_busy_s" in r.extra:
        # What the machine did besides this benchmark's processes (other work, kernel
        # threads): the figure that says whether a row was measured on a quiet machine.
        ours = (r.server_cpu_s or 0.0) + t.cpu_s + upstream_cpu
        row["other_cpu_util"] = max(0.0, r.extra["machine_busy_s"] - ours) / w.duration
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


def clean(row: dict[str, Any]) -> bool:
    """Every session connected, every turn ended, no error, no text lost."""
    return bool(
        row["connected"] == row["sessions"]
        and row["errors"] == 0
        and row["timeouts"] == 0
        and row["unfinished"] == 0
        and row["text_mismatch"] == 0
    )


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def log_row(row: dict[str, Any]) -> None:
    system = f"{row['system'].partition('@')[0]}@{row['loop']}"
    log(
        f"{row['scenario']:10} {system:18} sessions={row['sessions']:<5} "
        f"ttft_p99={row['ttft_p99']:.1f}ms gap_p99={row['gap_p99']:.1f}ms "
        f"tok/s={row['tokens_s']:.0f} frames/s={row['delta_frames_s']:.0f} "
        f"cpu={row['cpu_us_per_token']:.1f}us/tok cancel_p99={row['cancel_p99']:.1f}ms "
        f"errors={row['errors']} mismatch={row['text_mismatch']} "
        f"other_cpu={row.get('other_cpu_util', math.nan):.2f}"
    )


def run_systems(
    scenario: str,
    systems: list[str],
    engine: Engine,
    workloads: list[Workload],
    rows: list[dict[str, Any]],
    loop: str,
) -> None:
    """Each system in turn, every workload against one server process. A system named
    twice runs twice (a fresh process each time): its rows say which run they are."""
    for system in systems:
        with serving(system, engine, loop) as s:
            for w in workloads:
                row = summarize(scenario, system, w, load(s, w), s)
                row.update(step_ms=engine.step_ms, response_tokens=engine.response_tokens)
                row["choices"] = w.choices
                row["run"] = 1 + sum(
                    r["scenario"] == scenario
                    and r["system"] == system
                    and r["sessions"] == w.sessions
                    and r.get("lanes", 0) == w.lanes
                    and r.get("choices", 1) == w.choices
                    for r in rows
                )
                rows.append(row)
                log_row(row)


def run_capacity(
    systems: list[str],
    engine: Engine,
    base: Workload,
    coarse: list[int],
    fine_step: int,
    rows: list[dict[str, Any]],
    loop: str,
) -> None:
    """The most sessions each system streams with gap p99 <= 30 ms (and nothing lost).

    Up the ``coarse`` counts until one fails, then up from the last pass in steps of
    ``fine_step`` until one fails: the largest passing count is the capacity (load
    only makes gaps longer, so the first failure ends each climb).
    """
    for system in systems:
        with serving(system, engine, loop) as s:

            def measure(n: int, s: Serving = s, system: str = system) -> bool:
                w = replace(base, sessions=n)
                row = summarize("capacity", system, w, load(s, w), s)
                row.update(step_ms=engine.step_ms, response_tokens=engine.response_tokens)
                row["passed"] = clean(row) and row["gap_p99"] <= GAP_LIMIT_MS
                rows.append(row)
                log_row(row)
                return bool(row["passed"])

            passed, failed = 0, None
            for n in coarse:
                if not measure(n):
                    failed = n
                    break
                passed = n
            if failed is None:
                continue  # passed every count tried: the capacity is at least the last
            n = passed + fine_step
            while n < failed and measure(n):
                n += fine_step


def run_idle(
    systems: list[str], sessions: int, engine: Engine, rows: list[dict[str, Any]], loop: str
) -> None:
    """RSS of the server before and while ``sessions`` idle connections are open."""
    for system in systems:
        with serving(system, engine, loop) as s:
            assert s.pid is not None and s.http_get is not None
            # Warm up: the first connections load code paths and grow pools once.
            load(s, Workload(sessions=20, mode="idle"))
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
            result = load(s, w, on_ready=measure)
            held = result.tally.connected
            after = result.extra["rss"]
            row = {
                "scenario": "idle",
                "system": system,
                "loop": s.loop,
                "sessions": sessions,
                "connected": held,
                "connect_failed": result.tally.connect_failed,
                "rss_before_mib": before / 2**20,
                "rss_after_mib": after / 2**20,
                "kib_per_session": (after - before) / 1024 / held if held else math.nan,
            }
            rows.append(row)
            log(
                f"idle       {system:18} sessions={held:<5} "
                f"{row['kib_per_session']:.1f} KiB/session (RSS {row['rss_before_mib']:.0f} -> "
                f"{row['rss_after_mib']:.0f} MiB, {row['connect_failed']} failed)"
            )


# -- profiles --------------------------------------------------------------------------


def profile(system: str, engine: Engine, w: Workload, loop: str, out: Path) -> str:
    """Run ``w`` against ``system`` with py-spy sampling its server over the window."""
    from bench import pyspy

    name = f"frame-{system.replace('@', '-')}"
    raw = Path(tempfile.mkdtemp(prefix="bench-pyspy-")) / f"{name}.raw"
    with serving(system, engine, loop) as s:
        assert s.pid is not None
        pid = s.pid
        started: list[subprocess.Popen[bytes]] = []

        def start_sampling() -> dict[str, Any]:
            # "go" is 0.2 s after this returns; sample the measurement window only.
            timer = threading.Timer(
                0.2 + w.warmup, lambda: started.append(pyspy.record(pid, w.duration, raw))
            )
            timer.start()
            return {"timer": timer}

        result = load(s, w, on_ready=start_sampling)
        result.extra["timer"].join()
        for proc in started:
            _, err = proc.communicate(timeout=w.duration + 30)
            if proc.returncode:
                log(f"py-spy failed ({proc.returncode}): {err.decode(errors='replace')[-300:]}")
    t = result.tally
    title = (
        f"{SYSTEMS[split(system, loop)[0]]} on {s.loop}, {w.sessions} sessions x "
        f"{engine.response_tokens} tokens, sim step {engine.step_ms:g} ms: "
        f"{t.tokens_in_window / w.duration:.0f} tokens/s, "
        f"{t.delta_frames / w.duration:.0f} delta frames/s while sampled at 200 Hz"
    )
    text = pyspy.summarise(raw.read_text() if raw.exists() else "", title=title)
    raw.unlink(missing_ok=True)
    raw.parent.rmdir()
    (out / f"profile-{name}.txt").write_text(text)
    log(f"profile written to {out / f'profile-{name}.txt'}")
    return text


# -- the standard set --------------------------------------------------------------------


SCENARIOS = (
    "sweep",
    "ttft",
    "frame",
    "upstream",
    "capacity",
    "throughput",
    "saturated",
    "cancel",
    "open",
    "idle",
    "lanes",
    "http",
    "rps",
    "chat",
    "chat-rps",
    "completions",
    "choices",
)


def standard(quick: bool, loop: str, only: set[str] | None = None) -> dict[str, Any]:
    """The standard set (or the scenarios ``only`` names). Returns every row and the
    settings used."""
    rows: list[dict[str, Any]] = []
    base = Workload(sessions=1, warmup=1.0, duration=2.0 if quick else 4.0, drain=10.0)
    four = ["engine", "bare", "gateway", "gateway-nc"]
    other = "asyncio" if loop == "uvloop" else None  # the loop comparison, where there is one
    settings: dict[str, Any] = {}

    def want(name: str) -> bool:
        return only is None or name in only

    # 1. Latency against load: closed loop, a random think time so that arrivals
    #    fall at random points of the engine's step (else the step phase decides TTFT).
    sweep_engine = Engine(step_ms=20, response_tokens=32)
    if want("sweep"):
        levels = [10, 100] if quick else [10, 100, 300, 1000]
        sweep = [replace(base, sessions=c, think=(0.0, 0.04)) for c in levels]
        run_systems("sweep", four, sweep_engine, sweep, rows, loop)
        settings["sweep"] = asdict(sweep_engine)

    # 1b. The TTFT target at 100 sessions: a p99 over a few seconds moves by more than the
    #     0.5 ms the target allows from one run to the next (a collection, a burst of other
    #     work), so engine, bare and gateway take turns, three rounds of fresh processes,
    #     and the target compares the medians.
    rounds = 1 if quick else 3
    if want("ttft"):
        ttft = [replace(base, sessions=100, think=(0.0, 0.04), duration=base.duration + 2)]
        systems = ["engine", "bare", "gateway"] * rounds
        run_systems("ttft", systems, sweep_engine, ttft, rows, loop)

    # 2. One token per frame: the sim flat out (a step per loop turn), 300-token answers,
    #    no pause between turns; the bare server sends each token as its own frame.
    frame_engine = Engine(step_ms=0, response_tokens=100 if quick else 300)
    frame = [replace(base, sessions=50 if quick else 200, think=(0.0, 0.0))]
    if want("frame"):
        #  Bare, gateway and the gateway's Responses dialect (the same process, the client
        #  on /v1/responses, each turn continuing the previous response) alternate, twice
        #  each: the targets use their means, so that a burst of other work on the machine
        #  does not decide a ratio alone.
        systems = ["bare", "gateway", "responses"] * 2
        systems += [f"bare@{other}", f"gateway@{other}"] if other else []
        run_systems("frame", systems, frame_engine, frame, rows, loop)
        settings["frame"] = asdict(frame_engine) | {"sessions": frame[0].sessions}

    # 3. The upstream path: the same load through --engine upstream and an SSE server.
    if want("upstream"):
        run_systems("upstream", ["upstream"], frame_engine, frame, rows, loop)

    # 4. Capacity at 20 ms steps: the most sessions with gap p99 <= 30 ms.
    if want("capacity"):
        coarse = [100, 300] if quick else [200, 400, 600, 800, 1000, 1300, 1600, 2000]
        cap_base = replace(base, think=(0.0, 0.04))
        run_capacity(["bare", "gateway"], sweep_engine, cap_base, coarse, 50, rows, loop)
        settings["capacity"] = {
            **asdict(sweep_engine),
            "gap_limit_ms": GAP_LIMIT_MS,
            "coarse": coarse,
            "fine_step": 50,
        }

    # 5. Throughput: an engine that offers more tokens than one core can frame.
    if want("throughput"):
        tput_engine = Engine(step_ms=5, response_tokens=64)
        tput = [replace(base, sessions=100 if quick else 400, think=(0.0, 0.0))]
        run_systems("throughput", four, tput_engine, tput, rows, loop)
        settings["throughput"] = asdict(tput_engine)

    # 6. Saturated: the engine on a 2 ms clock, 400 streams: 200,000 tokens/s offered.
    if want("saturated"):
        sat_engine = Engine(step_ms=2, response_tokens=64)
        sat = [replace(base, sessions=100 if quick else 400, think=(0.0, 0.0))]
        systems = ["bare", "gateway", "gateway-nc", "bare", "gateway"]  # alternating, as above
        run_systems("saturated", systems, sat_engine, sat, rows, loop)
        settings["saturated"] = asdict(sat_engine) | {"sessions": sat[0].sessions}

    # 7. Cancel: each turn is cancelled after 1-8 delta frames.
    if want("cancel"):
        cancel_engine = Engine(step_ms=20, response_tokens=64)
        cancel = [replace(base, sessions=100, think=(0.0, 0.04), cancel_after=(1, 8))]
        run_systems("cancel", ["engine", "bare", "gateway"], cancel_engine, cancel, rows, loop)
        settings["cancel"] = asdict(cancel_engine)

    # 8. Open loop: Poisson arrivals at a fixed rate, each on a free session.
    if want("open"):
        open_loop = [replace(base, sessions=300, mode="open", rate=150.0)]
        run_systems("open", ["engine", "gateway"], sweep_engine, open_loop, rows, loop)

    # 9. Memory per idle session.
    if want("idle"):
        run_idle(["bare", "gateway"], 500 if quick else 5000, sweep_engine, rows, loop)

    # 10. Lanes: one Responses connection whose 16 lanes (stream_id l0..l15) each run
    #     turns back to back, against the same connection with 1 lane, and against 16
    #     connections of one lane each; 20 ms steps, so a lane's rate is the engine's
    #     (50 tokens/s) and what counts is whether 16 of them run at once. Two rounds,
    #     each a fresh gateway.
    lanes_engine = Engine(step_ms=20, response_tokens=64)
    if want("lanes"):
        one = replace(base, sessions=1, lanes=1, think=(0.0, 0.0))
        lanes = [one, replace(one, sessions=16, lanes=16), replace(one, sessions=16, lanes=0)]
        run_systems("lanes", ["responses"] * (1 if quick else 2), lanes_engine, lanes, rows, loop)
        settings["lanes"] = asdict(lanes_engine)

    # 11. The Responses API over HTTP: the frame load as one POST /v1/responses per turn
    #     (stream: true, keep-alive), beside the same requests over the Responses WebSocket
    #     and a FastAPI + uvicorn endpoint streaming the same events on the same clock.
    #     Every turn a new conversation (no previous_response_id, store: false), as an
    #     HTTP client without the store sends it. Alternating, twice each.
    fastapi = ["fastapi", "fastapi-httptools"] if httptools_installed() else ["fastapi"]
    if want("http"):
        http = [replace(frame[0], chain=False)]
        systems = ["responses", "http", *fastapi] * 2
        run_systems("http", systems, frame_engine, http, rows, loop)
        settings["http"] = asdict(frame_engine) | {"sessions": http[0].sessions}

    # 12. Requests per second: short non-streaming answers (8 tokens, the sim flat out),
    #     64 keep-alive connections sending back to back; the gateway's JSON Response
    #     against the FastAPI endpoint's.
    if want("rps"):
        rps_engine = Engine(step_ms=0, response_tokens=8)
        rps = [replace(base, sessions=64, think=(0.0, 0.0), stream=False, chain=False)]
        run_systems("rps", ["http", *fastapi] * 2, rps_engine, rps, rows, loop)
        settings["rps"] = asdict(rps_engine) | {"sessions": 64}

    # 13. Chat Completions: the HTTP load as POST /v1/chat/completions (stream: true with
    #     stream_options.include_usage), alternating with POST /v1/responses on the same
    #     clock, three times each; then the requests-per-second load as non-streaming chat
    #     requests, beside the FastAPI endpoint answering the same chat bodies.
    if want("chat"):
        http = [replace(frame[0], chain=False)]
        run_systems("chat", ["http", "chat"] * 3, frame_engine, http, rows, loop)
        settings["chat"] = asdict(frame_engine) | {"sessions": http[0].sessions}
    if want("chat-rps"):
        rps_engine = Engine(step_ms=0, response_tokens=8)
        rps = [replace(base, sessions=64, think=(0.0, 0.0), stream=False, chain=False)]
        chat_fastapi = [f"{name}-chat" for name in fastapi]
        run_systems("chat-rps", ["chat", *chat_fastapi] * 2, rps_engine, rps, rows, loop)
        settings["chat-rps"] = asdict(rps_engine) | {"sessions": 64}

    # 14. Completions: the same load as POST /v1/completions (a raw prompt, a
    #     text_completion chunk per token), alternating with Chat Completions on fresh
    #     processes, three times each; then n=4 choices per request against four times the
    #     requests with one each (the same tokens in flight), alternating, three times.
    if want("completions"):
        http = [replace(frame[0], chain=False)]
        run_systems("completions", ["chat", "completions"] * 3, frame_engine, http, rows, loop)
        settings["completions"] = asdict(frame_engine) | {"sessions": http[0].sessions}
    if want("choices"):
        one = replace(frame[0], chain=False)
        four = [replace(one, sessions=one.sessions // 4, choices=4), one]
        run_systems("choices", ["completions"] * 3, frame_engine, four, rows, loop)
        settings["choices"] = asdict(frame_engine) | {"sessions": one.sessions}

    settings |= {
        "quick": quick,
        "loop": loop,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    return {"rows": rows, "settings": settings}


def run_profiles(
    quick: bool, loop: str, out: Path, systems: Sequence[str] | None = None
) -> dict[str, str]:
    """py-spy under the one-token-per-frame load: the gateway on sim, on the upstream
    path, over SSE (POST /v1/responses), and the bare websockets server and FastAPI +
    uvicorn's SSE for comparison (or only ``systems``)."""
    from bench import pyspy

    if pyspy.executable() is None:
        log("no profiles: py-spy is not installed (pip install py-spy)")
        return {}
    engine = Engine(step_ms=0, response_tokens=100 if quick else 300)
    w = Workload(sessions=50 if quick else 200, think=(0.0, 0.0), duration=4.0 if quick else 10.0)
    fastapi = "fastapi-httptools" if httptools_installed() else "fastapi"
    chosen = systems or ("gateway", "upstream", "bare", "http", fastapi)
    return {system: profile(system, engine, w, loop, out) for system in chosen}


def merge(previous: dict[str, Any], fresh: dict[str, Any], ran: set[str]) -> dict[str, Any]:
    """``fresh`` rows of the scenarios in ``ran`` in place of ``previous``'s, the rest kept
    (each scenario's rows, its baselines with them, still come from one run)."""
    rows = [r for r in previous.get("rows", []) if r["scenario"] not in ran] + fresh["rows"]
    old, new = previous.get("settings", {}), fresh["settings"]
    # The header (when, how long, the load) stays the previous run's; each merged
    # scenario says its own.
    run_keys = ("wall_s", "finished_at", "load_avg", "load_avg_at_start", "quick")
    settings = old | {k: v for k, v in new.items() if k not in run_keys or k not in old}
    when = {k: new.get(k) for k in ("finished_at", "quick", "load_avg_at_start", "load_avg")}
    settings["merged"] = old.get("merged", {}) | dict.fromkeys(sorted(ran), when)
    merged = previous | {"rows": rows, "settings": settings}
    for key in ("warmup", "profiles"):
        if key in fresh:
            merged[key] = fresh[key]
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller set (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where results go")
    parser.add_argument(
        "--loop", choices=LOOPS, default=default_loop(), help="servers' and load generators' loop"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also sample the gateway with py-spy"
    )
    parser.add_argument(
        "--profile-only",
        action="store_true",
        help="only the profiles (latest.md and latest.json are left as they are)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=[*SCENARIOS, "warmup"],
        help="only this scenario (repeatable); its rows replace its old ones in latest.json",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the llama.cpp generate: false section (bench/warmup.py, about a minute)",
    )
    parser.add_argument(
        "--warmup-rounds", type=int, default=None, help="its rounds (default 5; --quick 2)"
    )
    args = parser.parse_args(argv)
    raise_nofile()  # inherited by every server and worker process
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.profile_only:
        run_profiles(args.quick, args.loop, args.out)
        return 0
    only = set(args.only) if args.only else None
    load_at_start = os.getloadavg()
    chosen = only - {"warmup"} if only is not None else None
    if chosen is None or chosen:
        results = standard(args.quick, args.loop, chosen)
    else:
        results = {"rows": [], "settings": {"quick": args.quick, "loop": args.loop}}
    results["settings"].update(
        wall_s=time.monotonic() - started,
        finished_at=time.strftime("%Y-%m-%d %H:%M"),
        load_avg=os.getloadavg()[0],
        load_avg_at_start=load_at_start[0],
    )
    if (only is None and not args.no_warmup) or (only is not None and "warmup" in only):
        from bench import warmup

        rounds = args.warmup_rounds or (2 if args.quick else 5)
        results["warmup"] = warmup.run(rounds, log=log)
    if args.profile:
        results["profiles"] = run_profiles(args.quick, args.loop, args.out)
    from bench.report import write_report

    previous = args.out / "latest.json"
    if only is not None and previous.exists():
        results = merge(json.loads(previous.read_text()), results, only)
        log(f"merged {', '.join(sorted(only))} into {previous}")
    write_report(results, args.out)
    log(f"done in {time.monotonic() - started:.0f}s: {args.out / 'latest.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
