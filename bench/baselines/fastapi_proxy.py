"""LiteLLM's architecture, minimal: a FastAPI + uvicorn app that forwards each
``POST /v1/chat/completions`` to an OpenAI-compatible upstream through httpx.

The baseline for the gateway's ``--engine upstream``: the same client requests, the same
upstream stand-in (bench/sse_server.py) behind it. One ``httpx.AsyncClient`` with a
keep-alive pool (as a proxy keeps one per deployment); the body is parsed with orjson
(a proxy reads the model to route by) and sent on as it came; a streamed answer
(``stream: true``) is passed through chunk by chunk from ``aiter_raw()`` in a
``StreamingResponse``, a whole one returned as the upstream answered it. No
translation, no logging, no retries, no accounting: what any proxy in Python on this
stack costs at least.

Run: ``python -m bench.baselines.fastapi_proxy --port 8806 --upstream http://127.0.0.1:8801``
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import httpx
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from bench.loadgen import raise_nofile
from gateway.__main__ import LOOPS, default_loop


def build_app(upstream: str) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    client = httpx.AsyncClient(
        base_url=upstream,
        timeout=httpx.Timeout(120.0, connect=5.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        trust_env=False,
    )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        raw = await request.body()
        body = orjson.loads(raw)
        headers = {"Content-Type": "application/json"}
        if not body.get("stream"):
            answer = await client.post("/v1/chat/completions", content=raw, headers=headers)
            return Response(
                answer.content, status_code=answer.status_code, media_type="application/json"
            )
        upstream_request = client.build_request(
            "POST", "/v1/chat/completions", content=raw, headers=headers
        )
        answer = await client.send(upstream_request, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()

        return StreamingResponse(
            relay(), status_code=answer.status_code, media_type="text/event-stream"
        )

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(b'{"ready": true}', media_type="application/json")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8806)
    parser.add_argument("--upstream", required=True, help="the upstream's base URL")
    parser.add_argument("--loop", choices=LOOPS, default=default_loop())
    parser.add_argument("--http", choices=("h11", "httptools"), default="httptools")
    args = parser.parse_args()
    raise_nofile()
    uvicorn.run(
        build_app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        loop=args.loop,
        http=args.http,
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_graceful_shutdown=2,
    )


if __name__ == "__main__":
    main()
