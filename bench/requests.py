"""The cost of a request: ``python -m bench.requests`` (``make bench`` runs it).

Agent frameworks and Codex make many short requests with long bodies; what each one
costs the server is what this measures, beside the baselines of the same run:

- ``sim``: one-shot (``stream: false``) requests on keep-alive connections, the sim flat
  out with 8-token answers (``--sim-response-tokens 8``), for three bodies: a small
  ``POST /v1/chat/completions``, a small ``POST /v1/responses`` and a Codex-shaped
  ``POST /v1/responses`` (about 45 KB: 10 function tools, a 22 KB developer message,
  6 function calls with their outputs, then the user's next message, ``store: false``).
  The baseline is the minimal FastAPI + uvicorn handler (bench/baselines/fastapi_server.py:
  httptools where installed, the body parsed with orjson, the same object answered,
  its tools and instructions echoed).
- ``upstream``: ``POST /v1/chat/completions`` through ``--engine upstream`` in front of
  bench/sse_server.py (8-token answers), streamed and not, beside a minimal FastAPI +
  httpx proxy in front of the same stand-in (bench/baselines/fastapi_proxy.py, LiteLLM's
  architecture). The stand-in's own CPU is given apart.

Each system a fresh process, the systems alternating within a round, ``--rounds`` rounds
(default 3); the figure is the server process's CPU µs per request over a window of
``--seconds`` (from /proc), median and range, and every ratio is taken within a round.
Every request is checked (status 200 and a whole answer); a run with errors says so.
``--rev REV`` also runs the gateway of commit REV (bench/other_tree.py) in every round:
the same figures before a change.
``--profile SYSTEM:BODY`` samples that server with py-spy instead (bench/pyspy.py).

Results: bench/results/requests.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench import other_tree
from bench.loadgen import raise_nofile
from bench.procs import (
    cpu_seconds,
    fastapi_proxy_argv,
    fastapi_server_argv,
    gateway_argv,
    httptools_installed,
    server_process,
    sse_server_argv,
)
from bench.turns import summary

RESULTS = Path(__file__).parent / "results"
ANSWER_TOKENS = 8
CLIENTS = 32
PROMPT = "Tell me about streaming gateways."
_MARK = b"\x00N\x00"  # where a request's number goes in its body


# -- the bodies ---------------------------------------------------------------------------


def _schema(i: int) -> dict[str, Any]:
    """A tool's JSON Schema, of the size Codex's tools have."""
    return {
        "type": "object",
        "properties": {
            "command": {
                "type": "array",
                "items": {"type": "string"},
                "description": f"The command to run (tool {i}), as a list of arguments.",
            },
            "workdir": {"type": "string", "description": "The working directory."},
            "timeout_ms": {"type": "number", "description": "How long it may take."},
            "justification": {
                "type": "string",
                "description": "Why it needs to run, in one sentence a reviewer can read. " * 3,
            },
        },
        "required": ["command"],
        "additionalProperties": False,
    }


def codex_body() -> dict[str, Any]:
    """A Codex-shaped turn: tools, a long developer message, calls and outputs, the next
    user message (whose text is numbered per request)."""
    tools = [
        {
            "type": "function",
            "name": f"tool_{i}",
            "description": f"Tool number {i}: runs a command in the workspace and returns "
            "its output. " * 4,
            "strict": False,
            "parameters": _schema(i),
        }
        for i in range(10)
    ]
    developer = ("You are a coding agent working in the user's repository. " * 8 + "\n") * 47
    items: list[dict[str, Any]] = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": developer}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Find why the tests fail, and fix it."}],
        },
    ]
    for k in range(6):
        call_id = f"call_{k:024d}"
        arguments = json.dumps({"command": ["bash", "-lc", f"rg -n 'def test_{k}' tests/"]})
        items.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": f"tool_{k}",
                "arguments": arguments,
            }
        )
        output = "\n".join(f"tests/test_{k}.py:{n}: def test_{k}_{n}(): ..." for n in range(46))
        items.append({"type": "function_call_output", "call_id": call_id, "output": output})
    items.append(
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Now run them again, please. (\x00N\x00)"}],
        }
    )
    return {
        "model": "default",
        "instructions": None,
        "input": items,
        "tools": tools,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": False,
        "stream": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
    }


def bodies(stream: bool = False) -> dict[str, tuple[bytes, bytes]]:
    """Each body's path and its bytes (a request's number goes where ``_MARK`` is)."""
    prompt = f"{PROMPT} (\x00N\x00)"
    chat: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "stream": stream,
    }
    if stream:
        chat["stream_options"] = {"include_usage": True}
    small = {"model": "default", "input": prompt, "store": False, "stream": stream}
    return {
        "chat": (b"/v1/chat/completions", _encoded(chat)),
        "responses": (b"/v1/responses", _encoded(small)),
        "codex": (b"/v1/responses", _encoded(codex_body() | {"stream": stream})),
    }


def _encoded(body: dict[str, Any]) -> bytes:
    # orjson writes the mark as \u0000N\u0000: a placeholder no real text holds.
    return orjson.dumps(body).replace(b"\\u0000N\\u0000", _MARK)


# -- the client ---------------------------------------------------------------------------


@dataclass
class Tally:
    done: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class Connection:
    """One keep-alive connection sending one request after another, each answer read whole
    (Content-Length or chunked) and checked."""

    def __init__(self, port: int, index: int, path: bytes, body: bytes) -> None:
        self.port = port
        self.index = index
        head = b"POST %b HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" % path
        self.head = head
        self.body = body
        self.buffer = b""
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.sent = 0

    async def run(self, stop: float, tally: Tally) -> None:
        try:
            self.reader, self.writer = await asyncio.open_connection(
                "127.0.0.1",
                self.port,
                local_addr=(f"127.0.0.{2 + self.index % 16}", 0),
                limit=1 << 22,
            )
            while time.monotonic() < stop:
                await self.one(tally)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            tally.error(type(exc).__name__)
        finally:
            if self.writer is not None:
                self.writer.close()

    async def one(self, tally: Tally) -> None:
        assert self.writer is not None
        self.sent += 1
        body = self.body.replace(_MARK, b"%d-%d" % (self.index, self.sent))
        self.writer.write(self.head + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        status, headers = await self._head()
        answer = await self._body(headers)
        if status != 200:
            tally.error(f"http_{status}")
        elif not (b'"completed"' in answer or b'"finish_reason":"stop"' in answer):
            tally.error("incomplete_answer")
        else:
            tally.done += 1

    async def _more(self) -> None:
        assert self.reader is not None
        data = await self.reader.read(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data

    async def _head(self) -> tuple[int, dict[bytes, bytes]]:
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            await self._more()
        head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
        lines = head.split(b"\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        return int(lines[0].split(b" ", 2)[1]), headers

    async def _body(self, headers: dict[bytes, bytes]) -> bytes:
        if headers.get(b"transfer-encoding") == b"chunked":
            parts = []
            while True:
                while (eol := self.buffer.find(b"\r\n")) < 0:
                    await self._more()
                size = int(self.buffer[:eol].split(b";", 1)[0], 16)
                while len(self.buffer) < eol + 2 + size + 2:
                    await self._more()
                parts.append(self.buffer[eol + 2 : eol + 2 + size])
                self.buffer = self.buffer[eol + 4 + size :]
                if size == 0:
                    return b"".join(parts)
        length = int(headers.get(b"content-length", b"0"))
        while len(self.buffer) < length:
            await self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return body


async def _drive(
    port: int, pid: int, path: bytes, body: bytes, seconds: float, also: list[int]
) -> dict[str, Any]:
    """CPU µs per request of ``pid`` (and of ``also``) over the window, and what the
    clients saw."""
    tally, window = Tally(), Tally()
    warm = time.monotonic() + 1.0
    stop = warm + seconds
    connections = [Connection(port, i, path, body) for i in range(CLIENTS)]
    tasks = [asyncio.create_task(c.run(stop + 0.3, tally)) for c in connections]
    await asyncio.sleep(warm - time.monotonic())
    c0, n0, e0 = cpu_seconds(pid), tally.done, sum(tally.errors.values())
    o0 = [cpu_seconds(p) for p in also]
    await asyncio.sleep(stop - time.monotonic())
    c1, n1, e1 = cpu_seconds(pid), tally.done, sum(tally.errors.values())
    o1 = [cpu_seconds(p) for p in also]
    await asyncio.gather(*tasks, return_exceptions=True)
    window.done = max(1, n1 - n0)
    return {
        "cpu_us_per_request": 1e6 * (c1 - c0) / window.done,
        "requests_s": window.done / seconds,
        "errors": e1 - e0,
        "error_kinds": tally.errors,
        "also_cpu_us_per_request": [
            1e6 * (b - a) / window.done for a, b in zip(o0, o1, strict=True)
        ],
    }


def drive(
    port: int, pid: int, path: bytes, body: bytes, seconds: float, also: list[int]
) -> dict[str, Any]:
    from gateway.__main__ import loop_factory

    with asyncio.Runner(loop_factory=loop_factory("uvloop")) as runner:
        return runner.run(_drive(port, pid, path, body, seconds, also))


# -- the systems ----------------------------------------------------------------------------


@contextlib.contextmanager
def system(name: str) -> Iterator[tuple[int, int, list[int]]]:
    """(port, pid, pids of processes behind it) of a fresh server process; a gateway
    named ``NAME+REV`` runs from commit REV's tree (bench/other_tree.py)."""
    name, _, rev = name.partition("+")
    if name == "gateway":
        argv = gateway_argv(loop="uvloop", step_ms=0, response_tokens=ANSWER_TOKENS)
        if rev:
            argv = other_tree.gateway_argv(rev, argv)
        with server_process(argv) as s:
            yield s.port, s.pid, []
        return
    if name == "fastapi":
        argv = fastapi_server_argv(
            step_ms=0,
            response_tokens=ANSWER_TOKENS,
            loop="uvloop",
            http="httptools" if httptools_installed() else "h11",
        )
        with server_process(argv) as s:
            yield s.port, s.pid, []
        return
    upstream_argv = sse_server_argv(response_tokens=ANSWER_TOKENS, loop="uvloop")
    with server_process(upstream_argv) as upstream:
        if name == "gateway-upstream":
            argv = gateway_argv(loop="uvloop", upstream=upstream.http_url)
            if rev:
                argv = other_tree.gateway_argv(rev, argv)
        elif name == "proxy":
            argv = fastapi_proxy_argv(upstream=upstream.http_url, loop="uvloop")
        else:
            raise ValueError(name)
        with server_process(argv) as s:
            yield s.port, s.pid, [upstream.pid]


