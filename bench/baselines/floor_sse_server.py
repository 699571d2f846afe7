"""The floor of an SSE stream: one loop turn writes one prebuilt event (a whole HTTP chunk)
to every active stream with ``transport.write``, and nothing else.

A bare asyncio protocol answers ``POST /v1/responses`` and ``POST /v1/chat/completions``
(keep-alive, one request at a time per connection) with a prebuilt streamed answer
(bench/baselines/prebuilt.py: the gateway's events and chunks, the sim's words): the
response head with the opening events in one write, then one event per token, each one
HTTP chunk in one write, then the closing events with the body's end in one write. The
deltas go out from :class:`~bench.baselines.prebuilt.Pump`, one callback per loop turn
for every active stream: no task per stream, no await per event, no JSON, no framework,
no HTTP library beyond finding the end of a request and its Content-Length.

What no server streaming one event per token can go below on this loop: the gap
between it and the gateway is everything the gateway does per token.

Run: ``python -m bench.baselines.floor_sse_server --port 8803 --response-tokens 300``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from typing import cast

from bench.baselines import prebuilt
from bench.loadgen import raise_nofile
from gateway.__main__ import LOOPS, default_loop, loop_factory

_READY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n"
_READY += b'{"ready": true}'
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


class FloorConnection(asyncio.Protocol):
    def __init__(self, pump: prebuilt.Pump, answers: dict[bytes, prebuilt.Answer]) -> None:
        self.pump = pump
        self.answers = answers
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.stream: prebuilt.Stream | None = None
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def _next(self) -> None:
        """Serve the request the buffer holds whole, if no answer is under way."""
        if self.stream is not None:
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].lower()
        length = 0
        at = head.find(b"content-length:")
        if at >= 0:
            eol = head.find(b"\r\n", at)
            length = int(head[at + 15 : eol if eol >= 0 else None])
        if len(self.buffer) < end + 4 + length:
            return
        self.buffer = self.buffer[end + 4 + length :]
        assert self.transport is not None
        path = head[head.find(b" ") + 1 : head.find(b" ", head.find(b" ") + 1)]
        answer = self.answers.get(path) if head.startswith(b"post ") else None
        if answer is None:
            self.transport.write(_READY if path == b"/readyz" else _NOT_FOUND)
            return
        self.transport.write(answer.head)
        self.stream = prebuilt.Stream(self, self.transport, answer.deltas, answer.tail, self._done)
        self.pump.add(self.stream)

    def _done(self) -> None:
        self.stream = None
        self._next()  # a request that came meanwhile

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.stream.gone()


async def serve(port: int, response_tokens: int) -> None:
    pump = prebuilt.Pump()
    answers = {
        b"/v1/responses": prebuilt.responses_sse(response_tokens),
        b"/v1/chat/completions": prebuilt.chat_sse(response_tokens),
    }
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FloorConnection(pump, answers), "127.0.0.1", port, backlog=4096
    )
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    with contextlib.suppress(asyncio.CancelledError):
        await stop
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8803)
    parser.add_argument("--step-ms", type=float, default=0.0, help="accepted; only 0 is served")
    parser.add_argument("--response-tokens", type=int, default=300)
    parser.add_argument("--loop", choices=LOOPS, default=default_loop())
    args = parser.parse_args()
    if args.step_ms:
        parser.error("the floor runs flat out only (--step-ms 0)")
    raise_nofile()
    with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        runner.run(serve(args.port, args.response_tokens))


if __name__ == "__main__":
    main()
