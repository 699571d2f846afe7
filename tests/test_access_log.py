"""The access log (``--access-log json``) read as a log shipper would: one JSON object per HTTP
request and per answer on a WebSocket, checked field by field against what the client was
sent; and ``x-request-id`` on every HTTP response, errors and upgrades included."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from gateway.engines.sim import SimEngine
from tests.support.harness import RawClient, RunningGateway, running_gateway
from tests.support.responses_harness import ResponsesClient

KEY = "key-of-alice"
Line = dict[str, Any]


@pytest.fixture
async def gw(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> AsyncIterator[RunningGateway]:
    caplog.set_level(logging.INFO, logger="gateway.access")
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} name=alice\n")
    engine = SimEngine(step_ms=1, response_tokens=8)
    async with running_gateway(engine, api_key_file=str(keys), access_log="json") as running:
        yield running


def lines(caplog: pytest.LogCaptureFixture) -> list[Line]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]


async def line(caplog: pytest.LogCaptureFixture, match: Callable[[Line], bool]) -> Line:
    """The access log line ``match`` accepts (written as its response ends: it may follow
    the client's last byte by a moment)."""
    async with asyncio.timeout(5):
        while True:
            found = [x for x in lines(caplog) if match(x)]
            if found:
                assert len(found) == 1, found  # one line per request or answer
                return found[0]
            await asyncio.sleep(0.005)


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, trust_env=False)


def check_answer_timings(x: Line) -> None:
    assert 0 <= x["slot_wait"] <= x["time_to_first_token"] <= x["duration"], x
    assert x["client"].startswith("127.0.0.1:")


async def test_http_routes_each_leave_one_line_with_their_figures(
    gw: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}
    async with client() as http:
        chat = await http.post(
            f"{gw.http_url}/v1/chat/completions",
            json=body,
            headers={"X-Client-Request-Id": "my-own-id 1"},
        )
        models = await http.get(f"{gw.http_url}/v1/models")
        refused = await http.post(
            f"{gw.http_url}/v1/chat/completions", json={**body, "logit_bias": {"1": 2}}
        )
        async with http.stream(
            "POST",
            f"{gw.http_url}/v1/responses",
            json={"model": "r", "input": "hi", "stream": True},
        ) as sse:
            events = [orjson.loads(x[6:]) async for x in sse.aiter_lines() if x.startswith("data:")]
        missing = await http.get(f"{gw.http_url}/v1/nothing-here")
    async with httpx.AsyncClient(trust_env=False) as anonymous:
        unauthorized = await anonymous.get(
            f"{gw.http_url}/v1/models", headers={"Authorization": "Bearer wrong"}
        )

    completion = chat.json()
    x = await line(caplog, lambda x: x.get("request_id") == chat.headers["x-request-id"])
    assert x["kind"] == "http" and x["method"] == "POST" and x["status"] == 200
    assert x["route"] == x["path"] == "/v1/chat/completions"
    assert x["client_request_id"] == "my-own-id 1"
    assert x["tenant"] == "alice" and x["model"] == "m"
    assert x["response_id"] == completion["id"] and x["response_status"] == "completed"
    usage = completion["usage"]
    assert x["input_tokens"] == usage["prompt_tokens"] and x["cached_tokens"] == 0
    assert x["output_tokens"] == usage["completion_tokens"] == 8
    assert "error_code" not in x and x["session_id"].startswith("sess_")
    check_answer_timings(x)

    x = await line(caplog, lambda x: x.get("request_id") == models.headers["x-request-id"])
    assert (x["route"], x["status"], x["tenant"]) == ("/v1/models", 200, "alice")
    assert "response_id" not in x and "model" not in x

    x = await line(caplog, lambda x: x.get("request_id") == refused.headers["x-request-id"])
    assert refused.status_code == x["status"] == 400
    assert (x["error_code"], x["error_param"]) == ("unsupported_value", "logit_bias")
    assert x["tenant"] == "alice" and "response_id" not in x

    completed = events[-1]["response"]
    x = await line(caplog, lambda x: x.get("request_id") == sse.headers["x-request-id"])
    assert (x["route"], x["status"], x["response_status"]) == ("/v1/responses", 200, "completed")
    assert x["response_id"] == completed["id"] and x["model"] == "r"
    assert x["output_tokens"] == completed["usage"]["output_tokens"]
    check_answer_timings(x)

    x = await line(caplog, lambda x: x.get("request_id") == missing.headers["x-request-id"])
    assert (x["status"], x["path"], x.get("route")) == (404, "/v1/nothing-here", None)

    x = await line(caplog, lambda x: x.get("request_id") == unauthorized.headers["x-request-id"])
    assert (x["status"], x["error_code"], x.get("tenant")) == (401, "invalid_api_key", None)


