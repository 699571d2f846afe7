"""The floor of a WebSocket stream: one loop turn writes one prebuilt frame to every active
socket with ``transport.write``, and nothing else.

It serves the turns of both WebSocket dialects the load generator speaks: Realtime at
``/v1/realtime`` (``conversation.item.create``, then ``response.create``) and Responses
at ``/v1/responses`` (``response.create``). Every answer is the same prebuilt answer
(bench/baselines/prebuilt.py: the gateway's frames, byte for byte in shape, the sim's
words), written as the gateway writes it: its opening events in one write, then one
delta frame per token, one write each, then its closing events in one write. The deltas
are written by :class:`~bench.baselines.prebuilt.Pump`: one callback per loop turn, for
every active stream at once: no task per stream, no await per frame, no encoding, no
numbering. The handshake and the client's frames go through websockets as usual (a few
per answer, not per token).

What no server sending one frame per token can go below on this machine and loop: the
gap between it and the gateway is everything the gateway does per token.

Run: ``python -m bench.baselines.floor_server --port 8804 --response-tokens 300``
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import orjson
from websockets.asyncio.server import ServerConnection, serve

from bench.baselines import prebuilt
from bench.baselines.bare_server import ready_route
from bench.loadgen import raise_nofile
from gateway.__main__ import LOOPS, default_loop, loop_factory


class FloorServer:
    def __init__(self, response_tokens: int) -> None:
        self.pump = prebuilt.Pump()
        self.greeting = prebuilt.realtime_greeting()
        self.user_item = prebuilt.realtime_user_item()
        self.answers = {
            "/v1/realtime": prebuilt.realtime(response_tokens),
            "/v1/responses": prebuilt.responses_ws(response_tokens),
        }

    async def handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        path = ws.request.path.partition("?")[0].rstrip("/")
        answer = self.answers.get(path)
        if answer is None:
            await ws.close(1008, "unknown path")
            return
        transport = ws.transport
        if path == "/v1/realtime":
            transport.write(self.greeting)
        stream: prebuilt.Stream | None = None
        try:
            async for message in ws:
                kind = orjson.loads(message)["type"]
                if kind == "conversation.item.create":
                    transport.write(self.user_item)
                elif kind == "response.create":
                    transport.write(answer.head)
                    stream = prebuilt.Stream(ws, transport, answer.deltas, answer.tail)
                    self.pump.add(stream)
        finally:
            if stream is not None:
                stream.gone()


async def main(args: argparse.Namespace) -> None:
    floor = FloorServer(args.response_tokens)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve(
        floor.handle,
        "127.0.0.1",
        args.port,
        process_request=ready_route,
        compression=None,
        max_size=1 << 20,
        close_timeout=2,
        backlog=4096,
    ):
        await stop.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8804)
    parser.add_argument("--response-tokens", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=0.0, help="accepted; only 0 is served")
    parser.add_argument("--loop", choices=LOOPS, default=default_loop())
    arguments = parser.parse_args()
    if arguments.step_ms:
        parser.error("the floor runs flat out only (--step-ms 0)")
    raise_nofile()
    with asyncio.Runner(loop_factory=loop_factory(arguments.loop)) as runner:
        runner.run(main(arguments))