SCENARIOS = ("sim", "upstream")


def scenarios(revs: list[str]) -> dict[str, list[tuple[str, str, bool]]]:
    """(system, body name, streamed): what each scenario runs, in each round; each
    ``--rev``'s gateway beside this tree's."""
    befores = [f"+{rev}" for rev in revs]
    return {
        "sim": [
            (system_name, body, False)
            for body in ("chat", "responses", "codex")
            for system_name in ("gateway", *(f"gateway{b}" for b in befores), "fastapi")
        ],
        "upstream": [
            (system_name, "chat", stream)
            for stream in (False, True)
            for system_name in (
                "gateway-upstream",
                *(f"gateway-upstream{b}" for b in befores),
                "proxy",
            )
        ],
    }


def run(rounds: int, seconds: float, only: set[str], revs: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for r in range(rounds):
        for scenario, runs in scenarios(revs).items():
            if scenario not in only:
                continue
            for name, body_name, stream in runs:
                path, body = bodies(stream)[body_name]
                with system(name) as (port, pid, also):
                    row = drive(port, pid, path, body, seconds, also)
                row |= {
                    "scenario": scenario,
                    "system": name,
                    "body": body_name,
                    "stream": stream,
                    "round": r,
                    "body_bytes": len(body),
                }
                rows.append(row)
                print(
                    f"[requests] {scenario:8} {name:16} {body_name:9} stream={stream!s:5} "
                    f"{row['cpu_us_per_request']:8.1f} µs/request {row['requests_s']:7.0f}/s "
                    f"errors={row['errors']}",
                    flush=True,
                )
    return rows


def profile(target: str, seconds: float, out: Path) -> str:
    """py-spy of ``SYSTEM:BODY[:stream]`` under its load."""
    from bench import pyspy

    name, body_name, *rest = target.split(":")
    stream = rest == ["stream"]
    path, body = bodies(stream)[body_name]
    raw = Path(tempfile.mkdtemp(prefix="bench-pyspy-")) / "requests.raw"
    with system(name) as (port, pid, also):
        started: list[Any] = []
        timer = threading.Timer(1.0, lambda: started.append(pyspy.record(pid, seconds, raw)))
        timer.start()
        row = drive(port, pid, path, body, seconds + 0.5, also)
        timer.join()
        for proc in started:
            proc.communicate(timeout=seconds + 30)
    title = (
        f"{name}, {body_name} {'streamed' if stream else 'one-shot'} requests, {CLIENTS} "
        f"keep-alive connections: {row['requests_s']:.0f}/s, "
        f"{row['cpu_us_per_request']:.0f} µs CPU/request"
    )
    text = pyspy.summarise(raw.read_text() if raw.exists() else "", title=title, top=30)
    out.mkdir(exist_ok=True)
    target_file = out / f"profile-requests-{name}-{body_name}{'-stream' if stream else ''}.txt"
    target_file.write_text(text)
    return text


# -- the report -------------------------------------------------------------------------------


def _cpu(
    rows: list[dict[str, Any]], scenario: str, name: str, body: str, stream: bool
) -> list[float]:
    return [
        r["cpu_us_per_request"]
        for r in sorted(rows, key=lambda r: r["round"])
        if (r["scenario"], r["system"], r["body"], r["stream"]) == (scenario, name, body, stream)
    ]


def _span(values: list[float], digits: int = 0) -> str:
    s = summary(values)
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}–{s['max']:,.{digits}f})"


