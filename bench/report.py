"""Turn a run's rows into ``latest.md``, ``latest.json`` and ``latency.png``."""

from __future__ import annotations

import json
import math
import os
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
}


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

    step = settings["cancel"]["step_ms"]
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
    return out


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
    loop = settings.get("loop", "asyncio")
    start = settings.get("load_avg_at_start")
    lines = [
        "# Benchmark results",
        "",
        f"Run {settings.get('finished_at', time.strftime('%Y-%m-%d %H:%M'))} on "
        f"{settings['cpus']} CPUs, Python {settings['python']}, {settings['wall_s']:.0f} s in all"
        + (" (**--quick**)" if settings["quick"] else "")
        + "; 1-minute load average "
        + (f"{start:.1f} at the start, " if start is not None else "")
        + f"{settings.get('load_avg', os.getloadavg()[0]):.1f} at the end. "
        f"Every server and load generator runs on **{loop}** unless its row says otherwise. "
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
    lines += _table(
        ["target", "measured", "baseline (same run)", "verdict"], targets(rows, settings)
    )

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
        added = r["ttft_p99"] - eng.get("ttft_p99", math.nan) if r["system"] != "engine" else None
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
        "streams advancing a token per loop turn); its *upstream CPU* is the SSE server's.",
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

    cap = settings.get("capacity", {})
    lines += [
        "## Capacity",
        "",
        f"How many sessions stream with inter-token gap p99 <= {fmt(cap.get('gap_limit_ms'), 0)}"
        f" ms (and no error, no lost text): sim engine at {fmt(cap.get('step_ms'), 0)} ms "
        f"steps, {fmt(cap.get('response_tokens'))}-token answers, 0-40 ms pauses. Each system "
        f"climbs {', '.join(str(n) for n in cap.get('coarse', []))} sessions until a count "
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
    chart(results["rows"], out / "latency.png")


if __name__ == "__main__":
    main()
