"""Resumable sessions over real sockets: drop the TCP connection (no close frame) and
resume on a new one with ``session.resume``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from gateway.engines.sim import SimEngine
from tests.support.harness import TIMEOUT, RunningGateway, running_gateway


class Resumable:
    """A raw client that remembers what a resume needs and checks the numbering."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = headers  # on every connection (a key: Authorization)
        self.ws: ClientConnection | None = None
        self.session_id = ""
        self.fresh_session_id = ""  # the session the latest connection started with
        self.token = ""
        self.last = 0  # the last sequence_number received
        self.events: list[dict[str, Any]] = []  # every numbered event, across connections

    async def open(self, query: str = "") -> dict[str, Any]:
        self.ws = await connect(
            self.url + query, open_timeout=TIMEOUT, additional_headers=self.headers
        )
        created = await self.recv()
        assert created["type"] == "session.created"
        self.session_id, self.token = created["session"]["id"], created["resume_token"]
        self.fresh_session_id = self.session_id
        return created

    async def recv(self) -> dict[str, Any]:
        assert self.ws is not None
        async with asyncio.timeout(TIMEOUT):
            event: dict[str, Any] = json.loads(await self.ws.recv())
        if "sequence_number" in event:
            # Numbered per session, 1, 2, 3... on whatever socket (a fresh session that
            # a resume replaced started its own count).
            if event["type"] == "session.created":
                self.last, self.events = 0, []
            assert event["sequence_number"] == self.last + 1, (event, self.last)
            self.last = event["sequence_number"]
            self.events.append(event)
        return event

    async def send(self, event: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(json.dumps(event))

    def drop(self) -> None:
        """The network goes away: no close frame."""
        assert self.ws is not None
        self.ws.transport.abort()

    async def resume(
        self, *, token: str | None = None, last: int | None = None, route: bool = True
    ) -> dict[str, Any]:
        """A new connection that asks for the session back; the answer (resumed or error).
        ``route``: the session id in the URL, for a load balancer (the gateway ignores it)."""
        session_id, own_token = self.session_id, self.token
        after = self.last if last is None else last
        events = [e for e in self.events if e["sequence_number"] <= after]
        # A fresh session first, as every connection starts.
        await self.open(f"?session_id={session_id}" if route else "")
        await self.send(
            {
                "type": "session.resume",
                "session_id": session_id,
                "resume_token": own_token if token is None else token,
                "last_sequence_number": after,
            }
        )
        answer = await self.recv()
        if answer["type"] == "session.resumed":  # the resumed session's numbers go on
            assert "sequence_number" not in answer
            self.session_id, self.token = answer["session"]["id"], answer["resume_token"]
            self.last, self.events = after, events
        # Else the connection goes on as the fresh session, numbered from its own 1.
        return answer

    async def until(self, event_type: str) -> dict[str, Any]:
        while (event := await self.recv())["type"] != event_type:
            pass
        return event

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


def response_text(events: list[dict[str, Any]], response_id: str) -> tuple[str, str]:
    """(the response's deltas joined, its output_text.done text)."""
    deltas = [
        e["delta"]
        for e in events
        if e["type"] == "response.output_text.delta" and e["response_id"] == response_id
    ]
    (done,) = [
        e["text"]
        for e in events
        if e["type"] == "response.output_text.done" and e["response_id"] == response_id
    ]
    return "".join(deltas), done


async def say(client: Resumable, text: str) -> None:
    await client.send(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": text}],
            },
        }
    )
    await client.until("conversation.item.done")


async def test_an_answer_survives_many_dropped_connections() -> None:
    rng = random.Random(7)
    engine = SimEngine(step_ms=2, response_tokens=400)
    async with running_gateway(engine) as gw:
        client = Resumable(gw.ws_url)
        await client.open()
        await say(client, "Tell me a long story.")
        await client.send({"type": "response.create"})
        response_id = (await client.until("response.created"))["response"]["id"]
        drops = 0
        while True:
            # Read a random number of events, then lose the connection.
            for _ in range(rng.randint(1, 40)):
                event = await client.recv()
                if event["type"] == "response.done":
                    break
            if event["type"] == "response.done":
                break
            client.drop()
            drops += 1
            answer = await client.resume()
            assert answer["type"] == "session.resumed", answer
        assert drops >= 5
        assert event["response"]["status"] == "completed"
        joined, final = response_text(client.events, response_id)
        assert joined == final != ""
        stored = event["response"]["output"][0]["content"][0]["text"]
        assert stored == final
        # The conversation goes on: the next turn sees the whole first one.
        await say(client, "And then?")
        await client.send({"type": "response.create"})
        done = await client.until("response.done")
        assert done["response"]["status"] == "completed"
        assert done["response"]["usage"]["input_tokens"] > 400
        await client.close()
        await gw.wait_idle()


