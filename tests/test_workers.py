"""``--workers N``: N gateway processes share one port (SO_REUSEPORT) and stop together."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

import gateway.client as gc
from gateway.cluster import worker_relay as relay
from tests.test_client import cut_at_random
from tests.test_resume import Resumable, response_text

WORKERS = 2
START_TIMEOUT = 20.0
ATTEMPTS = 300  # short connections; the kernel spreads them by their source port


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def get(url: str) -> bytes | None:
    """One GET on a fresh connection; None while nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body: bytes = response.read()
            return body
    except (urllib.error.URLError, ConnectionError):
        return None


@contextlib.contextmanager
def started_workers(**env: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``--workers 2`` on the sim, ``env`` added to its environment; killed at the end."""
    port = free_port()
    command = [sys.executable, "-m", "gateway", "--engine", "sim", "--log-level", "WARNING"]
    process = subprocess.Popen(
        [*command, "--workers", str(WORKERS), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: a failed test can end all of it
        env={**os.environ, **env},
    )
    try:
        yield process, port
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the parent and its workers
            process.wait()
        assert process.stderr is not None
        process.stderr.close()


@pytest.fixture
def gateway_workers() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    with started_workers() as started:
        yield started


@pytest.fixture
def keyed_workers() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Two keys, two tenants: ``sk-alice`` and ``sk-bob``."""
    with started_workers(LLM_GATEWAY_API_KEY="sk-alice,sk-bob") as started:
        yield started


def wait_until_serving(process: subprocess.Popen[bytes], base: str) -> None:
    """Until every worker says it is ready; skip if this build has no ``--workers`` yet.

    Each worker starts its own engine: one can answer while another is still loading
    (and would refuse a WebSocket with 503), so one answer is not enough. The kernel
    picks the worker of each new connection, so ask until each has said so.
    """
    deadline = time.monotonic() + START_TIMEOUT
    ready: set[str] = set()
    while len(ready) < WORKERS:
        body = get(f"http://{base}/healthz")
        if body is not None and (health := json.loads(body))["ready"]:
            ready.add(str(health["worker"]))
        elif process.poll() is not None:
            assert process.stderr is not None
            error = process.stderr.read().decode(errors="replace")
            if process.returncode == 2 and "--workers" in error:
                pytest.skip("this build does not accept --workers yet")
            pytest.fail(f"the gateway exited with {process.returncode}: {error}")
        assert time.monotonic() < deadline, f"only workers {sorted(ready)} became ready"
        time.sleep(0.02)


def workers_in_health(base: str) -> set[str]:
    """Worker ids from /healthz over many short connections, until all are seen."""
    seen: set[str] = set()
    for _ in range(ATTEMPTS):
        body = get(f"http://{base}/healthz")
        if body is not None:
            seen.add(str(json.loads(body)["worker"]))
        if len(seen) == WORKERS:
            break
    return seen


def workers_in_metrics(base: str) -> set[str]:
    """Worker ids from the ``gateway_info`` line of /metrics."""
    seen: set[str] = set()
    for _ in range(ATTEMPTS):
        body = get(f"http://{base}/metrics") or b""
        for line in body.decode().splitlines():
            if line.startswith("gateway_info{"):
                seen.add(line.split('worker="', 1)[1].split('"', 1)[0])
        if len(seen) == WORKERS:
            break
    return seen


def test_workers_share_the_port_and_stop_together(
    gateway_workers: tuple[subprocess.Popen[bytes], int],
) -> None:
    process, port = gateway_workers
    base = f"127.0.0.1:{port}"
    wait_until_serving(process, base)
    assert workers_in_health(base) == {str(i) for i in range(WORKERS)}
    assert workers_in_metrics(base) == {str(i) for i in range(WORKERS)}

    # A live session on one of them ends with "going away" when the group is stopped.
    with connect(f"ws://{base}/v1/realtime", open_timeout=5) as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
        stopped_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001

    assert process.wait(timeout=10) == 0
    assert time.monotonic() - stopped_at < 5
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # every worker is gone: nothing listens on the port any more


async def test_a_resume_reaching_the_other_worker_is_relayed_to_the_one_holding_it(
    gateway_workers: tuple[subprocess.Popen[bytes], int],
) -> None:
    process, port = gateway_workers
    base = f"127.0.0.1:{port}"
    wait_until_serving(process, base)
    client = Resumable(f"ws://{base}/v1/realtime")
    await client.open()
    owner = relay.owner_of(client.session_id)
    await client.send({"type": "response.create", "response": {"max_output_tokens": 60}})
    response_id = (await client.until("response.created"))["response"]["id"]
    await client.until("response.output_text.delta")
    landed: set[str] = set()
    for _ in range(4):  # drop and resume, landing on whichever worker the kernel picks
        client.drop()
        answer = await client.resume()
        assert answer["type"] == "session.resumed", answer
        landed.add(str(relay.owner_of(client.fresh_session_id)))
        # A few events on this connection, then drop it again.
        for _ in range(3):
            if (await client.recv())["type"] == "response.done":
                break
    # Until one resume has landed on the worker that does not hold the session.
    while landed <= {str(owner)}:
        client.drop()
        assert (await client.resume())["type"] == "session.resumed"
        landed.add(str(relay.owner_of(client.fresh_session_id)))
    done = (
        await client.until("response.done")
        if client.events[-1]["type"] != "response.done"
        else client.events[-1]
    )
    joined, final = response_text(client.events, response_id)
    assert joined == final != "" and done["response"]["status"] in ("completed", "incomplete")
    # A wrong token gets the same answer whichever worker the resume reaches.
    held = (client.session_id, client.token, client.last, client.events)
    refused: set[str] = set()
    while refused <= {str(owner)}:
        client.drop()
        wrong = await client.resume(token="not-the-token")
        assert wrong["type"] == "error" and wrong["error"]["code"] == "session_not_found"
        refused.add(str(relay.owner_of(client.fresh_session_id)))
        client.session_id, client.token, client.last, client.events = held
    client.drop()
    assert (await client.resume())["type"] == "session.resumed"
    # The conversation goes on through the relay.
    await client.send({"type": "response.create", "response": {"max_output_tokens": 5}})
    assert (await client.until("response.done"))["response"]["status"] in (
        "completed",
        "incomplete",
    )
    await client.close()


async def test_the_python_client_resumes_through_whichever_worker_it_reaches(
    gateway_workers: tuple[subprocess.Popen[bytes], int],
) -> None:
    process, port = gateway_workers
    base = f"127.0.0.1:{port}"
    wait_until_serving(process, base)
    rng = random.Random(3)
    cuts: list[float] = []
    async with gc.connect(f"ws://{base}/v1/realtime") as chat:
        session_id = chat.session_id
        cutter = asyncio.create_task(cut_at_random(chat, rng, cuts))
        try:
            for question in ("Tell me a long story.", "And then?"):
                stream = chat.stream(question, max_output_tokens=60)
                deltas = [delta async for delta in stream]
                assert stream.reply is not None and stream.reply.status in (
                    "completed",
                    "incomplete",
                )
                assert "".join(deltas) == stream.reply.text != ""  # nothing lost or repeated
        finally:
            cutter.cancel()
        assert chat.session_id == session_id  # one conversation throughout
    assert len(cuts) >= 3


async def test_a_relayed_socket_taken_over_gets_4001(
    gateway_workers: tuple[subprocess.Popen[bytes], int],
) -> None:
    """Found in review: the relaying worker closed the client with 1000, not the owner's
    code, when the handler returned before that close went out."""
    process, port = gateway_workers
    base = f"127.0.0.1:{port}"
    wait_until_serving(process, base)
    url = f"ws://{base}/v1/realtime"
    first = Resumable(url)
    await first.open()
    owner = relay.owner_of(first.session_id)
    while True:  # resume until this socket is one a non-owner worker relays
        first.drop()
        assert (await first.resume())["type"] == "session.resumed"
        if relay.owner_of(first.fresh_session_id) != owner:
            break
    relayed = first.ws
    assert relayed is not None
    second = Resumable(url)
    second.session_id, second.token, second.last = first.session_id, first.token, first.last
    second.events = first.events
    assert (await second.resume())["type"] == "session.resumed"
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            await relayed.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001
    await second.close()


async def test_a_resume_relayed_to_the_worker_holding_it_is_checked_for_its_tenant(
    keyed_workers: tuple[subprocess.Popen[bytes], int],
) -> None:
    """Another key with the session's id and token (a leaked token) gets
    ``session_not_found`` on whichever worker it lands, as a made-up id would; the
    session's own key resumes through either."""
    process, port = keyed_workers
    base = f"127.0.0.1:{port}"
    wait_until_serving(process, base)
    url = f"ws://{base}/v1/realtime"
    alice = Resumable(url, {"Authorization": "Bearer sk-alice"})
    await alice.open()
    owner = str(relay.owner_of(alice.session_id))
    bob = Resumable(url, {"Authorization": "Bearer sk-bob"})
    tried: set[str] = set()
    while tried <= {owner}:  # until one of Bob's resumes reached the other worker
        bob.session_id, bob.token, bob.last, bob.events = alice.session_id, alice.token, 1, []
        answer = await bob.resume()
        assert answer["type"] == "error", answer
        assert answer["error"]["code"] == "session_not_found"
        tried.add(str(relay.owner_of(bob.fresh_session_id)))
        await bob.close()
    landed: set[str] = set()
    while landed <= {owner}:
        alice.drop()
        assert (await alice.resume())["type"] == "session.resumed"
        landed.add(str(relay.owner_of(alice.fresh_session_id)))
    await alice.close()
