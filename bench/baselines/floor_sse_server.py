"""The floor of an SSE stream: a bare asyncio protocol answering ``POST /v1/responses``
with the FastAPI baseline's events (bench/baselines/fastapi_sse_server.py's ``stream``:
the same sequence, the same delta template, the same step clock), each event one HTTP
chunk written with ``transport.write`` and nothing else: no framework, no HTTP library
beyond finding the end of the request head and its Content-Length.

What no server streaming one event per token can go below on this loop: the gap
between it and the gateway is what the gateway's sessions, scheduler and outbox cost.

Run: ``python -m bench.baselines.floor_sse_server --port 8803 --step-ms 0 --response-tokens 300``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from typing import cast

import orjson

from bench.baselines.fastapi_sse_server import Answers, _id, stream
from bench.loadgen import raise_nofile
from gateway.__main__ import LOOPS, default_loop, loop_factory

_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_READY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n"
_READY += b'{"ready": true}'


class FloorConnection(asyncio.Protocol):
    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        """Serve the request the buffer holds whole, if no answer is under way."""
        if self.task is not None:
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].lower()
        length = 0
        at = head.find(b"content-length:")
        if at >= 0:
            length = int(head[at + 15 : head.find(b"\r\n", at) if b"\r\n" in head[at:] else None])
        if len(self.buffer) < end + 4 + length:
            return
        body, self.buffer = self.buffer[end + 4 : end + 4 + length], self.buffer[end + 4 + length :]
        assert self.transport is not None
        if head.startswith(b"get /readyz"):
            self.transport.write(_READY)
            return
        self.task = asyncio.get_running_loop().create_task(self._answer(orjson.loads(body)))

    async def _answer(self, body: dict[str, object]) -> None:
        transport = self.transport
        assert transport is not None
        transport.write(_HEAD)
        prompt = body["input"] if isinstance(body.get("input"), str) else ""
        tokens = self.answers.tokens(body)
        async for event in stream(self.answers, body, tokens, _id("resp"), _id("item"), prompt):
            transport.write(b"%x\r\n%b\r\n" % (len(event), event))
        transport.write(b"0\r\n\r\n")
        self.task = None
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()


async def serve(port: int, answers: Answers) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FloorConnection(answers), "127.0.0.1", port, backlog=4096
    )
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    with contextlib.suppress(asyncio.CancelledError):
        await stop
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8803)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--response-tokens", type=int, default=300)
    parser.add_argument("--loop", choices=LOOPS, default=default_loop())
    args = parser.parse_args()
    raise_nofile()
    with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        runner.run(serve(args.port, Answers(args.step_ms, args.response_tokens)))


if __name__ == "__main__":
    main()
