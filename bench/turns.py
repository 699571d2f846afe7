"""What bench.store and bench.tls share: a Realtime client that runs turns back to back,
counting the deltas it receives; the server's CPU per delta while clients run; a
throwaway redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import orjson
from websockets.asyncio.client import connect

from bench.procs import cpu_seconds, free_port

PROMPT = "Tell me about the gateway"


async def realtime_turns(
    url: str, stop: float, count: list[int], tls: ssl.SSLContext | None = None
) -> None:
    async with connect(url, max_size=None, compression=None, ssl=tls) as ws:
        await ws.recv()
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": PROMPT}],
        }
        create_item = orjson.dumps({"type": "conversation.item.create", "item": item}).decode()
        while time.monotonic() < stop:
            await ws.send(create_item)
            await ws.send('{"type":"response.create"}')
            while True:
                frame = await ws.recv()
                if (
                    b"output_text.delta" in frame
                    if isinstance(frame, bytes)
                    else "output_text.delta" in frame
                ):
                    count[0] += 1
                elif '"response.done"' in str(frame):
                    break


REDIS_PIDS: dict[str, int] = {}  # url: the pid of the redis-server redis_url() started


@contextlib.contextmanager
def redis_url() -> Iterator[str | None]:
    if shutil.which("redis-server") is None:
        yield None
        return
    port, folder = free_port(), tempfile.mkdtemp()
    argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*argv, "--dir", folder], stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    url = f"redis://127.0.0.1:{port}/0"
    REDIS_PIDS[url] = proc.pid
    try:
        yield url
    finally:
        REDIS_PIDS.pop(url, None)
        proc.terminate()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


async def measure(
    pid: int, seconds: float, clients: Any, also: dict[int, float] | None = None
) -> tuple[float, float]:
    """(CPU µs per unit, units per second) of the server ``pid`` while ``clients`` run;
    ``also``: more processes (pid: 0.0), each given its CPU µs per unit over the window."""
    count = [0]
    others = list(also or ())
    warm = time.monotonic() + 1.0
    stop = warm + seconds
    tasks = [asyncio.create_task(c(stop + 0.2, count)) for c in clients]
    await asyncio.sleep(warm - time.monotonic())
    c0, n0, t0 = cpu_seconds(pid), count[0], time.monotonic()
    o0 = [cpu_seconds(p) for p in others]
    await asyncio.sleep(stop - time.monotonic())
    c1, n1, t1 = cpu_seconds(pid), count[0], time.monotonic()
    o1 = [cpu_seconds(p) for p in others]
    await asyncio.gather(*tasks, return_exceptions=True)
    units = max(1, n1 - n0)
    if also is not None:
        for p, a, b in zip(others, o0, o1, strict=True):
            also[p] = 1e6 * (b - a) / units
    return 1e6 * (c1 - c0) / units, units / (t1 - t0)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