def _ratio(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=False)]


def report(rows: list[dict[str, Any]], rounds: int, revs: list[str]) -> str:
    lines = [
        "# The cost of a request (bench/requests.py)",
        "",
        f"uvloop, {os.cpu_count()} CPUs, {rounds} rounds, each system a fresh process, the "
        "systems alternating within a round; the server process's CPU µs per request, median "
        f"(range); {CLIENTS} keep-alive connections sending back to back, {ANSWER_TOKENS}-token "
        "answers.",
        "",
    ]
    errors = sum(r["errors"] for r in rows)
    if errors:
        lines += [f"**{errors} requests failed** (see requests.json)", ""]
    if any(r["scenario"] == "sim" for r in rows):
        lines += [
            "## One-shot requests on the sim (stream: false) beside a minimal FastAPI handler",
            "",
            "| body | gateway µs/request | minimal FastAPI µs/request | × FastAPI (target ≤ 1.5) |",
            "|---|---|---|---|",
        ]
        for body in ("chat", "responses", "codex"):
            mine = _cpu(rows, "sim", "gateway", body, False)
            theirs = _cpu(rows, "sim", "fastapi", body, False)
            if mine and theirs:
                size = next(r["body_bytes"] for r in rows if r["body"] == body)
                lines.append(
                    f"| {body} ({size:,} bytes) | {_span(mine)} | {_span(theirs)} | "
                    f"{_span(_ratio(mine, theirs), 2)} |"
                )
        lines += ["", *_befores(rows, revs, "sim", "gateway", False)]
    if any(r["scenario"] == "upstream" for r in rows):
        lines += [
            "## Chat Completions through --engine upstream beside FastAPI + httpx (LiteLLM's "
            "architecture), both in front of bench/sse_server.py",
            "",
            "| stream | gateway µs/request | FastAPI + httpx proxy µs/request | × proxy "
            "(target ≤ 0.35) | the stand-in's µs/request (gateway; proxy) |",
            "|---|---|---|---|---|",
        ]
        for stream in (False, True):
            mine = _cpu(rows, "upstream", "gateway-upstream", "chat", stream)
            theirs = _cpu(rows, "upstream", "proxy", "chat", stream)
            if mine and theirs:
                behind = [
                    summary(
                        [
                            r["also_cpu_us_per_request"][0]
                            for r in rows
                            if (r["scenario"], r["system"], r["stream"])
                            == ("upstream", name, stream)
                        ]
                    )["median"]
                    for name in ("gateway-upstream", "proxy")
                ]
                lines.append(
                    f"| {stream} | {_span(mine)} | {_span(theirs)} | "
                    f"{_span(_ratio(mine, theirs), 2)} | {behind[0]:,.0f}; {behind[1]:,.0f} |"
                )
        lines.append("")
        for stream in (False, True):
            lines += _befores(rows, revs, "upstream", "gateway-upstream", stream)
    return "\n".join(lines)


