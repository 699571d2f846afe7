"""Which Redis the session store talks to, and how: one server, Sentinel, or a Cluster.

``--session-store`` names it (one flag for all three; docs/deployment.md):

- ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`` (``rediss://`` for TLS, ``unix://PATH``):
  one server, as redis-py's ``from_url`` takes it;
- ``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]``: the
  sentinels (port 26379 by default) and the service they watch; the store writes to the
  primary they name, and after a failover to the one they name next. The password is the
  data servers'; a sentinel's own goes in ``?sentinel_password=``;
- ``redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]``: any nodes of a Redis
  Cluster (port 6379 by default), from which the client learns the rest.

What the store asks of a topology (:class:`Topology`) is small: a redis-py client for
single commands and reads (``redis.asyncio.Redis``, or ``RedisCluster``); the node a key
lives on (one name for one server or Sentinel; the slot's primary in a cluster), and a
connection of the store's own to it, where a lane pipelines its writes; learning the
primaries again after a failure; a relay channel (Cluster: sharded pub/sub, so that a
message goes to the one shard a channel hashes to and its receiver count is true);
and whether writes are replicated (then a takeover waits for a replica to have its lease).

Nothing here retries: a failure raises (``RedisError``/``OSError``), and the store's
callers retry as they see fit (store_reads.py, store_lanes.py).
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://")
MAX_CONNECTIONS = 256  # per node: a burst of resumes shares them with relays' tails
SOCKET_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0
WAIT_REPLICA_MS = 200  # a takeover's lease, until one replica has it (then it goes on)


class StoreUrlError(ValueError):
    """A ``--session-store`` URL that names no Redis the store can use."""


@dataclass(frozen=True, slots=True)
class StoreUrl:
    """A ``--session-store`` URL, taken apart."""

    kind: str  # "single", "sentinel" or "cluster"
    url: str
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)


def parse(url: str) -> StoreUrl:
    """``url`` taken apart; raises :class:`StoreUrlError` saying what is wrong."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return StoreUrl("single", url)
    scheme, sep, _ = url.partition("://")
    if scheme not in ("redis+sentinel", "redis+cluster") or not sep:
        raise StoreUrlError(
            "redis://HOST:PORT/DB (rediss:// for TLS), redis+sentinel://HOST:PORT,.../SERVICE/DB "
            "or redis+cluster://HOST:PORT,..."
        )
    parts = urllib.parse.urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    default_port = 26379 if scheme == "redis+sentinel" else 6379
    hosts = tuple(_host(h, default_port) for h in hostlist.split(",") if h)
    if not hosts:
        raise StoreUrlError(f"{scheme}:// needs at least one HOST[:PORT]")
    path = [p for p in parts.path.split("/") if p]
    query = urllib.parse.parse_qs(parts.query)
    common = {
        "hosts": hosts,
        "username": urllib.parse.unquote(user) or None,
        "password": urllib.parse.unquote(password) or None,
    }
    if scheme == "redis+cluster":
        if path:
            raise StoreUrlError("redis+cluster:// takes no /DB: a cluster has database 0 only")
        return StoreUrl("cluster", url, **common)  # type: ignore[arg-type]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise StoreUrlError("redis+sentinel:// needs /SERVICE, or /SERVICE/DB, after the hosts")
    return StoreUrl(
        "sentinel",
        url,
        service=path[0],
        db=int(path[1]) if len(path) == 2 else 0,
        sentinel_password=query.get("sentinel_password", [None])[0],
        **common,  # type: ignore[arg-type]
    )


def _host(text: str, default_port: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreUrlError(f"{text!r}: the port must be a number from 1 to 65535")
    return host.strip("[]"), int(port)


def safe(url: str) -> str:
    """``url`` without its password or query (which may hold one), for logs and /healthz."""
    scheme, sep, rest = url.partition("://")
    _, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host.partition('?')[0]}" if sep else url