async def test_a_resume_that_cannot_be_done_says_why_and_the_connection_goes_on() -> None:
    async with running_gateway(SimEngine(step_ms=2, response_tokens=8)) as gw:
        client = Resumable(gw.ws_url)
        await client.open()
        client.drop()
        wrong = await client.resume(token="not-the-token")
        assert wrong["type"] == "error" and wrong["error"]["code"] == "session_not_found"
        # The connection goes on as the fresh session it is.
        await client.send({"type": "response.create"})
        assert (await client.until("response.done"))["response"]["status"] == "completed"

        unknown = Resumable(gw.ws_url)
        await unknown.open()
        unknown.session_id = "sess_0_0123456789abcdef0123"
        answer = await unknown.resume()
        assert answer["error"]["code"] == "session_not_found"
        assert answer["error"]["message"] == wrong["error"]["message"]  # a guess learns nothing
        for c in (client, unknown):
            await c.close()


async def test_a_resume_after_the_window_is_session_not_found_and_nothing_is_left() -> None:
    engine = SimEngine(step_ms=5, response_tokens=100_000)
    async with running_gateway(engine, resume_window=0.3) as gw:
        client = Resumable(gw.ws_url)
        await client.open()
        await client.send({"type": "response.create"})
        await client.until("response.output_text.delta")
        client.drop()
        await asyncio.sleep(0.1)
        assert gw.gateway.metrics.detached.value == 1
        assert gw.gateway.scheduler.running == 1  # the answer goes on, for a resume
        await gw.wait_idle()  # the window ends: everything is freed
        assert engine.active == 0 and gw.gateway.metrics.detached.value == 0
        answer = await client.resume()
        assert answer["error"]["code"] == "session_not_found"
        await client.close()


async def test_a_too_old_sequence_number_is_a_resume_gap() -> None:
    engine = SimEngine(step_ms=1, response_tokens=300)
    async with running_gateway(engine, replay_buffer_bytes=4096) as gw:
        client = Resumable(gw.ws_url)
        await client.open()
        await client.send({"type": "response.create"})
        await client.until("response.done")
        client.drop()
        answer = await client.resume(last=1)  # event 2 on were sent long ago
        assert answer["error"]["code"] == "resume_gap"
        await client.close()


async def test_a_client_close_still_frees_the_engine_at_once() -> None:
    engine = SimEngine(step_ms=5, response_tokens=100_000)
    async with running_gateway(engine) as gw:
        client = Resumable(gw.ws_url)
        await client.open()
        await client.send({"type": "response.create"})
        await client.until("response.output_text.delta")
        await client.close()  # a close frame: the tab closed
        await gw.wait_idle()
        assert engine.active == 0 and gw.gateway.metrics.detached.value == 0


async def test_resuming_closes_an_older_socket_of_the_session_with_4001() -> None:
    async with running_gateway(SimEngine(step_ms=2, response_tokens=8)) as gw:
        first = Resumable(gw.ws_url)
        await first.open()
        old = first.ws
        assert old is not None
        second = Resumable(gw.ws_url)
        second.session_id, second.token, second.last = first.session_id, first.token, first.last
        second.events = first.events
        answer = await second.resume()
        assert answer["type"] == "session.resumed"
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await old.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001
        await second.send({"type": "response.create"})
        assert (await second.until("response.done"))["response"]["status"] == "completed"
        await second.close()


async def test_a_detached_session_that_outgrows_its_buffer_cannot_resume() -> None:
    engine = SimEngine(step_ms=0, response_tokens=100_000)
    async with running_gateway(engine, replay_buffer_bytes=8192, coalesce=False) as gw:
        client = Resumable(gw.ws_url)
        await client.open()
        await client.send({"type": "response.create"})
        await client.until("response.output_text.delta")
        client.drop()
        # Without coalescing every token is an event: the buffer overflows at once and the
        # answer is cancelled rather than kept whole for a resume that cannot be seamless.
        async with asyncio.timeout(TIMEOUT):
            while gw.gateway.scheduler.running:
                await asyncio.sleep(0.01)
        answer = await client.resume()
        assert answer["error"]["code"] == "resume_gap"
        await client.close()


async def test_resume_metrics(gw: RunningGateway) -> None:
    client = Resumable(gw.ws_url)
    await client.open()
    await client.send({"type": "response.create"})
    await client.until("response.done")
    client.drop()
    assert (await client.resume(last=client.last - 3))["type"] == "session.resumed"
    for _ in range(3):
        await client.recv()  # the three replayed events, numbers unchanged
    m = gw.gateway.metrics
    assert m.resumes.labels(outcome="resumed").value == 1
    assert m.replayed_events.value == 3
    await client.close()


