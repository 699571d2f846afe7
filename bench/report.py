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
}


def _pick(rows: Sequence[Row], scenario: str, system: str, sessions: int | None = None) -> Row:
    for row in rows:
        same = row["scenario"] == scenario and row["system"] == system
        if same and (sessions is None or row["sessions"] == sessions):
            return row
    return {}


def _table(header: Sequence[str], body: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in line) + " |" for line in body]
    return [*lines, ""]


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def targets(rows: Sequence[Row], settings: dict[str, Any]) -> list[list[Any]]:
    """The issue's targets, each with the figure, its baseline and whether it was met."""
    out: list[list[Any]] = []
    bare = _pick(rows, "throughput", "bare").get("delta_frames_s", math.nan)
    tok = _pick(rows, "throughput", "gateway").get("tokens_s", math.nan)
    out.append(
        [
            "gateway tokens/s >= bare websockets frames/s",
            f"{fmt(tok)} tok/s",
            f"{fmt(bare)} frames/s (x{fmt(ratio(tok, bare))})",
            _verdict(None if math.isnan(tok) else tok >= bare),
        ]
    )
    gw, eng = _pick(rows, "sweep", "gateway", 100), _pick(rows, "sweep", "engine", 100)
    added = gw.get("ttft_p99", math.nan) - eng.get("ttft_p99", math.nan)
    out.append(
        [
            "added TTFT p99 < 2 ms at 100 sessions",
            f"+{fmt(added)} ms (gateway p99 {fmt(gw.get('ttft_p99'))} ms)",
            f"bare engine p99 {fmt(eng.get('ttft_p99'))} ms",
            _verdict(None if math.isnan(added) else added < 2),
        ]
    )
    step = settings["cancel"]["step_ms"]
    gc, ec = _pick(rows, "cancel", "gateway"), _pick(rows, "cancel", "engine")
    p99 = gc.get("cancel_p99", math.nan)
    out.append(
        [
            f"cancel-to-done p99 < one step + 5 ms ({fmt(step + 5)} ms)",
            f"{fmt(p99)} ms",
            f"bare engine {fmt(ec.get('cancel_p99'), 3)} ms",
            _verdict(None if math.isnan(p99) else p99 < step + 5),
        ]
    )
    big = max((r["sessions"] for r in rows if r["scenario"] == "sweep"), default=0)
    g = _pick(rows, "sweep", "gateway", big)
    if g:
        clean = (
            g["errors"] == 0
            and g["text_mismatch"] == 0
            and g["unfinished"] == 0
            and g["connected"] == big
            and g["completed"] == g["turns"]
        )
        out.append(
            [
                f"{big} sessions streaming: no errors, no lost text",
                f"{g['completed']}/{g['turns']} completed, {g['errors']} errors, "
                f"{g['text_mismatch']} text mismatches",
                f"bare websockets {_pick(rows, 'sweep', 'bare', big).get('errors', '-')} errors",
                _verdict(clean),
            ]
        )
    idle = _pick(rows, "idle", "gateway")
    if idle:
        kib = idle["kib_per_session"]
        out.append(
            [
                f"{idle['sessions']} idle sessions < 30 KiB each",
                f"{fmt(kib)} KiB/session",
                f"bare websockets {fmt(_pick(rows, 'idle', 'bare').get('kib_per_session'))} KiB",
                _verdict(kib < 30),
            ]
        )
    return out


def markdown(results: dict[str, Any]) -> str:
    rows, settings = results["rows"], results["settings"]
    lines = [
        "# Benchmark results",
        "",
        f"Run {settings.get('finished_at', time.strftime('%Y-%m-%d %H:%M'))} on "
        f"{settings['cpus']} CPUs, Python {settings['python']}, {settings['wall_s']:.0f} s in all"
        + (" (**--quick**)" if settings["quick"] else "")
        + f"; 1-minute load average at the end {settings.get('load_avg', os.getloadavg()[0]):.1f}. "
        "Servers and load generators share these CPUs; see docs/performance.md.",
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
        "session pauses 0-40 ms between turns. Times in ms; *added* is the gateway's "
        "percentile minus the bare engine's at the same load.",
        "",
    ]
    body = []
    for r in (r for r in rows if r["scenario"] == "sweep"):
        eng = _pick(rows, "sweep", "engine", r["sessions"])
        added = r["ttft_p99"] - eng.get("ttft_p99", math.nan) if r["system"] != "engine" else None
        body.append(
            [
                r["sessions"],
                LABELS[r["system"]],
                r["turns"],
                r["ttft_p50"],
                r["ttft_p90"],
                r["ttft_p99"],
                added,
                r["gap_p50"],
                r["gap_p99"],
                r["e2e_p99"],
                r["tokens_s"],
                r["delta_frames_s"],
                r["cpu_ms_per_1k_tokens"],
                r["errors"] + r["timeouts"] + r["unfinished"],
                r["text_mismatch"],
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
            "delta frames/s",
            "CPU ms / 1k tok",
            "errors",
            "lost text",
        ],
        body,
    )

    tp = settings["throughput"]
    bare = _pick(rows, "throughput", "bare").get("delta_frames_s", math.nan)
    lines += [
        "## Throughput",
        "",
        f"Sim engine: {tp['step_ms']:g} ms steps, {tp['response_tokens']}-token answers, "
        "no pause between turns: the engine offers more tokens than one core can frame. "
        "*vs bare* divides by the bare server's delta frames/s (one token per frame). CPU is "
        "the server process's (for the bare engine: its process, load generator included).",
        "",
    ]
    body = [
        [
            LABELS[r["system"]],
            r["sessions"],
            r["tokens_s"],
            r["delta_frames_s"],
            r["tokens_per_frame"],
            ratio(r["tokens_s"], bare),
            r["server_cpu_util"],
            r["cpu_ms_per_1k_tokens"],
            r["ttft_p99"],
            r["gap_p99"],
            r["errors"] + r["timeouts"],
            r["text_mismatch"],
        ]
        for r in rows
        if r["scenario"] == "throughput"
    ]
    lines += _table(
        [
            "system",
            "sessions",
            "tokens/s",
            "delta frames/s",
            "tokens/frame",
            "vs bare",
            "CPU (cores)",
            "CPU ms / 1k tok",
            "TTFT p99",
            "gap p99",
            "errors",
            "lost text",
        ],
        body,
    )

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
            LABELS[r["system"]],
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
            LABELS[r["system"]],
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
            LABELS[r["system"]],
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
    return "\n".join(lines)


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
    fig.suptitle("Latency against load (sim engine, closed loop)")
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
