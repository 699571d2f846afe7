"""The Redis session store against a real Redis (Debian's ``redis-server``, started here
on a free loopback port): gateway processes that share it resume each other's sessions,
take over the sessions of one killed or drained mid-answer, and ride out a Redis restart.
No mock stands in for Redis or for the gateway processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench.sse_server import SseServer
from gateway.cluster.store_writes import log_key, state_key
from tests.support.gateway_processes import TIMEOUT, RollingPair, gateways
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401
from tests.support.responses_harness import ResponsesClient


class Chat:
    """A raw Realtime client that keeps every event it got, across connections."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.ws: ClientConnection | None = None
        self.session_id = ""
        self.token = ""

    async def open(self, url: str) -> None:
        self.ws = await connect(url, open_timeout=TIMEOUT)
        created = await self.recv()
        self.session_id, self.token = created["session"]["id"], created["resume_token"]

    async def resume(self, url: str) -> dict[str, Any]:
        self.ws = await connect(url, open_timeout=TIMEOUT)
        await self.recv()  # the fresh session.created this connection starts with
        self.events.pop()
        last = self.events[-1]["sequence_number"]
        resume = {"session_id": self.session_id, "resume_token": self.token}
        await self.send({"type": "session.resume", **resume, "last_sequence_number": last})
        answer = await self.recv(keep=False)
        if answer["type"] == "session.resumed":
            self.token = answer["resume_token"]
        return answer

    async def send(self, event: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(orjson.dumps(event).decode())

    async def recv(self, keep: bool = True) -> dict[str, Any]:
        assert self.ws is not None
        async with asyncio.timeout(TIMEOUT):
            event: dict[str, Any] = orjson.loads(await self.ws.recv())
        if keep:
            self.events.append(event)
        return event

    async def ask(self, text: str) -> None:
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        }
        await self.send({"type": "conversation.item.create", "item": item})
        await self.send({"type": "response.create"})

    async def until(self, event_type: str) -> dict[str, Any]:
        while True:
            event = await self.recv()
            if event["type"] == event_type:
                return event

    async def finish(self, url: str) -> None:
        """Until the answer's ``response.done``, resuming on ``url`` after each 1012 (a relay
        whose owner turned out dead: the next resume takes the session over)."""
        async with asyncio.timeout(TIMEOUT):
            while True:
                try:
                    await self.until("response.done")
                    return
                except ConnectionClosed as closed:
                    assert closed.rcvd is not None and closed.rcvd.code == 1012, closed
                    while (await self.resume(url))["type"] != "session.resumed":
                        await asyncio.sleep(0.2)

    async def limit(self, max_output_tokens: int) -> None:
        session = {"type": "realtime", "max_output_tokens": max_output_tokens}
        await self.send({"type": "session.update", "session": session})
        await self.until("session.updated")

    async def deltas(self, n: int) -> None:
        for _ in range(n):
            await self.until("response.output_text.delta")

    def check_whole(self, answers: int = 1) -> None:
        """Every event once, in order; each answer's deltas joined equal its final text."""
        numbers = [e["sequence_number"] for e in self.events]
        assert numbers == list(range(1, len(numbers) + 1)), numbers
        done = [e for e in self.events if e["type"] == "response.done"]
        assert len(done) == answers and all(d["response"]["status"] == "completed" for d in done)
        for d in done:
            rid = d["response"]["id"]
            text = "".join(
                e["delta"]
                for e in self.events
                if e["type"] == "response.output_text.delta" and e["response_id"] == rid
            )
            assert text == d["response"]["output"][0]["content"][0]["text"] != ""


async def test_a_resume_on_the_other_gateway_mid_answer_is_relayed(
    redis_server: RedisServer,
) -> None:
    async with gateways(redis_server.url, 2) as (a, b):
        chat = Chat()
        await chat.open(a.url())
        await chat.ask("Hello")
        await chat.deltas(5)
        assert chat.ws is not None
        chat.ws.transport.abort()  # a network drop; the owner lives on
        assert (await chat.resume(b.url()))["type"] == "session.resumed"
        await chat.until("response.done")
        await chat.ask("And a second question, through the relay")
        await chat.until("response.done")
        chat.check_whole(answers=2)
        assert any("took over" not in line for line in b.log)


