"""The HTTP/1.1 layer over real sockets: keep-alive, pipelining, bodies and their limits,
malformed requests, streaming with backpressure and disconnects, timeouts, and the
WebSocket upgrade beside it on the same port."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.engines.sim import SimEngine
from gateway.server import Gateway
from gateway.transport.http1 import ClientDisconnected, HttpReply, HttpRequest
from gateway.transport.router import Router
from tests.support.harness import RawClient

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
CHUNK = b"data: " + b"x" * 65536 + b"\n\n"


class RouteGateway(Gateway):
    """The gateway plus a few routes that exercise what its own routes do not."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(
            SimEngine(step_ms=0), dataclasses.replace(GatewayConfig(port=0), **settings)
        )
        self.blocked = asyncio.Event()  # /flood: drain() had to wait
        self.resumed = asyncio.Event()  # /flood: ...and returned
        self.finished = asyncio.Event()  # a streaming handler's finally ran
        self.saw_disconnect = False

    def _routes(self) -> Router:
        router = super()._routes()
        router.add("POST", "/test/echo/{name}", self._echo, body_limit=1 << 20)
        router.add("GET", "/test/flood", self._flood)
        router.add("GET", "/test/wait", self._wait)
        router.add("GET", "/test/boom", self._boom)
        router.add("GET", "/test/boom-midway", self._boom_midway)
        return router

    async def _echo(self, request: HttpRequest, reply: HttpReply) -> None:
        reply.send_json(
            200,
            {"name": request.params["name"], "n": request.arg("n"), "body": request.body.decode()},
        )

    async def _flood(self, request: HttpRequest, reply: HttpReply) -> None:
        reply.start(200, [("Content-Type", "text/event-stream")])
        try:
            for _ in range(2000):  # 128 MiB at most: far beyond any socket buffer
                reply.write(CHUNK)
                if not reply.writable:
                    self.blocked.set()
                    await reply.drain()
                    self.resumed.set()
                    break
            reply.write(b"event: done\ndata: {}\n\n")
            reply.end()
        except ClientDisconnected:
            self.saw_disconnect = True
            raise
        finally:
            self.saw_disconnect |= reply.disconnected.is_set()
            self.finished.set()

    async def _wait(self, request: HttpRequest, reply: HttpReply) -> None:
        reply.start(200, [("Content-Type", "text/event-stream")])
        reply.write(b"data: first\n\n")
        try:
            await asyncio.Event().wait()  # a generation that never ends
        finally:
            self.saw_disconnect = reply.disconnected.is_set()
            self.finished.set()

    async def _boom(self, request: HttpRequest, reply: HttpReply) -> None:
        raise RuntimeError("boom")

    async def _boom_midway(self, request: HttpRequest, reply: HttpReply) -> None:
        reply.start(200, [("Content-Type", "text/plain")])
        reply.write(b"half")
        raise RuntimeError("boom midway")


@contextlib.asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[RouteGateway]:
    gateway = RouteGateway(**settings)
    await gateway.start()
    try:
        await gateway.wait_ready()
        yield gateway
    finally:
        await gateway.stop()


@pytest.fixture
async def gw() -> AsyncIterator[RouteGateway]:
    async with serving() as gateway:
        yield gateway


async def connect(gateway: Gateway, *, receive_buffer: int | None = None) -> Connection:
    if receive_buffer is None:
        return await asyncio.open_connection("127.0.0.1", gateway.port)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gateway.port))
    return await asyncio.open_connection(sock=sock, limit=4096)


async def read_response(
    reader: asyncio.StreamReader, *, head: bool = False
) -> tuple[int, dict[str, str], bytes]:
    """One response: its status, headers (lower-case names) and body (de-chunked)."""
    async with asyncio.timeout(10):
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in filter(None, lines[1:]):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if head or status < 200:
            return status, headers, b""
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                body += (await reader.readexactly(size + 2))[:-2]
            await reader.readexactly(2)
            return status, headers, body
        if "content-length" in headers:
            return status, headers, await reader.readexactly(int(headers["content-length"]))
        return status, headers, await reader.read()


async def closed(reader: asyncio.StreamReader) -> bool:
    """Does the server close the connection (within 5 s)?"""
    async with asyncio.timeout(5):
        with contextlib.suppress(ConnectionError):
            return await reader.read() == b""
    return True


