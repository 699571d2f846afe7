"""The connection before it is a WebSocket, over raw sockets: malformed credential headers,
the handshake limits, plain HTTP methods, and shutdown with idle connections (issue 16)."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import resource
import signal
import sys
import time

import pytest
from websockets.exceptions import InvalidMessage

from gateway.__main__ import (
    build_parser,
    config_from_args,
    not_a_client_fault,
    raise_open_file_limit,
)
from gateway.config import GatewayConfig
from gateway.engines.sim import SimEngine
from gateway.server import Gateway
from tests.support.harness import RawClient, running_gateway
from tests.test_shutdown import free_port, wait_ready

UPGRADE = (
    b"GET /v1/realtime HTTP/1.1\r\nHost: gateway\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
)


async def exchange(port: int, request: bytes) -> tuple[int, bytes, bytes]:
    """Send ``request`` on a fresh TCP connection; the status, head and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        async with asyncio.timeout(5):
            answer = await reader.read(65536)
            while b"\r\n\r\n" not in answer:
                more = await reader.read(65536)
                assert more, answer
                answer += more
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), head, body


def handshake(*headers: bytes) -> bytes:
    key = b"Sec-WebSocket-Key: " + base64.b64encode(os.urandom(16)) + b"\r\n"
    return UPGRADE + key + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ((b"Authorization: Bearer sekret", b"Authorization: Bearer sekret"), b"Authorization"),
        ((b"Origin: https://chat.example", b"Origin: https://chat.example"), b"Origin"),
        (("Origin: https://chät.example".encode(),), b"Origin header must be ASCII"),
        (("Authorization: Bearer sékret".encode(),), b"Authorization header must be ASCII"),
        (
            ("Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.sék".encode(),),
            b"Sec-WebSocket-Protocol header must be ASCII",
        ),
    ],
    ids=["authorization-twice", "origin-twice", "origin-utf8", "key-utf8", "subprotocol-utf8"],
)
async def test_malformed_credential_headers_get_a_plain_400(
    headers: tuple[bytes, ...], reason: bytes
) -> None:
    async with running_gateway(
        SimEngine(step_ms=0), api_keys=("sekret",), allowed_origins=("https://chat.example",)
    ) as gw:
        port = gw.gateway.port
        status, _, body = await exchange(port, handshake(*headers))
        assert status == 400 and reason in body, body
        status, _, _ = await exchange(port, handshake(b"Authorization: Bearer sekret"))
        assert status == 101  # and the gateway serves on


async def test_an_unexpected_handshake_failure_is_answered_500_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(Gateway):
        def health(self) -> dict[str, object]:
            raise RuntimeError("health broke")

    gateway = Broken(SimEngine(step_ms=0), GatewayConfig(port=0))
    await gateway.start()
    try:
        with caplog.at_level(logging.ERROR, logger="gateway"):
            status, _, _ = await exchange(gateway.port, b"GET /healthz HTTP/1.1\r\n\r\n")
        assert status == 500
        failures = [r for r in caplog.records if r.name == "gateway.server"]
        assert failures and failures[0].exc_info is not None
        assert "health broke" in str(failures[0].exc_info[1])
    finally:
        await gateway.stop()


def test_the_log_filter_hides_client_faults_only() -> None:
    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord(
            "websockets.server", logging.ERROR, "", 0, "opening handshake failed", (),
            (type(exc), exc, None),
        )  # fmt: skip

    assert not not_a_client_fault(record(InvalidMessage("did not receive a valid HTTP request")))
    assert not not_a_client_fault(record(EOFError()))
    assert not_a_client_fault(record(RuntimeError("a bug of ours")))
    assert not_a_client_fault(record(KeyError("x")))


async def test_stop_does_not_wait_for_a_connection_that_sent_nothing() -> None:
    gateway = Gateway(SimEngine(step_ms=0), GatewayConfig(port=0))
    await gateway.start()
    await gateway.wait_ready()
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    async with asyncio.timeout(5):  # until the gateway holds it
        while not len(gateway.pending):
            await asyncio.sleep(0.005)
    started = time.perf_counter()
    await gateway.stop()
    assert time.perf_counter() - started < 1.0  # 6 s before: both 3 s grace periods
    assert await reader.read() == b""  # it was closed
    writer.close()


