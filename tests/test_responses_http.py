"""The Responses API over HTTP: ``POST /v1/responses`` (plain, SSE, background) and the
routes of a response, with openai-python, the Agents SDK and curl as the clients, and
raw HTTP for the wire details. SSE events are validated like the WebSocket's."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engines.sim import SimEngine
from tests.support.harness import gateway_on_a_thread, running_gateway
from tests.support.responses_harness import TERMINAL, ResponsesClient, validate
from tests.support.scripted_engine import ToolLoopEngine
from tests.test_responses_ws import responses_url
from tests.test_sdk import run_sdk


def long_answers() -> SimEngine:
    return SimEngine(step_ms=5, response_tokens=10_000)


def sse_events(text: str) -> list[dict[str, Any]]:
    """The events of an SSE body, each checked to be one ``event:`` + ``data:`` pair."""
    events = []
    for message in text.strip().split("\n\n"):
        name, data = message.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), message
        event = orjson.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        validate(event)
        events.append(event)
    return events


async def sdk(scenario: str, engine: Any = None) -> Any:
    async with running_gateway(engine or SimEngine(step_ms=1, response_tokens=12)) as gw:
        result = await run_sdk("responses_client.py", scenario, f"{gw.http_url}/v1", "k")
        gw.gateway.responses_http.close()  # background ones are kept: let them go, as stop() does
        await gw.wait_idle()
    assert result["invalid"] == [], result["invalid"]
    return result


# -- the official SDK ----------------------------------------------------------------


async def test_create_retrieve_input_items_and_delete() -> None:
    result = await sdk("http_create")
    assert result["object"] == "response" and result["status"] == "completed"
    assert result["retrieved"] == {
        "id": result["id"],
        "status": "completed",
        "text": result["text"],
    }
    assert result["input_items"] == ["message"]
    assert result["deleted"] == {"retrieve_after_delete": "NotFoundError"}


@pytest.mark.parametrize("scenario", ["http_stream", "http_stream_helper"])
async def test_create_stream_and_the_stream_helper(scenario: str) -> None:
    turn = (await sdk(scenario))["turn"]
    assert turn["status"] == "completed"
    assert turn["deltas"] == turn["text"] != ""
    assert turn["first_seq"] == 0 and turn["contiguous"]
    assert turn["types"][0] == "response.created" and turn["types"][-1] == "response.completed"


async def test_a_background_stream_cut_mid_answer_is_picked_up_with_starting_after() -> None:
    result = await sdk("http_background_resume", SimEngine(step_ms=5, response_tokens=60))
    assert result["tail_first_seq"] == result["starting_after"] + 1
    assert result["contiguous"]  # nothing lost, nothing repeated
    assert result["status"] == "completed"
    assert result["deltas"] == result["text"]
    assert result["helper"]["text"] == result["text"]  # the SDK's own resume helper


async def test_cancel_stops_a_background_response() -> None:
    result = await sdk("http_cancel", long_answers())
    assert result["started"] == "in_progress" and result["background"] is True
    assert result["cancelled"] == result["retrieved"] == "cancelled"


async def test_previous_response_id_across_requests() -> None:
    first, second = (await sdk("http_chain"))["turns"]
    assert second["previous_response_id"] == first["id"]
    assert second["input_tokens"] > first["input_tokens"]  # it carries the first turn


async def test_the_agents_sdk_runs_a_tool_loop_over_http() -> None:
    async with running_gateway(ToolLoopEngine(), api_keys=("k",)) as gw:
        result = await run_sdk("responses_agent.py", "http", f"{gw.http_url}/v1", "k")
    assert [c["name"] for c in result["calls"]] == ["get_weather", "get_time"]
    assert result["model_calls"] == 3
    assert "Sunny" in result["final_output"] and "10:30" in result["final_output"]


# -- curl and raw HTTP ---------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_gets_the_sse_wire_format() -> None:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=6)) as gw:
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sN", f"{gw.http_url}/v1/responses", "-H", "Content-Type: application/json",
            "-d", '{"model": "any", "input": "Hello", "stream": true}',
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    events = sse_events(out.decode())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] in TERMINAL


async def test_an_http_turn_continues_a_websocket_one_and_back() -> None:
    async with (
        running_gateway(SimEngine(step_ms=1, response_tokens=6)) as gw,
        ResponsesClient.connect(responses_url(gw)) as ws,
        httpx.AsyncClient(base_url=gw.http_url) as http,
    ):
        first = await ws.respond(input="On the socket.")
        reply = await http.post(
            "/v1/responses", json={"input": "Over HTTP.", "previous_response_id": first.id}
        )
        assert reply.status_code == 200, reply.text
        second = reply.json()
        assert second["previous_response_id"] == first.id
        third = await ws.respond(input="Back.", previous_response_id=second["id"])
        assert third.response["status"] == "completed"


async def test_store_false_keeps_nothing_after_the_answer() -> None:
    async with (
        running_gateway(SimEngine(step_ms=1, response_tokens=4)) as gw,
        httpx.AsyncClient(base_url=gw.http_url) as http,
    ):
        body = (await http.post("/v1/responses", json={"input": "x", "store": False})).json()
        assert (await http.get(f"/v1/responses/{body['id']}")).status_code == 404
        again = await http.post(
            "/v1/responses", json={"input": "y", "previous_response_id": body["id"]}
        )
        assert again.status_code == 400
        assert again.json()["error"]["code"] == "previous_response_not_found"
        assert len(gw.gateway.response_store) == 0


async def test_a_plain_stream_whose_client_leaves_is_aborted_in_the_engine() -> None:
    engine = SimEngine(step_ms=5, response_tokens=10_000)
    async with running_gateway(engine) as gw:
        async with (
            httpx.AsyncClient(base_url=gw.http_url) as http,
            http.stream("POST", "/v1/responses", json={"input": "go", "stream": True}) as r,
        ):
            async for line in r.aiter_lines():
                if "output_text.delta" in line:
                    break
        await gw.wait_idle()  # no session, nothing running: aborted
        generated = engine.tokens_generated
        await asyncio.sleep(0.05)
        assert engine.tokens_generated == generated


async def test_a_background_response_goes_on_without_its_connection() -> None:
    async with (
        running_gateway(SimEngine(step_ms=2, response_tokens=30)) as gw,
        httpx.AsyncClient(base_url=gw.http_url) as http,
    ):
        started = (
            await http.post("/v1/responses", json={"input": "go", "background": True})
        ).json()
        assert started["status"] == "in_progress" and started["background"] is True
        async with asyncio.timeout(10):
            while True:
                body = (await http.get(f"/v1/responses/{started['id']}")).json()
                if body["status"] != "in_progress":
                    break
                await asyncio.sleep(0.02)
        assert body["status"] == "completed" and body["usage"]["output_tokens"] == 30
        # Cancelling a finished response answers it as it ended.
        done = await http.post(f"/v1/responses/{started['id']}/cancel")
        assert done.status_code == 200 and done.json()["status"] == "completed"
        # The whole stream, from the start, within the retention.
        events = sse_events((await http.get(f"/v1/responses/{started['id']}?stream=true")).text)
        assert events[0]["sequence_number"] == 0 and events[-1]["type"] == "response.completed"


async def test_a_background_response_made_without_stream_is_picked_up_after_any_event() -> None:
    """``stream: false`` then ``GET ...?stream=true&starting_after=N``: the events after N
    (it answered 400 resume_gap for every N >= 0, as if they had never been kept)."""
    async with (
        running_gateway(SimEngine(step_ms=2, response_tokens=40)) as gw,
        httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http,
    ):
        body = {"input": "go", "background": True, "stream": False}
        started = (await http.post("/v1/responses", json=body)).json()
        url = f"/v1/responses/{started['id']}"
        async with asyncio.timeout(10):
            while (await http.get(url)).json()["status"] == "in_progress":
                await asyncio.sleep(0.02)
        # Before any stream was read: from event 5 on.
        early = sse_events((await http.get(f"{url}?stream=true&starting_after=5")).text)
        assert early[0]["sequence_number"] == 6 and early[-1]["type"] == "response.completed"
        whole = sse_events((await http.get(f"{url}?stream=true")).text)
        assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
        for after in (0, 5, len(whole) - 2):
            tail = await http.get(f"{url}?stream=true&starting_after={after}")
            assert tail.status_code == 200, tail.text
            events = sse_events(tail.text)
            assert [e["sequence_number"] for e in events] == list(range(after + 1, len(whole)))
        assert whole[-1]["type"] == "response.completed"


async def test_input_items_lists_what_the_request_sent() -> None:
    async with (
        running_gateway(SimEngine(step_ms=1, response_tokens=3)) as gw,
        httpx.AsyncClient(base_url=gw.http_url) as http,
    ):
        items = [
            {"role": "user", "content": "one"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "two"}]},
        ]
        body = (await http.post("/v1/responses", json={"input": items})).json()
        listed = (await http.get(f"/v1/responses/{body['id']}/input_items?order=asc")).json()
        assert [i["content"][0]["text"] for i in listed["data"]] == ["one", "two"]
        assert listed["object"] == "list" and listed["has_more"] is False
        page = (await http.get(f"/v1/responses/{body['id']}/input_items?limit=1")).json()
        assert [i["content"][0]["text"] for i in page["data"]] == ["two"] and page["has_more"]


async def test_errors_are_openai_error_objects_with_the_right_status() -> None:
    async with (
        running_gateway(SimEngine(step_ms=1), api_keys=("k",), max_message_bytes=4096) as gw,
        httpx.AsyncClient(base_url=gw.http_url) as http,
    ):
        auth = {"Authorization": "Bearer k"}
        no_key = await http.post("/v1/responses", json={"input": "x"})
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
        bad = await http.post("/v1/responses", json={"input": "x", "top_p": 7}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
        not_json = await http.post("/v1/responses", content=b"{", headers=auth)
        assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
        big = await http.post("/v1/responses", json={"input": "x" * 5000}, headers=auth)
        assert big.status_code == 413
        missing = await http.get("/v1/responses/resp_nope", headers=auth)
        assert missing.status_code == 404 and missing.json()["error"]["code"]
        for method, path in (("POST", "/cancel"), ("DELETE", ""), ("GET", "/input_items")):
            gone = await http.request(method, f"/v1/responses/resp_nope{path}", headers=auth)
            assert gone.status_code == 404, (method, path)


async def test_a_full_scheduler_answers_429_with_retry_after() -> None:
    async with (
        running_gateway(long_answers(), max_running=1, max_queued=0) as gw,
        httpx.AsyncClient(base_url=gw.http_url) as http,
    ):
        first = (await http.post("/v1/responses", json={"input": "a", "background": True})).json()
        refused = await http.post("/v1/responses", json={"input": "b"})
        assert refused.status_code == 429 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "overloaded"
        await http.post(f"/v1/responses/{first['id']}/cancel")


@pytest.fixture(scope="module")
def http_client() -> Iterator[httpx.Client]:
    """One client, keeping its connection, for every example: hypothesis runs many."""
    with (
        gateway_on_a_thread(SimEngine(step_ms=0, response_tokens=2)) as gw,
        httpx.Client(base_url=gw.http_url, timeout=10) as http,
    ):
        yield http


_bodies = st.binary(max_size=64) | st.dictionaries(
    st.sampled_from(["input", "model", "stream", "tools", "previous_response_id", "x"]),
    st.none() | st.booleans() | st.integers() | st.text(max_size=6) | st.lists(st.text(max_size=3)),
    max_size=4,
).map(lambda d: json.dumps(d).encode())


@settings(max_examples=150, deadline=None)
@given(body=_bodies)
def test_no_body_gives_a_500(http_client: httpx.Client, body: bytes) -> None:
    reply = http_client.post("/v1/responses", content=body)
    assert reply.status_code < 500, reply.text


async def test_hosted_tools_over_http_are_left_out_or_a_400_naming_the_tool() -> None:
    body = {"model": "m", "input": "hi", "tools": [{"type": "web_search"}], "stream": False}
    async with running_gateway(SimEngine(step_ms=1, response_tokens=4)) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as http:
            answer = await http.post("/v1/responses", json=body)
        assert answer.status_code == 200 and answer.json()["tools"] == []
    engine = SimEngine(step_ms=1, response_tokens=4)
    async with running_gateway(engine, hosted_tools="refuse") as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as http:
            refused = await http.post("/v1/responses", json=body)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "tools[0]"
        assert refused.json()["error"]["code"] == "unsupported_value"
