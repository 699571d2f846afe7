"""Turn a run's rows into ``latest.md``, ``latest.json`` and ``latency.png``."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.stats import fmt, ratio

Row = dict[str, Any]

LABELS = {
    "engine": "bare engine",
    "bare": "bare websockets",
    "gateway": "gateway",
    "gateway-nc": "gateway --no-coalesce",
    "upstream": "gateway --engine upstream",
    "responses": "gateway, Responses WebSocket",
    "http": "gateway, POST /v1/responses",
    "fastapi": "minimal FastAPI + uvicorn (h11)",
    "fastapi-httptools": "minimal FastAPI + uvicorn (httptools)",
    "chat": "gateway, POST /v1/chat/completions",
    "completions": "gateway, POST /v1/completions",
    "fastapi-chat": "minimal FastAPI + uvicorn (h11), chat",
    "fastapi-httptools-chat": "minimal FastAPI + uvicorn (httptools), chat",
}


RPS_HEADER = [
    "system",
    "connections",
    "requests/s",
    "CPU (cores)",
    "CPU µs/request",
    "latency p50",
    "latency p99",
    "errors",
    "lost text",
    "other CPU",
]


def _rps_row(r: Row) -> list[Any]:
    return [
        label(r),
        r["sessions"],
        r["completed_s"],
        r["server_cpu_util"],
        r["cpu_us_per_request"],
        r["e2e_p50"],
        r["e2e_p99"],
        r["errors"] + r["timeouts"] + r["unfinished"] + r["refused"],
        r["text_mismatch"],
        r.get("other_cpu_util"),
    ]


def label(row: Row) -> str:
    """The system's name, with its loop when it is not the run's, and which run it was
    when a scenario runs it more than once."""
    name, _, loop = row["system"].partition("@")
    text = f"{LABELS[name]} ({loop})" if loop else LABELS[name]
    run = row.get("run", 1)
    return f"{text}, run {run}" if run > 1 else text


def _pick(rows: Sequence[Row], scenario: str, system: str, sessions: int | None = None) -> Row:
    for row in rows:
        same = row["scenario"] == scenario and row["system"] == system
        if same and (sessions is None or row["sessions"] == sessions):
            return row
    return {}


def _mean(rows: Sequence[Row], scenario: str, system: str, key: str) -> float:
    """``key`` averaged over every run of ``system`` in ``scenario`` (NaN if none)."""
    values = [r[key] for r in rows if r["scenario"] == scenario and r["system"] == system]
    return sum(values) / len(values) if values else math.nan


def _median(rows: Sequence[Row], scenario: str, system: str, key: str) -> float:
    values: list[float] = sorted(
        r[key] for r in rows if r["scenario"] == scenario and r["system"] == system
    )
    if not values:
        return math.nan
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _runs(rows: Sequence[Row], scenario: str, system: str) -> int:
    return sum(r["scenario"] == scenario and r["system"] == system for r in rows)


def capacity(rows: Sequence[Row], system: str) -> int | None:
    """The largest session count ``system`` passed in the capacity climb (None: not run)."""
    tried = [r for r in rows if r["scenario"] == "capacity" and r["system"] == system]
    if not tried:
        return None
    return max((r["sessions"] for r in tried if r["passed"]), default=0)


def _table(header: Sequence[str], body: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in line) + " |" for line in body]
    return [*lines, ""]


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def targets(rows: Sequence[Row], settings: dict[str, Any]) -> list[list[Any]]:
    """The issue's targets, each with the figure, its baseline and whether it was met."""
    out: list[list[Any]] = []
    ran = {r["scenario"] for r in rows}
    skip: list[tuple[int, int]] = []  # the targets of scenarios this run did not have
    block = (0, "")

    def mark(scenario: str) -> None:
        nonlocal block
        if block[1] and block[1] not in ran:
            skip.append((block[0], len(out)))
        block = (len(out), scenario)

    mark("frame")
    gw_tok = _mean(rows, "frame", "gateway", "tokens_s")
    bare_frames = _mean(rows, "frame", "bare", "delta_frames_s")
    x = ratio(gw_tok, bare_frames)
    runs = _runs(rows, "frame", "gateway")
    out.append(
        [
            "one token per frame (sim flat out): gateway tokens/s >= 0.8x bare frames/s",
            f"{fmt(gw_tok)} tokens/s ({fmt(_mean(rows, 'frame', 'gateway', 'tokens_per_frame'))}"
            f" tokens/frame, {fmt(_mean(rows, 'frame', 'gateway', 'cpu_us_per_token'))} µs "
            f"CPU/token; mean of {runs} runs)",
            f"bare websockets {fmt(bare_frames)} frames/s "
            f"({fmt(_mean(rows, 'frame', 'bare', 'cpu_us_per_token'))} µs CPU/frame): "
            f"**x{fmt(x)}**",
            _verdict(None if math.isnan(x) else x >= 0.8),
        ]
    )

    mark("capacity")
    cap_gw, cap_bare = capacity(rows, "gateway"), capacity(rows, "bare")
    limit = settings.get("capacity", {}).get("gap_limit_ms", 30.0)
    x = ratio(cap_gw, cap_bare)
    out.append(
        [
            f"capacity at 20 ms steps (gap p99 <= {fmt(limit, 0)} ms): gateway >= 1.0x bare",
            f"{fmt(cap_gw)} sessions",
            f"bare websockets {fmt(cap_bare)} sessions: **x{fmt(x)}**",
            _verdict(None if math.isnan(x) else x >= 1.0),
        ]
    )

    mark("ttft")
    eng, bw, gw = (_median(rows, "ttft", s, "ttft_p99") for s in ("engine", "bare", "gateway"))
    more = gw - bw
    out.append(
        [
            "added TTFT p99 at 100 sessions (20 ms steps): within 0.5 ms of bare's added",
            f"+{fmt(gw - eng)} ms over the bare engine (p99 {fmt(gw)} ms; medians of "
            f"{_runs(rows, 'ttft', 'gateway')} rounds)",
            f"bare websockets +{fmt(bw - eng)} ms (bare engine p99 {fmt(eng)} ms): "
            f"**{'+' if more >= 0 else ''}{fmt(more)} ms**",
            _verdict(None if math.isnan(more) else more <= 0.5),
        ]
    )

    mark("upstream")
    up = _pick(rows, "upstream", "upstream")
    x = ratio(up.get("tokens_s"), gw_tok)
    out.append(
        [
            "upstream path: >= 0.5x the tokens/s of the sim path at one token per frame",
            f"{fmt(up.get('tokens_s'))} tokens/s ({fmt(up.get('cpu_us_per_token'))} µs "
            f"CPU/token; the SSE server {fmt(up.get('upstream_cpu_util'))} cores)",
            f"gateway on sim {fmt(gw_tok)} tokens/s: **x{fmt(x)}**",
            _verdict(None if math.isnan(x) else x >= 0.5),
        ]
    )

    mark("idle")
    idle, idle_bare = _pick(rows, "idle", "gateway"), _pick(rows, "idle", "bare")
    kib = idle.get("kib_per_session", math.nan)
    out.append(
        [
            f"{fmt(idle.get('sessions'))} idle sessions: <= 20 KiB each",
            f"{fmt(kib)} KiB/session",
            f"bare websockets {fmt(idle_bare.get('kib_per_session'))} KiB",
            _verdict(None if math.isnan(kib) else kib <= 20),
        ]
    )

    mark("saturated")
    sat = settings.get("saturated", {})
    gw_tok = _mean(rows, "saturated", "gateway", "tokens_s")
    bare_frames = _mean(rows, "saturated", "bare", "delta_frames_s")
    x = ratio(gw_tok, bare_frames)
    out.append(
        [
            f"saturated ({fmt(sat.get('step_ms'), 0)} ms steps, {fmt(sat.get('sessions'))} "
            "streams): gateway tokens/s >= 1.5x bare frames/s",
            f"{fmt(gw_tok)} tokens/s "
            f"({fmt(_mean(rows, 'saturated', 'gateway', 'tokens_per_frame'))} tokens/frame), "
            f"gap p99 {fmt(_mean(rows, 'saturated', 'gateway', 'gap_p99'))} ms; mean of "
            f"{_runs(rows, 'saturated', 'gateway')} runs",
            f"bare websockets {fmt(bare_frames)} frames/s, gap p99 "
            f"{fmt(_mean(rows, 'saturated', 'bare', 'gap_p99'))} ms: **x{fmt(x)}**",
            _verdict(None if math.isnan(x) else x >= 1.5),
        ]
    )

    mark("cancel")
    step = settings.get("cancel", {}).get("step_ms", math.nan)
    gc, bc = _pick(rows, "cancel", "gateway"), _pick(rows, "cancel", "bare")
    p99 = gc.get("cancel_p99", math.nan)
    out.append(
        [
            f"cancel-to-done p99 < one step + 5 ms ({fmt(step + 5)} ms)",
            f"{fmt(p99)} ms",
            f"bare websockets {fmt(bc.get('cancel_p99'))} ms",
            _verdict(None if math.isnan(p99) else p99 < step + 5),
        ]
    )

    mark("sweep")
    big = max((r["sessions"] for r in rows if r["scenario"] == "sweep"), default=0)
    g = _pick(rows, "sweep", "gateway", big)
    if g:
        out.append(
            [
                f"{big} sessions streaming: no errors, no lost text",
                f"{g['completed']}/{g['turns']} completed, {g['errors']} errors, "
                f"{g['text_mismatch']} text mismatches",
                f"bare websockets {_pick(rows, 'sweep', 'bare', big).get('errors', '-')} errors",
                _verdict(clean_sweep(g, big)),
            ]
        )
    mark("")
    out = [line for k, line in enumerate(out) if not any(a <= k < b for a, b in skip)]
    return out + responses_targets(rows, settings)


