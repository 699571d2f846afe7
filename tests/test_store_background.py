"""Background responses (``background: true`` over HTTP) with the Redis session store, on
two gateway processes and a real redis-server: streamed, retrieved and cancelled on the
gateway that does not hold them, and taken over when the one that does is killed."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from tests.support.gateway_processes import TIMEOUT, GatewayProcess, gateways
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401
from tests.test_responses_http import sse_events


def http(g: GatewayProcess) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://{g.address}", timeout=TIMEOUT)


async def background(client: httpx.AsyncClient, text: str) -> dict[str, Any]:
    body = {"input": text, "background": True, "stream": False}
    created = await client.post("/v1/responses", json=body)
    assert created.status_code == 200, created.text
    response: dict[str, Any] = created.json()
    assert response["status"] in ("queued", "in_progress")
    return response


def deltas(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def final_text(response: dict[str, Any]) -> str:
    text: str = response["output"][0]["content"][0]["text"]
    return text


async def test_the_other_gateway_streams_retrieves_and_cancels_a_running_one(
    redis_server: RedisServer,
) -> None:
    async with gateways(redis_server.url, 2, tokens=60) as (a, b), http(a) as on_a, http(b) as on_b:
        started = await background(on_a, "Tell me a story")
        url = f"/v1/responses/{started['id']}"
        # Asked at once on B: the record was in Redis before A answered.
        running = await on_b.get(url)
        assert running.status_code == 200, running.text
        assert running.json()["id"] == started["id"]
        assert running.json()["status"] in ("queued", "in_progress")
        # Relayed from A's log, then its tail, live, to the end.
        streamed = await on_b.get(f"{url}?stream=true&starting_after=0")
        assert streamed.status_code == 200, streamed.text
        events = sse_events(streamed.text)
        assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
        done = events[-1]
        assert done["type"] == "response.completed"
        assert deltas(events) == final_text(done["response"]) != ""
        assert (await on_b.get(url)).json()["status"] == "completed"

        # A cancel sent to B reaches the answer on A.
        long = await background(on_a, "And a long one")
        long_url = f"/v1/responses/{long['id']}"
        async with on_b.stream("GET", f"{long_url}?stream=true") as first:
            async for line in first.aiter_lines():
                if "output_text.delta" in line:
                    break  # it is generating on A
        cancelled = await on_b.post(f"{long_url}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        assert (await on_a.get(long_url)).json()["status"] == "cancelled"

        # A DELETE sent to B of one running on A stops it there and deletes it from the
        # store. (A keeps its own copy: docs/deployment.md, background responses.)
        doomed = await background(on_a, "And one to delete")
        doomed_url = f"/v1/responses/{doomed['id']}"
        deleted = await on_b.delete(doomed_url)
        assert deleted.status_code == 200, deleted.text
        assert deleted.json() == {"id": doomed["id"], "object": "response.deleted", "deleted": True}
        assert (await on_b.get(doomed_url)).status_code == 404
        assert (await on_a.get(doomed_url)).json()["status"] == "cancelled"


async def test_a_killed_gateways_answer_goes_on_from_the_other_one(
    redis_server: RedisServer,
) -> None:
    """The client read part of the answer from A; A is killed; the same GET with
    ``starting_after`` on B gets the rest, numbered on, the text whole."""
    async with gateways(redis_server.url, 2, tokens=120) as (a, b), http(b) as on_b:
        async with http(a) as on_a:
            started = await background(on_a, "Tell me a long story")
            url = f"/v1/responses/{started['id']}"
            seen: list[dict[str, Any]] = []
            async with on_a.stream("GET", f"{url}?stream=true") as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        seen.append(orjson.loads(line.removeprefix("data: ")))
                    if sum(e["type"] == "response.output_text.delta" for e in seen) == 10:
                        break
            a.kill()
        last = seen[-1]["sequence_number"]
        async with asyncio.timeout(TIMEOUT):
            rest = await on_b.get(f"{url}?stream=true&starting_after={last}")
        assert rest.status_code == 200, rest.text
        events = sse_events(rest.text)
        numbers = [e["sequence_number"] for e in seen + events]
        assert numbers == list(range(len(numbers)))
        done = events[-1]
        assert done["type"] == "response.completed", done
        assert deltas(seen + events) == final_text(done["response"])
        assert done["response"]["usage"]["output_tokens"] == 120
        assert any("took over session" in line for line in b.log)
        retrieved = (await on_b.get(url)).json()
        assert retrieved["status"] == "completed" and final_text(retrieved) == deltas(seen + events)
