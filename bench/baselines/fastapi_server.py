"""The framework baseline: a minimal FastAPI + uvicorn app answering the gateway's
``POST /v1/responses`` and ``POST /v1/chat/completions`` with no gateway logic.

What a user would otherwise write in front of an engine, written to be cheap, not
naive: the body parsed with orjson (no pydantic model), events encoded with orjson
(deltas from a bytes template), access logging off, uvicorn's httptools parser
(``--http h11``: the gateway's own parser) on the loop ``--loop`` names.

- ``stream: true`` answers ``text/event-stream`` from a plain async generator (a
  ``StreamingResponse``): the same event sequence as the gateway's (``response.created``,
  ``response.in_progress``, the item and part events, one ``response.output_text.delta``
  per token, the done events, ``response.completed`` with usage; for chat the role chunk,
  one content chunk per token, the finish reason, usage and ``[DONE]``), each event a chunk
  of its own. Tokens come at an engine's pace, with no queue: flat out (``--step-ms 0``)
  one per loop turn (``await asyncio.sleep(0)`` before each, the pace the sim flat out gives
  the gateway and the floors write at); with ``--step-ms`` above 0 a step's worth per step
  of the sim's step clock (bench/baselines/bare_server.py's ``Ticker``).
- ``stream: false`` answers the final object (a ``Response``, or a ``chat.completion``,
  with the tools and instructions the body gave echoed as the gateway echoes them) at
  once: the minimal handler a request's cost is compared with.

Tokens are the sim engine's words (``answer_tokens``) for the request's prompt, so that a
comparison with the gateway on ``--engine sim`` is between servers. The per-request
queue and producer task that vLLM's server puts between the engine and the generator is
a baseline of its own, named for what it is: bench/baselines/vllm_shape_server.py.

Run: ``python -m bench.baselines.fastapi_server --port 8802 --step-ms 0 --response-tokens 300``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bench.baselines.bare_server import Ticker
from bench.loadgen import raise_nofile
from gateway.__main__ import LOOPS, default_loop
from gateway.engines.sim import answer_tokens

MODEL = "sim"
# The gateway's delta template (sessions/responses/dialect.py), the response id's item beside it.
_DELTA = (
    b'{"type":"response.output_text.delta","sequence_number":%d,"item_id":"%b"'
    b',"output_index":0,"content_index":0,"logprobs":[],"delta":%b}'
)
# The gateway's chunk template (sessions/chat/dialect.py): the head object, still open.
_CHAT_DELTA = (
    b'%b,"choices":[{"index":0,"delta":{"content":%b},"logprobs":null,"finish_reason":null}]}'
)
_ids = itertools.count(1)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _id(prefix: str) -> str:
    return f"{prefix}_fastapi{next(_ids):013x}"


def response_object(
    rid: str, status: str, output: list[Any], usage: Any, body: dict[str, Any]
) -> dict[str, Any]:
    """The ``Response`` object, with the fields the gateway's carries."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": MODEL,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [{**t, "strict": t.get("strict", False)} for t in body.get("tools") or ()],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
    }


