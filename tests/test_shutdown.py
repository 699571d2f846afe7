"""SIGTERM on a real ``python -m gateway`` process: every response ends, sockets close 1001."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import time
import urllib.request

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_ready(port: int) -> None:
    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    async with asyncio.timeout(20):
        while not await asyncio.to_thread(ready):
            await asyncio.sleep(0.05)


async def test_sigterm_ends_responses_and_exits_zero() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "--engine",
        "sim",
        "--port",
        str(port),
        "--sim-step-ms",
        "20",
        "--sim-response-tokens",
        "100000",
    )
    try:
        await wait_ready(port)
        async with connect(f"ws://127.0.0.1:{port}/v1/realtime") as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "response.create"}))
            events = []
            while not events or events[-1]["type"] != "response.output_text.delta":
                events.append(json.loads(await ws.recv()))
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            try:
                async with asyncio.timeout(10):
                    while True:
                        events.append(json.loads(await ws.recv()))
            except ConnectionClosed:
                pass
            assert ws.close_code == 1001
        done = [e for e in events if e["type"] == "response.done"]
        assert len(done) == 1
        assert done[0]["response"]["status"] == "cancelled"
        assert done[0]["response"]["status_details"]["gateway_reason"] == "server_shutdown"
        assert events[-1]["type"] == "response.done"  # nothing after it
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
        assert time.monotonic() - started < 5
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_while_a_client_floods_and_never_reads() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--engine", "sim", "--port", str(port),
    )  # fmt: skip
    try:
        await wait_ready(port)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        ws = await connect(f"ws://127.0.0.1:{port}/v1/realtime", sock=sock, max_queue=1)
        frame = json.dumps({"type": "response.cancel"})
        flooding = True

        async def flood() -> None:
            with contextlib.suppress(ConnectionClosed, OSError):
                while flooding:
                    for _ in range(50):
                        await ws.send(frame)
                    await asyncio.sleep(0)

        flooder = asyncio.create_task(flood())
        await asyncio.sleep(0.3)  # let the gateway's inbox and socket buffers fill
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        async with asyncio.timeout(15):
            assert await proc.wait() == 0
        assert time.monotonic() - started < 10
        flooding = False
        ws.transport.abort()
        await flooder
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
