"""The Redis session store on Redis Sentinel and on a Redis Cluster beside a single Redis,
in the same run: ``python -m bench.store_topologies`` (``make bench`` runs it too).

- ``cpu``: one token per frame, the sim flat out, 50 sessions (as bench/store.py's
  ``cpu``): the gateway's CPU per token and its saturated tokens per second with
  ``--session-store`` on one Redis, on Sentinel (a primary, a replica, 3 sentinels) and
  on a 3-master cluster (a replica each), the order rotated every round; each topology
  against the single Redis of the same round (target: within 10 %).
- ``failover``: 20 sessions streaming on gateway A (B beside it, on the same store), the
  primary that holds the first session's keys killed (SIGKILL): the time from the kill
  to the first flush A writes again (its ``gateway_session_store_errors_total`` went up
  and ``gateway_session_store_up`` is 1 again), and to the first delta of an answer
  whose client lost its connection at the kill and resumed at once on B (a relay, which
  waits for the store rather than fail). Each round a fresh topology.

The topologies are tests/support/redis_topologies.py's (Debian's ``redis-server``).
Results: bench/results/store_topologies.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect

from bench.procs import gateway_argv, server_process
from bench.store import CREATE_ITEM, _Client, _span
from bench.turns import measure, realtime_turns, summary

RESULTS = Path(__file__).parent / "results"
KINDS = ("single", "sentinel", "cluster")


def _topology(kind: str) -> Any:
    from tests.support import redis_topologies as topologies
    from tests.support.redis_server import RedisServer

    if kind == "single":
        return topologies.Single(RedisServer().start())
    group = topologies.SentinelGroup() if kind == "sentinel" else topologies.ClusterGroup()
    return group.start()


def _close(topology: Any) -> None:
    if hasattr(topology, "close"):
        topology.close()
    else:
        topology.server.close()


def _primaries(topology: Any) -> list[int]:
    """The pids of the servers that take writes (their CPU counts beside the gateway's)."""
    if hasattr(topology, "server"):
        return [topology.server.pid]
    if hasattr(topology, "sentinels"):
        return [topology.primary().pid]
    return [n.pid for n in topology.nodes[:3]]


def cpu(rounds: int, seconds: float, sessions: int) -> dict[str, Any]:
    rows: dict[str, dict[str, list[float]]] = {}
    running = {kind: _topology(kind) for kind in KINDS}
    try:
        for r in range(rounds):
            for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
                topology = running[kind]
                extra = ["--session-store", topology.url]
                argv = gateway_argv(loop="uvloop", step_ms=0, response_tokens=300, extra=extra)
                with server_process(argv) as s:
                    clients = [lambda stop, n, url=s.ws_url: realtime_turns(url, stop, n)]
                    also = dict.fromkeys(_primaries(topology), 0.0)
                    us, rate = asyncio.run(measure(s.pid, seconds, clients * sessions, also))
                row = rows.setdefault(kind, {"us_per_token": [], "tokens_per_s": []})
                row["us_per_token"].append(us)
                row["tokens_per_s"].append(rate)
                row.setdefault("redis_us_per_token", []).append(sum(also.values()))
                print(f"cpu {kind:9} {us:6.1f} us/token {rate:8.0f} tokens/s", flush=True)
    finally:
        for topology in running.values():
            _close(topology)
    out: dict[str, Any] = {k: {m: summary(v) for m, v in row.items()} for k, row in rows.items()}
    for kind in KINDS[1:]:
        out[f"{kind}/single"] = {
            m: summary([b / a for a, b in zip(rows["single"][m], rows[kind][m], strict=True)])
            for m in ("us_per_token", "tokens_per_s")
        }
    return out


async def _metric(address: tuple[str, int], name: str) -> float:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    text = (await reader.read()).decode()
    writer.close()
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _open(url: str) -> _Client:
    c = _Client()
    c.ws = await connect(url, max_size=None, open_timeout=60)
    created = await c.recv()
    c.session, c.token = created["session"]["id"], created["resume_token"]
    await c.ws.send(CREATE_ITEM)
    await c.ws.send('{"type":"response.create"}')
    while (await c.recv())["type"] != "response.output_text.delta":
        pass
    return c


async def _resumed_delta(c: _Client, url: str, since: float) -> float:
    """``c`` resumed on ``url``: the seconds from ``since`` to its next delta."""
    async with connect(url, max_size=None, open_timeout=60) as ws:
        await ws.recv()
        last = c.events[-1]["sequence_number"]
        ask = {"session_id": c.session, "resume_token": c.token, "last_sequence_number": last}
        await ws.send(orjson.dumps({"type": "session.resume", **ask}).decode())
        c.ws = ws
        assert (await c.recv())["type"] == "session.resumed", c.events[-1]
        while (await c.recv())["type"] != "response.output_text.delta":
            pass
        return time.monotonic() - since


async def _failover(topology: Any, a: Any, b: Any, sessions: int) -> tuple[float, float]:
    from gateway.cluster.store_writes import log_key

    clients = await asyncio.gather(*(_open(a.ws_url) for _ in range(sessions)))
    address = ("127.0.0.1", a.port)
    errors = await _metric(address, "gateway_session_store_errors_total")
    victim = topology.primary_for(log_key(clients[0].session))
    killed_at = time.monotonic()
    victim.kill()
    assert clients[0].ws is not None
    clients[0].ws.transport.abort()
    resuming = asyncio.create_task(_resumed_delta(clients[0], b.ws_url, killed_at))
    while True:  # polled: the figure is the gateway's, read from outside as a user would
        failed = await _metric(address, "gateway_session_store_errors_total") > errors
        if failed and await _metric(address, "gateway_session_store_up") == 1:
            break
        await asyncio.sleep(0.01)
    writable = time.monotonic() - killed_at
    resumed = await resuming
    for c in clients[1:]:
        assert c.ws is not None
        await c.ws.close()
    return writable, resumed


def failover(rounds: int, sessions: int) -> dict[str, Any]:
    rows: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for kind in KINDS[1:]:
            topology = _topology(kind)
            try:
                extra = ["--session-store", topology.url]
                argv = gateway_argv(loop="uvloop", step_ms=20, response_tokens=400, extra=extra)
                with server_process(argv) as a, server_process(argv) as b:
                    writable, resumed = asyncio.run(_failover(topology, a, b, sessions))
            finally:
                _close(topology)
            row = rows.setdefault(kind, {"writable_s": [], "resumed_s": []})
            row["writable_s"].append(writable)
            row["resumed_s"].append(resumed)
            print(f"failover {kind:9} writable {writable:.2f} s, resumed {resumed:.2f} s")
    return {k: {m: summary(v) for m, v in row.items()} for k, row in rows.items()}


def report(results: dict[str, Any]) -> str:
    n = results["rounds"]
    lines = ["# The session store on Sentinel and Cluster beside one Redis", ""]
    if "cpu" in results:
        c = results["cpu"]
        lines += [
            "## One token per frame, the sim flat out (50 sessions, 300-token answers), "
            f"median (min–max) of {n} rounds, the order rotated",
            "",
            "| store | gateway CPU µs per token | tokens/s (saturated) "
            "| primaries' CPU µs per token |",
            "|---|---|---|---|",
        ]
        for kind in KINDS:
            row = c[kind]
            lines.append(
                f"| {kind} | {_span(row['us_per_token'])} | {_span(row['tokens_per_s'], 0)} "
                f"| {_span(row['redis_us_per_token'])} |"
            )
        for kind in KINDS[1:]:
            ratio = c[f"{kind}/single"]
            lines.append(
                f"| {kind} ÷ single (same round) | ×{_span(ratio['us_per_token'])} | "
                f"×{_span(ratio['tokens_per_s'])} (target within 10 %) | |"
            )
        lines.append("")
    if "failover" in results:
        f = results["failover"]
        lines += [
            f"## A primary killed under 20 streaming sessions, seconds, median (min–max) of {n}",
            "",
            "| store | kill → first write accepted again | kill → first resumed delta on the "
            "other gateway |",
            "|---|---|---|",
        ]
        for kind, row in f.items():
            lines.append(f"| {kind} | {_span(row['writable_s'])} | {_span(row['resumed_s'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store_topologies")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--only", choices=("cpu", "failover"), action="append")
    args = parser.parse_args(argv)
    only = set(args.only or ("cpu", "failover"))
    results: dict[str, Any] = {"rounds": args.rounds}
    if "cpu" in only:
        results["cpu"] = cpu(args.rounds, args.seconds, 50)
    if "failover" in only:
        results["failover"] = failover(args.rounds, 20)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "store_topologies.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (RESULTS / "store_topologies.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