def message(item_id: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(prompt: str, output: int) -> dict[str, Any]:
    tokens = len(prompt.split()) + 2
    return {
        "input_tokens": tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens + output,
    }


def chat_usage(prompt: str, output: int) -> dict[str, Any]:
    tokens = len(prompt.split()) + 2
    return {
        "prompt_tokens": tokens,
        "completion_tokens": output,
        "total_tokens": tokens + output,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _numbered(seq: int, kind: str, **fields: Any) -> bytes:
    data = orjson.dumps({"sequence_number": seq, "type": kind, **fields})
    return b"event: %b\ndata: %b\n\n" % (kind.encode(), data)


def prompt_of(body: dict[str, Any]) -> str:
    """The text the answer is made from: the input string, or the last input item's text."""
    value = body.get("input")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        content = value[-1].get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and content and isinstance(content[0], dict):
            return str(content[0].get("text", ""))
    return ""


def chat_prompt(body: dict[str, Any]) -> str:
    messages = body.get("messages") or [{}]
    content = messages[-1].get("content", "") if isinstance(messages[-1], dict) else ""
    return content if isinstance(content, str) else orjson.dumps(content).decode()


class Answers:
    """The tokens of each answer, and the step clock they come on (flat out: none)."""

    def __init__(self, step_ms: float, response_tokens: int) -> None:
        self.step_s = step_ms / 1000
        self.response_tokens = response_tokens
        self.ticker: Ticker | None = None  # made on the server's loop, at the first request

    def tokens(self, prompt: str, budget: object = None) -> list[str]:
        tokens = answer_tokens(prompt, self.response_tokens)
        return tokens[:budget] if isinstance(budget, int) else tokens

    async def paced(self, tokens: list[str]) -> AsyncIterator[list[str]]:
        """``tokens`` as they come: one per loop turn flat out, else a step's worth per step."""
        if self.step_s <= 0:
            for token in tokens:
                await asyncio.sleep(0)
                yield [token]
            return
        if self.ticker is None:
            self.ticker = Ticker(self.step_s)
        ticker = self.ticker
        seen = ticker.join()
        sent = 0
        try:
            while sent < len(tokens):
                steps = await ticker.wait(seen)
                yield tokens[sent : sent + steps - seen]
                sent += steps - seen
                seen = steps
        finally:
            ticker.leave()


TokenSource = Callable[[list[str]], AsyncIterator[list[str]]]


def build_app(answers: Answers, source: TokenSource | None = None) -> FastAPI:
    """The routes; ``source`` turns an answer's tokens into what its stream awaits (the
    minimal app: :meth:`Answers.paced`; vLLM's shape: a queue fed by a producer task)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    tokens_of = source or answers.paced

    async def whole(tokens: list[str]) -> str:
        if source is None and answers.step_s <= 0:
            return "".join(tokens)  # flat out, the minimal handler answers at once
        return "".join([t async for batch in tokens_of(tokens) for t in batch])

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if not isinstance(body.get("input"), (str, list)):
            error = {"message": "input is required", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=400)
        prompt = prompt_of(body)
        tokens = answers.tokens(prompt, body.get("max_output_tokens"))
        rid, item_id = _id("resp"), _id("item")
        if body.get("stream"):
            events = stream(tokens_of(tokens), body, tokens, rid, item_id, prompt)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        text = await whole(tokens)
        output = [message(item_id, "completed", text)]
        final = response_object(rid, "completed", output, usage(prompt, len(tokens)), body)
        return Response(orjson.dumps(final), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            error = {"message": "messages is required", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=400)
        prompt = chat_prompt(body)
        tokens = answers.tokens(prompt, body.get("max_tokens"))
        head = {
            "id": _id("chatcmpl"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model") or MODEL,
        }
        if body.get("stream"):
            include = (body.get("stream_options") or {}).get("include_usage", False)
            chunks = chat_stream(tokens_of(tokens), head, tokens, prompt, include)
            return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
        text = await whole(tokens)
        reply = {"role": "assistant", "content": text, "refusal": None}
        completion = {
            **head,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": reply, "finish_reason": "stop", "logprobs": None}],
            "usage": chat_usage(prompt, len(tokens)),
        }
        return Response(orjson.dumps(completion), media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(b'{"ready": true}', media_type="application/json")

    return app


async def stream(
    batches: AsyncIterator[list[str]],
    body: dict[str, Any],
    tokens: list[str],
    rid: str,
    item_id: str,
    prompt: str,
) -> AsyncIterator[bytes]:
    seq = itertools.count()
    started = response_object(rid, "in_progress", [], None, body)
    yield _numbered(next(seq), "response.created", response=started)
    yield _numbered(next(seq), "response.in_progress", response=started)
    added = message(item_id, "in_progress", None)
    yield _numbered(next(seq), "response.output_item.added", output_index=0, item=added)
    ids = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield _numbered(next(seq), "response.content_part.added", **ids, part=text_part(""))
    item = item_id.encode()
    async for batch in batches:
        for token in batch:  # each token an event (and a chunk) of its own
            delta = _DELTA % (next(seq), item, orjson.dumps(token))
            yield b"event: response.output_text.delta\ndata: %b\n\n" % delta
    text = "".join(tokens)
    yield _numbered(next(seq), "response.output_text.done", **ids, text=text, logprobs=[])
    yield _numbered(next(seq), "response.content_part.done", **ids, part=text_part(text))
    done = message(item_id, "completed", text)
    yield _numbered(next(seq), "response.output_item.done", output_index=0, item=done)
    final = response_object(rid, "completed", [done], usage(prompt, len(tokens)), body)
    yield _numbered(next(seq), "response.completed", response=final)


async def chat_stream(
    batches: AsyncIterator[list[str]],
    head: dict[str, Any],
    tokens: list[str],
    prompt: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The gateway's chunks: the role first, a content delta per token (from the same kind
    of bytes template), the finish reason, the usage, ``[DONE]``."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: %b\n\n" % orjson.dumps({**head, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    prefix = orjson.dumps(head)[:-1]
    async for batch in batches:
        for token in batch:
            yield b"data: " + _CHAT_DELTA % (prefix, orjson.dumps(token)) + b"\n\n"
    yield chunk({}, "stop")
    if include_usage:
        last = {**head, "choices": [], "usage": chat_usage(prompt, len(tokens))}
        yield b"data: %b\n\n" % orjson.dumps(last)
    yield b"data: [DONE]\n\n"


def arguments(description: str, port: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--response-tokens", type=int, default=300)
    parser.add_argument("--loop", choices=LOOPS, default=default_loop())
    parser.add_argument("--http", choices=("h11", "httptools"), default="httptools")
    return parser.parse_args()


def run(app: FastAPI, args: argparse.Namespace) -> None:
    raise_nofile()
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop=args.loop,
        http=args.http,
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_graceful_shutdown=2,
    )


def main() -> None:
    args = arguments(__doc__.splitlines()[0], 8802)
    run(build_app(Answers(args.step_ms, args.response_tokens)), args)


if __name__ == "__main__":
    main()
