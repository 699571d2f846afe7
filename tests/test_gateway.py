"""The gateway over a real socket, with a raw ``websockets`` client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.engines.sim import SimEngine
from tests.support.harness import TIMEOUT, RawClient, RunningGateway, running_gateway


async def test_health_and_routes(gw: RunningGateway) -> None:
    health = await gw.get_json("/healthz")
    assert health.pop("engine_details") == gw.gateway.engine.describe()
    assert health == {
        "status": "ok",
        "ready": True,
        "engine": "sim",
        "model": "sim",
        "worker": "0",
        "sessions": 0,
        "responses": {"running": 0, "queued": 0},
        "store": {"kind": "memory"},
        "tls": None,
        "urls": {  # as this client reached it, in the schemes the port speaks
            "page": f"{gw.http_url}/",
            "realtime": gw.ws_url,
            "responses": gw.ws_url.replace("/v1/realtime", "/v1/responses"),
            "http": f"{gw.http_url}/v1",
        },
    }
    assert (await gw.get("/readyz"))[0] == 200
    assert (await gw.get("/nope"))[0] == 404
    async with RawClient.connect(gw.ws_url):
        assert (await gw.get_json("/healthz"))["sessions"] == 1


async def test_multi_turn_conversation(gw: RunningGateway) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        await c.say("What is the capital of France?")
        first = await c.respond()
        await c.say("And of Korea?")
        second = await c.respond()
    for turn in (first, second):
        assert turn.status == "completed"
        assert turn.text == turn.final_text != ""
    used = [t.response["usage"]["input_tokens"] for t in (first, second)]
    answer = first.response["usage"]["output_tokens"]
    assert used[1] > used[0] + answer  # the second prompt holds the whole first turn
    assert second.text != first.text


async def test_cancel_mid_stream_keeps_the_partial_answer() -> None:
    async with (
        running_gateway(SimEngine(step_ms=10, response_tokens=200)) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await c.say("Tell me everything.")
        await c.send({"type": "response.create"})
        created = await c.recv_until("response.created")
        for _ in range(3):
            await c.recv_until("response.output_text.delta")
        await c.send({"type": "response.cancel", "response_id": created["response"]["id"]})
        done = await c.recv_until("response.done")
        sent = "".join(e["delta"] for e in c.events if e["type"] == "response.output_text.delta")
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"]["reason"] == "client_cancelled"
        item_id = done["response"]["output"][0]["id"]
        # Nothing of that response comes after its done: the next event answers this.
        await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
        retrieved = await c.recv()
        assert retrieved["type"] == "conversation.item.retrieved"
        assert retrieved["item"]["status"] == "incomplete"
        assert retrieved["item"]["content"][0]["text"] == sent
        assert 3 <= len(sent.split()) < 200
        # ...and the session goes on.
        assert (await c.respond()).status == "completed"


async def test_abrupt_disconnect_frees_everything_without_a_resume_window() -> None:
    engine = SimEngine(step_ms=5, response_tokens=10_000)
    async with running_gateway(engine, resume_window=0) as gw:
        for _ in range(3):
            c = await connect(gw.ws_url).__aenter__()
            await c.recv()
            await c.send(json.dumps({"type": "response.create"}))
            while json.loads(await c.recv())["type"] != "response.output_text.delta":
                pass
            c.transport.abort()  # no close frame: the TCP connection just drops
        await gw.wait_idle()
        engine = gw.gateway.engine
        assert isinstance(engine, SimEngine)
        await asyncio.sleep(0.02)  # a few engine steps
        assert engine.active == 0
        health = await gw.get_json("/healthz")
        assert health["sessions"] == 0 and health["responses"] == {"running": 0, "queued": 0}


async def test_overload_is_refused_with_an_error_naming_the_request() -> None:
    async with (
        running_gateway(
            SimEngine(step_ms=20, response_tokens=50), max_running=1, max_queued=1
        ) as gw,
        RawClient.connect(gw.ws_url) as a,
        RawClient.connect(gw.ws_url) as b,
        RawClient.connect(gw.ws_url) as c,
    ):
        await a.send({"type": "response.create"})
        await a.recv_until("response.created")
        await b.send({"type": "response.create"})
        await b.recv_until("response.created")
        await c.send({"type": "response.create", "event_id": "mine"})
        error = await c.recv()
        assert error["type"] == "error"
        assert (error["error"]["code"], error["error"]["event_id"]) == ("overloaded", "mine")
        await a.send({"type": "response.cancel"})
        await a.recv_until("response.done")
        assert (await b.recv_until("response.done"))["response"]["status"] == "completed"


async def test_a_batch_does_not_starve_another_session() -> None:
    async with running_gateway(
        SimEngine(step_ms=2, response_tokens=8),
        max_running=2,
        max_queued=64,
        max_parallel_per_session=16,
    ) as gw:
        async with RawClient.connect(gw.ws_url) as greedy, RawClient.connect(gw.ws_url) as polite:
            batch = {"type": "response.create", "response": {"conversation": "none"}}
            for _ in range(16):
                await greedy.send(batch)
            for _ in range(16):
                await greedy.recv_until("response.created")
            await polite.send({"type": "response.create"})
            await polite.recv_until("response.done")
            # Count greedy's responses finished before polite got its answer.
            finished_first = sum(1 for e in greedy.events if e["type"] == "response.done")
            pending = [e for e in greedy.events if e["type"] == "response.done"]
            while len(pending) < 16:
                pending.append(await greedy.recv_until("response.done"))
        # Two slots: the polite request waits for one slot to turn over, not for 16.
        assert finished_first <= 4


MALFORMED: list[tuple[str | bytes, str]] = [
    (b"\x01\x02", "binary_frame_not_supported"),
    ("not json", "invalid_json"),
    ("[]", "invalid_event"),
    ('{"event_id": "x"}', "missing_required_parameter"),
    ('{"type": "bogus"}', "unknown_event_type"),
    ('{"type": "session.update", "session": {"temperature": "x"}}', "invalid_type"),
    (
        '{"type": "session.update", "session": {"output_modalities": ["audio"]}}',
        "unsupported_modality",
    ),
    ('{"type": "session.update", "session": {"wat": 1}}', "unknown_parameter"),
    ('{"type": "conversation.item.delete", "item_id": "missing"}', "item_not_found"),
    ('{"type": "conversation.item.retrieve", "item_id": "missing"}', "item_not_found"),
    ('{"type": "response.cancel"}', "response_cancel_not_active"),
]


async def test_every_malformed_input_gets_an_error_and_the_connection_lives(
    gw: RunningGateway,
) -> None:
    async with RawClient.connect(gw.ws_url) as c:
        for frame, code in MALFORMED:
            await c.ws.send(frame)
            event = await c.recv()
            assert event["type"] == "error", frame
            assert event["error"]["code"] == code, (frame, event)
            assert event["error"]["message"]
        await c.say("still here?")
        assert (await c.respond()).status == "completed"


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def threaded_gateway() -> Iterator[str]:
    """One gateway on its own loop and thread, so hypothesis examples can share it."""
    loop = asyncio.new_event_loop()
    started: concurrent.futures.Future[str] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def serve() -> None:
        async with running_gateway(SimEngine(step_ms=0, response_tokens=4)) as gw:
            started.set_result(gw.ws_url)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    yield started.result(timeout=10)
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=10)


_event_types = [
    "session.update",
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "response.create",
    "response.cancel",
    "x",
]
_fields = {k: _values for k in ("session", "item", "item_id", "response", "event_id")}


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(_event_types)}, optional=_fields),
        min_size=1,
        max_size=6,
    )
)
def test_random_events_never_break_the_connection(
    threaded_gateway: str, events: list[dict[str, Any]]
) -> None:
    probe = {"conversation": "none", "metadata": {"probe": "1"}}

    async def scenario() -> dict[str, Any]:
        async with RawClient.connect(threaded_gateway) as c:
            for event in events:
                await c.ws.send(json.dumps(event))
            await c.send({"type": "response.create", "response": probe})
            async with asyncio.timeout(10):
                while True:
                    event = await c.recv()
                    if event["type"] == "response.done" and event["response"]["metadata"]:
                        return event

    assert asyncio.run(scenario())["response"]["status"] == "completed"


async def test_a_frame_over_the_limit_closes_with_1009() -> None:
    async with (
        running_gateway(SimEngine(step_ms=0), max_message_bytes=1000) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await c.say("x" * 10)
        await c.ws.send(json.dumps({"type": "bogus", "pad": "x" * 2000}))
        with pytest.raises(ConnectionClosed):
            await c.recv()
        assert c.ws.close_code == 1009


async def test_origin_key_and_session_limits() -> None:
    async with running_gateway(
        SimEngine(step_ms=0),
        allowed_origins=("https://chat.example",),
        api_keys=("sekret",),
        max_sessions=1,
    ) as gw:
        with pytest.raises(InvalidStatus) as refused:
            await connect(gw.ws_url, origin="https://evil.example").__aenter__()  # type: ignore[arg-type]
        assert refused.value.response.status_code == 403
        with pytest.raises(InvalidStatus) as refused:
            await connect(gw.ws_url).__aenter__()
        assert refused.value.response.status_code == 401
        headers = {"Authorization": "Bearer sekret"}
        async with RawClient.connect(gw.ws_url, additional_headers=headers):
            with pytest.raises(InvalidStatus) as refused:
                await connect(gw.ws_url, additional_headers=headers).__aenter__()
            assert refused.value.response.status_code == 503
        await gw.wait_idle()
        # Browsers: the key as a subprotocol, next to "realtime" (which is the one chosen).
        async with RawClient.connect(
            gw.ws_url,
            origin="https://chat.example",  # type: ignore[arg-type]
            subprotocols=["realtime", "openai-insecure-api-key.sekret"],  # type: ignore[list-item]
        ) as c:
            assert c.ws.subprotocol == "realtime"


async def test_not_ready_until_the_engine_has_loaded() -> None:
    loaded = asyncio.Event()

    class SlowLoadingSim(SimEngine):
        async def start(self) -> None:
            await loaded.wait()
            await super().start()

    engine = SlowLoadingSim(step_ms=0)
    from gateway.config import GatewayConfig
    from gateway.server import Gateway

    gateway = Gateway(engine, GatewayConfig(port=0))
    await gateway.start()
    try:
        running = RunningGateway(
            gateway,
            f"ws://127.0.0.1:{gateway.port}/v1/realtime",
            f"http://127.0.0.1:{gateway.port}",
        )
        assert (await running.get("/readyz"))[0] == 503
        with pytest.raises(InvalidStatus) as refused:
            await connect(running.ws_url).__aenter__()
        assert refused.value.response.status_code == 503
        loaded.set()
        await gateway.wait_ready()
        assert (await running.get("/readyz"))[0] == 200
    finally:
        loaded.set()
        await gateway.stop()


def _small_buffer_socket(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


async def test_a_reader_that_stops_reading_costs_bounded_memory_and_loses_nothing() -> None:
    tokens = 20_000
    async with running_gateway(SimEngine(step_ms=0, response_tokens=tokens)) as gw:
        sock = _small_buffer_socket(gw.gateway.port)
        async with connect(gw.ws_url, sock=sock, max_queue=1) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "response.create"}))
            (session,) = gw.gateway.sessions
            outbox = session.outbox
            peak = 0
            while not outbox.stats.deltas_in:
                await asyncio.sleep(0.001)
            # Read nothing while the engine produces the whole answer.
            while session.live_responses:
                peak = max(peak, len(outbox))
                await asyncio.sleep(0.005)
            assert peak < 50  # a few merged deltas, not thousands of frames
            assert outbox.pending_bytes < 1 << 20
            assert outbox.stats.delta_frames_out < outbox.stats.deltas_in
            deltas: list[str] = []
            async with asyncio.timeout(20):
                while True:
                    event = json.loads(await ws.recv())
                    if event["type"] == "response.output_text.delta":
                        deltas.append(event["delta"])
                    if event["type"] == "response.output_text.done":
                        final = event["text"]
                    if event["type"] == "response.done":
                        break
        assert "".join(deltas) == final
        assert len(final.split()) == tokens
        assert len(deltas) < tokens  # coalesced


async def test_a_client_that_never_reads_is_closed_after_the_stall_timeout() -> None:
    async with running_gateway(
        SimEngine(step_ms=0, response_tokens=1_000_000), stall_timeout=0.5, resume_window=0
    ) as gw:
        sock = _small_buffer_socket(gw.gateway.port)
        ws = await connect(gw.ws_url, sock=sock, max_queue=1).__aenter__()
        await ws.send(json.dumps({"type": "response.create"}))
        await gw.wait_idle()  # the server gave up on it and freed its work
        assert gw.gateway.metrics.finished.labels(status="cancelled").value == 1
        ws.transport.abort()


async def test_slow_streams_to_clients_that_never_read_are_closed_within_the_stall_timeout() -> (
    None
):
    """A slow stream never fills the kernel's buffers within the stall timeout (the issue's
    reproduction: the keepalive closed such clients after 40 s, with 1011): an unanswered
    ping behind the events is what tells."""
    stall, clients = 1.0, 20
    engine = SimEngine(step_ms=20, response_tokens=4000)
    async with running_gateway(engine, stall_timeout=stall) as gw:
        sockets = [
            await connect(gw.ws_url, max_queue=1, ping_interval=None).__aenter__()
            for _ in range(clients)
        ]
        for ws in sockets:  # each asks for an answer and then reads nothing at all
            await ws.send(json.dumps({"type": "response.create"}))
            ws.transport.pause_reading()
        started = time.monotonic()
        metrics = gw.gateway.metrics
        async with asyncio.timeout(stall + 4):
            while metrics.stalled.value < clients:
                await asyncio.sleep(0.05)
        took = time.monotonic() - started
        assert stall <= took < stall + 2, took
        # Their sessions wait for a resume (no close frame came from these clients), once
        # the close frame that cannot reach them has had its moment.
        async with asyncio.timeout(stall + 2):
            while metrics.detached.value < clients:
                await asyncio.sleep(0.05)
        for ws in sockets:
            ws.transport.abort()


async def test_a_stalled_generation_fails_after_the_generation_timeout() -> None:
    engine = SimEngine(step_ms=2, response_tokens=50, stall_after=5)
    async with running_gateway(engine, generation_timeout=0.5) as gw:
        async with RawClient.connect(gw.ws_url) as client:
            started = time.monotonic()
            await client.send({"type": "response.create"})
            error = await client.recv_until("error")
            done = await client.recv_until("response.done")
            took = time.monotonic() - started
        assert error["error"]["code"] == "generation_timeout"
        assert done["response"]["status"] == "failed"
        assert done["response"]["status_details"]["error"]["code"] == "generation_timeout"
        assert 0.5 <= took < 2.5
        await gw.wait_idle()  # aborted in the engine, the slot is free
        assert engine.active == 0
        assert gw.gateway.metrics.generation_timeouts.value == 1


async def test_a_slow_reader_still_gets_its_response_done_and_1001_at_shutdown() -> None:
    """Found in review: the ended session's pending events (its response.done, then the
    close) were dropped when the session let go of its outbox."""
    engine = SimEngine(step_ms=1, response_tokens=100_000)
    gw_cm = running_gateway(engine)
    gw = await gw_cm.__aenter__()
    try:
        sock = _small_buffer_socket(gw.gateway.port)
        ws = await connect(gw.ws_url, sock=sock, max_queue=4)
        await ws.recv()
        await ws.send(json.dumps({"type": "response.create"}))
        ws.transport.pause_reading()  # a reader that is behind...
        async with asyncio.timeout(TIMEOUT):  # ...until the gateway's side pushes back
            while not any(len(s.outbox) for s in gw.gateway.sessions):
                await asyncio.sleep(0.01)
        stopping = asyncio.create_task(gw.gateway.stop())
        await asyncio.sleep(0.3)
        ws.transport.resume_reading()  # it catches up during the shutdown's grace
        done = None
        with contextlib.suppress(ConnectionClosed):
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.done":
                    done = event
        assert done is not None
        assert done["response"]["status_details"]["gateway_reason"] == "server_shutdown"
        assert ws.close_code == 1001
        await stopping
    finally:
        await gw_cm.__aexit__(None, None, None)
