"""The Python client against a live gateway on the simulated engine.

Async tests share the test's loop with an in-process gateway. Whatever blocks (the sync
client, a subprocess, a Jupyter kernel) talks to a gateway on its own thread and loop
(:class:`GatewayThread`): blocking the test's loop must not freeze the gateway.
"""

from __future__ import annotations

import asyncio
import gc as garbage
import itertools
import json
import os
import pty
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from websockets.frames import Close

import gateway.client as gc
from gateway.client import cli
from gateway.client.resume import Cursor, Unconfirmed, backoff, is_drop, resume_url
from gateway.engines.sim import SimEngine
from tests.support.harness import RawClient, RunningGateway, running_gateway

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20.0


# ---------------------------------------------------------------------------
# Helpers


class GatewayThread:
    """A gateway on a thread with its own event loop, reachable from other threads/processes."""

    def __init__(self, engine: SimEngine, **settings: Any) -> None:
        self.engine = engine
        self._settings = settings
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.ws_url = ""
        self.http_url = ""

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with running_gateway(self.engine, **self._settings) as gw:
                self.ws_url, self.http_url = gw.ws_url, gw.http_url
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        assert self._ready.wait(TIMEOUT), "gateway thread did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(TIMEOUT)

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.http_url + "/healthz", timeout=TIMEOUT) as r:
            health: dict[str, Any] = json.loads(r.read())
        return health

    def wait_no_running(self) -> None:
        """Until the gateway runs and queues no response (the cancel reached the engine)."""
        deadline = time.monotonic() + TIMEOUT
        while (r := self.health()["responses"])["running"] or r["queued"]:
            assert time.monotonic() < deadline, f"responses still running: {r}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def threaded() -> Iterator[GatewayThread]:
    """10 ms steps, 150-token answers (1.5 s): long enough to interrupt one by hand."""
    with GatewayThread(SimEngine(step_ms=10, response_tokens=150)) as gateway:
        yield gateway


@pytest.fixture
async def slow_gw() -> AsyncIterator[RunningGateway]:
    """Answers of 400 tokens at 5 ms: a stream is still running when the test acts on it."""
    async with running_gateway(SimEngine(step_ms=5, response_tokens=400)) as running:
        yield running


async def raw_answer(url: str, question: str, **session: Any) -> str:
    """The answer to ``question`` in a fresh conversation, over the raw protocol."""
    async with RawClient.connect(url) as raw:
        if session:
            await raw.send({"type": "session.update", "session": {"type": "realtime", **session}})
            await raw.recv_until("session.updated")
        await raw.say(question)
        turn = await raw.respond()
        assert turn.status in ("completed", "incomplete")
        return turn.text


