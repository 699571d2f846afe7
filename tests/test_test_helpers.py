"""The test helpers themselves: tests/support/redis_server.py (a real redis-server) and
tests/support/balancer.py (a TCP balancer without affinity), each against the real thing.

The Redis tests skip where ``redis-server`` is not installed, except under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, ConnectionClosedError

from tests.support.balancer import Address, Balancer, parse_address
from tests.support.redis_server import (  # the fixtures redis_server and redis_module
    RedisServer,
    RedisServerMissing,
    free_port,
    redis_cli,
    redis_module_fixture,  # noqa: F401
    redis_server_fixture,  # noqa: F401
    require_redis_server,
)

TIMEOUT = 10.0


# -- tests/support/redis_server.py ----------------------------------------------------


def answers(url: str) -> bool:
    try:
        return bool(redis_cli(url, "ping"))
    except redis.exceptions.ConnectionError:
        return False


def test_redis_server_starts_on_a_loopback_port_and_answers(redis_server: RedisServer) -> None:
    assert redis_server.running
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_cli(redis_server.url, "set", "greeting", "hi", "ex", 100)
    assert redis_cli(redis_server.url, "get", "greeting") == "hi"
    assert redis_cli(redis_server.url, "keys", "*") == ["greeting"]
    assert 0 < redis_cli(redis_server.url, "ttl", "greeting") <= 100
    assert redis_cli(redis_server.url, "get", "greeting", decode=False) == b"hi"
    # The settings it was started with: nothing kept on disk, loopback only.
    assert redis_cli(redis_server.url, "config", "get", "save") == {"save": ""}
    assert redis_cli(redis_server.url, "config", "get", "appendonly") == {"appendonly": "no"}
    assert redis_cli(redis_server.url, "config", "get", "bind") == {"bind": "127.0.0.1"}


def test_restart_keeps_the_port_and_the_settings(redis_server: RedisServer) -> None:
    port, pid = redis_server.port, redis_server.pid
    redis_cli(redis_server.url, "set", "k", "v")
    redis_server.restart()
    assert redis_server.port == port and redis_server.pid != pid
    assert answers(redis_server.url)
    assert redis_cli(redis_server.url, "keys", "*") == []  # --save '' --appendonly no
    assert redis_cli(redis_server.url, "config", "get", "appendonly") == {"appendonly": "no"}


def test_kill_then_start_on_the_same_port(redis_server: RedisServer) -> None:
    port = redis_server.port
    redis_server.kill()
    assert not redis_server.running and not answers(redis_server.url)
    redis_server.start()
    assert redis_server.port == port and answers(redis_server.url)


def test_stop_ends_the_process_and_a_client_sees_it_gone(redis_server: RedisServer) -> None:
    with redis_server.client(retry=Retry(NoBackoff(), 0)) as client:
        assert client.ping()
        redis_server.stop()
        assert not redis_server.running
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()
        redis_server.start()
        assert client.ping()  # the client reconnects to the same address


def test_appendonly_data_survive_a_kill() -> None:
    require_redis_server()
    with RedisServer(appendonly=True) as server:
        redis_cli(server.url, "set", "kept", "1")
        server.kill()
        server.start()
        assert redis_cli(server.url, "get", "kept") == "1"


def test_context_manager_stops_and_removes_its_folder() -> None:
    require_redis_server()
    with RedisServer() as server:
        folder, url = server.dir, server.url
        assert answers(url) and folder.is_dir()
    assert not server.running and not answers(url) and not folder.exists()


def test_a_missing_redis_server_is_a_clear_error() -> None:
    server = RedisServer(executable="no-such-redis-server-here")
    with pytest.raises(RedisServerMissing, match="apt-get install redis-server"):
        server.start()
    server.close()


def test_redis_module_is_one_server_for_the_module(redis_module: RedisServer) -> None:
    assert answers(redis_module.url)
    redis_cli(redis_module.url, "incr", "tests")


def test_redis_module_carries_over(redis_module: RedisServer) -> None:
    assert int(redis_cli(redis_module.url, "get", "tests")) >= 1


# -- tests/support/balancer.py --------------------------------------------------------


class Echo:
    """A tiny backend: sends ``name\\n`` on connect, then echoes every byte until EOF,
    then closes. ``hold`` (an Event) keeps it from reading until set."""

    def __init__(self, name: str, hold: asyncio.Event | None = None) -> None:
        self.name = name
        self.hold = hold
        self.server: asyncio.Server | None = None
        self.lost = 0  # connections that ended
        self.resets = 0  # of them, by a reset
        self.writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> Address:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            writer.write(self.name.encode() + b"\n")
            if self.hold is not None:
                await self.hold.wait()
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()
            await writer.wait_closed()
        except ConnectionResetError:
            self.resets += 1
        finally:
            self.lost += 1
            self.writers.discard(writer)
            writer.close()


@asynccontextmanager
async def echoes(*names: str, hold: asyncio.Event | None = None) -> AsyncIterator[list[Echo]]:
    servers = [Echo(name, hold) for name in names]
    for echo in servers:
        echo.server = await asyncio.start_server(echo.handle, "127.0.0.1", 0)
    try:
        yield servers
    finally:
        for echo in servers:
            assert echo.server is not None
            echo.server.close()
            for writer in list(echo.writers):
                writer.transport.abort()
            await echo.server.wait_closed()
        await asyncio.sleep(0)  # the aborted transports close on the next turn


@asynccontextmanager
async def through(
    lb: Balancer,
) -> AsyncIterator[tuple[str, asyncio.StreamReader, asyncio.StreamWriter]]:
    """A client connection through ``lb``, and the name of the backend it reached."""
    reader, writer = await asyncio.open_connection("127.0.0.1", lb.port)
    try:
        name = (await asyncio.wait_for(reader.readline(), TIMEOUT)).decode().strip()
        yield name, reader, writer
    finally:
        writer.close()
        with suppress(ConnectionError):
            await writer.wait_closed()


async def first_backend(lb: Balancer) -> str:
    async with through(lb) as (name, _, _):
        return name


@pytest.fixture
def no_resource_warnings() -> Iterator[None]:
    """Fails the test if a socket or transport was left to the garbage collector by this test.

    What earlier tests left is collected first, outside the record: otherwise their garbage,
    collected whenever the collector happens to run, is blamed on whichever test comes next.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    leaked = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaked, [str(w.message) for w in leaked]


