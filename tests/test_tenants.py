"""Keys are tenants: what one key (or a client secret it minted) creates, another key
cannot see, continue, cancel, delete or resume; it gets exactly what an id that does not
exist gets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus

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
            assert (await http.get(f"http://{b.address}/v1/responses/{rid}")).status_code == 200
        async with httpx.AsyncClient(headers=auth(BOB)) as http:
            theirs = await http.get(f"http://{b.address}/v1/responses/{rid}")
            assert theirs.status_code == 404
            assert theirs.json()["error"]["code"] == "response_not_found"