def subprocess_env(url: str) -> dict[str, str]:
    env = dict(os.environ, GATEWAY_URL=url, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# ---------------------------------------------------------------------------
# Async: ask, gather, stream, cancel


async def test_ask_returns_what_the_raw_protocol_returns(gw: RunningGateway) -> None:
    expected = await raw_answer(gw.ws_url, "What is a GPU?", instructions="Be brief.")
    async with gc.connect(gw.ws_url, instructions="Be brief.") as chat:
        reply = await chat.ask("What is a GPU?")
    assert reply.text == expected
    assert str(reply) == expected
    assert reply.status == "completed"
    assert reply.response_id
    assert reply.usage is not None and reply.usage.output_tokens > 0
    assert reply.time_to_first_token is not None
    assert 0 <= reply.time_to_first_token <= reply.elapsed


async def test_stream_yields_the_answer_piece_by_piece(gw: RunningGateway) -> None:
    expected = await raw_answer(gw.ws_url, "Tell me about batching")
    async with gc.connect(gw.ws_url) as chat:
        stream = chat.stream("Tell me about batching")
        deltas = [delta async for delta in stream]
    assert len(deltas) > 1
    assert "".join(deltas) == expected
    assert stream.reply is not None and stream.reply.text == expected


async def test_a_conversation_remembers_earlier_turns(gw: RunningGateway) -> None:
    async with gc.connect(gw.ws_url) as chat:
        await chat.ask("first question")
        second = await chat.ask("second question")
    # The sim answers from the whole rendered conversation: alone, the question differs.
    assert second.text != await raw_answer(gw.ws_url, "second question")
    assert second.usage is not None and second.usage.input_tokens > 10


async def test_gather_runs_conversations_concurrently() -> None:
    # 25 ms steps: the engine's time (0.5 s an answer) dominates, not the client's CPU, so
    # a loaded machine still shows the overlap; the bound is loose (sequential would be 8x).
    async with running_gateway(SimEngine(step_ms=25, response_tokens=20)) as gw:

        async def one(i: int) -> gc.Reply:
            async with gc.connect(gw.ws_url) as chat:
                return await chat.ask(f"question number {i}")

        started = time.monotonic()
        await one(0)
        single = time.monotonic() - started

        started = time.monotonic()
        replies = await asyncio.gather(*(one(i) for i in range(8)))
        together = time.monotonic() - started

    assert all(r.status == "completed" and r.text for r in replies)
    assert len({r.text for r in replies}) > 1  # eight real conversations, not one answer
    ratio = together / single
    print(f"\ngather: one answer {single:.3f} s, 8 gathered {together:.3f} s, ratio {ratio:.2f}")
    assert ratio < 4.0, f"8 gathered conversations took {ratio:.1f}x one (sequential: 8x)"


async def test_stream_cancel_stops_the_answer(slow_gw: RunningGateway) -> None:
    async with gc.connect(slow_gw.ws_url) as chat:
        stream = chat.stream("Tell me a long story")
        seen: list[str] = []
        after_cancel: list[str] = []
        reply = None
        async for delta in stream:
            if stream.finished or len(seen) >= 3:
                after_cancel.append(delta)
                continue
            seen.append(delta)
            if len(seen) == 3:
                reply = await stream.cancel()
        assert after_cancel == []
        assert reply is not None and reply is stream.reply
        assert reply.status == "cancelled"
        assert reply.text.startswith("".join(seen))
        assert reply.usage is not None and reply.usage.output_tokens < 400
        # The conversation goes on, with the cut answer in it.
        follow_up = await chat.ask("go on", max_output_tokens=5)
        assert follow_up.status == "incomplete" and follow_up.reason == "max_output_tokens"
    await slow_gw.wait_idle()


async def test_cancel_from_another_task_ends_the_reader(slow_gw: RunningGateway) -> None:
    async with gc.connect(slow_gw.ws_url) as chat:
        stream = chat.stream("Tell me a long story")
        first = asyncio.Event()

        async def read() -> list[str]:
            out = []
            async for delta in stream:
                out.append(delta)
                first.set()
            return out

        reader = asyncio.create_task(read())
        await first.wait()
        reply = await stream.cancel()
        deltas = await asyncio.wait_for(reader, TIMEOUT)
    assert reply is not None and reply.status == "cancelled"
    assert reply.text.startswith("".join(deltas))


class HeldSend:
    """Records the event types a chat sends, and holds its sender right after ``kind`` went out.

    So a test can act at a point of the turn that is otherwise gone in an instant (the
    question sent, its acknowledgement not yet read), with no sleeping.
    """

    def __init__(self, chat: gc.AsyncChat, kind: str) -> None:
        self.kinds: list[str] = []
        self.sent = asyncio.Event()
        self.proceed = asyncio.Event()
        send = chat._ws.send

        async def held(frame: Any) -> None:
            await send(frame)
            self.kinds.append(json.loads(frame)["type"])
            if self.kinds[-1] == kind and not self.sent.is_set():
                self.sent.set()
                await self.proceed.wait()

        chat._ws.send = held  # type: ignore[method-assign]


async def test_cancel_while_the_question_is_sent_asks_for_no_answer(
    slow_gw: RunningGateway,
) -> None:
    async with gc.connect(slow_gw.ws_url) as chat:
        wire = HeldSend(chat, "conversation.item.create")
        stream = chat.stream("Tell me a long story")
        reader = asyncio.create_task(anext(stream, None))
        await asyncio.wait_for(wire.sent.wait(), TIMEOUT)  # the question is on its way
        canceller = asyncio.create_task(stream.cancel())  # runs before the sender goes on
        wire.proceed.set()
        reply = await asyncio.wait_for(canceller, TIMEOUT)
        assert await asyncio.wait_for(reader, TIMEOUT) is None  # no delta at all
        assert reply is not None and reply is stream.reply and reply.status == "cancelled"
        assert reply.text == ""
        assert "response.create" not in wire.kinds and "response.cancel" not in wire.kinds

        # The same through chat.cancel(), during a blocking ask in another task.
        wire = HeldSend(chat, "conversation.item.create")
        asking = asyncio.create_task(chat.ask("And another one"))
        await asyncio.wait_for(wire.sent.wait(), TIMEOUT)
        canceller = asyncio.create_task(chat.cancel())
        wire.proceed.set()
        assert (await asyncio.wait_for(asking, TIMEOUT)).status == "cancelled"
        assert await asyncio.wait_for(canceller, TIMEOUT) is not None
        assert "response.create" not in wire.kinds
        engine = slow_gw.gateway.engine
        assert isinstance(engine, SimEngine) and engine.tokens_generated == 0  # none, ever

        # The unanswered questions stay in the conversation, which goes on.
        follow_up = await chat.ask("go on", max_output_tokens=2)
        assert follow_up.status == "incomplete"
        assert follow_up.usage is not None and follow_up.usage.input_tokens > 10


async def test_a_new_question_cancels_an_abandoned_stream(slow_gw: RunningGateway) -> None:
    async with gc.connect(slow_gw.ws_url) as chat:
        stream = chat.stream("Tell me a long story")
        async for _ in stream:
            break  # abandoned: the gateway is still generating it
        reply = await chat.ask("short one", max_output_tokens=3)
        assert stream.reply is not None and stream.reply.status == "cancelled"
        assert reply.usage is not None and reply.usage.output_tokens == 3


async def test_async_with_stream_cancels_on_leaving(slow_gw: RunningGateway) -> None:
    async with gc.connect(slow_gw.ws_url) as chat:
        async with chat.stream("Tell me a long story") as stream:
            async for _ in stream:
                break
        assert stream.reply is not None and stream.reply.status == "cancelled"


# ---------------------------------------------------------------------------
# Errors: typed, and never a silent hang


async def test_a_refused_setting_raises_gateway_error(gw: RunningGateway) -> None:
    with pytest.raises(gc.GatewayError) as caught:
        async with gc.connect(gw.ws_url, temperature=5.0):
            pass
    assert caught.value.code == "invalid_value"
    assert caught.value.param == "session.temperature"

    async with gc.connect(gw.ws_url) as chat:
        with pytest.raises(gc.GatewayError) as caught:
            await chat.ask("hi", top_p=3.0)
        assert caught.value.code == "invalid_value"
        assert (await chat.ask("hi")).status == "completed"  # the chat stays usable


async def test_a_full_gateway_raises_overloaded() -> None:
    engine = SimEngine(step_ms=5, response_tokens=400)
    async with (
        running_gateway(engine, max_running=1, max_queued=0) as gw,
        gc.connect(gw.ws_url) as busy,
        gc.connect(gw.ws_url) as chat,
    ):
        async with busy.stream("Tell me a long story") as stream:
            await anext(stream)  # the one slot is taken
            with pytest.raises(gc.GatewayError) as caught:
                await chat.ask("me too")
            assert caught.value.code == "overloaded"
        assert (await chat.ask("now?", max_output_tokens=2)).text  # the slot is free again


async def test_a_cancel_that_crosses_the_answers_end_is_harmless(gw: RunningGateway) -> None:
    async with gc.connect(gw.ws_url) as chat:
        stream = chat.stream("short")
        _ = [delta async for delta in stream]
        assert stream.reply is not None
        assert await stream.cancel() is stream.reply  # after the end: nothing to do
        await chat._send_cancel(stream.reply.response_id)  # as if sent just before the end
        assert (await chat.ask("next")).status == "completed"


async def test_a_failed_answer_raises_with_the_partial_reply() -> None:
    async with (
        running_gateway(SimEngine(step_ms=1, fail_after=3)) as gw,
        gc.connect(gw.ws_url) as chat,
    ):
        deltas = []
        with pytest.raises(gc.GatewayError) as caught:
            async for delta in chat.stream("this will break"):
                deltas.append(delta)
    assert caught.value.reply is not None and caught.value.reply.status == "failed"
    assert caught.value.reply.text == "".join(deltas)


async def test_a_dropped_connection_raises_connection_lost() -> None:
    # A gateway with resume off (window 0): the resume the client tries is refused.
    engine = SimEngine(step_ms=5, response_tokens=400)
    async with (
        running_gateway(engine, resume_window=0) as slow_gw,
        gc.connect(slow_gw.ws_url) as chat,
    ):
        stream = chat.stream("Tell me a long story")
        with pytest.raises(gc.ConnectionLost) as caught:
            async for _ in stream:
                chat._ws.transport.abort()  # the network goes away mid-answer
        assert caught.value.resume_error == "session_not_found"
        assert chat.closed
        with pytest.raises(gc.ConnectionLost):
            await chat.ask("anyone there?")
        await slow_gw.wait_idle()  # and the gateway freed what the answer held


async def test_resume_false_raises_connection_lost_at_once(slow_gw: RunningGateway) -> None:
    async with gc.connect(slow_gw.ws_url, resume=False) as chat:
        stream = chat.stream("Tell me a long story")
        with pytest.raises(gc.ConnectionLost) as caught:
            async for _ in stream:
                chat._ws.transport.abort()
        assert caught.value.resume_error is None and chat.closed
    assert slow_gw.gateway.metrics.resumes.labels(outcome="resumed").value == 0


async def test_a_silent_gateway_times_out() -> None:
    async with running_gateway(SimEngine(step_ms=1, stall_after=2)) as gw:
        async with gc.connect(gw.ws_url, timeout=0.3) as chat:
            started = time.monotonic()
            with pytest.raises(gc.GatewayTimeout):
                await chat.ask("this will stall")
            assert time.monotonic() - started < 3
        await gw.wait_idle()


async def test_wrong_key_and_no_gateway_are_told_apart() -> None:
    async with running_gateway(SimEngine(step_ms=1), api_keys=("sesame",)) as gw:
        with pytest.raises(gc.HandshakeRefused) as caught:
            await gc.connect(gw.ws_url, api_key="wrong")
        assert caught.value.status == 401
        async with gc.connect(gw.ws_url, api_key="sesame") as chat:
            assert (await chat.ask("hi")).text
        port = gw.gateway.port
    with pytest.raises(gc.GatewayUnavailable):
        await gc.connect(f"ws://127.0.0.1:{port}", timeout=5)


def test_urls_get_the_realtime_path(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gc.resolve_url("ws://h:1") == "ws://h:1/v1/realtime"
    assert gc.resolve_url("http://h:1/") == "ws://h:1/v1/realtime"
    assert gc.resolve_url("wss://h/custom") == "wss://h/custom"
    monkeypatch.setenv("GATEWAY_URL", "ws://elsewhere:9")
    assert gc.resolve_url(None) == "ws://elsewhere:9/v1/realtime"
    monkeypatch.delenv("GATEWAY_URL")
    assert gc.resolve_url(None) == gc.DEFAULT_URL
    with pytest.raises(ValueError):
        gc.resolve_url("ftp://h")


# ---------------------------------------------------------------------------
# Resume: a connection that drops (no close frame) is resumed, and nothing is lost


async def raw_conversation(url: str, questions: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(answer text, usage) of each turn of one conversation, over the raw protocol.

    The simulated engine answers from the whole conversation, so the same questions give
    the same answers and token counts: a lost, repeated or doubled piece anywhere (a
    question sent twice included) shows up as a difference.
    """
    async with RawClient.connect(url) as raw:
        turns = []
        for question in questions:
            await raw.say(question)
            turn = await raw.respond()
            assert turn.status == "completed" and turn.text == turn.final_text
            turns.append((turn.text, turn.response["usage"]))
        return turns


def usage_json(usage: gc.Usage | None) -> dict[str, Any]:
    assert usage is not None
    return {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
    }


def usage_of(usage: dict[str, Any]) -> dict[str, Any]:
    return {k: usage[k] for k in ("input_tokens", "output_tokens", "total_tokens")}


class Proxy:
    """A TCP relay in front of the gateway: :meth:`cut` drops every connection through it
    (no close frame, like a network that goes away), :meth:`refuse` stops accepting new
    ones (the network stays down) until :meth:`accept`."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    async def __aenter__(self) -> Proxy:
        await self.accept()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            await self.refuse()

    async def accept(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def refuse(self) -> None:
        assert self._server is not None
        server, self._server = self._server, None
        server.close()
        self.cut()
        await server.wait_closed()

    def cut(self) -> None:
        for writer in self._links:
            writer.transport.abort()
        self._links.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        self._links |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.transport.abort()  # one side gone: so is the other, without a close frame

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        self._links -= {writer, up_writer}


async def cut_at_random(chat: gc.AsyncChat, rng: random.Random, cuts: list[float]) -> None:
    """Drop the chat's connection at random moments (mid-answer, mid-question, mid-resume),
    until cancelled."""
    while True:
        await asyncio.sleep(rng.uniform(0.002, 0.04))
        transport = chat._ws.transport
        if not transport.is_closing():
            transport.abort()
            cuts.append(time.monotonic())


QUESTIONS = ["Tell me a long story.", "And then?", "Why?"]


@pytest.fixture
async def story_gw() -> AsyncIterator[RunningGateway]:
    """Answers of 150 tokens at 2 ms: several connections drop during each."""
    async with running_gateway(SimEngine(step_ms=2, response_tokens=150)) as running:
        yield running


@pytest.mark.parametrize("seed", [1, 2])
async def test_answers_survive_connections_dropped_at_random(
    story_gw: RunningGateway, seed: int
) -> None:
    truth = await raw_conversation(story_gw.ws_url, QUESTIONS)
    rng = random.Random(seed)
    cuts: list[float] = []
    async with gc.connect(story_gw.ws_url) as chat:
        session_id = chat.session_id
        server = next(s for s in story_gw.gateway.sessions if s.id == session_id)
        cutter = asyncio.create_task(cut_at_random(chat, rng, cuts))
        try:
            for i, (question, (text, usage)) in enumerate(zip(QUESTIONS, truth, strict=True)):
                if i % 2:
                    reply = await chat.ask(question)
                    deltas = [reply.text]
                else:
                    stream = chat.stream(question)
                    deltas = [delta async for delta in stream]
                    assert stream.reply is not None
                    reply = stream.reply
                assert reply.status == "completed"
                assert "".join(deltas) == reply.text == text  # no piece lost or repeated
                assert usage_json(reply.usage) == usage_of(usage)  # no question sent twice
                stored = server.conversation.get(str(reply.item_id))
                assert stored is not None and stored.text == text
        finally:
            cutter.cancel()
        assert chat.session_id == session_id  # one conversation throughout
    resumed = story_gw.gateway.metrics.resumes.labels(outcome="resumed").value
    print(f"\n{len(cuts)} connections cut, {resumed:.0f} resumed")
    assert len(cuts) >= 10 and resumed >= len(cuts) - 1  # the last cut may find no reader
    await story_gw.wait_idle()


@pytest.mark.parametrize("delivered", [False, True], ids=["lost", "delivered"])
@pytest.mark.parametrize("kind", ["conversation.item.create", "response.create"])
async def test_a_request_cut_off_with_its_connection_is_sent_again_only_if_lost(
    story_gw: RunningGateway, kind: str, delivered: bool
) -> None:
    """A request written just before the drop may or may not have reached the gateway:
    the client must send it again if it was lost, and must not if it arrived (a second
    response.create would start a second answer)."""
    ((text, usage),) = await raw_conversation(story_gw.ws_url, QUESTIONS[:1])
    async with gc.connect(story_gw.ws_url, timeout=5) as chat:
        server = next(s for s in story_gw.gateway.sessions if s.id == chat.session_id)
        ws = chat._ws
        send = ws.send

        async def send_then_cut(frame: Any) -> None:
            if json.loads(frame)["type"] != kind:
                await send(frame)
                return
            # Whatever the gateway answers now is lost with the connection: the client
            # learns of it only from the replay.
            ws.transport.pause_reading()
            if not delivered:
                ws.transport.abort()  # the frame goes nowhere
            before = server.outbox.last_sequence_number
            await send(frame)
            if delivered:  # the gateway handled it (answered it), then the network went away
                async with asyncio.timeout(TIMEOUT):
                    while server.outbox.last_sequence_number == before:
                        await asyncio.sleep(0.001)
                ws.transport.abort()

        ws.send = send_then_cut  # type: ignore[method-assign]
        reply = await chat.ask(QUESTIONS[0])
        assert reply.status == "completed" and reply.text == text
        assert usage_json(reply.usage) == usage_of(usage)
        assert (await chat.ask("And then?")).status == "completed"
        assert len(server.conversation) == 4  # two questions, two answers: nothing twice
    m = story_gw.gateway.metrics
    assert m.resumes.labels(outcome="resumed").value == 1
    for code in ("duplicate_item_id", "conversation_already_has_active_response"):
        assert m.errors.labels(code=code).value == 0


async def test_a_cancel_cut_off_with_its_connection_still_stops_the_answer(
    slow_gw: RunningGateway,
) -> None:
    async with gc.connect(slow_gw.ws_url, timeout=5) as chat:
        stream = chat.stream("Tell me a long story")
        seen = [await anext(stream)]
        ws = chat._ws
        send = ws.send

        async def cut_then_send(frame: Any) -> None:
            if json.loads(frame)["type"] == "response.cancel":
                ws.transport.abort()  # the cancel is lost with the connection
            await send(frame)

        ws.send = cut_then_send  # type: ignore[method-assign]
        reply = await stream.cancel()
        assert reply is not None and reply.status == "cancelled"  # not the whole answer
        assert reply.text.startswith("".join(seen))
        assert reply.usage is not None and reply.usage.output_tokens < 400
        assert (await chat.ask("go on", max_output_tokens=3)).status == "incomplete"
    await slow_gw.wait_idle()


async def test_a_network_down_for_a_while_is_waited_for(story_gw: RunningGateway) -> None:
    ((text, _),) = await raw_conversation(story_gw.ws_url, QUESTIONS[:1])

    async def back_after_a_while(proxy: Proxy) -> None:
        await asyncio.sleep(0.5)
        await proxy.accept()

    async with Proxy(story_gw.gateway.port) as proxy, gc.connect(proxy.ws_url) as chat:
        deltas: list[str] = []
        stream = chat.stream(QUESTIONS[0])
        async for delta in stream:
            deltas.append(delta)
            if len(deltas) == 3:
                await proxy.refuse()  # the network goes away, and stays away a while
                network = asyncio.create_task(back_after_a_while(proxy))
        assert "".join(deltas) == text and stream.reply is not None
        assert stream.reply.text == text
        await network
    assert story_gw.gateway.metrics.resumes.labels(outcome="resumed").value == 1


async def test_a_network_down_for_too_long_raises_connection_lost(
    story_gw: RunningGateway,
) -> None:
    async with (
        Proxy(story_gw.gateway.port) as proxy,
        gc.connect(proxy.ws_url, resume_timeout=0.5) as chat,
    ):
        stream = chat.stream(QUESTIONS[0])
        await anext(stream)
        await proxy.refuse()
        started = time.monotonic()
        with pytest.raises(gc.ConnectionLost) as caught:
            async for _ in stream:
                pass
        waited = time.monotonic() - started
    assert caught.value.resume_error is None
    assert isinstance(caught.value.__cause__, gc.GatewayUnavailable)
    assert 0.4 < waited < 5, waited
    assert chat.closed


async def test_a_resume_after_the_window_raises_connection_lost() -> None:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=8), resume_window=0.3) as gw:
        async with gc.connect(gw.ws_url) as chat:
            assert (await chat.ask("hello")).status == "completed"
            chat._ws.transport.abort()  # dropped while idle...
            await gw.wait_idle()  # ...for longer than the window: the gateway let it go
            assert not chat.closed  # the chat does not know yet
            with pytest.raises(gc.ConnectionLost) as caught:
                await chat.ask("still there?")
            assert caught.value.resume_error == "session_not_found"
            assert chat.closed
            with pytest.raises(gc.ConnectionLost):
                await chat.ask("and now?")  # no second attempt
        await gw.wait_idle()  # the fresh session of the refused resume ended too


async def test_a_resume_past_the_replay_buffer_raises_connection_lost() -> None:
    engine = SimEngine(step_ms=1, response_tokens=400)
    async with (
        running_gateway(engine, replay_buffer_bytes=4096) as gw,
        gc.connect(gw.ws_url) as chat,
    ):
        stream = chat.stream("Tell me a long story")
        await anext(stream)
        # The client reads no more while the gateway sends the whole answer: what it
        # has not read (in socket buffers) is lost with the connection, and the
        # gateway kept only the last 4 KiB of it.
        async with asyncio.timeout(TIMEOUT):
            while gw.gateway.scheduler.running:
                await asyncio.sleep(0.01)
        chat._ws.transport.abort()
        with pytest.raises(gc.ConnectionLost) as caught:
            async for _ in stream:
                pass
        assert caught.value.resume_error == "resume_gap"


async def test_another_connection_taking_the_session_over_is_not_fought(
    story_gw: RunningGateway,
) -> None:
    async with gc.connect(story_gw.ws_url) as chat:
        await chat.ask("hello")
        async with RawClient.connect(story_gw.ws_url) as other:
            await other.send(chat._cursor.resume_event())  # same id and token: a takeover
            assert (await other.recv())["type"] == "session.resumed"
            with pytest.raises(gc.ConnectionLost) as caught:
                await chat.ask("mine?")
    assert caught.value.code == 4001 and caught.value.resume_error is None
    assert story_gw.gateway.metrics.resumes.labels(outcome="resumed").value == 1


async def test_a_gateway_shutdown_is_not_resumed() -> None:
    async with (
        running_gateway(SimEngine(step_ms=5, response_tokens=400)) as gw,
        gc.connect(gw.ws_url) as chat,
    ):
        stream = chat.stream("Tell me a long story")
        await anext(stream)
        stopping = asyncio.create_task(gw.gateway.stop())
        async for _ in stream:
            pass
        assert stream.reply is not None and stream.reply.status == "cancelled"
        started = time.monotonic()
        with pytest.raises(gc.ConnectionLost) as caught:
            await chat.ask("anyone there?")
        assert caught.value.code == 1001 and time.monotonic() - started < 2
        await stopping


def test_resume_urls_carry_the_session_id() -> None:
    assert resume_url("ws://h:1/v1/realtime", "sess_0_ab") == (
        "ws://h:1/v1/realtime?session_id=sess_0_ab"
    )
    assert resume_url("wss://h/x?a=1&session_id=old", "sess_1") == "wss://h/x?a=1&session_id=sess_1"


def test_only_requests_a_fence_proves_lost_are_sent_again() -> None:
    answered: set[str] = set()
    ledger = Unconfirmed()

    def request(eid: str, connection: int) -> None:
        ledger.add({"event_id": eid}, connection, lambda: eid not in answered)

    request("a", 0)
    request("b", 0)
    request("c", 1)  # sent on the connection after the first drop
    answered.add("a")  # its answer came in the replay
    assert ledger.any_before(1)
    ledger.fence("f1", 1)
    assert ledger.fence_answered("other", 1) is None  # not a fence: someone else's error
    assert ledger.fence_answered("f1", 1) == [{"event_id": "b"}]  # "c" awaits its own fence
    ledger.fence("f2", 2)  # a second drop: b (sent again on 1) and c are both in doubt
    assert ledger.fence_answered("f2", 2) == [{"event_id": "b"}, {"event_id": "c"}]
    assert not ledger.any_before(2)


def test_only_a_lost_connection_is_resumed() -> None:
    assert is_drop(None, None)  # a reset: no close frame either way
    assert is_drop(None, Close(1011, "keepalive ping timeout"))  # pings went unanswered
    for gateway_closed in (1000, 1001, 1008, 1009, 4001):
        assert not is_drop(Close(gateway_closed, ""), None)
    assert not is_drop(None, Close(1009, ""))  # the client refused a frame: it would again


def test_backoff_is_short_then_capped() -> None:
    delays = list(itertools.islice(backoff(rng=lambda: 1.0), 7))
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert next(backoff(rng=lambda: 0.0)) == 0.025


def test_events_already_processed_are_skipped_and_a_gap_is_an_error() -> None:
    cursor = Cursor(
        {
            "type": "session.created",
            "sequence_number": 1,
            "session": {"id": "s"},
            "resume_token": "t",
        }
    )
    assert cursor.accept({"type": "x", "sequence_number": 2})
    assert not cursor.accept({"type": "x", "sequence_number": 2})  # replayed twice
    assert cursor.accept({"type": "session.resumed"})  # not numbered
    with pytest.raises(gc.ClientError):
        cursor.accept({"type": "x", "sequence_number": 4})
    assert cursor.resume_event() == {
        "type": "session.resume",
        "session_id": "s",
        "resume_token": "t",
        "last_sequence_number": 2,
    }


# ---------------------------------------------------------------------------
# Sync: in a plain function, inside a running loop, and Ctrl-C


def test_sync_client_returns_what_the_raw_protocol_returns(threaded: GatewayThread) -> None:
    expected = asyncio.run(raw_answer(threaded.ws_url, "Hello", max_output_tokens=20))
    with gc.connect_sync(threaded.ws_url, max_output_tokens=20) as chat:
        reply = chat.ask("Hello")
    with gc.connect_sync(threaded.ws_url, max_output_tokens=20) as chat:
        stream = chat.stream("Hello")
        deltas = list(stream)
    assert reply.text == expected
    assert "".join(deltas) == expected and len(deltas) > 1
    assert stream.reply is not None and stream.reply.status == "incomplete"


async def test_sync_client_works_inside_a_running_loop(threaded: GatewayThread) -> None:
    asyncio.get_running_loop()  # like a notebook cell: a loop runs on this very thread
    expected = await raw_answer(threaded.ws_url, "Inside a loop", max_output_tokens=20)
    with gc.connect_sync(threaded.ws_url, max_output_tokens=20) as chat:
        assert chat.ask("Inside a loop").text == expected
        assert "".join(chat.stream("Inside a loop")) != ""  # a second turn streams too


def test_sync_break_cancels_the_answer(threaded: GatewayThread) -> None:
    with gc.connect_sync(threaded.ws_url) as chat:
        stream = chat.stream("Tell me a long story")
        for _ in stream:
            break
        assert stream.reply is not None and stream.reply.status == "cancelled"
        threaded.wait_no_running()


def test_an_unclosed_sync_chat_stops_its_thread_when_collected(threaded: GatewayThread) -> None:
    chat = gc.connect_sync(threaded.ws_url)
    stream = chat.stream("Hello", max_output_tokens=3)
    thread = chat._runner.thread
    del chat  # the stream still needs the chat: it must keep it alive
    assert "".join(stream) and thread.is_alive()
    del stream  # now nothing refers to the chat, and nobody closed it
    garbage.collect()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the loop thread of an unreferenced chat is still running"
    deadline = time.monotonic() + TIMEOUT
    while threaded.health()["sessions"]:  # and the gateway saw the connection end
        assert time.monotonic() < deadline, "the gateway still holds the session"
        time.sleep(0.02)


def test_ctrl_c_during_a_sync_call_cancels_it_on_the_gateway() -> None:
    with (
        GatewayThread(SimEngine(step_ms=1, stall_after=3)) as stalled,
        gc.connect_sync(stalled.ws_url) as chat,
    ):
        stream = chat.stream("this will stall after three tokens")
        deltas = []
        timer = None
        with pytest.raises(KeyboardInterrupt):
            for delta in stream:
                deltas.append(delta)
                if timer is None:  # the stream stalls soon: a person then presses Ctrl-C
                    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
                    timer.start()
        assert timer is not None
        timer.join()
        assert stream.reply is not None and stream.reply.status == "cancelled"
        assert stream.reply.text == "".join(deltas)
        stalled.wait_no_running()

        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            chat.ask("this will stall too")  # Ctrl-C while a blocking ask waits
        timer.join()
        stalled.wait_no_running()
        assert chat.ask("still there?", max_output_tokens=2).status == "incomplete"


class SyncCutter:
    """Drops a sync chat's connection at random moments, from another thread, until stopped."""

    def __init__(self, chat: gc.SyncChat, seed: int) -> None:
        self._chat = chat
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.cuts = 0

    def __enter__(self) -> SyncCutter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)

    def _run(self) -> None:
        while not self._stop.wait(self._rng.uniform(0.002, 0.04)):
            self._chat._runner.loop.call_soon_threadsafe(self._cut)

    def _cut(self) -> None:  # on the chat's loop, which owns the socket
        transport = self._chat._chat._ws.transport
        if not transport.is_closing():
            transport.abort()
            self.cuts += 1


def test_sync_answers_survive_connections_dropped_at_random() -> None:
    with GatewayThread(SimEngine(step_ms=2, response_tokens=150)) as gateway:
        truth = asyncio.run(raw_conversation(gateway.ws_url, QUESTIONS))
        with gc.connect_sync(gateway.ws_url) as chat, SyncCutter(chat, seed=4) as cutter:
            for i, (question, (text, usage)) in enumerate(zip(QUESTIONS, truth, strict=True)):
                if i % 2:
                    reply = chat.ask(question)
                    deltas = [reply.text]
                else:
                    stream = chat.stream(question)
                    deltas = list(stream)
                    assert stream.reply is not None
                    reply = stream.reply
                assert reply.status == "completed"
                assert "".join(deltas) == reply.text == text
                assert usage_json(reply.usage) == usage_of(usage)
        print(f"\n{cutter.cuts} connections cut")
        assert cutter.cuts >= 10


def test_sync_resume_after_the_window_raises_connection_lost() -> None:
    engine = SimEngine(step_ms=1, response_tokens=8)
    with (
        GatewayThread(engine, resume_window=0.3) as gateway,
        gc.connect_sync(gateway.ws_url) as chat,
    ):
        assert chat.ask("hello").status == "completed"
        chat._runner.loop.call_soon_threadsafe(chat._chat._ws.transport.abort)
        deadline = time.monotonic() + TIMEOUT
        while gateway.health()["sessions"]:  # the window ends: the gateway lets it go
            assert time.monotonic() < deadline, "the gateway still holds the session"
            time.sleep(0.02)
        with pytest.raises(gc.ConnectionLost) as caught:
            for _ in chat.stream("still there?"):
                pass
        assert caught.value.resume_error == "session_not_found" and chat.closed


# ---------------------------------------------------------------------------
# The examples, and the terminal chat


def test_three_modes_script_runs(threaded: GatewayThread) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "three_modes.py")],
        env=subprocess_env(threaded.ws_url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "== asynchronous streaming" in done.stdout and "(cancelled)" in done.stdout


def test_notebook_runs_top_to_bottom_in_a_kernel(
    threaded: GatewayThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    path = ROOT / "examples" / "notebook.ipynb"
    notebook = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )
    for key, value in subprocess_env(threaded.ws_url).items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    client = nbclient.NotebookClient(
        notebook,
        timeout=60,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "examples")}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = "".join(
        o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "(cancelled)" in outputs and "invalid_value" in outputs


def test_terminal_chat_once(threaded: GatewayThread) -> None:
    expected = asyncio.run(raw_answer(threaded.ws_url, "Hi there", max_output_tokens=20))
    command = [sys.executable, "-m", "gateway.client", threaded.ws_url, "--max-output-tokens", "20"]
    env = subprocess_env(threaded.ws_url)
    done = subprocess.run(
        [*command, "--once", "Hi there"], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    piped = subprocess.run(
        [*command, "--once", "-"], input="Hi there\n", env=env, capture_output=True, text=True
    )
    assert piped.stdout == expected + "\n"


async def test_terminal_chat_once_survives_a_dropped_connection() -> None:
    question = "Tell me a long story."
    async with (
        running_gateway(SimEngine(step_ms=5, response_tokens=150)) as gw,
        Proxy(gw.gateway.port) as proxy,
    ):
        ((text, _),) = await raw_conversation(gw.ws_url, [question])
        chat = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "gateway.client", proxy.ws_url, "--once", question],
            env=subprocess_env(proxy.ws_url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert chat.stdout is not None
        first = await asyncio.wait_for(chat.stdout.read(1), TIMEOUT)  # the answer streams
        proxy.cut()
        rest, err = await asyncio.wait_for(chat.communicate(), TIMEOUT)
    assert chat.returncode == 0, err
    assert (first + rest).decode() == text + "\n"
    assert gw.gateway.metrics.resumes.labels(outcome="resumed").value == 1


def test_terminal_chat_once_reports_a_missing_gateway() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.client", "ws://127.0.0.1:9", "--once", "hi"],
        env=subprocess_env("ws://127.0.0.1:9"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert "cannot connect" in done.stderr


# Makes the pty the child's controlling terminal, so that Ctrl-C typed into it is a SIGINT
# to the child's process group, exactly as in a real terminal; then becomes the chat.
_CTTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'gateway.client', *sys.argv[1:]])"
)