async def no_request_in_progress(gateway: Gateway) -> None:
    async with asyncio.timeout(5):
        while gateway.http is not None and gateway.http.in_progress:
            await asyncio.sleep(0.005)


def get(path: str, *extra: str) -> bytes:
    return "".join(
        f"{line}\r\n" for line in (f"GET {path} HTTP/1.1", "Host: t", *extra, "")
    ).encode()


async def raw_response(reader: asyncio.StreamReader) -> bytes:
    """One response's bytes as sent (its body by Content-Length, or chunks to the last)."""
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        if b"\r\ntransfer-encoding: chunked\r\n" in head.lower():
            body = b""
            while not body.endswith(b"\r\n0\r\n\r\n") and body != b"0\r\n\r\n":
                body += await reader.readuntil(b"\r\n")
            return head + body
        length = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0] or 0)
        return head + await reader.readexactly(length)


# A header of obs-text: h11 takes it, the common-shape reader (request_head.py) does not.
H11_ONLY = "X-Note: caf\xe9"


@pytest.mark.parametrize(
    "request_lines",
    [
        ["GET /healthz HTTP/1.1"],
        ["GET /nope HTTP/1.1"],
        ["GET /test/boom HTTP/1.1"],
        ["POST /test/echo/b?n=3 HTTP/1.1", "Content-Type: text/plain", "Content-Length: 2"],
        ["DELETE /v1/realtime HTTP/1.1"],
        ["GET /healthz HTTP/1.1", "Connection: close"],
        ["GET /healthz HTTP/1.1", "Connection: keep-alive, Close"],
    ],
    ids=["json", "404", "500", "post-body", "405", "close", "close-token"],
)
async def test_the_common_shape_is_answered_as_h11_answers_it(
    gw: RouteGateway, request_lines: list[str]
) -> None:
    """Requests read without h11 (request_head.py) get the bytes h11 would have written:
    each sent plain and with a header that only h11 reads, on a connection of its own."""
    answers = []
    for extra in ((), (H11_ONLY,)):
        lines = [request_lines[0], "Host: t", *request_lines[1:], *extra, "", ""]
        body = b"hi" if "Content-Length: 2" in lines else b""
        reader, writer = await connect(gw)
        writer.write("\r\n".join(lines).encode("latin-1") + body)
        raw = await raw_response(reader)
        # The request id differs from request to request: the rest may not.
        start = raw.lower().index(b"x-request-id: ") + len(b"x-request-id: ")
        answers.append(raw[:start] + raw[raw.index(b"\r\n", start) :])
        if "close" in "".join(request_lines).lower():
            assert await closed(reader)
        else:  # kept alive: a second request on it is answered too
            writer.write(get("/healthz"))
            assert (await read_response(reader))[0] == 200
        writer.close()
    assert answers[0] == answers[1]


async def test_a_stream_read_without_h11_is_chunked_as_h11_chunks_it(gw: RouteGateway) -> None:
    answers = []
    for extra in ((), (H11_ONLY,)):
        reader, writer = await connect(gw)
        writer.write(get("/test/wait", *extra))
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            size = await reader.readuntil(b"\r\n")
            first = size + await reader.readexactly(int(size, 16) + 2)
        start = head.lower().index(b"x-request-id: ") + len(b"x-request-id: ")
        answers.append(head[:start] + head[head.index(b"\r\n", start) :] + first)
        writer.close()
        await gw.finished.wait()
        gw.finished.clear()
    assert answers[0] == answers[1]
    assert b"\r\nTransfer-Encoding: chunked\r\n" in answers[0]


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /healthz HTTP/1.1\nHost: t\n\n", 200),
        (b"GET /healthz HTTP/1.1\r\nHost: t\n\r\n", 200),
        (
            b"POST /test/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n"
            b"Content-Length: 3\r\n\r\nhi",
            400,
        ),
        (b"POST /test/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length : 2\r\n\r\nhi", 400),
        (b"POST /test/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length: -2\r\n\r\nhi", 400),
        (b"POST /test/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length: +2\r\n\r\nhi", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: t\rX: y\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: t\r\nX: a\x00b\r\n\r\n", 400),
        (
            b"POST /test/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length: 99999999999999999999"
            b"\r\n\r\n",
            413,
        ),
    ],
    ids=[
        "lf",
        "lf-then-crlf",
        "two-lengths",
        "space-before-colon",
        "negative",
        "plus",
        "bare-cr",
        "nul",
        "huge-length",
    ],
)
async def test_what_the_common_shape_reader_passes_on_h11_answers(
    gw: RouteGateway, request_bytes: bytes, status: int
) -> None:
    """Heads the common-shape reader (request_head.py) does not take go to h11 whole: a
    bare LF is served, and what could desynchronise a proxy's framing from ours is refused."""
    reader, writer = await connect(gw)
    writer.write(request_bytes)
    assert (await read_response(reader))[0] == status
    if status >= 400:
        assert await closed(reader)
    writer.close()


