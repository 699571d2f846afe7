"""The upstream engine's HTTP client (gateway/engines/http_client.py) against a server
that answers with raw bytes: what a replica can get wrong is an error of the request,
never the gateway's process, and a replica faster than its reader is not buffered
without bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.engines import http_client
from gateway.engines.http_client import Pool, RemoteProtocolError


async def serve(answer: bytes, sent: asyncio.Event | None = None) -> AsyncIterator[str]:
    """A server answering every request with ``answer``; ``sent`` is set once the
    client has taken all of it in (the server's writes have drained)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        if sent is not None:
            sent.set()
        await reader.read()  # until the client closes

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\nhi".encode("latin-1"),
        b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nhi",
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX : y\r\nContent-Length: 0\r\n\r\n",
    ],
    ids=[
        "negative-chunk",
        "0x-chunk",
        "underscore-chunk",
        "no-crlf-after-chunk",
        "unicode-digit-length",
        "two-lengths",
        "not-http",
        "space-before-colon",
    ],
)
async def test_a_malformed_answer_is_a_protocol_error(answer: bytes) -> None:
    async for url in serve(answer):
        pool = Pool(url, read_timeout=5.0)
        with pytest.raises(RemoteProtocolError):
            async with asyncio.timeout(5):
                response = await pool.request("POST", "/v1/chat/completions", body=b"{}")
                await response.read()
        await pool.close()


async def test_chunks_with_extensions_and_trailers_are_read_whole() -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"6;name=value\r\ndata: \r\n3\r\nhi\n\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    async for url in serve(answer):
        pool = Pool(url)
        response = await pool.request("GET", "/")
        assert [line async for line in response.lines()] == ["data: hi"]
        await pool.close()


async def test_a_replica_faster_than_its_reader_is_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What arrives beyond MAX_UNREAD waits in the sockets, not in the gateway (the
    server cannot finish sending); it all comes once read."""
    monkeypatch.setattr(http_client, "MAX_UNREAD", 64 * 1024)
    body = b"x" * (64 * 1024 * 1024)  # far more than the sockets' buffers hold
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    sent = asyncio.Event()
    async for url in serve(answer, sent):
        pool = Pool(url)
        response = await pool.request("GET", "/")
        connection = response._connection
        async with asyncio.timeout(5):
            while not connection._paused:
                await asyncio.sleep(0.01)
        # Paused as the limit was passed: at most one read beyond it is held.
        assert connection._unread < 1024 * 1024 and not sent.is_set()
        assert await response.read() == body
        async with asyncio.timeout(5):
            await sent.wait()  # and the server could send it all
        await pool.close()