class Terminal:
    """A program on a pseudo-terminal: type into it, wait for what it prints."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CTTY, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            env=env,
            cwd=ROOT,
        )
        os.close(slave)
        self.master = master
        self.seen = b""
        self._pos = 0

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def expect(self, pattern: bytes, timeout: float = TIMEOUT) -> re.Match[bytes]:
        """Wait for ``pattern`` in the output after the previous match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while not (match := regex.search(self.seen, self._pos)):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen[self._pos :]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                assert chunk, f"terminal closed before {pattern!r}: {self.seen[self._pos :]!r}"
                self.seen += chunk
        self._pos = match.end()
        return match

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)
        os.close(self.master)


# Echo of the typed line, then (terminal control codes and spaces aside) the first answer text.
_ANSWER_STARTS = rb"(?:\x1b\[[0-9;?]*[A-Za-z]|\s)*[^\s\x1b>]"


def test_terminal_chat_ctrl_c_stops_the_answer_and_goes_on(threaded: GatewayThread) -> None:
    env = subprocess_env(threaded.ws_url)
    term = Terminal([threaded.ws_url], env)
    try:
        term.expect(rb"connected")
        term.expect(rb"> ")
        term.type(b"Tell me a long story\r")
        term.expect(rb"long story" + _ANSWER_STARTS)
        term.type(b"\x03")  # Ctrl-C while the answer streams
        term.expect(re.escape(cli.STOPPED.encode()))
        threaded.wait_no_running()  # stopped on the gateway, not only on the screen
        term.expect(rb"> ")
        assert term.proc.poll() is None  # still running

        term.type(b"/system Be brief.\r")
        term.expect(rb"\(instructions set\)")
        term.type(b"/reset\r")
        term.expect(rb"\(new conversation\)")
        term.type(b"And another one\r")
        term.expect(rb"another one" + _ANSWER_STARTS)
        term.type(b"\x03")
        term.expect(re.escape(cli.STOPPED.encode()))
        term.expect(rb"> ")
        term.type(b"\x04")  # Ctrl-D exits
        assert term.proc.wait(TIMEOUT) == 0
    finally:
        term.close()