class Topology:
    """One Redis server (or a Sentinel-watched primary): one node, named ``""``."""

    kind = "single"
    replicated = False  # writes reach a replica that a failover promotes

    def __init__(self, client: Any) -> None:
        self.client: Any = client  # redis.asyncio.Redis, or RedisCluster

    def node_of(self, key: str) -> str:
        return ""

    async def connect(self, node: str) -> AbstractConnection:
        """A connection to ``node`` for the caller alone (give it back with :meth:`release`)."""
        connection: AbstractConnection = await self.client.connection_pool.get_connection()
        return connection

    async def release(
        self, node: str, connection: AbstractConnection, *, broken: bool = False
    ) -> None:
        """Give back a connection :meth:`connect` gave (``broken``: closed first)."""
        if broken:
            with contextlib.suppress(Exception):
                await connection.disconnect()
        await self.client.connection_pool.release(connection)

    async def refresh(self) -> None:
        """After a failure: learn the primaries again (a new connection does, here)."""

    async def execute_on(self, key: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``commands`` on one connection to ``key``'s node, in order; their replies."""
        node = self.node_of(key)
        connection = await self.connect(node)
        try:
            packed = connection.pack_commands(commands)
            await connection.send_packed_command(packed, check_health=False)
            replies = [await connection.read_response() for _ in commands]
        except BaseException:
            await self.release(node, connection, broken=True)
            raise
        await self.release(node, connection)
        return replies

    async def publish(self, channel: str, message: bytes) -> int:
        """Send ``message`` on ``channel``; how many subscribers received it."""
        return int(await self.client.publish(channel, message))

    async def messages(self, channel: str) -> AsyncIterator[bytes]:
        """What ``channel`` receives, until the connection fails (raises)."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            async for message in pubsub.listen():
                yield message["data"]
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


class SentinelTopology(Topology):
    """The primary a set of sentinels names; a connection made after a failover (or one
    refused with READONLY by a demoted primary, which redis-py turns into a
    ``ConnectionError``) asks them again."""

    kind = "sentinel"
    replicated = True

    def __init__(self, client: Any, sentinel: Sentinel) -> None:
        super().__init__(client)
        self.sentinel = sentinel

    async def aclose(self) -> None:
        await super().aclose()
        await self.sentinel.aclose()


class ClusterTopology(Topology):
    """A Redis Cluster: each key on its slot's primary; sharded pub/sub for relays."""

    kind = "cluster"
    replicated = True

    def __init__(self, client: RedisCluster) -> None:
        super().__init__(client)
        self.cluster = client
        self._ready = False

    def node_of(self, key: str) -> str:
        node = self.cluster.get_node_from_key(key)
        if node is None:
            raise redis.ConnectionError(f"no node of the cluster serves {key!r} now")
        name: str = node.name
        return name

    async def connect(self, node: str) -> AbstractConnection:
        if not self._ready:
            await self.refresh()
        found = self.cluster.get_node(node_name=node)
        if found is None:
            raise redis.ConnectionError(f"the cluster no longer has node {node}")
        connection = found.acquire_connection()
        try:
            await connection.connect()  # type: ignore[no-untyped-call]
        except BaseException:
            found.release(connection)
            raise
        return connection

    async def release(
        self, node: str, connection: AbstractConnection, *, broken: bool = False
    ) -> None:
        if broken:
            with contextlib.suppress(Exception):
                await connection.disconnect()
        found = self.cluster.get_node(node_name=node)
        if found is not None and isinstance(connection, Connection):
            found.release(connection)

    async def refresh(self) -> None:
        if not self._ready:
            await self.cluster.initialize()  # the first: nodes and slots from scratch
            self._ready = True
            return
        # A slot map read again from the nodes now: a replica promoted since (the
        # client's own initialize() refreshes only after errors of its own commands).
        await self.cluster.nodes_manager.initialize()
        # The node redis-py asks for the keys of a command whose keys it cannot find
        # itself (XREAD ... STREAMS: a relay's tail) is set by its own initialize() only:
        # left on a primary that was killed, every such command would fail for good.
        self.cluster.commands_parser.node = self.cluster.nodes_manager.default_node

    async def publish(self, channel: str, message: bytes) -> int:
        if not self._ready:
            await self.refresh()
        return int(await self.cluster.spublish(channel, message))

    async def messages(self, channel: str) -> AsyncIterator[bytes]:
        if not self._ready:
            await self.refresh()
        pubsub = self.cluster.pubsub()
        try:
            await pubsub.ssubscribe(channel)
            while True:
                message = await pubsub.get_sharded_message(
                    ignore_subscribe_messages=True, timeout=1.0
                )
                if message is not None and message.get("type") == "smessage":
                    yield message["data"]
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool that makes a command wait for a free connection rather than fail,
    as the one-server pool does."""


def connect(url: str) -> Topology:
    """The topology ``url`` names (nothing is connected yet)."""
    parsed = parse(url)
    timeouts: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": CONNECT_TIMEOUT,
    }
    auth: dict[str, Any] = {"username": parsed.username, "password": parsed.password}
    if parsed.kind == "single":
        # A bounded pool that makes a command wait for a connection rather than fail: a
        # burst of resumes (a drained gateway's clients) shares it with relays' tails.
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=MAX_CONNECTIONS, timeout=10, health_check_interval=5, **timeouts
        )
        return Topology(redis.Redis(connection_pool=pool))
    if parsed.kind == "sentinel":
        sentinel = Sentinel(
            list(parsed.hosts),
            sentinel_kwargs={"password": parsed.sentinel_password, **timeouts},
            **timeouts,
        )
        client = sentinel.master_for(
            parsed.service,
            connection_pool_class=_BlockingSentinelPool,
            db=parsed.db,
            max_connections=MAX_CONNECTIONS,
            timeout=10,
            **auth,
        )
        return SentinelTopology(client, sentinel)
    nodes = [ClusterNode(host, port) for host, port in parsed.hosts]
    cluster = RedisCluster(startup_nodes=nodes, max_connections=MAX_CONNECTIONS, **auth, **timeouts)
    return ClusterTopology(cluster)