async def test_sigterm_with_an_idle_connection_exits_promptly() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--engine", "sim", "--port", str(port),
    )  # fmt: skip
    try:
        await wait_ready(port)
        idle = await asyncio.open_connection("127.0.0.1", port)
        async with RawClient.connect(f"ws://127.0.0.1:{port}/v1/realtime") as client:
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            async with asyncio.timeout(10):
                assert await proc.wait() == 0
            assert time.monotonic() - started < 2.0
            assert client.ws.close_code == 1001 or await client.ws.wait_closed() is None
        idle[1].close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_connections_still_in_the_handshake_are_capped_oldest_first() -> None:
    async with running_gateway(SimEngine(step_ms=0), max_handshakes=3) as gw:
        idle = [await asyncio.open_connection("127.0.0.1", gw.gateway.port) for _ in range(5)]
        for reader, _ in idle[:2]:  # the two oldest were dropped
            async with asyncio.timeout(5):
                assert await reader.read() == b""
        assert len(gw.gateway.pending) == 3
        async with RawClient.connect(gw.ws_url) as c:  # a real client still gets in,
            assert c.events[0]["type"] == "session.created"
        async with asyncio.timeout(5):  # at the cost of the oldest idle one
            assert await idle[2][0].read() == b""
        assert len(gw.gateway.pending) == 2  # and left the count once its request came
        metrics = (await gw.get("/metrics"))[1].decode()
        assert 'gateway_handshakes_dropped_total{reason="limit"} 3.0' in metrics
        for _, writer in idle:
            writer.close()


async def test_a_connection_that_sends_nothing_is_closed_after_the_handshake_timeout() -> None:
    async with running_gateway(SimEngine(step_ms=0), handshake_timeout=0.3) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.gateway.port)
        started = time.perf_counter()
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        assert 0.2 < time.perf_counter() - started < 2
        writer.close()


async def test_other_methods_are_answered_on_the_same_port() -> None:
    async with running_gateway(SimEngine(step_ms=0)) as gw:
        port = gw.gateway.port
        status, head, body = await exchange(port, b"HEAD /healthz HTTP/1.1\r\nHost: g\r\n\r\n")
        assert status == 200 and body == b"" and b"content-length: " in head.lower()
        status, head, _ = await exchange(port, b"DELETE /healthz HTTP/1.1\r\n\r\n")
        assert status == 405 and b"Allow: GET, HEAD" in head
        chunked = b"POST /v1/realtime/client_secrets HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        assert (await exchange(port, chunked + b"2\r\n{}\r\n0\r\n\r\n"))[0] == 200
        huge = b"POST /v1/realtime/client_secrets HTTP/1.1\r\nContent-Length: 999999\r\n\r\n"
        assert (await exchange(port, huge))[0] == 413
        assert (await exchange(port, b"POST /x HTTP/1.1\r\nno colon\r\n\r\n"))[0] == 400
        async with RawClient.connect(gw.ws_url):  # and the WebSocket is untouched
            pass


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        raise_open_file_limit()
        raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raised == hard or (hard == resource.RLIM_INFINITY and raised >= 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_security_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_GATEWAY_API_KEY", "from-env")
    argv = ["--api-key", "a", "--api-key", "b", "--handshake-timeout", "2.5"]
    argv += ["--max-handshakes", "64", "--client-secret-ttl", "120"]
    argv += ["--client-secret-url", "/app/secret"]
    config = config_from_args(build_parser().parse_args(argv))
    assert [k.key for k in config.api_keys] == ["a", "b", "from-env"]
    assert (config.handshake_timeout, config.max_handshakes) == (2.5, 64)
    assert (config.client_secret_ttl, config.client_secret_url) == (120, "/app/secret")
    defaults = config_from_args(build_parser().parse_args([]))
    assert (defaults.handshake_timeout, defaults.max_handshakes) == (5.0, 1024)