def _values(rows: Sequence[Row], scenario: str, system: str, key: str, **match: Any) -> list[Any]:
    return [
        r[key]
        for r in rows
        if r["scenario"] == scenario
        and r["system"] == system
        and all(r.get(k, 0) == v for k, v in match.items())
    ]


def _avg(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _spread(values: Sequence[float], digits: int = 2) -> str:
    """``mean (min–max, N runs)``, or the one value."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{fmt(values[0], digits)} (1 run)"
    return (
        f"{fmt(_avg(values), digits)} ({fmt(min(values), digits)}–{fmt(max(values), digits)}, "
        f"{len(values)} runs)"
    )


def _paired(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[k] / b[k]`` of each round (the systems alternate: run k of one beside run k of
    the other)."""
    return [ratio(x, y) for x, y in zip(a, b, strict=False)]


def _ratio_cell(a: Sequence[float], b: Sequence[float]) -> tuple[float, str]:
    """The ratio of the means, and the range of the per-round ratios."""
    x = ratio(_avg(a), _avg(b))
    per_round = [v for v in _paired(a, b) if not math.isnan(v)]
    if len(per_round) > 1:
        return x, f"**x{fmt(x)}** (rounds x{fmt(min(per_round))}–x{fmt(max(per_round))})"
    return x, f"**x{fmt(x)}**"


def responses_targets(rows: Sequence[Row], settings: dict[str, Any]) -> list[list[Any]]:
    """The Responses API's targets: its WebSocket dialect beside the Realtime one, lanes,
    the warm-up on llama.cpp, SSE beside the WebSocket and beside FastAPI + uvicorn."""
    out: list[list[Any]] = []
    rt = _values(rows, "frame", "gateway", "cpu_us_per_token")
    rs = _values(rows, "frame", "responses", "cpu_us_per_token")
    if rt and rs:
        x, cell = _ratio_cell(rs, rt)
        out.append(
            [
                "one token per frame: Responses WebSocket CPU µs/token <= 1.1x the Realtime "
                "dialect's (same gateway)",
                f"{_spread(rs)} µs/token, "
                f"{fmt(_avg(_values(rows, 'frame', 'responses', 'tokens_s')))} tokens/s",
                f"Realtime {_spread(rt)} µs/token, "
                f"{fmt(_avg(_values(rows, 'frame', 'gateway', 'tokens_s')))} tokens/s: {cell}",
                _verdict(None if math.isnan(x) else x <= 1.1),
            ]
        )
    one = _values(rows, "lanes", "responses", "tokens_s", sessions=1, lanes=1)
    many = _values(rows, "lanes", "responses", "tokens_s", sessions=16, lanes=16)
    if one and many:
        x, cell = _ratio_cell(many, one)
        step = settings.get("lanes", {}).get("step_ms", math.nan)
        out.append(
            [
                f"16 lanes on one Responses connection ({fmt(step, 0)} ms steps): tokens/s "
                ">= 12x one lane's",
                f"{_spread(many, 0)} tokens/s",
                f"1 lane {_spread(one, 0)} tokens/s: {cell}",
                _verdict(None if math.isnan(x) else x >= 12),
            ]
        )
    ws = _values(rows, "http", "responses", "cpu_us_per_token")
    sse = _values(rows, "http", "http", "cpu_us_per_token")
    if ws and sse:
        x, cell = _ratio_cell(sse, ws)
        out.append(
            [
                "Responses over SSE (POST /v1/responses, stream: true): CPU µs/token <= 1.3x "
                "the Responses WebSocket's",
                f"{_spread(sse)} µs/token, "
                f"{fmt(_avg(_values(rows, 'http', 'http', 'tokens_s')))} tokens/s",
                f"WebSocket {_spread(ws)} µs/token, "
                f"{fmt(_avg(_values(rows, 'http', 'responses', 'tokens_s')))} tokens/s: {cell}",
                _verdict(None if math.isnan(x) else x <= 1.3),
            ]
        )
    for name in ("fastapi", "fastapi-httptools"):
        fa = _values(rows, "http", name, "cpu_us_per_token")
        if not (fa and sse):
            continue
        x, cell = _ratio_cell(fa, sse)
        out.append(
            [
                f"SSE: {LABELS[name]} uses >= 2x the gateway's CPU µs/token",
                f"gateway {_spread(sse)} µs/token",
                f"{LABELS[name]} {_spread(fa)} µs/token, "
                f"{fmt(_avg(_values(rows, 'http', name, 'tokens_s')))} tokens/s: {cell}",
                _verdict(None if math.isnan(x) else x >= 2),
            ]
        )
    gw = _values(rows, "rps", "http", "completed_s")
    for name in ("fastapi", "fastapi-httptools"):
        fa = _values(rows, "rps", name, "completed_s")
        if not (gw and fa):
            continue
        _, cell = _ratio_cell(gw, fa)
        out.append(
            [
                "short non-streaming answers (8 tokens, 64 keep-alive connections): "
                f"requests/s beside {LABELS[name]} (no target)",
                f"gateway {_spread(gw, 0)} requests/s, "
                f"{fmt(_avg(_values(rows, 'rps', 'http', 'cpu_us_per_request')), 0)} µs "
                "CPU/request",
                f"{LABELS[name]} {_spread(fa, 0)} requests/s, "
                f"{fmt(_avg(_values(rows, 'rps', name, 'cpu_us_per_request')), 0)} µs "
                f"CPU/request: {cell}",
                "n/a",
            ]
        )
    responses_sse = _values(rows, "chat", "http", "cpu_us_per_token")
    chat_sse = _values(rows, "chat", "chat", "cpu_us_per_token")
    if responses_sse and chat_sse:
        x, cell = _ratio_cell(chat_sse, responses_sse)
        out.append(
            [
                "Chat Completions SSE (stream: true, include_usage): CPU µs/token <= 1.1x "
                "Responses SSE's",
                f"{_spread(chat_sse)} µs/token, "
                f"{fmt(_avg(_values(rows, 'chat', 'chat', 'tokens_s')))} tokens/s",
                f"POST /v1/responses {_spread(responses_sse)} µs/token, "
                f"{fmt(_avg(_values(rows, 'chat', 'http', 'tokens_s')))} tokens/s: {cell}",
                _verdict(None if math.isnan(x) else x <= 1.1),
            ]
        )
    chat_sse = _values(rows, "completions", "chat", "cpu_us_per_token")
    completions_sse = _values(rows, "completions", "completions", "cpu_us_per_token")
    if chat_sse and completions_sse:
        x, cell = _ratio_cell(completions_sse, chat_sse)
        out.append(
            [
                "Completions SSE (stream: true, include_usage): CPU µs/token <= 1.1x "
                "Chat Completions SSE's",
                f"{_spread(completions_sse)} µs/token, "
                f"{fmt(_avg(_values(rows, 'completions', 'completions', 'tokens_s')))} tokens/s",
                f"POST /v1/chat/completions {_spread(chat_sse)} µs/token, "
                f"{fmt(_avg(_values(rows, 'completions', 'chat', 'tokens_s')))} tokens/s: {cell}",
                _verdict(None if math.isnan(x) else x <= 1.1),
            ]
        )
    n4 = _values(rows, "choices", "completions", "cpu_us_per_token", choices=4)
    n1 = _values(rows, "choices", "completions", "cpu_us_per_token", choices=1)
    if n4 and n1:
        _, cell = _ratio_cell(n4, n1)
        out.append(
            [
                "Completions n=4 (choices interleaved on one stream) beside four times the "
                "requests with one choice each: CPU µs/token (no target)",
                f"n=4 {_spread(n4)} µs/token",
                f"4 requests {_spread(n1)} µs/token: {cell}",
                "n/a",
            ]
        )
    gw = _values(rows, "chat-rps", "chat", "completed_s")
    for name in ("fastapi-chat", "fastapi-httptools-chat"):
        fa = _values(rows, "chat-rps", name, "completed_s")
        if not (gw and fa):
            continue
        _, cell = _ratio_cell(gw, fa)
        out.append(
            [
                "short non-streaming chat completions (8 tokens, 64 keep-alive connections): "
                f"requests/s beside {LABELS[name]} (no target)",
                f"gateway {_spread(gw, 0)} requests/s, "
                f"{fmt(_avg(_values(rows, 'chat-rps', 'chat', 'cpu_us_per_request')), 0)} µs "
                "CPU/request",
                f"{LABELS[name]} {_spread(fa, 0)} requests/s, "
                f"{fmt(_avg(_values(rows, 'chat-rps', name, 'cpu_us_per_request')), 0)} µs "
                f"CPU/request: {cell}",
                "n/a",
            ]
        )
    return out


def warmup_target(warmup: dict[str, Any]) -> list[Any] | None:
    summary = warmup.get("summary", {})
    if "ratio" not in summary:
        return None
    cold, warm, x = summary["cold"]["ttft_s"], summary["warm"]["ttft_s"], summary["ratio"]

    def ms(d: dict[str, float]) -> str:
        return (
            f"{fmt(1000 * d['median'], 0)} ms (median; {fmt(1000 * d['min'], 0)}–"
            f"{fmt(1000 * d['max'], 0)}, {d['n']} rounds)"
        )

    return [
        "generate: false on llama.cpp (~1,000-token prefix): warm TTFT <= 0.5x cold",
        f"warm {ms(warm)}, {fmt(summary['warm']['cached_tokens']['median'], 0)} prompt tokens "
        "cached",
        f"cold {ms(cold)}: **x{fmt(x['median'])}** (rounds x{fmt(x['min'])}–x{fmt(x['max'])})",
        _verdict(x["median"] <= 0.5),
    ]


def clean_sweep(g: Row, sessions: int) -> bool:
    return bool(
        g["errors"] == 0
        and g["text_mismatch"] == 0
        and g["unfinished"] == 0
        and g["connected"] == sessions
        and g["completed"] == g["turns"]
    )


def _rate_rows(rows: Sequence[Row], scenario: str, bare_frames: float) -> list[list[Any]]:
    """The common columns of the rate scenarios (frame, upstream, throughput, saturated)."""
    return [
        [
            label(r),
            r["loop"],
            r["sessions"],
            r["tokens_s"],
            r["delta_frames_s"],
            r["tokens_per_frame"],
            ratio(r["tokens_s"], bare_frames),
            r["server_cpu_util"],
            r["cpu_us_per_token"],
            r["ttft_p99"],
            r["gap_p50"],
            r["gap_p99"],
            r["gap_max"],
            r["errors"] + r["timeouts"] + r["unfinished"],
            r["text_mismatch"],
            r.get("other_cpu_util"),
        ]
        for r in rows
        if r["scenario"] == scenario
    ]


RATE_HEADER = [
    "system",
    "loop",
    "sessions",
    "tokens/s",
    "delta frames/s",
    "tokens/frame",
    "vs bare",
    "CPU (cores)",
    "CPU µs/token",
    "TTFT p99",
    "gap p50",
    "gap p99",
    "gap max",
    "errors",
    "lost text",
    "other CPU",
]


def markdown(results: dict[str, Any]) -> str:
    rows, settings = results["rows"], results["settings"]
    ran = {r["scenario"] for r in rows}
    loop = settings.get("loop", "asyncio")
    start = settings.get("load_avg_at_start")
    merged = settings.get("merged") or {}
    machine = (
        f"{settings.get('cpus', os.cpu_count())} CPUs, Python "
        f"{settings.get('python', sys.version.split()[0])}"
    )
    if merged and ran | ({"warmup"} if results.get("warmup") else set()) <= set(merged):
        # Every scenario was rerun on its own: the first run's time and load say nothing.
        times = sorted(m.get("finished_at") or "" for m in merged.values())
        when = (
            f"Each scenario run on its own (`--only`, {times[0]} to {times[-1]}; the time of "
            f"each under the targets) on {machine}"
            + (" (**--quick**)" if any(m.get("quick") for m in merged.values()) else "")
            + ". "
        )
    else:
        when = (
            f"Run {settings.get('finished_at', time.strftime('%Y-%m-%d %H:%M'))} on {machine}, "
            f"{settings['wall_s']:.0f} s in all"
            + (" (**--quick**)" if settings.get("quick") else "")
            + "; 1-minute load average "
            + (f"{start:.1f} at the start, " if start is not None else "")
            + f"{settings.get('load_avg', os.getloadavg()[0]):.1f} at the end"
            + ("; scenarios rerun since are listed under the targets" if merged else "")
            + ". "
        )
    lines = [
        "# Benchmark results",
        "",
        when + f"Every server and load generator runs on **{loop}** unless its row says otherwise. "
        "Servers and load generators share these CPUs; see docs/performance.md. CPU µs/token "
        "is the serving process's CPU over the window per token delivered (for the bare "
        "engine: its process, load generator included). *Other CPU* is the machine's busy "
        "CPU over the window (in cores) minus the benchmark's own processes: work that was "
        "not the benchmark's (other users, kernel threads); a row with much of it was "
        "measured on a busy machine.",
        "",
        "## Targets",
        "",
    ]
    goals = targets(rows, settings)
    warm = warmup_target(results.get("warmup") or {})
    goals += [warm] if warm else []
    lines += _table(["target", "measured", "baseline (same run)", "verdict"], goals)
    if merged:
        lines += [
            "Scenarios run on their own (`--only`), each with its baselines: "
            + "; ".join(
                f"{name} {m.get('finished_at')}" + (" (--quick)" if m.get("quick") else "")
                for name, m in sorted(merged.items())
            )
            + ".",
            "",
        ]

    if "sweep" in ran:
        sw = settings["sweep"]
        lines += [
            "## Latency against load (closed loop)",
            "",
            f"Sim engine: {sw['step_ms']:g} ms steps, {sw['response_tokens']}-token answers; each "
            "session pauses 0-40 ms between turns. Times in ms; *added* is the percentile minus "
            "the bare engine's at the same load.",
            "",
        ]
        body = []
        for r in (r for r in rows if r["scenario"] == "sweep"):
            eng = _pick(rows, "sweep", "engine", r["sessions"])
            added = (
                r["ttft_p99"] - eng.get("ttft_p99", math.nan) if r["system"] != "engine" else None
            )
            body.append(
                [
                    r["sessions"],
                    label(r),
                    r["turns"],
                    r["ttft_p50"],
                    r["ttft_p90"],
                    r["ttft_p99"],
                    added,
                    r["gap_p50"],
                    r["gap_p99"],
                    r["e2e_p99"],
                    r["tokens_s"],
                    r["tokens_per_frame"],
                    r["cpu_us_per_token"],
                    r["errors"] + r["timeouts"] + r["unfinished"],
                    r["text_mismatch"],
                    r.get("other_cpu_util"),
                ]
            )
        lines += _table(
            [
                "sessions",
                "system",
                "turns",
                "TTFT p50",
                "p90",
                "p99",
                "added p99",
                "gap p50",
                "gap p99",
                "e2e p99",
                "tokens/s",
                "tokens/frame",
                "CPU µs/token",
                "errors",
                "lost text",
                "other CPU",
            ],
            body,
        )

    if "ttft" in ran:
        lines += [
            "## Time to first token at 100 sessions",
            "",
            "The sweep's 100-session point again, engine, bare websockets and gateway taking "
            "turns (fresh processes each round); the target compares the medians of the p99s.",
            "",
        ]
        body = [
            [
                r.get("run", 1),
                label(r).partition(", run")[0],
                r["turns"],
                r["ttft_p50"],
                r["ttft_p99"],
                r["ttft_p99"] - _median(rows, "ttft", "engine", "ttft_p99"),
                r["gap_p99"],
                r["cpu_us_per_token"],
                r.get("other_cpu_util"),
            ]
            for r in rows
            if r["scenario"] == "ttft"
        ]
        lines += _table(
            [
                "round",
                "system",
                "turns",
                "TTFT p50",
                "TTFT p99",
                "added p99 (vs median engine)",
                "gap p99",
                "CPU µs/token",
                "other CPU",
            ],
            body,
        )

    if "frame" in ran or "upstream" in ran:
        fr = settings.get("frame", {})
        bare = _pick(rows, "frame", "bare").get("delta_frames_s", math.nan)
        lines += [
            "## One token per frame, and the upstream path",
            "",
            f"The sim engine flat out (`--sim-step-ms 0`: a step per loop turn), "
            f"{fmt(fr.get('sessions'))} sessions x {fmt(fr.get('response_tokens'))}-token answers, "
            "no pause between turns; the gateway coalesces as by default (it merges when a socket "
            "pushes back or when it falls behind the engine; a step per loop turn gives each batch "
            "one token per stream, so tokens/frame stays near 1). The bare server sends each token "
            "as its own frame as fast as its loop turns. *vs bare* divides by the bare "
            f"server's delta frames/s on {loop}. The upstream row is the same load through "
            "`--engine upstream` in front of bench/sse_server.py (one token per SSE chunk, all "
            "streams advancing a token per loop turn); its *upstream CPU* is the SSE server's. "
            "The Responses WebSocket rows are the same gateway with the client on "
            "`/v1/responses`: a `response.create` per turn continuing the previous response "
            "(`previous_response_id`, `store: false`), so the conversation grows as the "
            "Realtime one does; bare, Realtime and Responses alternate.",
            "",
        ]
        body = _rate_rows(rows, "frame", bare) + _rate_rows(rows, "upstream", bare)
        lines += _table(RATE_HEADER, body)
        up = _pick(rows, "upstream", "upstream")
        if up:
            lines += [
                f"SSE server: {fmt(up.get('upstream_cpu_util'))} cores, "
                f"{fmt(up.get('upstream_cpu_us_per_token'))} µs CPU/token.",
                "",
            ]

    if "capacity" in ran:
        cap = settings.get("capacity", {})
        lines += [
            "## Capacity",
            "",
            "How many sessions stream with inter-token gap p99 <= "
            f"{fmt(cap.get('gap_limit_ms'), 0)} ms (and no error, no lost text): sim engine at "
            f"{fmt(cap.get('step_ms'), 0)} ms steps, {fmt(cap.get('response_tokens'))}-token "
            "answers, 0-40 ms pauses. Each system climbs"
            f" {', '.join(str(n) for n in cap.get('coarse', []))} sessions until a count "
            f"fails, then from the last pass in steps of {fmt(cap.get('fine_step'))} until one "
            "fails; its capacity is the largest passing count.",
            "",
        ]
        lines += _table(
            ["system", "capacity (sessions)"],
            [
                [LABELS[s], capacity(rows, s)]
                for s in ("bare", "gateway")
                if capacity(rows, s) is not None
            ],
        )
        body = [
            [
                label(r),
                r["sessions"],
                r["gap_p50"],
                r["gap_p99"],
                r["ttft_p99"],
                r["tokens_s"],
                r["tokens_per_frame"],
                r["server_cpu_util"],
                r["cpu_us_per_token"],
                r["errors"] + r["timeouts"] + r["unfinished"] + r["text_mismatch"],
                r.get("other_cpu_util"),
                "pass" if r["passed"] else "fail",
            ]
            for r in rows
            if r["scenario"] == "capacity"
        ]
        lines += _table(
            [
                "system",
                "sessions",
                "gap p50",
                "gap p99",
                "TTFT p99",
                "tokens/s",
                "tokens/frame",
                "CPU (cores)",
                "CPU µs/token",
                "errors",
                "other CPU",
                "verdict",
            ],
            body,
        )

    for scenario, title, words in (
        (
            "throughput",
            "Throughput",
            "the engine offers more tokens than one core can frame one by one",
        ),
        (
            "saturated",
            "Saturated",
            "the engine on a 2 ms clock offers far more than any of them can send one token a "
            "frame: what counts is what arrives, merged losslessly, and how long the gaps get",
        ),
    ):
        if scenario not in ran:
            continue
        eng = settings.get(scenario, {})
        bare = _pick(rows, scenario, "bare").get("delta_frames_s", math.nan)
        sessions = _pick(rows, scenario, "bare").get("sessions")
        lines += [
            f"## {title}",
            "",
            f"Sim engine: {fmt(eng.get('step_ms'), 0)} ms steps, "
            f"{fmt(eng.get('response_tokens'))}-token answers, {fmt(sessions)} sessions, no pause "
            f"between turns: {words}. *vs bare* divides by the bare server's delta frames/s "
            "(one token per frame). A server that sends a late step's tokens back to back has "
            "mostly zero gaps and a few long ones, so its gap p99 can fall among the zeros: "
            "read it with the gap max.",
            "",
        ]
        lines += _table(RATE_HEADER, _rate_rows(rows, scenario, bare))

    if "cancel" in ran:
        ca = settings["cancel"]
        lines += [
            "## Cancel",
            "",
            f"{ca['step_ms']:g} ms steps; every turn sends `response.cancel` after 1-8 delta "
            "frames. Time from sending the cancel to receiving `response.done`, in ms "
            "(TTFT and gap: of the same turns, before their cancel).",
            "",
        ]
        body = [
            [
                label(r),
                r["sessions"],
                r["cancelled"],
                r["completed"],
                r["cancel_p50"],
                r["cancel_p90"],
                r["cancel_p99"],
                r["cancel_max"],
                r["ttft_p99"],
                r["gap_p99"],
                r["errors"] + r["timeouts"],
                r["text_mismatch"],
            ]
            for r in rows
            if r["scenario"] == "cancel"
        ]
        lines += _table(
            [
                "system",
                "sessions",
                "cancelled",
                "completed first",
                "p50",
                "p90",
                "p99",
                "max",
                "TTFT p99",
                "gap p99",
                "errors",
                "lost text",
            ],
            body,
        )

    if "open" in ran:
        lines += [
            "## Open loop",
            "",
            "Poisson arrivals, each taking a free session (sweep engine settings).",
            "",
        ]
        body = [
            [
                label(r),
                r["rate"],
                r["turns"],
                r["dropped_arrivals"],
                r["ttft_p50"],
                r["ttft_p99"],
                r["gap_p99"],
                r["e2e_p99"],
                r["errors"] + r["timeouts"],
            ]
            for r in rows
            if r["scenario"] == "open"
        ]
        lines += _table(
            [
                "system",
                "arrivals/s",
                "turns",
                "dropped",
                "TTFT p50",
                "TTFT p99",
                "gap p99",
                "e2e p99",
                "errors",
            ],
            body,
        )

    if "idle" in ran:
        lines += [
            "## Memory per idle session",
            "",
            "RSS of the server process before and while "
            "the sessions are connected (each has received `session.created`).",
            "",
        ]
        body = [
            [
                label(r),
                r["connected"],
                r["rss_before_mib"],
                r["rss_after_mib"],
                r["kib_per_session"],
            ]
            for r in rows
            if r["scenario"] == "idle"
        ]
        lines += _table(
            ["system", "sessions", "RSS before MiB", "RSS after MiB", "KiB / session"], body
        )

    lines += responses_sections(results)
    lines += ["![latency against load](latency.png)", ""]
    profiles = results.get("profiles") or {}
    if profiles:
        lines += [
            "## Profiles",
            "",
            "py-spy sampling the server process (200 Hz) over a one-token-per-frame window "
            "run for the purpose (not the measured one: sampling pauses the process for each "
            "stack); the top of each view, the whole of it in `profile-frame-*.txt` (not "
            "committed). Time in C (the send syscall, orjson, uvloop) is charged to the Python "
            "line that called it.",
            "",
        ]
        for text in profiles.values():
            lines += ["```", *_head_of_views(text, 10), "```", ""]
    return "\n".join(lines)


def _lanes_label(r: Row) -> str:
    def many(n: int, word: str) -> str:
        return f"{n} {word}{'s' if n > 1 else ''}"

    if r.get("lanes"):
        return f"{many(r['sessions'] // r['lanes'], 'connection')}, {many(r['lanes'], 'lane')}"
    return f"{many(r['sessions'], 'connection')}, 1 lane each"


def responses_sections(results: dict[str, Any]) -> list[str]:
    """The Responses API's tables: lanes, SSE beside the WebSocket and FastAPI, requests
    per second, and the warm-up on llama.cpp."""
    rows, settings = results["rows"], results["settings"]
    lines: list[str] = []
    lanes = [r for r in rows if r["scenario"] == "lanes"]
    if lanes:
        eng = settings.get("lanes", {})
        lines += [
            "## Lanes on one Responses connection",
            "",
            f"Sim engine at {fmt(eng.get('step_ms'), 0)} ms steps, "
            f"{fmt(eng.get('response_tokens'))}-token answers. One connection whose lanes "
            "(`stream_id` l0, l1, ...) each run turns back to back, every lane continuing its "
            "own previous response; the same connection with one lane; and, for comparison, "
            "as many connections of one (unnamed) lane each. A lane streams at the engine's "
            "pace (one token per step), so 16 lanes reach 16x one lane only if they all run at "
            "once. *vs 1 lane* divides by the one-lane row of the same gateway process.",
            "",
        ]
        body = []
        for r in lanes:
            one: Row = next(
                (
                    x
                    for x in lanes
                    if x.get("run") == r.get("run") and x.get("lanes") == 1 and x["sessions"] == 1
                ),
                {},
            )
            body.append(
                [
                    r.get("run", 1),
                    _lanes_label(r),
                    r["tokens_s"],
                    ratio(r["tokens_s"], one.get("tokens_s")),
                    r["completed"],
                    r["ttft_p50"],
                    r["ttft_p99"],
                    r["gap_p50"],
                    r["gap_p99"],
                    r["cpu_us_per_token"],
                    r["errors"] + r["timeouts"] + r["unfinished"],
                    r["text_mismatch"],
                    r.get("other_cpu_util"),
                ]
            )
        lines += _table(
            [
                "round",
                "shape",
                "tokens/s",
                "vs 1 lane",
                "turns completed",
                "TTFT p50",
                "TTFT p99",
                "gap p50",
                "gap p99",
                "CPU µs/token",
                "errors",
                "lost text",
                "other CPU",
            ],
            body,
        )
    http = [r for r in rows if r["scenario"] == "http"]
    if http:
        eng = settings.get("http", {})
        ws = _avg(_values(rows, "http", "responses", "tokens_s"))
        lines += [
            "## The Responses API over HTTP (SSE), beside the WebSocket and FastAPI + uvicorn",
            "",
            f"The one-token-per-frame load ({fmt(eng.get('sessions'))} sessions x "
            f"{fmt(eng.get('response_tokens'))}-token answers, the sim flat out, no pause) as "
            "one request per turn, each a new conversation (`store: false`, no "
            "`previous_response_id`): over the Responses WebSocket; as `POST /v1/responses` "
            "with `stream: true` on keep-alive HTTP/1.1 connections (one SSE event, and one "
            "HTTP chunk, per token); and against bench/baselines/fastapi_server.py, a "
            "minimal FastAPI + uvicorn app answering the same events and words from a plain "
            "generator (orjson, no validation, no access log), with uvicorn's h11 parser "
            "(the gateway's own) and, where installed, httptools. Each alternates, twice. "
            "*vs WS* divides tokens/s by the WebSocket rows' mean; the load generator's own "
            "HTTP client reads the events (bench/loadgen.py, `HttpSession`).",
            "",
        ]
        header = [*RATE_HEADER]
        header[header.index("vs bare")] = "vs WS"
        lines += _table(header, _rate_rows(rows, "http", ws))
    for scenario, route, body_kind in (
        ("rps", "POST /v1/responses", "a JSON `Response`"),
        ("chat-rps", "POST /v1/chat/completions", "one `chat.completion`"),
    ):
        rps = [r for r in rows if r["scenario"] == scenario]
        if not rps:
            continue
        eng = settings.get(scenario, {})
        lines += [
            f"## Short non-streaming answers: requests per second, {route}",
            "",
            f"`{route}` with `stream: false` ({body_kind}), "
            f"{fmt(eng.get('response_tokens'))}-token answers of the sim flat out, "
            f"{fmt(eng.get('sessions'))} keep-alive connections each sending its next request "
            "as soon as the answer is in; the gateway against the FastAPI + uvicorn endpoint "
            "(the same answers to the same bodies, on the same clock). Times in ms.",
            "",
        ]
        lines += _table(RPS_HEADER, [_rps_row(r) for r in rps])
    chat = [r for r in rows if r["scenario"] == "chat"]
    if chat:
        eng = settings.get("chat", {})
        responses = _avg(_values(rows, "chat", "http", "tokens_s"))
        lines += [
            "## Chat Completions over SSE, beside the Responses API's",
            "",
            f"The HTTP load ({fmt(eng.get('sessions'))} keep-alive connections x "
            f"{fmt(eng.get('response_tokens'))}-token answers, the sim flat out, no pause) "
            "as `POST /v1/chat/completions` with `stream: true` and "
            "`stream_options.include_usage` (a `data:` chunk per token), alternating with "
            "`POST /v1/responses` (`stream: true`) on fresh gateway processes, three times each. "
            "*vs Responses* divides tokens/s by the Responses rows' mean.",
            "",
        ]
        header = [*RATE_HEADER]
        header[header.index("vs bare")] = "vs Responses"
        lines += _table(header, _rate_rows(rows, "chat", responses))
    warm = results.get("warmup") or {}
    if warm.get("runs"):
        lines += [
            "## generate: false on llama.cpp",
            "",
            "bench/warmup.py: a gateway on its default engine (llama.cpp, the bundled SmolLM2 "
            f"model, loaded in {fmt(warm.get('model_load_s'), 1)} s), a prefix of about 1,000 "
            "tokens (a text made from a seed, its own each round and arm). *cold*: on a new "
            "connection, one `response.create` with the prefix and a short question; *warm*: on "
            "another new connection, `generate: false` with the prefix (*prefill*: until its "
            "`response.completed`), then the question alone with `previous_response_id`. Time "
            "to first token from sending that `response.create` to its first delta, "
            "`temperature: 0`, 8 output tokens; the arms alternate which goes first. *cached* "
            "is the answer's `input_tokens_details.cached_tokens`.",
            "",
        ]
        body = [
            [
                r["round"],
                r["arm"],
                1000 * r["ttft_s"],
                1000 * r["total_s"],
                r["input_tokens"],
                r["cached_tokens"],
                r.get("prefill_s"),
            ]
            for r in warm["runs"]
        ]
        lines += _table(
            [
                "round",
                "arm",
                "TTFT ms",
                "answer ms",
                "prompt tokens",
                "cached",
                "prefill s",
            ],
            body,
        )
    return lines


def _head_of_views(text: str, per_view: int) -> list[str]:
    """The title and the first ``per_view`` lines of each view of a py-spy summary."""
    out: list[str] = []
    taken = 0
    for line in text.splitlines():
        if line.startswith("#"):
            out.append(line)
            taken = 0
        elif line and taken < per_view and not line.lstrip().startswith(("100.0 ", "99.9 ")):
            out.append(line)
            taken += 1
    return out


def chart(rows: Sequence[Row], path: Path) -> None:
    """TTFT p50/p99 and inter-delta gap p99 against concurrent sessions, per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    sweep = [r for r in rows if r["scenario"] == "sweep"]
    systems = [s for s in LABELS if any(r["system"] == s for r in sweep)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("ttft_p50", "TTFT p50"),
        ("ttft_p99", "TTFT p99"),
        ("gap_p99", "inter-delta gap p99"),
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        for system in systems:
            points = sorted((r["sessions"], r[key]) for r in sweep if r["system"] == system)
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], marker="o", label=LABELS[system]
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    loop = next((r.get("loop") for r in sweep), None)
    fig.suptitle(f"Latency against load (sim engine, closed loop, {loop or 'asyncio'})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Redraw the report from ``latest.json`` (``python -m bench.report [DIR]``)."""
    import sys

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results"
    write_report(json.loads((out / "latest.json").read_text()), out)


def write_report(results: dict[str, Any], out: Path) -> None:
    (out / "latest.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "latest.md").write_text(markdown(results))
    if any(r["scenario"] == "sweep" for r in results["rows"]):  # else the old chart stays
        chart(results["rows"], out / "latency.png")


if __name__ == "__main__":
    main()