async def test_a_request_sent_a_byte_at_a_time_then_one_pipelined_in_the_same_read(
    gw: RouteGateway,
) -> None:
    reader, writer = await connect(gw)
    first = b"POST /test/echo/a HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"
    for i in range(len(first) - 1):
        writer.write(first[i : i + 1])
        await writer.drain()
    # Its last byte arrives with the whole of the next request (and the start of a third).
    writer.write(
        first[-1:] + b"POST /test/echo/b HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nx"
    )
    writer.write(b"GET /healthz HTTP/1.1\r\nHo")
    assert (await read_response(reader))[2] == b'{"name":"a","n":null,"body":"hi"}'
    assert (await read_response(reader))[2] == b'{"name":"b","n":null,"body":"x"}'
    writer.write(b"st: t\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_two_requests_on_one_connection(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    for _ in range(2):
        writer.write(get("/healthz"))
        status, headers, body = await read_response(reader)
        assert status == 200 and b'"status":"ok"' in body
        assert "connection" not in headers  # kept alive
    writer.close()


async def test_pipelined_requests_are_answered_in_order(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(
        get("/readyz")
        + b"HEAD /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
        + b"POST /test/echo/b HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"
        + get("/nope")
    )
    assert (await read_response(reader))[:1] == (200,)
    status, headers, _ = await read_response(reader, head=True)
    assert status == 200 and int(headers["content-length"]) > 0
    assert (await read_response(reader))[2] == b'{"name":"b","n":null,"body":"hi"}'
    status, _, body = await read_response(reader)
    assert status == 404 and b"Invalid URL (GET /nope)" in body
    writer.close()


async def test_a_chunked_body_with_path_and_query_parameters(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(
        b"POST /test/echo/caf%C3%A9?n=3&n=4 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
    )
    status, _, body = await read_response(reader)
    assert (status, body) == (200, '{"name":"café","n":"3","body":"abcdefg"}'.encode())
    writer.close()


async def test_expect_100_continue_is_answered_before_the_body(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(
        b"POST /test/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    assert (await read_response(reader))[0] == 100
    writer.write(b"ok")
    assert (await read_response(reader))[0] == 200
    writer.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_over_the_route_limit_is_413(gw: RouteGateway, chunked: bool) -> None:
    big = b"x" * (64 * 1024 + 1)  # the default limit (client secrets) plus one
    if chunked:
        framing, body = "Transfer-Encoding: chunked", b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
    else:
        framing, body = f"Content-Length: {len(big)}", big
    reader, writer = await connect(gw)
    writer.write(
        f"POST /v1/realtime/client_secrets HTTP/1.1\r\nHost: t\r\n{framing}\r\n\r\n".encode() + body
    )
    status, headers, text = await read_response(reader)
    assert (status, headers["connection"]) == (413, "close")
    assert b"65536 bytes" in text
    assert await closed(reader)
    writer.close()
    # A route that asks for more takes more.
    reader, writer = await connect(gw)
    writer.write(
        f"POST /test/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length: {len(big)}\r\n\r\n".encode()
        + big
    )
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_a_head_over_the_limit_is_431(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(get("/healthz", "X-Pad: " + "a" * 17000))
    status, _, body = await read_response(reader)
    assert (status, body) == (431, b"The request's headers are too large.\n")
    assert await closed(reader)
    writer.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /\r\n\r\n",
        b"GET / HTTP/1.1 extra\r\n\r\n",
        b"\x16\x03\x01\x02\x00\r\n\r\n",
    ],
    ids=["garbage", "no-version", "four-words", "tls"],
)
async def test_a_malformed_request_is_400_not_500(gw: RouteGateway, request_bytes: bytes) -> None:
    reader, writer = await connect(gw)
    writer.write(request_bytes)
    assert (await read_response(reader))[0] == 400
    assert await closed(reader)
    writer.close()


async def test_an_http_version_other_than_1_x_is_505(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert (await read_response(reader))[0] == 505
    writer.close()


@pytest.mark.parametrize(
    "request_bytes",
    [get("/healthz", "Connection: close"), b"GET /healthz HTTP/1.0\r\n\r\n"],
    ids=["connection-close", "http-1.0"],
)
async def test_connection_close_and_http_1_0_close_after_the_answer(
    gw: RouteGateway, request_bytes: bytes
) -> None:
    reader, writer = await connect(gw)
    writer.write(request_bytes)
    status, headers, _ = await read_response(reader)
    assert (status, headers["connection"]) == (200, "close")
    assert await closed(reader)
    writer.close()


async def test_head_then_get_on_one_connection(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(b"HEAD /test/flood HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers, _ = await read_response(reader, head=True)
    assert (status, headers["content-type"]) == (200, "text/event-stream")
    writer.write(get("/readyz"))
    assert (await read_response(reader))[2] == b'{"ready":true}'
    writer.close()


async def test_a_stream_waits_for_a_slow_reader_and_goes_on_when_it_reads(gw: RouteGateway) -> None:
    reader, writer = await connect(gw, receive_buffer=4096)
    writer.write(get("/test/flood"))
    async with asyncio.timeout(10):
        await gw.blocked.wait()  # the client reads nothing: drain() waits...
    await asyncio.sleep(0.2)
    assert not gw.resumed.is_set()  # ...and keeps waiting
    status, _, body = await read_response(reader)  # the client reads: the stream goes on
    assert status == 200 and body.endswith(b"event: done\ndata: {}\n\n")
    assert gw.resumed.is_set() and gw.finished.is_set() and not gw.saw_disconnect
    writer.write(get("/readyz"))  # and the connection serves on
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_a_client_gone_during_drain_ends_the_handler_at_once(gw: RouteGateway) -> None:
    _, writer = await connect(gw, receive_buffer=4096)
    writer.write(get("/test/flood"))
    async with asyncio.timeout(10):
        await gw.blocked.wait()
    writer.transport.abort()
    started = time.perf_counter()
    async with asyncio.timeout(5):
        await gw.finished.wait()
    assert time.perf_counter() - started < 1.0
    assert gw.saw_disconnect and not gw.resumed.is_set()
    await no_request_in_progress(gw)


async def test_a_waiting_handler_learns_that_its_client_closed(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(get("/test/wait"))
    async with asyncio.timeout(10):
        await reader.readuntil(b"data: first\n\n")
    writer.close()  # a FIN, nothing unread
    started = time.perf_counter()
    async with asyncio.timeout(5):
        await gw.finished.wait()
    assert time.perf_counter() - started < 1.0 and gw.saw_disconnect
    await no_request_in_progress(gw)  # its task is gone


async def test_a_failing_handler_is_500_and_logged_and_the_server_serves_on(
    gw: RouteGateway, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="gateway"):
        reader, writer = await connect(gw)
        writer.write(get("/test/boom"))
        status, _, body = await read_response(reader)
        assert (status, body) == (500, b"The gateway failed to answer; its log says why.\n")
        writer.write(get("/test/boom-midway"))  # same connection: kept alive after a 500
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            assert b" 200 " in head and b"chunked" in head
            assert (await reader.read()).startswith(b"4\r\nhalf\r\n")  # cut short, closed
        writer.close()
    assert [r.exc_info[1].args for r in caplog.records if r.exc_info and r.exc_info[1]] == [
        ("boom",),
        ("boom midway",),
    ]
    reader, writer = await connect(gw)
    writer.write(get("/healthz"))
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_an_idle_keep_alive_connection_is_closed_after_the_timeout() -> None:
    async with serving(keepalive_timeout=0.3) as gw:
        reader, writer = await connect(gw)
        writer.write(get("/healthz"))
        await read_response(reader)
        started = time.perf_counter()
        assert await closed(reader)
        assert 0.2 < time.perf_counter() - started < 2
        writer.close()


async def test_stop_closes_idle_keep_alive_connections_at_once(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(get("/healthz"))
    await read_response(reader)
    started = time.perf_counter()
    await gw.stop()
    assert time.perf_counter() - started < 1.0
    assert await closed(reader)
    writer.close()


def handshake() -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return get(
        "/v1/realtime",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    )


async def test_a_websocket_opens_beside_a_kept_alive_plain_connection(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(get("/healthz"))
    assert (await read_response(reader))[0] == 200
    async with RawClient.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime") as client:
        assert client.events[0]["type"] == "session.created"
        writer.write(get("/readyz"))  # the plain connection is still served meanwhile
        assert (await read_response(reader))[0] == 200
    writer.close()


async def test_a_kept_alive_connection_can_become_a_websocket(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(get("/healthz"))
    assert (await read_response(reader))[0] == 200
    writer.write(handshake())
    status, headers, _ = await read_response(reader, head=True)
    assert (status, headers["upgrade"]) == (101, "websocket")
    writer.close()


async def test_a_first_request_upgrade_in_pieces_and_any_case_becomes_a_websocket(
    gw: RouteGateway,
) -> None:
    # A connection's first request skips h11 once its head is whole: a head in several
    # reads, with the Upgrade header in another case, still opens the WebSocket.
    request = handshake().replace(b"Upgrade: websocket", b"upgrade:  WebSocket")
    reader, writer = await connect(gw)
    for piece in (request[:7], request[7:40], request[40:]):
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.01)  # separate reads on the server
    status, headers, _ = await read_response(reader, head=True)
    assert (status, headers["upgrade"]) == (101, "websocket")
    writer.close()


async def test_a_websocket_upgrade_elsewhere_is_404(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(handshake().replace(b"/v1/realtime", b"/healthz"))
    status, _, body = await read_response(reader)
    assert status == 404 and b"Invalid URL (GET /healthz)" in body
    writer.close()


async def _answer(request: HttpRequest, reply: HttpReply) -> None:
    reply.send_text(200, "routed")


async def _other(request: HttpRequest, reply: HttpReply) -> None:
    reply.send_text(200, "other")


def test_the_router_matches_patterns_methods_and_limits() -> None:
    router = Router(_other)
    router.add("GET", "/v1/responses/{id}", _answer)
    router.add("DELETE", "/v1/responses/{id}", _answer)
    router.add("POST", "/v1/responses/{id}/cancel", _answer, body_limit=1 << 20)
    router.add("*", "/any", _answer)
    target = router.resolve("POST", "/v1/responses/resp%5F1/cancel")
    assert (target.handler, dict(target.params), target.body_limit) == (
        _answer,
        {"id": "resp_1"},
        1 << 20,
    )
    assert router.resolve("HEAD", "/v1/responses/r").handler is _answer  # HEAD: the GET route
    assert router.resolve("PATCH", "/any").handler is _answer
    assert router.resolve("GET", "/v1/responses").handler is _other  # no match: the fallback
    assert router.resolve("GET", "/v1/responses/a/b").handler is _other  # {id}: one segment
    assert router.resolve("GET", "/v1/responses/r", websocket=True).handler is _other
    with pytest.raises(ValueError, match="already routed"):
        router.add("GET", "/v1/responses/{id}", _other)


async def test_a_method_a_pattern_has_no_route_for_is_405_with_allow(gw: RouteGateway) -> None:
    reader, writer = await connect(gw)
    writer.write(b"PUT /test/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert (status, headers["allow"]) == (405, "POST")
    assert b"Invalid method for URL (PUT /test/echo/x): send POST." in body
    writer.write(b"DELETE /healthz HTTP/1.1\r\nHost: t\r\n\r\n")  # kept alive after a 405
    status, headers, _ = await read_response(reader)
    assert (status, headers["allow"]) == (405, "GET, HEAD")
    writer.close()


async def test_stop_ends_a_stream_that_outlives_the_grace() -> None:
    async with serving(shutdown_grace=0.3) as gw:
        reader, writer = await connect(gw)
        writer.write(get("/test/wait"))
        async with asyncio.timeout(10):
            await reader.readuntil(b"data: first\n\n")
        started = time.perf_counter()
        await gw.stop()
        assert time.perf_counter() - started < 2.0
        assert gw.finished.is_set() and gw.saw_disconnect
        async with asyncio.timeout(5):  # the first chunk's end, then the close: cut short
            assert await reader.read() == b"\r\n"
        writer.close()
