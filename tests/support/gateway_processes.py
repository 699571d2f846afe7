"""Gateway processes for the session store's tests: ``python -m gateway --engine sim`` with a
store, on a free port, and two of them behind a load balancer without affinity, restarted
in turn (a rolling restart). Shared by tests/test_store.py (raw clients, gateway.client)
and tests/test_browser.py (the chat page)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

from tests.support.balancer import Balancer

TIMEOUT = 20.0


class GatewayProcess:
    """``python -m gateway --engine sim`` (or ``engine``'s flags) with a session store, on a
    free port."""

    def __init__(
        self,
        store: str,
        *extra: str,
        step_ms: int = 20,
        tokens: int = 80,
        engine: tuple[str, ...] | None = None,
    ) -> None:
        argv = [sys.executable, "-m", "gateway", "--port", "0"]
        if engine is None:
            engine = ("--engine", "sim", "--sim-step-ms", str(step_ms))
            engine += ("--sim-response-tokens", str(tokens))
        argv += engine
        argv += ["--session-store", store, *extra]
        self.process = subprocess.Popen(
            argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        assert self.process.stderr is not None
        self.log: list[str] = []
        found = None
        while found is None:
            line = self.process.stderr.readline()
            assert line, f"the gateway exited before its ready line: {self.log}"
            self.log.append(line)
            found = re.search(r"chat page http://(127\.0\.0\.1:\d+)/", line)
        self.address = found.group(1)
        self.terminated = False
        self._drain = asyncio.get_running_loop().run_in_executor(None, self._read_log)

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)

    def url(self, path: str = "/v1/realtime") -> str:
        return f"ws://{self.address}{path}"

    def terminate(self) -> None:
        self.terminated = True
        self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(TIMEOUT)

    async def stop(self) -> int:
        """SIGTERM (unless it was sent already) and the exit code."""
        if self.process.poll() is None and not self.terminated:
            self.process.terminate()
        code = await asyncio.to_thread(self.process.wait, TIMEOUT)
        await self._drain
        return code

    async def close(self) -> None:
        """Stopped, and its log pipe closed (else a later test's warnings catch it)."""
        if self.process.poll() is None:
            await self.stop()
        else:
            await asyncio.to_thread(self.process.wait, TIMEOUT)
            await self._drain
        assert self.process.stderr is not None
        self.process.stderr.close()


@contextlib.asynccontextmanager
async def gateways(
    store: str, n: int, *extra: str, **kw: Any
) -> AsyncIterator[list[GatewayProcess]]:
    started = [GatewayProcess(store, *extra, **kw) for _ in range(n)]
    try:
        yield started
    finally:
        for g in started:
            await g.close()


class RollingPair:
    """Two gateways sharing one store behind a round-robin :class:`Balancer` (no affinity).

    :meth:`begin_restart` sends SIGTERM to one of them (it drains, hands its sessions to the
    store and closes their sockets with 1012); :meth:`finish_restart` waits for it to exit
    cleanly and puts a fresh process in its place at the balancer.
    """

    def __init__(self, store: str, *extra: str, **kw: Any) -> None:
        self._args = (store, *extra)
        self._kw = kw
        self.gateways: list[GatewayProcess] = []
        self.balancer = Balancer()
        self.restarts = 0

    async def __aenter__(self) -> RollingPair:
        try:
            for _ in range(2):
                self.gateways.append(GatewayProcess(*self._args, **self._kw))
            self.balancer.set_backends(g.address for g in self.gateways)
            await self.balancer.start()
        except BaseException:
            await self._stop_all()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.balancer.close()
        finally:
            await self._stop_all()

    async def _stop_all(self) -> None:
        for g in self.gateways:
            await g.close()

    def begin_restart(self, index: int) -> None:
        self.gateways[index].terminate()

    async def finish_restart(self, index: int) -> None:
        old = self.gateways[index]
        code = await old.stop()
        await old.close()
        assert code == 0, old.log[-10:]
        self.gateways[index] = GatewayProcess(*self._args, **self._kw)
        self.balancer.set_backends(g.address for g in self.gateways)
        self.restarts += 1

    async def restart(self, index: int) -> None:
        self.begin_restart(index)
        await self.finish_restart(index)
