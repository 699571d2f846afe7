"""Run a real gateway on a loopback port and talk to it with a raw WebSocket client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import openai
import orjson
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from gateway.config import GatewayConfig
from gateway.engines.base import Engine
from gateway.server import Gateway
from tests.support.turn import Turn

TIMEOUT = 10.0


@dataclass
class RunningGateway:
    gateway: Gateway
    ws_url: str
    http_url: str
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def openai(self, api_key: str = "k") -> openai.AsyncOpenAI:
        """An SDK client of this gateway, closed with it: a client left open leaves its
        pooled sockets to the garbage collector, which then warns in whichever test runs."""
        client = openai.AsyncOpenAI(base_url=f"{self.http_url}/v1", api_key=api_key, max_retries=0)
        self.clients.append(client)
        return client

    async def get(self, path: str) -> tuple[int, bytes]:
        """A plain HTTP GET, off the event loop (urllib blocks)."""

        def fetch() -> tuple[int, bytes]:
            try:
                with urllib.request.urlopen(self.http_url + path, timeout=TIMEOUT) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        return await asyncio.to_thread(fetch)

    async def get_json(self, path: str) -> Any:
        _, body = await self.get(path)
        return orjson.loads(body)

    async def wait_idle(self) -> None:
        """Until no session, running or queued response is left, and the engine has let go
        of every aborted one (bounded by TIMEOUT)."""
        g = self.gateway
        async with asyncio.timeout(TIMEOUT):
            while g.sessions or g.scheduler.running or g.scheduler.queued or g.scheduler.draining:
                await asyncio.sleep(0.005)


@asynccontextmanager
async def running_gateway(engine: Engine, **settings: Any) -> AsyncIterator[RunningGateway]:
    """Start ``engine`` and a gateway on a free port; stop both on exit."""
    config = dataclasses.replace(GatewayConfig(port=0), **settings)
    gateway = Gateway(engine, config)
    await gateway.start()
    try:
        await gateway.wait_ready()
        base = f"127.0.0.1:{gateway.port}"
        http, ws = gateway.scheme, gateway.scheme.replace("http", "ws")
        running = RunningGateway(gateway, f"{ws}://{base}/v1/realtime", f"{http}://{base}")
        try:
            yield running
        finally:
            for client in running.clients:
                await client.close()
    finally:
        await gateway.stop()


class RawClient:
    """A thin client over the raw protocol; records every event it receives."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str, **kwargs: Any) -> AsyncIterator[RawClient]:
        # Unbounded: a test that closes with events left unread must not wait out the
        # close timeout (websockets stops reading at max_queue, so its close frame would
        # never be read). A test of a client that stops reading passes max_queue itself.
        kwargs.setdefault("max_queue", None)
        async with ws_connect(url, open_timeout=TIMEOUT, **kwargs) as ws:
            client = cls(ws)
            created = await client.recv()
            assert created["type"] == "session.created", created
            yield client

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(orjson.dumps(event).decode())

    async def recv(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            event: dict[str, Any] = orjson.loads(await self.ws.recv())
        self.events.append(event)
        return event

    async def recv_until(self, event_type: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        """The next event of ``event_type`` (events before it are kept in ``events``)."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self.recv()
                if event["type"] == event_type:
                    return event

    async def say(self, text: str, role: str = "user") -> dict[str, Any]:
        part = "output_text" if role == "assistant" else "input_text"
        await self.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": role,
                    "content": [{"type": part, "text": text}],
                },
            }
        )
        return await self.recv_until("conversation.item.done")

    async def respond(self, **response: Any) -> Turn:
        """``response.create``, then collect that response's events up to ``response.done``."""
        await self.send({"type": "response.create", "response": response})
        return await self.collect()

    async def collect(self, timeout: float = TIMEOUT) -> Turn:
        """Events of the next response to start, until its ``response.done``."""
        turn = Turn()
        response_id = None
        async with asyncio.timeout(timeout):
            while True:
                event = await self.recv()
                if event["type"] == "error" and response_id is None:
                    raise AssertionError(f"error instead of a response: {event}")
                if event["type"] == "response.created" and response_id is None:
                    response_id = event["response"]["id"]
                rid = event.get("response_id") or event.get("response", {}).get("id")
                if response_id is None or rid != response_id:
                    continue
                turn.events.append(event)
                if event["type"] == "response.done":
                    return turn


@contextmanager
def gateway_on_a_thread(engine: Engine, **settings: Any) -> Iterator[RunningGateway]:
    """A gateway on its own loop and thread, so synchronous code (hypothesis examples)
    can share one."""
    loop = asyncio.new_event_loop()
    started: concurrent.futures.Future[RunningGateway] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def serve() -> None:
        async with running_gateway(engine, **settings) as gw:
            started.set_result(gw)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield started.result(timeout=10)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        loop.close()