async def test_the_choices_of_one_request_are_one_line_with_the_requests_usage(
    gw: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """``n`` choices (and a Completions request's prompts) are answers of one request: its
    one line, named by the id the client got, with the usage the client got."""
    messages = [{"role": "user", "content": "hi"}]
    async with client() as http:
        chat = await http.post(
            f"{gw.http_url}/v1/chat/completions", json={"messages": messages, "n": 3}
        )
        body = {"prompt": ["one two", "three"], "n": 2, "stream": True}
        body["stream_options"] = {"include_usage": True}
        completions = await http.post(f"{gw.http_url}/v1/completions", json=body)
    chunks = [orjson.loads(x[6:]) for x in completions.text.splitlines() if x[:7] == "data: {"]
    seen = [  # (answer, the id and usage its client got, its choices of 8 tokens each)
        (chat, chat.json()["id"], chat.json()["usage"], 3),
        (completions, chunks[0]["id"], chunks[-1]["usage"], 4),
    ]
    for answer, answer_id, usage, choices in seen:
        x = await line(caplog, lambda x, a=answer: x.get("request_id") == a.headers["x-request-id"])
        assert x["kind"] == "http" and x["response_id"] == answer_id
        assert x["response_status"] == "completed"
        assert x["input_tokens"] == usage["prompt_tokens"]
        assert x["output_tokens"] == usage["completion_tokens"] == choices * 8
        check_answer_timings(x)
    assert not [x for x in lines(caplog) if x["kind"] == "answer"]  # no line of their own


async def test_openais_404_and_405_have_their_lines_and_the_id_the_sdk_reports(
    gw: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key=KEY, max_retries=0) as c:
        with pytest.raises(openai.NotFoundError) as missing:  # no embeddings on the sim
            await c.embeddings.create(model="m", input="hello")
        with pytest.raises(openai.APIStatusError) as wrong:
            await c.get("/completions", cast_to=object)
    for error, route, status in ((missing, "/v1/embeddings", 404), (wrong, "/v1/completions", 405)):
        request_id = error.value.request_id
        assert request_id is not None and request_id.startswith("req_")
        x = await line(caplog, lambda x, rid=request_id: x.get("request_id") == rid)
        assert (x["route"], x["status"], x["tenant"]) == (route, status, "alice")


async def test_every_other_route_leaves_its_line(
    gw: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The routes of a stored response, the models, client secrets, the probes, the page:
    each request its line, with its route's pattern, status, tenant and request id."""
    async with client() as http:
        stored = (await http.post(f"{gw.http_url}/v1/responses", json={"input": "hi"})).json()
        rid = stored["id"]
        calls = [
            ("GET", f"/v1/responses/{rid}", "/v1/responses/{id}", 200),
            ("GET", f"/v1/responses/{rid}/input_items", "/v1/responses/{id}/input_items", 200),
            ("POST", f"/v1/responses/{rid}/cancel", "/v1/responses/{id}/cancel", 400),
            ("DELETE", f"/v1/responses/{rid}", "/v1/responses/{id}", 200),
            ("GET", "/v1/models/sim", "/v1/models/{id}", 200),
            ("POST", "/v1/realtime/client_secrets", "/v1/realtime/client_secrets", 200),
            ("GET", "/healthz", "/healthz", 200),
            ("GET", "/readyz", "/readyz", 200),
            ("GET", "/metrics", "/metrics", 200),
            ("GET", "/", "/", 200),
            ("GET", "/v1/realtime", "/v1/realtime", 426),
        ]
        for method, path, route, status in calls:
            answer = await http.request(
                method, gw.http_url + path, json={} if method == "POST" else None
            )
            assert answer.status_code == status, (path, answer.text)
            x = await line(
                caplog, lambda x, a=answer: x.get("request_id") == a.headers["x-request-id"]
            )
            assert (x["kind"], x["method"], x["route"], x["path"], x["status"]) == (
                "http",
                method,
                route,
                path,
                status,
            )
            assert x["tenant"] == "alice" and x["duration"] >= 0


async def test_socket_answers_refusals_and_connections_each_leave_one_line(
    gw: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "X-Client-Request-Id": "sock-1"}
    async with RawClient.connect(gw.ws_url, additional_headers=headers) as c:
        assert c.ws.response is not None
        connection_id = c.ws.response.headers["x-request-id"]
        session_id = c.events[0]["session"]["id"]
        await c.say("Hello")
        done = await c.respond(temperature=0.25, max_output_tokens=5)
        await c.send({"type": "response.create", "response": {"temperature": 7}})
        await c.recv_until("error")
        await c.send({"type": "response.create"})
        await c.recv_until("response.output_text.delta")
        await c.send({"type": "response.cancel"})
        cancelled = (await c.recv_until("response.done"))["response"]

    x = await line(caplog, lambda x: x.get("response_id") == done.id)
    assert (x["kind"], x["event"], x["route"], x["status"]) == (
        "answer",
        "response.create",
        "/v1/realtime",
        "incomplete",  # cut at its max_output_tokens
    )
    assert x["connection_id"] == connection_id and x["session_id"] == session_id
    assert x["client_request_id"] == "sock-1" and x["tenant"] == "alice"
    assert x["model"] == gw.gateway.model and "request_id" not in x
    usage = done.response["usage"]
    assert (x["input_tokens"], x["output_tokens"]) == (usage["input_tokens"], 5)
    check_answer_timings(x)

    x = await line(caplog, lambda x: x["kind"] == "refusal" and x["session_id"] == session_id)
    assert (x["event"], x["status"], x["error_code"], x["error_param"]) == (
        "error",
        "refused",
        "invalid_value",
        "response.temperature",
    )
    assert x["connection_id"] == connection_id

    x = await line(caplog, lambda x: x.get("response_id") == cancelled["id"])
    assert (x["status"], x["cancel_reason"]) == ("cancelled", "client_cancelled")

    x = await line(caplog, lambda x: x.get("request_id") == connection_id)
    assert (x["kind"], x["method"], x["path"], x["status"]) == (
        "connection",
        "GET",
        "/v1/realtime",
        101,
    )
    assert (x["session_id"], x["tenant"], x["close_code"]) == (session_id, "alice", 1000)

    url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
    async with ResponsesClient.connect(url, additional_headers=headers) as r:
        turn = await r.respond(model="m", input="hi")
    x = await line(caplog, lambda x: x.get("response_id") == turn.id)
    assert (x["route"], x["status"], x["model"]) == ("/v1/responses", "completed", "m")
    assert x["session_id"] == r.session_id


async def test_every_http_response_carries_a_request_id(gw: RunningGateway) -> None:
    """Errors included: those of a route, of the HTTP layer (malformed, too large) and of
    a WebSocket upgrade refused, or accepted (the 101 names the connection)."""
    host, port = gw.http_url.removeprefix("http://").split(":")
    answers = []
    for raw in (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        b"BREW /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",  # 405
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",  # 431
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n",  # 413
        b"GET /\x00 HTTP/1.1\r\n\r\n",  # malformed: 400
    ):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw)
        answers.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()
    statuses = [int(a.split(b" ")[1]) for a in answers]
    assert statuses == [200, 405, 431, 413, 400]
    for answer in answers:
        assert b"\r\nx-request-id: req_" in answer, answer
    with pytest.raises(InvalidStatus) as refused:
        await connect(gw.ws_url, additional_headers={"Authorization": "Bearer wrong"})
    assert refused.value.response.headers["x-request-id"].startswith("req_")
    async with connect(gw.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.response is not None
        assert ws.response.headers["x-request-id"].startswith("req_")


async def test_the_off_switch_writes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    async with running_gateway(SimEngine(step_ms=1, response_tokens=3), access_log="off") as gw:
        async with RawClient.connect(gw.ws_url) as c:
            await c.respond()
        status, _ = await gw.get("/healthz")
        assert status == 200
    assert not lines(caplog)
