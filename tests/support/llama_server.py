"""A real llama.cpp OpenAI-compatible HTTP server on a loopback port, for the upstream tests.

Run as its own process (``python -m tests.support.llama_server --slots 2``) so that a test
can kill it mid-run like a crashed replica. It prints ``READY <base url>`` once the
model is loaded and serves until its stdin closes (the test process went away)
or it is signalled.

:func:`start` and :class:`LlamaServer` are the test side.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from gateway.engines.base import EngineUnavailableError
from gateway.engines.llamacpp import bundled_model_path

MODEL_ALIAS = "smollm2-135m"
READY = "READY "
# ``-m tests.support.llama_server`` imports from the repository root.
ROOT = Path(__file__).resolve().parents[2]


def model_available() -> bool:
    """Whether the bundled GGUF file is installed (the llamacpp engine's default model)."""
    try:
        bundled_model_path()
    except EngineUnavailableError:
        return False
    return True


def serve(slots: int, ctx: int, port: int, threads: int, embeddings: bool = False) -> None:
    import xllamacpp

    try:
        path = bundled_model_path()
    except EngineUnavailableError as exc:
        sys.exit(exc.message)
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.model_alias = {MODEL_ALIAS}
    params.n_parallel = slots
    params.n_ctx = ctx * slots  # split evenly among the slots
    params.kv_unified = False
    params.cache_prompt = True
    params.n_gpu_layers = 0
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.endpoint_slots = True
    params.endpoint_metrics = True
    params.endpoint_props = True
    params.ui = False
    params.verbosity = 1  # errors only
    if embeddings:  # /v1/embeddings too (mean-pooled); completions are still served
        params.embedding = True
        params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
    server = xllamacpp.Server(params)
    print(READY + server.listening_address, flush=True)
    sys.stdin.read()  # until the test process closes our stdin (or dies)
    os._exit(0)  # skip tearing llama.cpp down: nothing of it needs saving


class LlamaServer:
    """A running llama_server.py process."""

    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url

    def kill(self) -> None:
        """Like a crash: no goodbye to open connections."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self._close_pipes()

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        """Else the garbage collector closes them, warning in whichever test then runs."""
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


def start(
    *,
    slots: int = 2,
    ctx: int = 1024,
    threads: int = 1,
    port: int = 0,
    timeout: float = 60,
    embeddings: bool = False,
) -> LlamaServer:
    """Start a server process and wait until it has loaded the model (port 0: any free).

    Blocks for as long as the model loads: from async code, call it through
    ``asyncio.to_thread``.
    """
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.llama_server",
            f"--slots={slots}",
            f"--ctx={ctx}",
            f"--threads={threads}",
            f"--port={port}",
            *(["--embeddings"] if embeddings else []),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""  # READY, or "" once it exited
    if not line.startswith(READY):
        process.kill()
        process.wait()
        raise RuntimeError(f"llama server did not start (exit {process.poll()}): {line!r}")
    return LlamaServer(process, line[len(READY) :].strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=1024, help="context per slot")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--embeddings", action="store_true", help="serve /v1/embeddings too")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve(args.slots, args.ctx, args.port, args.threads, args.embeddings)


if __name__ == "__main__":
    main()
