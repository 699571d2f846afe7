"""The layers of docs/design.md, read from the import graph (``ast``, so imports under
``TYPE_CHECKING`` and inside functions count): imports point down only, there is no
cycle, the session core imports no dialect, and only ``gateway/__main__.py`` builds the
server. A change that breaks a rule fails here with the import that breaks it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each layer and the layers it may import (itself included). Transport and the session
# layer never see each other: bytes below, sessions above, joined by the host layer.
# Telemetry (the metrics and gateway/observability/: the access log, the spans) is at the
# bottom: the HTTP layer and the session core both write to it, and it imports neither.
LAYERS: dict[str, set[str]] = {
    "telemetry": {"telemetry"},
    "engines": {"engines", "telemetry"},
    "sessions": {"sessions", "engines", "telemetry"},
    "transport": {"transport", "telemetry"},
    "host": {"host", "sessions", "transport", "engines", "telemetry"},
    "cluster": {"cluster", "host", "sessions", "transport", "engines", "telemetry"},
    "api": {"api", "cluster", "host", "sessions", "transport", "engines", "telemetry"},
    "server": {"server", "api", "cluster", "host", "sessions", "transport", "engines", "telemetry"},
    "main": {
        "main",
        "server",
        "api",
        "cluster",
        "host",
        "sessions",
        "transport",
        "engines",
        "telemetry",
    },
    "client": {"client"},  # the Python client library: it speaks the wire, nothing else
}
# The session core: what every dialect builds on, and which knows none of them.
CORE = {"core", "outbox", "conversation", "snapshot", "response_store", "codec", "errors"}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "sessions":
        return "sessions"
    sub = parts[1] if len(parts) > 1 else ""
    # A new top-level module has no layer until it is given one here (a KeyError).
    return {
        "": "host",  # the package itself
        "engines": "engines",
        "scheduler": "engines",
        "tenants": "engines",
        "metrics": "telemetry",
        "observability": "telemetry",
        "transport": "transport",
        "config": "host",
        "session_table": "host",
        "cluster": "cluster",
        "api": "api",
        "server": "server",
        "__main__": "main",
        "client": "client",
    }[sub]


def modules() -> dict[str, Path]:
    found = {}
    for package in ("gateway", "sessions"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports (a ``from package import name`` of a
    submodule counts as that submodule)."""
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {name for name in out if name in known and name != module}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def test_imports_point_down_only() -> None:
    upward = [
        f"{a} ({layer(a)}) imports {b} ({layer(b)})"
        for a, targets in graph().items()
        for b in sorted(targets)
        if layer(b) not in LAYERS[layer(a)] and not b.endswith("__init__")
    ]
    assert not upward, "\n".join(upward)


def test_the_session_core_imports_no_dialect() -> None:
    bad = [
        f"{a} imports {b}"
        for a, targets in graph().items()
        if a.startswith("sessions.") and a.split(".")[1] in CORE
        for b in targets
        if b.startswith(("sessions.realtime", "sessions.responses", "sessions.dialects"))
    ]
    assert not bad, "\n".join(bad)


def test_only_main_builds_the_server() -> None:
    bad = [a for a, targets in graph().items() if "gateway.server" in targets]
    assert bad == ["gateway.__main__"], bad


def test_no_import_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_rules_catch_what_they_forbid() -> None:
    """The checks above can fail: the layer map puts known modules where the design says."""
    assert layer("gateway.transport.wire") == "transport"
    assert "sessions" not in LAYERS["transport"]
    assert "api" not in LAYERS["cluster"]
    assert layer("gateway.cluster.resumes") == "cluster"
    assert layer("sessions.core") == "sessions"
    assert layer("gateway.observability.record") == "telemetry"
    assert "transport" not in LAYERS["telemetry"] and "sessions" not in LAYERS["telemetry"]
    g = graph()
    assert "gateway.server" in g["gateway.__main__"]
    assert "sessions.core" in g["sessions.realtime.dialect"]
