"""What the gateway does not serve answers as OpenAI does: a walk of every route of the
server with every method (a 405 with OpenAI's error object and a true ``Allow``, or the
route's own answer), unknown paths (a 404 with that object, which the SDK raises as
``NotFoundError``), and ``/v1/embeddings`` on an engine that serves none."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from gateway.engines.sim import SimEngine
from tests.support.harness import RunningGateway, running_gateway

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=4)) as running:
        yield running


def concrete(pattern: str) -> str:
    """A path the pattern matches (its ``{name}`` segments filled in)."""
    return re.sub(r"\{[^}]+\}", "x", pattern)


def openai_error(reply: httpx.Response, message: str) -> None:
    assert reply.headers["content-type"] == "application/json", reply.text
    assert reply.json() == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


async def test_every_route_answers_every_method_with_its_own_or_405(
    gw: RunningGateway,
) -> None:
    routes = gw.gateway.http.routes.routes() if gw.gateway.http else []
    assert ("/v1/completions", "POST") in routes and ("/v1/embeddings", "POST") in routes
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http:
        for pattern, allow in routes:
            path = concrete(pattern)
            for method in METHODS:
                reply = await http.request(method, path, content=b"{}")
                if method in allow.split(", "):
                    assert reply.status_code != 405, (method, path)
                    continue
                assert reply.status_code == 405, (method, path, reply.status_code)
                # The Allow is true: each method it names was answered by its route above.
                assert reply.headers["allow"] == allow
                if method != "HEAD":  # HEAD: GET's status and headers, no body
                    message = f"Invalid method for URL ({method} {path}): send {allow}."
                    openai_error(reply, message)


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/nope"), ("GET", "/v1/files"), ("DELETE", "/nothing/here"), ("POST", "/")],
)
async def test_an_unknown_path_is_openais_404(gw: RunningGateway, method: str, path: str) -> None:
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http:
        reply = await http.request(method, path)
    if path == "/":  # the page's path, served for GET: another method is a 405
        assert reply.status_code == 405 and reply.headers["allow"] == "GET, HEAD"
        return
    assert reply.status_code == 404
    openai_error(reply, f"Invalid URL ({method} {path})")


async def test_the_sdk_raises_not_found_and_status_errors(gw: RunningGateway) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0
    ) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.embeddings.create(model="m", input="hello")
        assert "the sim engine serves no embeddings" in missing.value.message
        with pytest.raises(openai.NotFoundError):
            await client.files.list()
        with pytest.raises(openai.APIStatusError) as wrong:
            await client.get("/completions", cast_to=object)
        assert wrong.value.status_code == 405