async def test_round_robin_across_two_backends(no_resource_warnings: None) -> None:
    async with echoes("a", "b") as (a, b), Balancer([a.address, b.address]) as lb:
        assert lb.url == f"http://127.0.0.1:{lb.port}"
        assert lb.ws_url("/v1/realtime") == f"ws://127.0.0.1:{lb.port}/v1/realtime"
        assert [await first_backend(lb) for _ in range(6)] == ["a", "b"] * 3
        assert lb.connections == {a.address: 3, b.address: 3}
        await lb.wait_links(0)


async def test_bytes_pass_unchanged_both_ways_and_eof_is_passed_on(
    no_resource_warnings: None,
) -> None:
    payload = os.urandom(4 << 20) + bytes(range(256))
    async with echoes("a") as (a,), Balancer([a.address]) as lb:
        async with through(lb) as (name, reader, writer):
            assert name == "a"

            async def send() -> None:
                for i in range(0, len(payload), 100_000):
                    writer.write(payload[i : i + 100_000])
                    await writer.drain()
                writer.write_eof()  # the echo server ends its answer on EOF

            sender = asyncio.create_task(send())
            echoed = await asyncio.wait_for(reader.read(), TIMEOUT)  # until the backend's FIN
            await sender
            assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
        await lb.wait_links(0)
        assert a.lost == 1 and a.resets == 0


async def test_a_slow_reader_pauses_its_writer_then_everything_arrives(
    no_resource_warnings: None,
) -> None:
    payload = os.urandom(32 << 20)
    hold = asyncio.Event()  # the backend reads nothing until set
    async with (
        echoes("a", hold=hold) as (a,),
        Balancer([a.address], write_limit=64 << 10) as lb,
        through(lb) as (_, reader, writer),
    ):
        digest = hashlib.sha256()
        received = 0

        async def receive() -> None:
            nonlocal received
            while received < len(payload):
                data = await reader.read(1 << 20)
                assert data, "the echo ended early"
                digest.update(data)
                received += len(data)

        async def send() -> None:
            for i in range(0, len(payload), 1 << 20):
                writer.write(payload[i : i + (1 << 20)])
                await writer.drain()

        receiver = asyncio.create_task(receive())
        sender = asyncio.create_task(send())
        await asyncio.sleep(0.5)
        # The backend does not read: the balancer stopped reading the client, whose own
        # writes then stopped, far short of the payload.
        assert lb.pauses >= 1 and not sender.done() and received == 0
        hold.set()
        await asyncio.wait_for(asyncio.gather(sender, receiver), TIMEOUT * 3)
        assert digest.digest() == hashlib.sha256(payload).digest()


