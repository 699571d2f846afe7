"""The gateway's plain-HTTP routes on its port: /healthz names the model, HEAD answers every
route like GET without the body and is never a WebSocket handshake, and a request sent
byte by byte is still answered (HTTP/1.1 itself: tests/test_http1.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.harness import RawClient, RunningGateway

ROUTES = ["/", "/static/app.js", "/healthz", "/readyz", "/metrics", "/v1/realtime", "/nope"]


async def raw_http(gw: RunningGateway, request: bytes) -> bytes:
    """Send ``request`` as it is and read until the server closes: every byte it answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.gateway.port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read()  # to EOF: these requests say Connection: close
    finally:
        writer.close()


def split(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


async def test_healthz_names_the_model(gw: RunningGateway) -> None:
    health = await gw.get_json("/healthz")
    assert (health["engine"], health["model"]) == ("sim", "sim")


@pytest.mark.parametrize("path", ROUTES)
async def test_head_answers_like_get_without_the_body(gw: RunningGateway, path: str) -> None:
    request = f"{{}} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    get_status, get_headers, get_body = split(await raw_http(gw, request.format("GET").encode()))
    status, headers, body = split(await raw_http(gw, request.format("HEAD").encode()))
    assert status == get_status
    assert body == b""
    assert headers["content-type"] == get_headers["content-type"]
    if path != "/metrics":  # metrics change between the two requests
        assert headers["content-length"] == str(len(get_body))


async def test_head_is_never_a_websocket_handshake(gw: RunningGateway) -> None:
    request = (
        b"HEAD /v1/realtime HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade, close\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    status, _, body = split(await raw_http(gw, request))
    assert (status, body) == (426, b"")
    assert not gw.gateway.sessions


async def test_a_request_arriving_byte_by_byte_is_still_answered(gw: RunningGateway) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.gateway.port)
    for byte in b"HEAD /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n":
        writer.write(bytes([byte]))
        await writer.drain()
    async with asyncio.timeout(10):
        status, _, body = split(await reader.read())
    writer.close()
    assert (status, body) == (200, b"")
    async with RawClient.connect(gw.ws_url):  # and the WebSocket still opens after all that
        pass
