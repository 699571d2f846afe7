"""An OpenAI-compatible server on loopback for the upstream engine's tests: what a real one
(vLLM, SGLang, llama.cpp) sends, and what it rarely does (an abort, a stream held open, a
connection cut mid-answer), in a few lines of HTTP. It keeps what each generation was sent."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson


def sse(delta: str | None = None, finish: str | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` as the servers send it."""
    content = {"content": delta} if delta is not None else {}
    return {"choices": [{"index": 0, "delta": content, "finish_reason": finish}]}


class FakeUpstream:
    """An OpenAI-compatible server on loopback that streams ``chunks`` for every generation.

    Keep-alive HTTP/1.1 with chunked SSE bodies, like vLLM and SGLang; ``/health``
    answers 200, ``/props`` and ``/v1/models`` 404. With ``hold`` set it sends the
    headers and then keeps the stream open until it stops; ``requested`` is set
    once a generation arrived. With ``drop_reused`` it closes a connection that
    served a generation when the next request arrives on it, unanswered: the
    moment in which a pooled connection is reused just as the server closes it.
    """

    def __init__(
        self,
        chunks: list[dict[str, Any]],
        *,
        hold: bool = False,
        drop_reused: bool = False,
        cut_after: int | None = None,
    ) -> None:
        self.chunks = chunks
        self.hold = hold
        self.drop_reused = drop_reused
        self.cut_after = cut_after  # chunks sent before the connection is cut (a crash)
        self.accepted = 0  # connections opened to it
        self.dropped = 0
        self.generations = 0
        self.health_probes = 0
        self.bodies: list[dict[str, Any]] = []  # of the generations, parsed
        self.headers: list[dict[str, str]] = []  # of the generations, names in lower case
        self.requested = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> FakeUpstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._connections.values():
            writer.transport.abort()  # held streams and idle keep-alive connections end too
        await asyncio.wait_for(asyncio.gather(*self._connections), timeout=10)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        this = asyncio.current_task()
        assert this is not None
        self._connections[this] = writer
        self.accepted += 1
        streamed = False
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while request_line := await reader.readline():
                if streamed and self.drop_reused:
                    self.dropped += 1
                    break
                path = request_line.split()[1]
                length = 0
                headers: dict[str, str] = {}
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    headers[name.strip().lower().decode()] = value.strip().decode()
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if path == b"/health":
                    self.health_probes += 1
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                elif path != b"/v1/chat/completions":
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                else:
                    self.bodies.append(orjson.loads(body))
                    self.headers.append(headers)
                    await self._stream(reader, writer)
                    streamed = True
                await writer.drain()
        writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.generations += 1
        self.requested.set()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        if self.hold:
            await writer.drain()
            await reader.read()  # the client sends nothing more: until the connection ends
            return
        for sent, event in enumerate([*(orjson.dumps(c).decode() for c in self.chunks), "[DONE]"]):
            if sent == self.cut_after:
                await writer.drain()
                writer.transport.abort()  # a replica that dies mid-answer
                return
            data = f"data: {event}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        writer.write(b"0\r\n\r\n")
