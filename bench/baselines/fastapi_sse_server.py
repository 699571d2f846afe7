"""The framework baseline: a FastAPI + uvicorn ``POST /v1/responses`` answering the
gateway's Responses events (and ``POST /v1/chat/completions`` its chunks), with no
gateway logic.

What a user would otherwise put in front of an engine (trtllm-serve and vLLM serve
HTTP this way). ``stream: true`` answers ``text/event-stream``: the same event
sequence as the gateway's (``response.created``, ``response.in_progress``, the item
and part events, one ``response.output_text.delta`` per token built from the same
bytes template, the done events, ``response.completed`` with usage), each event an
``event: TYPE`` and a ``data: JSON`` line and a chunk of its own (a
``StreamingResponse`` over an async generator). ``stream: false`` answers the final
``Response`` JSON once every token has come. Tokens are the sim engine's words
(``answer_tokens``) on bench/baselines/bare_server.py's step clock (``Ticker``: steps on a
fixed clock, missed steps counted at once, ``--step-ms 0`` a step per loop turn),
so that a comparison with the gateway on ``--engine sim`` is between servers.

It is written to be cheap, not naive: events are encoded with orjson from
templates, the body is parsed with orjson rather than a pydantic model, access
logging is off. ``--http`` picks uvicorn's HTTP parser: ``h11`` (what the bench
extra installs, and the gateway's own parser) or ``httptools`` (uvicorn's fast one,
where installed). It runs on the loop ``--loop`` names, as the other servers do.

Run: ``python -m bench.baselines.fastapi_sse_server --port 8802 --step-ms 0 --response-tokens 300``
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import AsyncIterator
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


def _id(prefix: str) -> str:
    return f"{prefix}_fastapi{next(_ids):013x}"


def _response(
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
        "metadata": {},
        "model": MODEL,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "truncation": "disabled",
        "usage": usage,
    }


def _message(item_id: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(prompt: str, output: int) -> dict[str, Any]:
    tokens = len(prompt.split()) + 2
    return {
        "input_tokens": tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens + output,
    }


def _sse(kind: str, data: bytes) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (kind.encode(), data)


def _numbered(seq: int, kind: str, **fields: Any) -> bytes:
    return _sse(kind, orjson.dumps({"sequence_number": seq, "type": kind, **fields}))


class Answers:
    """The tokens of each answer, on the shared step clock."""

    def __init__(self, step_ms: float, response_tokens: int) -> None:
        self.step_s = step_ms / 1000
        self.response_tokens = response_tokens
        self.ticker: Ticker | None = None  # made on the server's loop, at the first request

    def tokens(self, body: dict[str, Any]) -> list[str]:
        prompt = body.get("input")
        prompt = prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
        tokens = answer_tokens(prompt, self.response_tokens)
        budget = body.get("max_output_tokens")
        return tokens[:budget] if isinstance(budget, int) else tokens

    def clock(self) -> Ticker:
        if self.ticker is None:
            self.ticker = Ticker(self.step_s)
        return self.ticker

    async def wait_out(self, steps: int) -> None:
        """As long as ``steps`` steps of the clock take (a non-streaming answer)."""
        ticker = self.clock()
        seen = start = ticker.join()
        try:
            while seen - start < steps:
                seen = await ticker.wait(seen)
        finally:
            ticker.leave()


def build_app(answers: Answers) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if not isinstance(body.get("input"), (str, list)):
            error = {"message": "input is required", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=400)
        tokens = answers.tokens(body)
        rid, item_id = _id("resp"), _id("item")
        prompt = body["input"] if isinstance(body["input"], str) else ""
        if body.get("stream"):
            return StreamingResponse(
                stream(answers, body, tokens, rid, item_id, prompt),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        await answers.wait_out(len(tokens))
        text = "".join(tokens)
        output = [_message(item_id, "completed", text)]
        usage = _usage(prompt, len(tokens))
        raw = orjson.dumps(_response(rid, "completed", output, usage, body))
        return Response(raw, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            error = {"message": "messages is required", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=400)
        prompt = str(messages[-1].get("content", ""))
        tokens = answers.tokens({"input": prompt, "max_output_tokens": body.get("max_tokens")})
        head = {
            "id": _id("chatcmpl"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model") or MODEL,
        }
        if body.get("stream"):
            usage = (body.get("stream_options") or {}).get("include_usage", False)
            return StreamingResponse(
                chat_stream(answers, head, tokens, prompt, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        await answers.wait_out(len(tokens))
        message = {"role": "assistant", "content": "".join(tokens), "refusal": None}
        completion = {
            **head,
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            ],
            "usage": _chat_usage(prompt, len(tokens)),
        }
        return Response(orjson.dumps(completion), media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(b'{"ready": true}', media_type="application/json")

    return app


async def stream(
    answers: Answers,
    body: dict[str, Any],
    tokens: list[str],
    rid: str,
    item_id: str,
    prompt: str,
) -> AsyncIterator[bytes]:
    seq = itertools.count()
    started = _response(rid, "in_progress", [], None, body)
    yield _numbered(next(seq), "response.created", response=started)
    yield _numbered(next(seq), "response.in_progress", response=started)
    added = _message(item_id, "in_progress", None)
    yield _numbered(next(seq), "response.output_item.added", output_index=0, item=added)
    ids = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield _numbered(next(seq), "response.content_part.added", **ids, part=_part(""))
    item = item_id.encode()
    ticker = answers.clock()
    seen = ticker.join()
    sent = 0
    try:
        while sent < len(tokens):
            steps = await ticker.wait(seen)
            # One token per step since the last look, each an event (and a chunk) of its own.
            for token in tokens[sent : sent + steps - seen]:
                delta = _DELTA % (next(seq), item, orjson.dumps(token))
                yield b"event: response.output_text.delta\ndata: %b\n\n" % delta
                sent += 1
            seen = steps
    finally:
        ticker.leave()
    text = "".join(tokens)
    yield _numbered(next(seq), "response.output_text.done", **ids, text=text, logprobs=[])
    yield _numbered(next(seq), "response.content_part.done", **ids, part=_part(text))
    done = _message(item_id, "completed", text)
    yield _numbered(next(seq), "response.output_item.done", output_index=0, item=done)
    final = _response(rid, "completed", [done], _usage(prompt, len(tokens)), body)
    yield _numbered(next(seq), "response.completed", response=final)


def _chat_usage(prompt: str, output: int) -> dict[str, Any]:
    tokens = len(prompt.split()) + 2
    return {
        "prompt_tokens": tokens,
        "completion_tokens": output,
        "total_tokens": tokens + output,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def chat_stream(
    answers: Answers, head: dict[str, Any], tokens: list[str], prompt: str, usage: bool
) -> AsyncIterator[bytes]:
    """The gateway's chunks: the role first, a content delta per token (from the same kind
    of bytes template), the finish reason, the usage, ``[DONE]``."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: %b\n\n" % orjson.dumps({**head, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    prefix = orjson.dumps(head)[:-1]
    ticker = answers.clock()
    seen = ticker.join()
    sent = 0
    try:
        while sent < len(tokens):
            steps = await ticker.wait(seen)
            for token in tokens[sent : sent + steps - seen]:
                yield b"data: " + _CHAT_DELTA % (prefix, orjson.dumps(token)) + b"\n\n"
                sent += 1
            seen = steps
    finally:
        ticker.leave()
    yield chunk({}, "stop")
    if usage:
        last = {**head, "choices": [], "usage": _chat_usage(prompt, len(tokens))}
        yield b"data: %b\n\n" % orjson.dumps(last)
    yield b"data: [DONE]\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8802)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--response-tokens", type=int, default=300)
    parser.add_argument("--loop", choices=LOOPS, default=default_loop())
    parser.add_argument("--http", choices=("h11", "httptools"), default="h11")
    args = parser.parse_args()
    raise_nofile()
    app = build_app(Answers(args.step_ms, args.response_tokens))
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


if __name__ == "__main__":
    main()