async def test_a_down_backend_is_passed_over_until_it_is_up(no_resource_warnings: None) -> None:
    async with (
        echoes("a", "b") as (a, b),
        Balancer([a.address, f"{b.address[0]}:{b.address[1]}"]) as lb,
    ):
        lb.mark_down(a.address)
        assert lb.is_down(a.address)
        assert [await first_backend(lb) for _ in range(3)] == ["b", "b", "b"]
        lb.mark_up(f"127.0.0.1:{a.address[1]}")
        assert sorted([await first_backend(lb) for _ in range(2)]) == ["a", "b"]
        assert lb.connections[a.address] == 1


async def test_a_refusing_backend_is_skipped_for_the_next(no_resource_warnings: None) -> None:
    closed = ("127.0.0.1", free_port())  # nothing listens there
    async with echoes("a") as (a,), Balancer([closed, a.address]) as lb:
        assert [await first_backend(lb) for _ in range(3)] == ["a", "a", "a"]
        assert lb.refused[closed] >= 1 and lb.connections[a.address] == 3
        # With every backend down, a client is reset rather than left hanging.
        lb.set_backends([closed])
        reader, writer = await asyncio.open_connection("127.0.0.1", lb.port)
        try:
            with pytest.raises(ConnectionResetError):
                if not await asyncio.wait_for(reader.read(1), TIMEOUT):
                    raise ConnectionResetError  # an EOF: a reset the kernel reported late
        finally:
            writer.close()
        assert lb.unrouted == 1


async def test_cut_all_drops_live_links_on_both_sides(no_resource_warnings: None) -> None:
    async with echoes("a", "b") as (a, b), Balancer([a.address, b.address]) as lb:
        async with through(lb) as (n1, r1, w1), through(lb) as (n2, r2, _):
            assert {n1, n2} == {"a", "b"}
            w1.write(b"ping")
            assert await asyncio.wait_for(r1.readexactly(4), TIMEOUT) == b"ping"
            await lb.wait_links(2)
            assert lb.active() == {a.address: 1, b.address: 1}
            assert lb.cut_all() == 2
            for reader in (r1, r2):
                with pytest.raises(ConnectionResetError):
                    if not await asyncio.wait_for(reader.read(1), TIMEOUT):
                        raise AssertionError("an orderly EOF, not a drop")
            await lb.wait_links(0)
            # The backends lost their connections too.
            for _ in range(200):
                if a.lost == b.lost == 1:
                    break
                await asyncio.sleep(0.01)
            assert a.lost == b.lost == 1 and a.resets == b.resets == 1
        # New connections go on being balanced after the drop.
        assert await first_backend(lb) in {"a", "b"}


async def test_a_websocket_through_the_balancer_then_a_drop_without_a_close_frame(
    no_resource_warnings: None,
) -> None:
    async def echo(ws: ServerConnection) -> None:
        with suppress(ConnectionClosed):
            async for message in ws:
                await ws.send(message)

    async with (
        serve(echo, "127.0.0.1", 0) as server,
        Balancer([server.sockets[0].getsockname()[:2]]) as lb,
        connect(lb.ws_url("/v1/realtime"), open_timeout=TIMEOUT) as ws,
    ):
        await ws.send("hello")
        assert await asyncio.wait_for(ws.recv(), TIMEOUT) == "hello"
        big = os.urandom(256 << 10)
        await ws.send(big)
        assert await asyncio.wait_for(ws.recv(), TIMEOUT) == big
        assert lb.cut_all() == 1
        with pytest.raises(ConnectionClosedError) as closed:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
        assert closed.value.rcvd is None  # no close frame came


async def test_mark_down_with_cut_drops_that_backends_links_only(
    no_resource_warnings: None,
) -> None:
    async with (
        echoes("a", "b") as (a, b),
        Balancer([a.address, b.address]) as lb,
        through(lb) as (n1, r1, w1),
        through(lb) as (n2, r2, w2),
    ):
        links = {n1: (r1, w1), n2: (r2, w2)}
        lb.mark_down(a.address, cut=True)
        with pytest.raises(ConnectionResetError):
            if not await asyncio.wait_for(links["a"][0].read(1), TIMEOUT):
                raise AssertionError("an orderly EOF, not a drop")
        reader, writer = links["b"]
        writer.write(b"still here")
        assert await asyncio.wait_for(reader.readexactly(10), TIMEOUT) == b"still here"
        assert lb.active() == {b.address: 1}


async def test_close_shuts_the_listener_and_every_link(no_resource_warnings: None) -> None:
    async with echoes("a") as (a,):
        lb = await Balancer([a.address]).start()
        port = lb.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.readline(), TIMEOUT) == b"a\n"
        await lb.close()
        assert lb.links == 0
        with suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        # It starts again on the same port.
        async with lb:
            assert lb.port == port and await first_backend(lb) == "a"


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_address("[::1]:8000") == ("::1", 8000)
    assert parse_address(("localhost", "9")) == ("localhost", 9)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        parse_address("8000")
