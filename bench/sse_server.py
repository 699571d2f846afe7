"""A fast OpenAI-compatible upstream for the bench: ``POST /v1/chat/completions`` streamed.

What the gateway's ``--engine upstream`` sees from trtllm-serve, vLLM or llama.cpp's
server, minus the model: HTTP/1.1 with keep-alive, a streamed answer in
``chat.completion.chunk`` server-sent events (one token per event, each event its
own HTTP chunk), then a chunk with the finish reason, a usage chunk (as with
``stream_options.include_usage``) and ``data: [DONE]``; with ``stream: false``, one
``chat.completion`` at once (what a proxy passes a non-streaming request on as). Answers
are the sim engine's (the same words for the same conversation, ``--response-tokens`` long,
``max_tokens`` honoured; a final assistant message is continued, as llama.cpp's server
prefills it: what follows it in the answer that conversation gets), and tokens go out as
fast as the loop turns: each
stream writes one token and yields, so that all open streams advance one token
per loop turn, like a continuous-batching engine with no step clock. A client that
closes its connection stops its stream at once (the gateway's cancel).

``GET /health``, ``/readyz``, ``/v1/models`` and ``/props`` (llama.cpp's, with
``total_slots``, so that the gateway learns how many streams it may open) answer
too, and llama.cpp's ``POST /tokenize`` (``{"content": TEXT}``: ``{"tokens": [...]}``, a
token per word, as the answers are made). Nothing else is implemented: this is a load
source, not a server to expose.

Run: ``python -m bench.sse_server --port 8801 --response-tokens 300``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import time
from typing import Any

import orjson

from bench.loadgen import raise_nofile
from gateway.__main__ import LOOPS, default_loop, loop_factory
from gateway.engines.sim import answer_tokens

MODEL = "bench-sse"
_ids = itertools.count(1)


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def _response(status: int, body: Any) -> bytes:
    raw = orjson.dumps(body)
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


class SseServer:
    def __init__(self, response_tokens: int, slots: int, token_s: float = 0.0) -> None:
        self.token_s = token_s  # 0: a token per loop turn; else a token per token_s
        self.response_tokens = response_tokens
        self.slots = slots
        self.streams = 0
        self.tokens = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another on this connection
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, path, headers = _parse_head(head)
                length = int(headers.get("content-length", "0"))
                body = await reader.readexactly(length) if length else b""
                if method == "POST" and path.startswith("/v1/chat/completions"):
                    if not await self.complete(writer, body):
                        return
                elif method == "POST" and path.partition("?")[0] == "/tokenize":
                    writer.write(self.tokenize(body))
                else:
                    writer.write(self.route(method, path))
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    def route(self, method: str, path: str) -> bytes:
        path = path.partition("?")[0]
        if method != "GET":
            return _response(404, {"error": {"message": f"{method} {path}"}})
        if path in ("/health", "/readyz"):
            return _response(200, {"status": "ok"})
        if path == "/v1/models":
            return _response(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if path == "/props":
            return _response(200, {"total_slots": self.slots})
        return _response(404, {"error": {"message": f"not found: {path}"}})

    @staticmethod
    def tokenize(body: bytes) -> bytes:
        """llama.cpp's ``/tokenize``: a token per word of ``content`` (how answers are made)."""
        content = orjson.loads(body).get("content")
        if not isinstance(content, str):
            return _response(400, {"error": {"message": "'content' must be a string"}})
        return _response(200, {"tokens": list(range(len(content.split())))})

    async def complete(self, writer: asyncio.StreamWriter, body: bytes) -> bool:
        """Stream one answer; False if the client went away before its end."""
        request = orjson.loads(body)
        messages = request.get("messages") or []
        so_far = ""
        if messages and messages[-1].get("role") == "assistant":
            # Prefilled, as llama.cpp's server does: the rest of the answer it begins.
            so_far = messages[-1].get("content") or ""
            messages = messages[:-1]
        prompt = "".join(f"<|{m.get('role')}|>{m.get('content') or ''}" for m in messages)
        tokens = _after(answer_tokens(prompt, self.response_tokens), so_far)
        budget = request.get("max_tokens")
        finish = "stop"
        if isinstance(budget, int) and len(tokens) > budget:
            tokens, finish = tokens[:budget], "length"
        prompt_tokens = len(prompt.split()) + 2 * len(messages)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(tokens),
            "total_tokens": prompt_tokens + len(tokens),
        }
        if not request.get("stream"):
            # The whole answer at once (a proxy's non-streaming request).
            self.tokens += len(tokens)
            text = "".join(tokens)
            reply = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": reply, "finish_reason": finish}
            completion = {
                "id": f"chatcmpl-{next(_ids)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": MODEL,
                "choices": [choice],
                "usage": usage,
            }
            writer.write(_response(200, completion))
            return True
        head = (
            b'{"id":"chatcmpl-%d","object":"chat.completion.chunk","created":%d,"model":"%b",'
            % (
                next(_ids),
                int(time.time()),
                MODEL.encode(),
            )
        )
        writer.write(_STREAM_HEAD)
        first = b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
        writer.write(_chunk(b"data: " + head + first + b"\n\n"))
        transport = writer.transport
        self.streams += 1
        try:
            for token in tokens:
                await asyncio.sleep(self.token_s)  # 0: every stream's token this loop turn
                if transport.is_closing():
                    return False  # the client closed the stream: the gateway's cancel
                delta = b'"choices":[{"index":0,"delta":{"content":%b},"finish_reason":null}]}' % (
                    orjson.dumps(token)
                )
                writer.write(_chunk(b"data: " + head + delta + b"\n\n"))
                self.tokens += 1
                await writer.drain()
        finally:
            self.streams -= 1
        tail = b'"choices":[{"index":0,"delta":{},"finish_reason":"%b"}]}' % finish.encode()
        writer.write(_chunk(b"data: " + head + tail + b"\n\n"))
        usage_event = b'"choices":[],"usage":%b}' % orjson.dumps(usage)
        writer.write(_chunk(b"data: " + head + usage_event + b"\n\n"))
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True


def _after(tokens: list[str], sent: str) -> list[str]:
    """The tokens that follow the text ``sent`` (a prefix of the answer, token by token)."""
    told = 0
    for index, token in enumerate(tokens):
        if told >= len(sent):
            return tokens[index:]
        told += len(token)
    return []


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, path, headers


async def main(args: argparse.Namespace) -> None:
    server = SseServer(args.response_tokens, args.slots, args.token_ms / 1000)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", args.port, backlog=1024)
    async with listener:
        await stop.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8801)
    parser.add_argument("--response-tokens", type=int, default=300)
    parser.add_argument("--slots", type=int, default=4096, help="reported as /props total_slots")
    parser.add_argument(
        "--token-ms", type=float, default=0.0, help="time per token (0: as fast as it can)"
    )
    parser.add_argument("--loop", choices=LOOPS, default=default_loop())
    arguments = parser.parse_args()
    raise_nofile()
    with asyncio.Runner(loop_factory=loop_factory(arguments.loop)) as runner:
        runner.run(main(arguments))
