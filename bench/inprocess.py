"""The gateway's own work per token and per request, in one process, with no socket:
``python -m bench.inprocess``.

The figures of bench.writes and bench.requests are what a server process spends,
measured from outside, kernel and all: the right figures to quote, and the noisiest on a
shared machine (a send's cost moves with what the receiving process and the other cores
are doing). This measures the part the gateway's own code decides: a
:class:`~gateway.server.Gateway` (the sim engine flat out, the scheduler, the session
table, the real dialects and outboxes) whose sockets are transports that only count
what they are given. What it reports is process CPU per token (each dialect's sessions
streaming one token per frame, as in bench.writes) and per request (a one-shot
``POST /v1/responses`` or ``/v1/chat/completions`` handled by the real HTTP handlers on
an in-memory connection, as in bench.requests), with the sim engine's own work inside.

Use it to see where a change moves the gateway's own cost (``--profile`` prints
cProfile's top functions); quote bench.writes and bench.requests.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import orjson
from websockets.protocol import State

from gateway.__main__ import loop_factory
from gateway.api.routes import WEBSOCKET_PATHS
from gateway.config import GatewayConfig
from gateway.engines.sim import SimEngine
from gateway.server import Gateway
from gateway.transport.http1 import HttpConnection, HttpService
from gateway.transport.wire import SocketWire
from sessions.dialects import REALTIME, RESPONSES, DialectContext

PROMPT = "Tell me about the gateway"
T = TypeVar("T")


class CountingTransport:
    """A transport that takes every write at once and keeps only the byte count."""

    def __init__(self) -> None:
        self.bytes = 0
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)
        self.writes += 1

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _Protocol:
    state = State.OPEN


class _Closed:
    state = State.CLOSED


class FakeConnection:
    """What :class:`SocketWire` reads of websockets' ServerConnection."""

    def __init__(self) -> None:
        self.transport = CountingTransport()
        self.protocol = _Protocol()
        self.paused = False

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.protocol = _Closed()


def gateway(response_tokens: int) -> Gateway:
    engine = SimEngine(step_ms=0, max_batch=4096, response_tokens=response_tokens)
    return Gateway(engine, GatewayConfig(max_queued=100_000))


async def stream_tokens(
    dialect: str, sessions: int, turns: int, response_tokens: int
) -> list[float]:
    """CPU µs per token of each turn: ``sessions`` sessions of ``dialect``, each ``turns``
    answers (a turn: every session's answer, at once)."""
    gw = gateway(response_tokens)
    await gw.engine.start()
    context = DialectContext(gw.response_store)
    kind = REALTIME if dialect == "realtime" else RESPONSES
    opened = []
    ended = [0]
    all_ended = asyncio.Event()
    for _ in range(sessions):
        session = gw.table.open(*kind.make(context))
        _count_ends(session.dialect, sessions, ended, all_ended)
        session.outbox.attach(SocketWire(FakeConnection(), None, gw.write_batch))  # type: ignore[arg-type]
        opened.append(session)
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}
    create_item = orjson.dumps({"type": "conversation.item.create", "item": item}).decode()
    create = orjson.dumps({"type": "response.create", "input": PROMPT, "store": False}).decode()
    await asyncio.sleep(0.05)
    figures = []
    for _ in range(turns):
        tokens_before = gw.engine.tokens_generated
        start = time.process_time()
        for session in opened:
            if dialect == "realtime":
                await session.deliver(session.dialect.decode(create_item))
                await session.deliver(session.dialect.decode('{"type":"response.create"}'))
            else:
                await session.deliver(session.dialect.decode(create))
        await all_ended.wait()
        all_ended.clear()
        ended[0] = 0
        spent = time.process_time() - start
        figures.append(1e6 * spent / max(gw.engine.tokens_generated - tokens_before, 1))
    for session in opened:
        session.close()
    await gw.table.wait_ended(5)
    await gw.scheduler.close()
    await gw.engine.close()
    return figures


