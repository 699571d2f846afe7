"""Redis without a single point of failure, for tests: Sentinel and Cluster, from Debian's
``redis-server`` (tests/support/redis_server.py runs each process).

- :class:`SentinelGroup`: a primary, its replicas (``--replicaof``) and sentinels
  (``redis-server CONF --sentinel``), with a short ``down-after-milliseconds`` so that a
  killed primary is replaced within a second or two. Its :attr:`~SentinelGroup.url` is
  the gateway's ``redis+sentinel://`` store URL.
- :class:`ClusterGroup`: cluster nodes (``--cluster-enabled yes``), formed with
  ``redis-cli --cluster create`` into masters with a replica each, with a short
  ``cluster-node-timeout``. Its :attr:`~ClusterGroup.url` is ``redis+cluster://``.

Both, and :class:`Single` around one :class:`RedisServer`, answer the same few questions a
test asks (:class:`Topology`): the store URL, a client that reads any key, the server
that is primary for a key now, and a wait for the replacement of a killed primary
(returning how long it took).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any, Protocol

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from tests.support.redis_server import RedisServer, free_port, require_redis_server

SERVICE = "llmgw"
FAILOVER_TIMEOUT = 20.0  # seconds for a topology to promote a replica; it takes one or two
_POLL = 0.02
# A replica's first sync at once (Redis waits 5 s by default for more replicas to join it).
_FAST_SYNC = ("--repl-diskless-sync-delay", "0")


class Topology(Protocol):
    kind: str

    @property
    def url(self) -> str:
        """The gateway's ``--session-store`` URL."""

    def client(self) -> Any:
        """A synchronous client that reads and writes any key (close it after use)."""

    def primary_for(self, key: str) -> RedisServer:
        """The server that takes the writes of ``key`` now."""

    def wait_replaced(self, killed: RedisServer) -> float:
        """Until another server took over ``killed``'s keys; the seconds it took since
        this call."""

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The servers that replicate ``primary`` (one of them replaces it if it dies)."""


class Single:
    """One ``redis-server``: the topology with a single point of failure."""

    kind = "single"

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    def client(self) -> Any:
        return self.server.client()

    def primary_for(self, key: str) -> RedisServer:
        return self.server

    def wait_replaced(self, killed: RedisServer) -> float:
        raise AssertionError("a single Redis has nothing to promote")

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        return []


class SentinelGroup:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels watching them."""

    kind = "sentinel"

    def __init__(self, replicas: int = 1, sentinels: int = 3, down_after_ms: int = 400) -> None:
        self.servers: list[RedisServer] = []
        self.sentinels: list[RedisServer] = []
        self._replicas = replicas
        self._sentinel_count = sentinels
        self._down_after_ms = down_after_ms

    def start(self) -> SentinelGroup:
        primary = RedisServer(*_FAST_SYNC).start()
        self.servers.append(primary)
        for _ in range(self._replicas):
            replica = RedisServer(*_FAST_SYNC, "--replicaof", primary.host, str(primary.port))
            self.servers.append(replica.start())
        quorum = self._sentinel_count // 2 + 1
        config = (
            f"sentinel monitor {SERVICE} {primary.host} {primary.port} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {self._down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} 3000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        for replica in self.servers[1:]:
            config += f"sentinel known-replica {SERVICE} {replica.host} {replica.port}\n"
        # Each sentinel told of the others up front, instead of learning of them from the
        # primary's hello messages (every 2 s): the group is ready at once.
        ports = [free_port() for _ in range(self._sentinel_count)]
        ids = [secrets.token_hex(20) for _ in ports]
        for port, own in zip(ports, ids, strict=True):
            known = "".join(
                f"sentinel known-sentinel {SERVICE} 127.0.0.1 {p} {i}\n"
                for p, i in zip(ports, ids, strict=True)
                if i != own
            )
            sentinel = RedisServer(
                "--sentinel", port=port, config=f"{config}{known}sentinel myid {own}\n"
            )
            self.sentinels.append(sentinel.start())
        # Until every sentinel knows the replicas and the other sentinels (learnt from
        # the primary's hello channel): a failover needs both.
        deadline = time.monotonic() + FAILOVER_TIMEOUT
        for sentinel in self.sentinels:
            with sentinel.client() as s:
                while True:
                    info = s.sentinel_master(SERVICE)
                    if int(info["num-slaves"]) >= self._replicas and (
                        int(info["num-other-sentinels"]) >= self._sentinel_count - 1
                    ):
                        break
                    assert time.monotonic() < deadline, f"sentinel never saw the group: {info}"
                    time.sleep(_POLL)
        self._wait_replicas_synced(primary)
        return self

    @property
    def url(self) -> str:
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def primary(self) -> RedisServer:
        """The server the sentinels name as primary now."""
        with self.sentinels[0].client() as s:
            _host, port = s.sentinel_get_master_addr_by_name(SERVICE)
        return next(r for r in self.servers if r.port == int(port))

    def primary_for(self, key: str) -> RedisServer:
        return self.primary()

    def client(self) -> Any:
        return self.primary().client()

    def wait_replaced(self, killed: RedisServer) -> float:
        began = time.monotonic()
        while True:
            now = self.primary()
            if now is not killed:
                with contextlib.suppress(redis.exceptions.ConnectionError), now.client() as c:
                    if c.execute_command("ROLE")[0] == "master":
                        return time.monotonic() - began
            assert time.monotonic() - began < FAILOVER_TIMEOUT, "no replica was promoted"
            time.sleep(_POLL)

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        return [r for r in self.servers if r is not primary and r.running]

    def _wait_replicas_synced(self, primary: RedisServer) -> None:
        deadline = time.monotonic() + FAILOVER_TIMEOUT
        for replica in self.servers:
            if replica is primary:
                continue
            with replica.client() as c:
                while c.info("replication").get("master_link_status") != "up":
                    assert time.monotonic() < deadline, "a replica never synced"
                    time.sleep(_POLL)

    def close(self) -> None:
        for server in self.sentinels + self.servers:
            server.close()


class ClusterGroup:
    """``masters`` masters with ``replicas`` replicas each, formed into a Redis Cluster."""

    kind = "cluster"

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 500) -> None:
        self.nodes: list[RedisServer] = []
        self._masters = masters
        self._replicas = replicas
        self._node_timeout_ms = node_timeout_ms

    def start(self) -> ClusterGroup:
        flags = (*_FAST_SYNC, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        flags += ("--cluster-node-timeout", str(self._node_timeout_ms))
        # A replica whose master died a while ago may still take over (tests pause nodes).
        flags += ("--cluster-replica-validity-factor", "0")
        for _ in range(self._masters * (1 + self._replicas)):
            self.nodes.append(RedisServer(*flags, port=_cluster_port()).start())
        cli = shutil.which("redis-cli")
        assert cli is not None, "redis-cli is installed with redis-server (redis-tools)"
        addresses = [f"{n.host}:{n.port}" for n in self.nodes]
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                str(self._replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + FAILOVER_TIMEOUT
        for node in self.nodes:
            with node.client() as c:
                while not _cluster_ok(c) or not self._roles_settled(c):
                    assert time.monotonic() < deadline, "the cluster never formed"
                    time.sleep(_POLL)
        return self

    def _roles_settled(self, c: redis.Redis) -> bool:
        """Every node sees every other and each replica its master's link up."""
        known = c.execute_command("CLUSTER", "NODES").splitlines()
        if len(known) < len(self.nodes):
            return False
        if c.execute_command("ROLE")[0] == "slave":
            return bool(c.info("replication").get("master_link_status") == "up")
        return True

    @property
    def url(self) -> str:
        hosts = ",".join(f"{n.host}:{n.port}" for n in self.nodes[: self._masters])
        return f"redis+cluster://{hosts}"

    def client(self) -> Any:
        nodes = [ClusterNode(n.host, n.port) for n in self.nodes if n.running]
        return RedisCluster(startup_nodes=nodes, decode_responses=True)

    def primary_for(self, key: str) -> RedisServer:
        live = next(n for n in self.nodes if n.running)
        with live.client() as c:
            slot = c.execute_command("CLUSTER", "KEYSLOT", key)
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise AssertionError(f"no node serves slot {slot}")

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        with primary.client() as c:
            own = c.execute_command("CLUSTER", "MYID")
            lines = c.execute_command("CLUSTER", "REPLICAS", own)
        ports = {int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in lines}
        return [n for n in self.nodes if n.port in ports]

    def wait_replaced(self, killed: RedisServer) -> float:
        began = time.monotonic()
        live = [n for n in self.nodes if n.running and n is not killed]
        while True:
            with contextlib.suppress(redis.exceptions.ConnectionError), live[0].client() as c:
                masters = {int(m[1]) for *_, m in _slot_ranges(c)}
                if killed.port not in masters and _cluster_ok(c):
                    return time.monotonic() - began
            assert time.monotonic() - began < FAILOVER_TIMEOUT, "no replica was promoted"
            time.sleep(_POLL)

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def _cluster_port() -> int:
    """A free port below 55536 whose cluster bus port (10000 above it) is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _cluster_ok(c: redis.Redis) -> bool:
    info = c.execute_command("CLUSTER", "INFO")
    return "cluster_state:ok" in info and "cluster_slots_ok:16384" in info


def _slot_ranges(c: redis.Redis) -> list[tuple[int, int, list[Any]]]:
    return [
        (start, end, master) for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS")
    ]


@pytest.fixture(name="sentinel_group", scope="module")
def sentinel_group_fixture() -> Iterator[SentinelGroup]:
    """A primary, a replica and three sentinels, shared by the tests of a module."""
    require_redis_server()
    group = SentinelGroup()
    try:
        yield group.start()
    finally:
        group.close()


@pytest.fixture(name="cluster_group", scope="module")
def cluster_group_fixture() -> Iterator[ClusterGroup]:
    """Three masters with a replica each, shared by the tests of a module."""
    require_redis_server()
    group = ClusterGroup()
    try:
        yield group.start()
    finally:
        group.close()
