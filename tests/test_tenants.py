"""Keys are tenants: what one key (or a client secret it minted) creates, another key
cannot see, continue, cancel, delete or resume; it gets exactly what an id that does not
exist gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.cluster.store_writes import response_key
from gateway.engines.sim import SimEngine
from tests.support.gateway_processes import gateways
from tests.support.harness import RawClient, RunningGateway, running_gateway
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401
from tests.support.responses_harness import ResponsesClient

ALICE, BOB = "key-alice", "key-bob"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    engine = SimEngine(step_ms=1, response_tokens=6)
    async with running_gateway(engine, api_keys=(ALICE, BOB)) as running:
        yield running


async def post(gw: RunningGateway, key: str, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http_url, headers=auth(key)) as http:
        return await http.post(path, json=body)


async def call(gw: RunningGateway, key: str, method: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http_url, headers=auth(key)) as http:
        return await http.request(method, path)


async def test_another_keys_stored_response_is_as_if_it_did_not_exist(gw: RunningGateway) -> None:
    stored = (await post(gw, ALICE, "/v1/responses", {"model": "m", "input": "secret"})).json()
    rid = stored["id"]
    for method, path in [
        ("GET", f"/v1/responses/{rid}"),
        ("GET", f"/v1/responses/{rid}/input_items"),
        ("DELETE", f"/v1/responses/{rid}"),
        ("POST", f"/v1/responses/{rid}/cancel"),
    ]:
        theirs = await call(gw, BOB, method, path)
        unknown = await call(gw, BOB, method, path.replace(rid, "resp_" + "0" * 24))
        assert theirs.status_code == unknown.status_code == 404, (method, path)
        assert theirs.json()["error"]["code"] == "response_not_found"
        assert theirs.json()["error"].keys() == unknown.json()["error"].keys()
    continued = await post(
        gw, BOB, "/v1/responses", {"model": "m", "input": "x", "previous_response_id": rid}
    )
    assert continued.status_code == 400
    assert continued.json()["error"]["code"] == "previous_response_not_found"
    # Alice's is untouched by Bob's delete, and hers to read and continue.
    assert (await call(gw, ALICE, "GET", f"/v1/responses/{rid}")).status_code == 200
    items = (await call(gw, ALICE, "GET", f"/v1/responses/{rid}/input_items")).json()
    assert items["data"][0]["content"][0]["text"] == "secret"
    mine = await post(
        gw, ALICE, "/v1/responses", {"model": "m", "input": "x", "previous_response_id": rid}
    )
    assert mine.status_code == 200
    assert (await call(gw, ALICE, "DELETE", f"/v1/responses/{rid}")).status_code == 200


async def test_a_client_secret_is_its_keys_tenant(gw: RunningGateway) -> None:
    minted = await post(gw, ALICE, "/v1/realtime/client_secrets", {})
    secret = minted.json()["value"]
    stored = (await post(gw, ALICE, "/v1/responses", {"model": "m", "input": "hi"})).json()
    assert (await call(gw, secret, "GET", f"/v1/responses/{stored['id']}")).status_code == 200
    bobs = (await post(gw, BOB, "/v1/realtime/client_secrets", {})).json()["value"]
    assert (await call(gw, bobs, "GET", f"/v1/responses/{stored['id']}")).status_code == 404


async def test_a_websocket_turn_cannot_continue_another_keys_response(
    gw: RunningGateway,
) -> None:
    url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
    async with ResponsesClient.connect(url, additional_headers=auth(ALICE)) as alice:
        turn = await alice.respond(model="m", input="secret")
    async with ResponsesClient.connect(url, additional_headers=auth(BOB)) as bob:
        await bob.create(model="m", input="x", previous_response_id=turn.id)
        error = await bob.error()
        assert error["error"]["code"] == "previous_response_not_found"
        assert (await bob.respond(model="m", input="mine")).status == "completed"


async def test_a_resume_needs_the_sessions_tenant_as_well_as_its_token(
    gw: RunningGateway,
) -> None:
    async with RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)) as alice:
        session = alice.events[0]["session"]
        created = alice.events[0]
        alice.ws.transport.abort()  # a dropped connection: no close frame
    resume = {
        "type": "session.resume",
        "session_id": session["id"],
        "resume_token": created["resume_token"],
        "last_sequence_number": created["sequence_number"],
    }
    async with RawClient.connect(gw.ws_url, additional_headers=auth(BOB)) as bob:
        await bob.send(resume)
        error = await bob.recv_until("error")
        assert error["error"]["code"] == "session_not_found"
    async with RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)) as again:
        await again.send(resume)
        assert (await again.recv_until("session.resumed"))["type"] == "session.resumed"
    # The Responses WebSocket's resume at the upgrade: 404 for another tenant.
    url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
    async with ResponsesClient.connect(url, additional_headers=auth(ALICE)) as mine:
        ids = {"x-session-id": mine.session_id, "x-resume-token": mine.resume_token}
        mine.ws.transport.abort()
    with pytest.raises(InvalidStatus) as refused:
        async with ResponsesClient.connect(url, additional_headers={**auth(BOB), **ids}):
            pass
    assert refused.value.response.status_code == 404


async def test_the_redis_store_keeps_each_tenants_responses_its_own(
    redis_server: RedisServer,
) -> None:
    keys = ("--api-key", ALICE, "--api-key", BOB)
    async with gateways(redis_server.url, 2, *keys, step_ms=1, tokens=5) as (a, b):
        async with httpx.AsyncClient(headers=auth(ALICE)) as http:
            made = await http.post(f"http://{a.address}/v1/responses", json={"input": "hi"})
            rid = made.json()["id"]
            # The store's write follows the answer (one flush later): wait for it there.
            async with asyncio.timeout(10):
                while not redis_server.client().exists(response_key(rid)):
                    await asyncio.sleep(0.01)
            assert (await http.get(f"http://{b.address}/v1/responses/{rid}")).status_code == 200
        async with httpx.AsyncClient(headers=auth(BOB)) as http:
            theirs = await http.get(f"http://{b.address}/v1/responses/{rid}")
            assert theirs.status_code == 404
            assert theirs.json()["error"]["code"] == "response_not_found"


# -- the key file's limits -------------------------------------------------------------


def key_file(tmp_path: Any, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


async def test_requests_per_minute_is_a_429_with_retry_after_and_a_socket_error(
    tmp_path: Any,
) -> None:
    keys = key_file(tmp_path, f"{ALICE} name=alice requests_per_minute=2\n{BOB} name=bob\n")
    engine = SimEngine(step_ms=1, response_tokens=4)
    async with running_gateway(engine, api_key_file=keys) as gw:
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        for _ in range(2):
            assert (await post(gw, ALICE, "/v1/chat/completions", chat)).status_code == 200
        over = await post(gw, ALICE, "/v1/chat/completions", chat)
        assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
        assert over.json()["error"]["code"] == "rate_limit_exceeded"
        over = await post(gw, ALICE, "/v1/responses", {"model": "m", "input": "x"})
        assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
        # Bob has no limits; Alice's socket says so in its error event and goes on.
        assert (await post(gw, BOB, "/v1/chat/completions", chat)).status_code == 200
        async with RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)) as alice:
            await alice.send({"type": "response.create"})
            error = await alice.recv_until("error")
            assert error["error"]["code"] == "rate_limit_exceeded"
            await alice.send({"type": "session.update", "session": {"instructions": "hi"}})
            assert (await alice.recv_until("session.updated"))["type"] == "session.updated"
        _, text = await gw.get("/metrics")
        assert b'gateway_tenant_refused_total{reason="request",tenant="alice"' in text
        assert ALICE.encode() not in text and BOB.encode() not in text


async def test_max_sessions_refuses_the_handshake_with_429(tmp_path: Any) -> None:
    keys = key_file(tmp_path, f"{ALICE} name=alice max_sessions=1\n")
    async with (
        running_gateway(SimEngine(step_ms=1), api_key_file=keys) as gw,
        RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)),
    ):
        with pytest.raises(InvalidStatus) as refused:
            async with RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)):
                pass
        assert refused.value.response.status_code == 429
        assert refused.value.response.headers["Retry-After"] == "1"


async def test_tokens_per_minute_and_rate_limits_updated(tmp_path: Any) -> None:
    keys = key_file(tmp_path, f"{ALICE} name=alice tokens_per_minute=10 requests_per_minute=5\n")
    engine = SimEngine(step_ms=1, response_tokens=6)
    async with (
        running_gateway(engine, api_key_file=keys) as gw,
        RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)) as alice,
    ):
        await alice.respond()
        updated = next(e for e in alice.events if e["type"] == "rate_limits.updated")
        named = {r["name"]: r for r in updated["rate_limits"]}
        assert named["requests"]["limit"] == 5 and named["requests"]["remaining"] == 4
        assert named["tokens"]["limit"] == 10
        # 6 tokens used: an answer without a limit reserves the whole minute's 10.
        await alice.send({"type": "response.create"})
        error = await alice.recv_until("error")
        assert error["error"]["code"] == "rate_limit_exceeded"
        assert "tokens_per_minute" in error["error"]["message"]


async def test_a_sighup_adds_and_removes_keys_without_a_restart(tmp_path: Any) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{ALICE} name=alice\n")
    async with running_gateway(
        SimEngine(step_ms=5, response_tokens=400), api_key_file=str(path)
    ) as gw:
        async with RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)) as alice:
            await alice.send({"type": "response.create"})
            await alice.recv_until("response.output_text.delta")
            path.write_text(f"{BOB} name=bob\nnot a valid line=\n")
            gw.gateway.reload_keys()  # malformed: the old keys stay
            assert (await call(gw, ALICE, "GET", "/v1/models")).status_code == 200
            path.write_text(f"{BOB} name=bob\n")
            gw.gateway.reload_keys()
            assert (await call(gw, BOB, "GET", "/v1/models")).status_code == 200
            assert (await call(gw, ALICE, "GET", "/v1/models")).status_code == 401
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    await alice.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4003
        await gw.wait_idle()
        assert not gw.gateway.scheduler.running


async def test_a_busy_tenant_does_not_starve_another(tmp_path: Any) -> None:
    """Two engine slots, ten answers of Alice's waiting: Bob's one answer takes the next
    free slot, not the eleventh."""
    engine = SimEngine(step_ms=5, response_tokens=40)  # 0.2 s an answer: Bob is queued in time
    async with running_gateway(engine, api_keys=(ALICE, BOB), max_running=2) as gw:
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}

        async def first_token(key: str) -> float:
            async with (
                httpx.AsyncClient(base_url=gw.http_url, headers=auth(key)) as http,
                http.stream("POST", "/v1/chat/completions", json=chat) as answer,
            ):
                first = None
                async for line in answer.aiter_lines():  # read to the end: leaving cancels
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = asyncio.get_running_loop().time()
            assert first is not None, "no token"
            return first

        alices = [asyncio.create_task(first_token(ALICE)) for _ in range(10)]
        while gw.gateway.scheduler.queued < 8:
            await asyncio.sleep(0.001)
        bob = await first_token(BOB)
        times = sorted(await asyncio.gather(*alices))
        assert bob < times[3], "Bob waited behind Alice's queue"


@pytest.mark.parametrize(("level", "access_log"), [("debug", "text"), ("info", "json")])
async def test_no_log_line_holds_a_key_or_a_client_secret(level: str, access_log: str) -> None:
    flags = ("--api-key", ALICE, "--log-level", level, "--access-log", access_log)
    async with gateways("memory", 1, *flags, step_ms=1, tokens=3) as (g,):
        async with httpx.AsyncClient(base_url=f"http://{g.address}", headers=auth(ALICE)) as http:
            secret = (await http.post("/v1/realtime/client_secrets", json={})).json()["value"]
            await http.post("/v1/responses", json={"input": "hi"})
            wrong = await http.get("/v1/models", headers=auth(ALICE + "-wrong"))
            assert wrong.status_code == 401
        async with RawClient.connect(g.url(), additional_headers=auth(ALICE)) as c:
            token = c.events[0]["resume_token"]
            session_id = c.events[0]["session"]["id"]
            await c.respond()
            c.ws.transport.abort()  # dropped: resumed below with the token in the query
        subprotocols: Any = ["realtime", f"openai-insecure-api-key.{secret}"]
        async with RawClient.connect(g.url(), subprotocols=subprotocols) as c:
            await c.respond()
        url = g.url("/v1/responses")
        async with ResponsesClient.connect(url, additional_headers=auth(secret)) as r:
            await r.respond(input="hi")
            responses_token = r.resume_token
            query = f"?session_id={r.session_id}&resume_token={responses_token}"
            r.ws.transport.abort()
        async with ResponsesClient.connect(url + query, additional_headers=auth(secret)):
            pass
        await g.stop()
    text = "".join(g.log)
    assert "GET /v1/realtime" in text or level != "debug"  # DEBUG did log the requests
    # The access log's lines are there (names, ids) and hold no credential either.
    access = [line for line in g.log if "gateway.access" in line or line.startswith("{")]
    assert len(access) >= 8 and session_id in "".join(access)
    assert "tenant=key-" in "".join(access) or '"tenant":"key-' in "".join(access)
    for found in (ALICE, secret, token, responses_token):
        assert found not in text, f"a credential in the {level} log"


async def test_a_session_waiting_for_its_resume_leaves_room_to_resume_it(
    tmp_path: Any,
) -> None:
    keys = key_file(tmp_path, f"{ALICE} name=alice max_sessions=1\n")
    async with running_gateway(SimEngine(step_ms=1), api_key_file=keys) as gw:
        async with RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)) as first:
            created = first.events[0]
            first.ws.transport.abort()
        while not gw.gateway.table.detached:
            await asyncio.sleep(0.005)
        async with RawClient.connect(gw.ws_url, additional_headers=auth(ALICE)) as again:
            await again.send(
                {
                    "type": "session.resume",
                    "session_id": created["session"]["id"],
                    "resume_token": created["resume_token"],
                    "last_sequence_number": created["sequence_number"],
                }
            )
            assert (await again.recv_until("session.resumed"))["type"] == "session.resumed"
        assert gw.gateway.scheduler.tenants.sessions["alice"] <= 1


async def test_a_tenants_stored_responses_evict_only_its_own() -> None:
    """The response store's byte budget is each tenant's: a busy tenant's responses push
    out its own oldest, never another tenant's."""
    engine = SimEngine(step_ms=1, response_tokens=6)
    async with running_gateway(engine, api_keys=(ALICE, BOB), response_store_bytes=16 << 10) as gw:
        kept = (await post(gw, ALICE, "/v1/responses", {"model": "m", "input": "mine"})).json()
        bobs = []
        for i in range(40):  # each stored response is 2 KiB or more: far past the budget
            body = {"model": "m", "input": f"busy {i}"}
            bobs.append((await post(gw, BOB, "/v1/responses", body)).json()["id"])
        assert (await call(gw, ALICE, "GET", f"/v1/responses/{kept['id']}")).status_code == 200
        assert (await call(gw, BOB, "GET", f"/v1/responses/{bobs[-1]}")).status_code == 200
        assert (await call(gw, BOB, "GET", f"/v1/responses/{bobs[0]}")).status_code == 404


async def test_tokens_per_minute_is_reserved_when_an_answer_starts(tmp_path: Any) -> None:
    """Answers started at once cannot overshoot ``tokens_per_minute``: each reserves its
    ``max_output_tokens`` when admitted, and what it really used is charged at its end."""
    keys = key_file(tmp_path, f"{ALICE} name=alice tokens_per_minute=100\n")
    engine = SimEngine(step_ms=10, response_tokens=30)
    async with running_gateway(engine, api_key_file=keys) as gw:
        body = {"model": "m", "input": "hi", "max_output_tokens": 40}
        answers = await asyncio.gather(*(post(gw, ALICE, "/v1/responses", body) for _ in range(5)))
        served = [a.json() for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code == 429]
        assert len(served) + len(refused) == 5
        assert sum(r["usage"]["output_tokens"] for r in served) <= 100
        assert refused and refused[0].json()["error"]["code"] == "rate_limit_exceeded"
        # Each used 30 of the 40 it reserved: settled at its end, the room is used - 100.
        assert (await post(gw, ALICE, "/v1/responses", body)).status_code == 200