class RequestTransport(CountingTransport):
    """An HTTP connection's transport whose client sends its next request as soon as an
    answer's end is written (a keep-alive client with no network between)."""

    def __init__(self, on_answer: Callable[[bytes], None]) -> None:
        super().__init__()
        self.on_answer = on_answer

    def write(self, data: bytes) -> None:
        super().write(data)
        self.on_answer(data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False


async def http_requests(
    body_name: str,
    connections: int,
    requests: int,
    *,
    stream: bool = False,
    response_tokens: int = 8,
) -> tuple[float, float]:
    """CPU µs per request and per token, each connection sending its next request when the
    last one's answer has ended, through the real HTTP service."""
    from bench.requests import _MARK, bodies

    gw = gateway(response_tokens)
    await gw.engine.start()
    service = HttpService(
        gw._routes(),
        websocket_paths=WEBSOCKET_PATHS,
        pending=gw.pending,
        handshake_timeout=5.0,
        keepalive_timeout=5.0,
        write_batch=gw.write_batch,
    )
    path, body = bodies(stream)[body_name]
    before, after = body.split(_MARK)
    head = b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path
    finished = asyncio.Event()
    answered = [0]
    loop = asyncio.get_running_loop()

    def request(n: int) -> bytes:
        numbered = b"%b%d%b" % (before, n, after)
        return head + b"Content-Length: %d\r\n\r\n%b" % (len(numbered), numbered)

    def client(index: int) -> None:
        sent = [0]

        def on_answer(data: bytes) -> None:
            if not data.endswith((b"}", b"0\r\n\r\n")):
                return  # a part of a streamed answer
            answered[0] += 1
            if answered[0] >= requests:
                finished.set()
            elif sent[0] * connections < requests:
                sent[0] += 1
                loop.call_soon(connection.data_received, request(index * requests + sent[0]))

        connection = HttpConnection(service, None, lambda: None)  # type: ignore[arg-type]
        connection.connection_made(RequestTransport(on_answer))  # type: ignore[arg-type]
        sent[0] += 1
        connection.data_received(request(index * requests))

    tokens_before = gw.engine.tokens_generated
    start = time.process_time()
    for index in range(connections):
        client(index)
    await finished.wait()
    spent = time.process_time() - start
    tokens = gw.engine.tokens_generated - tokens_before
    await gw.scheduler.close()
    await gw.engine.close()
    return 1e6 * spent / answered[0], 1e6 * spent / max(tokens, 1)


def _count_ends(dialect: Any, sessions: int, ended: list[int], all_ended: asyncio.Event) -> None:
    """Count each answer's end (once per answer, not per token): ``all_ended`` is set when
    every session's answer of a turn has ended."""
    inner = dialect.response_ended

    def response_ended(*args: Any) -> None:
        inner(*args)
        ended[0] += 1
        if ended[0] == sessions:
            all_ended.set()

    dialect.response_ended = response_ended


def run(make: Callable[[], Coroutine[Any, Any, T]], loop: str, profile: bool) -> T:
    profiler = cProfile.Profile() if profile else None
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        if profiler is not None:
            profiler.enable()
        result = runner.run(make())
        if profiler is not None:
            profiler.disable()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return result


def _show(name: str, unit: str, figures: list[float]) -> None:
    """The least of the figures (the one the other work on a shared machine disturbed
    least: compare these between versions), and their median."""
    median = statistics.median(figures)
    print(f"{name:10} CPU µs per {unit}: least {min(figures):.2f}, median {median:.2f}")


STREAMS = ("realtime", "responses")  # WebSocket dialects, one token per frame
# HTTP loads: (body, streamed): one-shot requests, or SSE at one token per event.
REQUESTS = {
    "chat": ("chat", False),
    "small": ("responses", False),
    "codex": ("codex", False),
    "sse": ("responses", True),
    "sse-chat": ("chat", True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inprocess", description=__doc__)
    parser.add_argument("--loop", default="uvloop")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="cProfile of the last round")
    parser.add_argument("--requests", type=int, default=1000, help="per round, one-shot")
    parser.add_argument(
        "--only", choices=(*STREAMS, *REQUESTS), action="append", help="(default: all)"
    )
    args = parser.parse_args(argv)
    chosen = args.only or (*STREAMS, *REQUESTS)
    for name in chosen:
        if name in STREAMS:
            turns: list[float] = []
            for r in range(args.rounds):
                turns += run(
                    lambda d=name: stream_tokens(d, args.sessions, args.turns, args.tokens),
                    args.loop,
                    args.profile and r == args.rounds - 1,
                )
            _show(name, "token", turns)
            continue
        body, stream = REQUESTS[name]
        figures = [
            run(
                lambda b=body, s=stream: http_requests(
                    b,
                    50 if s else 32,
                    args.requests // 10 if s else args.requests,
                    stream=s,
                    response_tokens=args.tokens if s else 8,
                ),
                args.loop,
                args.profile and r == args.rounds - 1,
            )
            for r in range(args.rounds)
        ]
        _show(name, "token" if stream else "request", [f[1] if stream else f[0] for f in figures])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