class NodeRouter:
    """A load balancer in front of several gateway hosts, as docs/deployment.md configures
    one: a connection whose URL carries ``session_id`` goes to the node that id names
    (``sess_<node>.<worker>_...``, from ``--node``); any other goes round-robin."""

    def __init__(self, nodes: dict[str, int]) -> None:
        self.nodes = nodes
        self._turn = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._route, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"ws://127.0.0.1:{port}/v1/realtime"

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _route(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        named = re.search(rb"[?&]session_id=sess_([A-Za-z0-9-]+)\.", head.split(b"\r\n")[0])
        if named is not None:
            port = self.nodes[named.group(1).decode()]
        else:
            port = list(self.nodes.values())[self._turn % len(self.nodes)]
            self._turn += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        up_writer.write(head)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()  # a drop stays a drop: no FIN is made up on the way

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


async def test_a_load_balancer_routes_a_resume_by_the_session_id() -> None:
    engines = [SimEngine(step_ms=2, response_tokens=200) for _ in range(2)]
    async with (
        running_gateway(engines[0], node="a") as a,
        running_gateway(engines[1], node="b") as b,
        NodeRouter({"a": a.gateway.port, "b": b.gateway.port}) as url,
    ):
        client = Resumable(url)
        await client.open()
        await client.send({"type": "response.create"})
        response_id = (await client.until("response.created"))["response"]["id"]
        for _ in range(4):  # each drop: a fresh connection, routed by the session id
            await client.until("response.output_text.delta")
            client.drop()
            assert (await client.resume())["type"] == "session.resumed"
        done = await client.until("response.done")
        joined, final = response_text(client.events, response_id)
        assert joined == final != "" and done["response"]["status"] == "completed"
        # Without the id in the URL, round-robin sends the resume to the other host.
        held = (client.session_id, client.token, client.last, client.events)
        outcomes = set()
        for _ in range(2):
            client.drop()
            outcomes.add((await client.resume(route=False))["type"])
            client.session_id, client.token, client.last, client.events = held
        assert outcomes == {"session.resumed", "error"}
        await client.close()


async def test_a_resume_cut_before_session_resumed_arrives_can_be_retried() -> None:
    """The token rotates at each resume; the client that never saw the new one (its
    connection dropped first) still gets its session back with the one it holds."""
    async with running_gateway(SimEngine(step_ms=2, response_tokens=8)) as gw:
        client = Resumable(gw.ws_url)
        await client.open()
        held = (client.session_id, client.token, client.last, client.events)
        client.drop()
        await client.open()
        await client.send(
            {
                "type": "session.resume",
                "session_id": held[0],
                "resume_token": held[1],
                "last_sequence_number": held[2],
            }
        )
        client.drop()  # before reading session.resumed: its fresh token is lost
        client.session_id, client.token, client.last, client.events = held
        again = await client.resume()
        assert again["type"] == "session.resumed", again
        # The token the server issued last works too, and then only the newest ones do.
        client.drop()
        assert (await client.resume())["type"] == "session.resumed"
        client.drop()
        stale = await client.resume(token=held[1])
        assert stale["type"] == "error" and stale["error"]["code"] == "session_not_found"
        await client.close()


async def test_resuming_the_session_the_connection_already_has_is_refused() -> None:
    async with running_gateway(SimEngine(step_ms=2, response_tokens=8)) as gw:
        client = Resumable(gw.ws_url)
        await client.open()
        await client.send(
            {
                "type": "session.resume",
                "session_id": client.session_id,
                "resume_token": client.token,
                "last_sequence_number": client.last,
            }
        )
        answer = await client.recv()
        assert answer["type"] == "error" and answer["error"]["code"] == "session_not_found"
        await client.send({"type": "response.create"})  # the session is unharmed
        assert (await client.until("response.done"))["response"]["status"] == "completed"
        await client.close()


async def test_a_session_whose_outbox_overflowed_still_ends() -> None:
    """Found in review: the outbox let go of the socket on overflow, the connection's end
    then looked like a resume elsewhere, and the session lived on for good."""
    async with running_gateway(SimEngine(step_ms=2, response_tokens=8), resume_window=0.3) as gw:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gw.gateway.port))
        ws = await connect(gw.ws_url, sock=sock, max_queue=1)
        ws.transport.pause_reading()  # reads nothing from now on
        bad = json.dumps({"type": "nonsense.event", "padding": "x" * 4000})
        with contextlib.suppress(ConnectionClosed):
            for _ in range(6000):  # an error event each, far past what the outbox holds
                await ws.send(bad)
        async with asyncio.timeout(TIMEOUT):
            while gw.gateway.scheduler is not None and not any(
                s.outbox.lost for s in gw.gateway.sessions
            ):
                await asyncio.sleep(0.01)
        ws.transport.abort()
        await gw.wait_idle()  # lost, dropped, and ended once its resume window is over