@contextlib.contextmanager
def upstream_standin(tokens: int, token_s: float) -> Iterator[str]:
    """An OpenAI-compatible server that streams the sim's answers (bench/sse_server.py),
    continues a final assistant message as llama.cpp's does, and has its ``/tokenize``;
    on a loop of its own (the test's blocks while a gateway process starts)."""
    loop = asyncio.new_event_loop()
    started = concurrent.futures.Future[str]()
    stop = asyncio.Event()

    async def serve() -> None:
        handler = SseServer(tokens, 4, token_s).handle
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        started.set_result(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        async with server:
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield started.result(TIMEOUT)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(TIMEOUT)
        loop.close()


@pytest.mark.parametrize("engine", ["sim", "upstream"])
async def test_kill_9_of_the_owner_mid_answer_then_a_takeover_continues_it(
    redis_server: RedisServer, engine: str
) -> None:
    """The answer another gateway continues is the one the first would have given: its
    text, its ``max_output_tokens`` (the whole answer's budget, not a new one for the
    rest) and its usage; on the sim and over an upstream replica."""
    limit = 60
    async with contextlib.AsyncExitStack() as stack:
        flags: dict[str, Any] = {}
        if engine == "upstream":
            url = stack.enter_context(upstream_standin(300, 0.01))
            flags["engine"] = ("--engine", "upstream", "--upstream", url)
        a, b = await stack.enter_async_context(gateways(redis_server.url, 2, **flags))
        chat = Chat()
        await chat.open(a.url())
        await chat.limit(limit)
        await chat.ask("Tell me a story")
        await chat.deltas(8)
        a.kill()
        with contextlib.suppress(Exception):
            while True:
                await chat.recv()  # what was on its way; then the socket is gone
        cut = chat.events[-1]["sequence_number"]
        # Until the dead owner's lease runs out, B relays; then it closes with 1012 and
        # the next resume takes the session over.
        assert (await chat.resume(b.url()))["type"] == "session.resumed"
        await chat.finish(b.url())
        assert any("took over session" in line for line in b.log)
        whole = Chat()  # the same question, uninterrupted
        await whole.open(b.url())
        await whole.limit(limit)
        await whole.ask("Tell me a story")
        expected = (await whole.until("response.done"))["response"]
    numbers = [e["sequence_number"] for e in chat.events]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    done = [e["response"] for e in chat.events if e["type"] == "response.done"]
    assert len(done) == 1 and done[0]["status"] == "incomplete", done
    deltas = [e for e in chat.events if e["type"] == "response.output_text.delta"]
    assert any(e["sequence_number"] > cut for e in deltas)  # continued after the cut
    text = done[0]["output"][0]["content"][0]["text"]
    assert "".join(e["delta"] for e in deltas) == text
    assert text == expected["output"][0]["content"][0]["text"]
    assert len(deltas) <= limit  # a token per delta at most
    assert done[0]["usage"]["output_tokens"] == expected["usage"]["output_tokens"] == limit


async def test_sigterm_drains_then_every_client_resumes_on_the_other_gateway(
    redis_server: RedisServer,
) -> None:
    sessions = 200
    # All 200 stream at once (the sim's batch holds them all: with its default of 64 the
    # rest would wait for whole answers before their first delta).
    extra = ("--drain-timeout", "0.3", "--sim-max-batch", str(sessions))
    async with gateways(redis_server.url, 2, *extra, tokens=150) as (a, b):
        chats = [Chat() for _ in range(sessions)]
        await asyncio.gather(*(c.open(a.url()) for c in chats))
        await asyncio.gather(*(c.ask(f"question {i}") for i, c in enumerate(chats)))
        await asyncio.gather(*(c.deltas(2) for c in chats))
        a.terminate()

        async def until_closed(chat: Chat) -> int | None:
            with contextlib.suppress(Exception):
                while True:
                    await chat.recv()
            assert chat.ws is not None
            return chat.ws.close_code

        codes = await asyncio.gather(*(until_closed(c) for c in chats))
        assert set(codes) == {1012}
        assert await a.stop() == 0, a.log[-10:]
        started = time.perf_counter()
        answers = await asyncio.gather(*(c.resume(b.url()) for c in chats))
        resumed_in = time.perf_counter() - started
        assert {a["type"] for a in answers} == {"session.resumed"}, [
            a for a in answers if a["type"] != "session.resumed"
        ][:3] + [line for line in b.log + a.log if "WARN" in line or "ERROR" in line][:10]
        in_flight = [c for c in chats if not any(e["type"] == "response.done" for e in c.events)]
        assert in_flight  # some answers were cut by the drain and go on on the other gateway
        await asyncio.gather(*(c.until("response.done") for c in in_flight))
        for chat in chats:
            chat.check_whole()
        assert resumed_in < 15


async def test_a_redis_restart_mid_stream_loses_nothing_delivered(
    redis_server: RedisServer,
) -> None:
    async with gateways(redis_server.url, 1, tokens=100) as (a,):
        chat = Chat()
        await chat.open(a.url())
        await chat.ask("Hello")
        await chat.deltas(5)
        redis_server.stop()
        await chat.deltas(10)  # memory-only meanwhile: the answer goes on
        redis_server.start()
        await chat.until("response.done")
        chat.check_whole()
        async with asyncio.timeout(TIMEOUT):
            while True:
                health = orjson.loads(await fetch(a.address, "/healthz"))
                if health["store"]["up"]:
                    break
                await asyncio.sleep(0.1)
        second = Chat()  # stored again once Redis is back
        await second.open(a.url())
        await second.ask("Hi")
        await second.until("response.done")
        async with asyncio.timeout(TIMEOUT):
            while not redis_server.client().exists(state_key(second.session_id)):
                await asyncio.sleep(0.05)


async def test_after_a_redis_restart_a_new_session_resumes_through_the_other_gateway(
    redis_server: RedisServer,
) -> None:
    # The relay's path through Redis (B's read of the log, its store's flushes that the
    # relayed frames wait for) comes back with it, for a relay that ran through the
    # restart and for a new one.
    async with gateways(redis_server.url, 2, tokens=300) as (a, b):
        through = Chat()  # a stream on A and its relay on B, across the restart
        await through.open(a.url())
        await through.ask("Streaming through the restart")
        await through.deltas(3)
        assert through.ws is not None
        through.ws.transport.abort()
        assert (await through.resume(b.url()))["type"] == "session.resumed"
        await through.deltas(3)
        redis_server.stop()
        await store_up(a, False)  # A streams on memory-only: it saw Redis go
        redis_server.start()
        for gateway in (a, b):
            await store_up(gateway, True)
        chat = Chat()
        await chat.open(a.url())
        await chat.ask("Hello after the restart")
        await chat.deltas(5)
        assert chat.ws is not None
        chat.ws.transport.abort()
        async with asyncio.timeout(TIMEOUT):
            assert (await chat.resume(b.url()))["type"] == "session.resumed"
            await chat.until("response.done")
        chat.check_whole()
        # The relayed stream was never told it was over: it ends whole, resuming (1012)
        # where the frames the log lacks are kept, on its owner.
        await through.finish(a.url())
        through.check_whole()


async def test_a_cancel_sent_through_a_relay_while_redis_restarts_reaches_the_owner(
    redis_server: RedisServer,
) -> None:
    async with gateways(redis_server.url, 2, tokens=300) as (a, b):
        chat = Chat()
        await chat.open(a.url())
        await chat.ask("A long answer")
        await chat.deltas(3)
        assert chat.ws is not None
        chat.ws.transport.abort()
        assert (await chat.resume(b.url()))["type"] == "session.resumed"
        redis_server.stop()
        await store_up(a, False)  # Redis is gone (A, streaming, saw it)
        await chat.send({"type": "response.cancel"})  # B cannot publish it now
        redis_server.start()
        await chat.finish(a.url())  # the relay's log has a gap (1012): the rest from A
        done = [e for e in chat.events if e["type"] == "response.done"]
        assert [d["response"]["status"] for d in done] == ["cancelled"]


async def test_a_closed_session_leaves_no_keys(redis_server: RedisServer) -> None:
    async with gateways(redis_server.url, 1, step_ms=1, tokens=5) as (a,):
        chat = Chat()
        await chat.open(a.url())
        await chat.ask("Hello")
        await chat.until("response.done")
        client = redis_server.client()
        assert client.exists(state_key(chat.session_id), log_key(chat.session_id)) == 2
        assert client.pttl(state_key(chat.session_id)) > 0  # they would expire anyway
        assert chat.ws is not None
        await chat.ws.close()
        async with asyncio.timeout(TIMEOUT):
            while client.keys(f"llmgw:*{chat.session_id}*"):
                await asyncio.sleep(0.05)


async def test_the_responses_dialect_takes_over_and_continues_stored_responses(
    redis_server: RedisServer,
) -> None:
    async with gateways(redis_server.url, 2, tokens=60) as (a, b):
        async with ResponsesClient.connect(a.url("/v1/responses")) as c:
            first = await c.respond(input="Hello")
            session, token = c.session_id, c.resume_token
            await c.create(input="A long one", previous_response_id=first.id)
            seen = [await c.recv() for _ in range(8)]
            a.kill()
        headers = {
            "x-session-id": session,
            "x-resume-token": token,
            "x-last-sequence-number": str(seen[-1]["sequence_number"]),
        }
        async with asyncio.timeout(TIMEOUT):
            while True:
                try:
                    async with ResponsesClient.connect(
                        b.url("/v1/responses"), additional_headers=headers
                    ) as r:
                        rest = await r.collect()
                        break
                except Exception:
                    await asyncio.sleep(0.5)  # the dead owner's lease has not run out yet
        events = seen + rest.events
        numbers = [e["sequence_number"] for e in events]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == rest.done_text and rest.response["status"] == "completed"
        # A stored response continues on any gateway, over HTTP too.
        async with ResponsesClient.connect(b.url("/v1/responses")) as other:
            again = await other.respond(input="Go on", previous_response_id=first.id)
            assert again.response["previous_response_id"] == first.id


async def store_up(gateway: Any, up: bool) -> None:
    """Until ``gateway``'s /healthz says its store is ``up`` (or not)."""
    async with asyncio.timeout(TIMEOUT):
        while orjson.loads(await fetch(gateway.address, "/healthz"))["store"]["up"] is not up:
            await asyncio.sleep(0.05)


async def fetch(address: str, path: str) -> bytes:
    reader, writer = await asyncio.open_connection(*address.split(":"))
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return data.partition(b"\r\n\r\n")[2]


async def test_gateway_client_rides_a_rolling_restart_of_two_gateways(
    redis_server: RedisServer,
) -> None:
    import gateway.client as gc

    async with (
        RollingPair(redis_server.url, "--drain-timeout", "0.2", tokens=200) as pair,
        gc.connect(pair.balancer.ws_url()) as chat,
    ):
        for turn in range(2):
            deltas: list[str] = []
            stream = chat.stream(f"Tell me story {turn}")
            async for delta in stream:
                deltas.append(delta)
                if len(deltas) == 5:
                    # Restart the gateway that holds the session: SIGTERM, then a new one.
                    # Round robin put the first socket on the first, the resume on the second.
                    pair.begin_restart(turn)
            assert stream.reply is not None and stream.reply.status == "completed"
            assert "".join(deltas) == stream.reply.text
            await pair.finish_restart(turn)


async def test_a_takeover_keeps_the_responses_turns_waiting_for_a_slot(
    redis_server: RedisServer,
) -> None:
    async with gateways(redis_server.url, 2, tokens=80) as (a, b):
        async with ResponsesClient.connect(a.url("/v1/responses")) as c:
            await c.create(input="A long one")
            seen = [await c.recv() for _ in range(4)]
            await c.create(input="And one behind it on the same lane")  # waits for the first
            session, token = c.session_id, c.resume_token
            stored = redis_server.client()
            async with asyncio.timeout(TIMEOUT):
                while '"waiting":[[null,[{' not in (stored.get(state_key(session)) or ""):
                    await asyncio.sleep(0.02)
            seen += [await c.recv() for _ in range(2)]
            a.kill()
        headers = {
            "x-session-id": session,
            "x-resume-token": token,
            "x-last-sequence-number": str(seen[-1]["sequence_number"]),
        }
        async with asyncio.timeout(TIMEOUT):
            while True:
                try:
                    async with ResponsesClient.connect(
                        b.url("/v1/responses"), additional_headers=headers
                    ) as r:
                        first = await r.collect()
                        second = await r.collect()
                        break
                except Exception:
                    await asyncio.sleep(0.5)  # the dead owner's lease has not run out yet
        events = seen + first.events + second.events
        numbers = [e["sequence_number"] for e in events]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        assert first.response["status"] == second.response["status"] == "completed"
        assert first.id != second.id and second.done_text
        # The second turn waited for the first: every delta before its end is the first's.
        deltas = [e["delta"] for e in seen + first.events if e["type"].endswith("text.delta")]
        assert "".join(deltas) == first.done_text