def test_terminal_chat_reports_a_failed_command_and_goes_on() -> None:
    # Frames of at most 1 KiB: the instructions below are refused by closing the connection.
    with GatewayThread(SimEngine(step_ms=1, response_tokens=5), max_message_bytes=1024) as small:
        term = Terminal([small.ws_url], subprocess_env(small.ws_url))
        try:
            term.expect(rb"connected")
            term.expect(rb"> ")
            term.type(b"/system " + b"Be brief. " * 150 + b"\r")
            term.expect(rb"error: [^\r\n]*lost")
            # Reconnecting sends the instructions again: the refused ones were not kept.
            term.expect(rb"\(reconnected: new conversation\)")
            term.expect(rb"> ")
            term.type(b"/system Be brief.\r")
            term.expect(rb"\(instructions set\)")
            term.type(b"Hi there\r")
            term.expect(rb"Hi there" + _ANSWER_STARTS)
            term.expect(rb"> ")
            term.type(b"\x04")
            assert term.proc.wait(TIMEOUT) == 0
        finally:
            term.close()


def test_terminal_chat_keeps_the_conversation_after_a_refused_command(
    threaded: GatewayThread, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(self: gc.SyncChat, **options: Any) -> None:
        raise gc.GatewayError("invalid_value", "refused", "session.instructions")

    repl = cli.Repl(lambda options: gc.connect_sync(threaded.ws_url, **options), {})
    try:
        chat = repl.chat
        monkeypatch.setattr(gc.SyncChat, "update", refuse)
        repl.handle("/system Be brief.")
        assert "error: invalid_value: refused" in capsys.readouterr().err
        assert repl.chat is chat and not chat.closed  # the same conversation goes on
        assert "instructions" not in repl.options
    finally:
        repl.chat.close()
