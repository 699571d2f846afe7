"""The measured servers as subprocesses of their own, and what /proc says about them."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of ``pid`` so far (fields 14 and 15 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy so far, all CPUs together
    (/proc/stat: user, nice, system, irq, softirq and steal; not idle or iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` now (/proc/PID/statm, second field)."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE


@dataclass
class Server:
    pid: int
    port: int
    log: Path
    tls: ssl.SSLContext | None = None  # a client context trusting its certificate, with TLS

    @property
    def ws_url(self) -> str:
        return f"{self._ws}://127.0.0.1:{self.port}/v1/realtime"

    @property
    def responses_url(self) -> str:
        """The gateway's Responses WebSocket dialect, beside the Realtime one."""
        return f"{self._ws}://127.0.0.1:{self.port}/v1/responses"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def _ws(self) -> str:
        return "wss" if self.tls else "ws"

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.http_url + path, timeout=10, context=self.tls) as r:
            body: bytes = r.read()
            return body


def free_port() -> int:
    """A loopback port free right now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def server_process(
    argv: Sequence[str], *, timeout: float = 30.0, tls: ssl.SSLContext | None = None
) -> Iterator[Server]:
    """Run ``argv`` + ``--port PORT`` until ``/readyz`` answers; stop it with SIGTERM.
    ``tls``: the server speaks TLS, and this client context trusts it."""
    with tempfile.NamedTemporaryFile(prefix="bench-", suffix=".log", delete=False) as f:
        log = Path(f.name)
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        server = Server(proc.pid, port, log, tls)
        _wait_ready(proc, server, timeout)
        yield server
    finally:
        stop(proc)
        log.unlink(missing_ok=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it takes over 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"server exited with {proc.returncode}: {tail}")
        try:
            server.get("/readyz")
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not become ready in time")


def gateway_argv(
    *,
    loop: str,
    step_ms: float = 20.0,
    max_batch: int = 64,
    response_tokens: int = 64,
    coalesce: bool = True,
    upstream: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m gateway --engine sim ...``, or ``--engine upstream`` in front of
    ``upstream``."""
    if upstream is None:
        engine = ["--engine", "sim", "--sim-step-ms", str(step_ms)]
        engine += ["--sim-max-batch", str(max_batch), "--sim-response-tokens", str(response_tokens)]
    else:
        # The upstream reports its slots (/props); the gateway admits that many at once.
        engine = ["--engine", "upstream", "--upstream", upstream]
    argv = [
        sys.executable,
        "-m",
        "gateway",
        *engine,
        "--loop",
        loop,
        "--log-level",
        "WARNING",
        "--max-queued",
        "100000",
        *extra,
    ]
    if not coalesce:
        argv.append("--no-coalesce")
    return argv


def bare_server_argv(*, step_ms: float, response_tokens: int, loop: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.baselines.bare_server",
        "--step-ms",
        str(step_ms),
        "--response-tokens",
        str(response_tokens),
        "--loop",
        loop,
    ]


def sse_server_argv(*, response_tokens: int, loop: str, token_ms: float = 0.0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.sse_server",
        "--response-tokens",
        str(response_tokens),
        "--loop",
        loop,
        "--token-ms",
        str(token_ms),
    ]


def _baseline_argv(module: str, *, step_ms: float, response_tokens: int, loop: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        f"bench.baselines.{module}",
        "--step-ms",
        str(step_ms),
        "--response-tokens",
        str(response_tokens),
        "--loop",
        loop,
    ]


def fastapi_server_argv(
    *, step_ms: float, response_tokens: int, loop: str, http: str = "httptools", vllm: bool = False
) -> list[str]:
    """The minimal FastAPI app (bench/baselines/fastapi_server.py), or with ``vllm`` the
    same app with vLLM's per-request queue and producer task (vllm_shape_server.py)."""
    module = "vllm_shape_server" if vllm else "fastapi_server"
    argv = _baseline_argv(module, step_ms=step_ms, response_tokens=response_tokens, loop=loop)
    return [*argv, "--http", http]


def floor_server_argv(*, response_tokens: int, loop: str) -> list[str]:
    """The WebSocket floor (bench/baselines/floor_server.py)."""
    return _baseline_argv("floor_server", step_ms=0, response_tokens=response_tokens, loop=loop)


def floor_sse_server_argv(*, response_tokens: int, loop: str) -> list[str]:
    """The SSE floor (bench/baselines/floor_sse_server.py)."""
    return _baseline_argv("floor_sse_server", step_ms=0, response_tokens=response_tokens, loop=loop)


def fastapi_proxy_argv(*, upstream: str, loop: str) -> list[str]:
    """FastAPI + httpx forwarding to ``upstream`` (bench/baselines/fastapi_proxy.py)."""
    return [
        sys.executable,
        "-m",
        "bench.baselines.fastapi_proxy",
        "--upstream",
        upstream,
        "--loop",
        loop,
        "--http",
        "httptools" if httptools_installed() else "h11",
    ]


def httptools_installed() -> bool:
    """Whether uvicorn's httptools parser is there (the bench extra installs it)."""
    import importlib.util

    return importlib.util.find_spec("httptools") is not None
