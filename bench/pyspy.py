"""Sampling profiles of a running server with py-spy, summarised as text.

py-spy samples the process from outside (no tracing hooks in the measured
process, unlike cProfile), so the profile shows the gateway as it runs in the
benchmark. ``record`` writes py-spy's raw (collapsed) stacks; ``summarise``
turns them into three views: own time by area (the innermost Python frame's
module: what code the CPU was in), own time by function, and inclusive time by
function (a function counted once per sample it is on the stack of). Time spent
in C (a send syscall, orjson, uvloop's loop) is charged to the Python line that
called it. Samples of an idle thread (waiting in epoll) are left out, so the
percentages are of the time the process was busy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path


def executable() -> str | None:
    """py-spy beside this interpreter (the bench extra installs it), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def record(
    pid: int, seconds: float, out: Path, rate: int = 200, *, nonblocking: bool = False
) -> subprocess.Popen[bytes]:
    """Start sampling ``pid`` for ``seconds`` into ``out`` (raw format); returns py-spy's process.

    By default py-spy pauses the process for each sample (tens of microseconds), so
    every stack is read whole; ``nonblocking`` reads it while it runs (no pause, but
    a stack read mid-change can be charged to the wrong function).
    """
    binary = executable()
    if binary is None:
        raise RuntimeError("py-spy is not installed: pip install py-spy")
    argv = [binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds)))]
    argv += ["--rate", str(rate), "--format", "raw", "--output", str(out)]
    if nonblocking:
        argv.append("--nonblocking")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _frames(stack: str) -> list[tuple[str, str]]:
    """``func (path:line);...`` -> [(function, path), ...], outermost first."""
    out = []
    for frame in stack.split(";"):
        name, _, where = frame.rpartition(" (")
        path = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
        out.append((name or frame, path))
    return out


def area(path: str) -> str:
    """What a source file belongs to, for the by-area view."""
    parts = path.replace("\\", "/").split("/")
    for package in ("gateway", "sessions", "bench"):
        if package in parts[:-1]:
            index = len(parts) - 1 - parts[::-1].index(package)
            return "/".join(parts[index:])
    for package, label in (
        ("websockets", "websockets"),
        ("httpx", "httpx (HTTP client)"),
        ("httpcore", "httpcore (HTTP client)"),
        ("h11", "h11 (HTTP/1.1 parser)"),
        ("anyio", "anyio"),
        ("prometheus_client", "prometheus_client"),
        ("asyncio", "asyncio"),
    ):
        if package in parts:
            return label
    return parts[-1] or path


def _short(function: str, path: str) -> str:
    return f"{function} ({area(path)})"


def summarise(raw: str, *, top: int = 20, title: str = "") -> str:
    """Three tables (by area, own by function, inclusive by function) as text."""
    own_area: Counter[str] = Counter()
    own_func: Counter[str] = Counter()
    incl_func: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = _frames(stack)
        if not frames:
            continue
        total += count
        leaf_function, leaf_path = frames[-1]
        own_area[area(leaf_path)] += count
        own_func[_short(leaf_function, leaf_path)] += count
        for name in {_short(f, p) for f, p in frames}:
            incl_func[name] += count
    if not total:
        return f"# {title}\n(no samples: could py-spy attach?)\n"
    lines = [f"# {title}", f"# {total} busy samples (idle ones left out)", ""]
    lines += _section(
        "own time by area (the innermost Python frame's module)", own_area, total, top
    )
    lines += _section("own time by function", own_func, total, top)
    # What is on every stack (the interpreter's entry, the loop's run) says nothing.
    incl_func = Counter({name: n for name, n in incl_func.items() if n < 0.995 * total})
    lines += _section("inclusive time by function", incl_func, total, top)
    return "\n".join(lines) + "\n"


def _section(heading: str, counts: Counter[str], total: int, top: int) -> Iterable[str]:
    yield f"## {heading}"
    for name, count in counts.most_common(top):
        yield f"{100 * count / total:6.1f} %  {name}"
    yield ""


def main() -> None:
    """``python -m bench.pyspy RAW [TITLE]``: print the summary of a raw py-spy file."""
    raw = Path(sys.argv[1]).read_text()
    print(summarise(raw, title=sys.argv[2] if len(sys.argv) > 2 else sys.argv[1]))


if __name__ == "__main__":
    main()