def _befores(
    rows: list[dict[str, Any]], revs: list[str], scenario: str, name: str, stream: bool
) -> list[str]:
    """Each ``--rev``'s gateway beside this tree's, per body, in the same rounds."""
    lines = []
    for rev in revs:
        for body in ("chat", "responses", "codex"):
            mine = _cpu(rows, scenario, name, body, stream)
            before = _cpu(rows, scenario, f"{name}+{rev}", body, stream)
            if mine and before:
                lines.append(
                    f"- {body}{' streamed' if stream else ''}: {name} of {rev} {_span(before)} "
                    f"µs/request; this tree's ÷ it: {_span(_ratio(mine, before), 2)}"
                )
    return [*lines, ""] if lines else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.requests", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--only", choices=SCENARIOS, action="append")
    parser.add_argument(
        "--rev", action="append", default=[], help="also the gateway of this commit (an A/B)"
    )
    parser.add_argument(
        "--profile",
        metavar="SYSTEM:BODY[:stream]",
        action="append",
        help="py-spy of one system under one load instead (e.g. gateway:codex); repeatable",
    )
    args = parser.parse_args(argv)
    raise_nofile()
    RESULTS.mkdir(exist_ok=True)
    if args.profile:
        for target in args.profile:
            print(profile(target, args.seconds, RESULTS))
        return 0
    rows = run(args.rounds, args.seconds, set(args.only or SCENARIOS), args.rev)
    (RESULTS / "requests.json").write_text(json.dumps(rows, indent=2))
    text = report(rows, args.rounds, args.rev)
    (RESULTS / "requests.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
