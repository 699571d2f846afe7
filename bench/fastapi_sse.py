"""The baseline a user would otherwise put in front of an engine: a FastAPI + uvicorn
endpoint (what trtllm-serve and vLLM use) streaming the Responses API's SSE events, one
event per token, as fast as the loop allows (a step per loop turn, like the sim engine
flat out): ``python -m bench.fastapi_sse --port N``. Not part of the gateway."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

WORDS = ("the", "gateway", "streams", "tokens", "to", "every", "browser", "and", "engine")
app = FastAPI()
TOKENS = 300
ids = itertools.count()


def response(rid: str, status: str, text: str | None) -> dict[str, object]:
    output = (
        []
        if text is None
        else [
            {
                "id": f"item_{rid}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ]
    )
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": "sim",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


async def events(rid: str) -> AsyncIterator[bytes]:
    seq = itertools.count()

    def sse(event: dict[str, object]) -> bytes:
        event["sequence_number"] = next(seq)
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    yield sse({"type": "response.created", "response": response(rid, "in_progress", None)})
    parts = []
    for i in range(TOKENS):
        await asyncio.sleep(0)  # one engine step
        token = (" " if i else "") + WORDS[i % len(WORDS)]
        parts.append(token)
        yield sse(
            {
                "type": "response.output_text.delta",
                "item_id": f"item_{rid}",
                "output_index": 0,
                "content_index": 0,
                "delta": token,
                "logprobs": [],
            }
        )
    text = "".join(parts)
    yield sse({"type": "response.completed", "response": response(rid, "completed", text)})


@app.post("/v1/responses")
async def create(request: Request) -> object:
    body = await request.json()
    rid = f"resp_{next(ids)}"
    if body.get("stream"):
        return StreamingResponse(events(rid), media_type="text/event-stream")
    text = " ".join(WORDS[i % len(WORDS)] for i in range(TOKENS))
    for _ in range(TOKENS):
        await asyncio.sleep(0)
    return JSONResponse(response(rid, "completed", text))


@app.get("/readyz")
async def readyz() -> dict[str, bool]:
    return {"ready": True}


def main() -> None:
    global TOKENS
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--response-tokens", type=int, default=300)
    args = parser.parse_args()
    TOKENS = args.response_tokens
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", loop="uvloop")


if __name__ == "__main__":
    main()
