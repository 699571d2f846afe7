"""The load generator: worker processes, each an asyncio loop holding many sessions.

It never runs inside the process it measures. The parent (:func:`run_load`) starts
``workers`` processes, hands each a share of the sessions, waits until every share
has connected, then sends one "go" with a shared start time (``perf_counter`` is
CLOCK_MONOTONIC on Linux, the same clock in every process), so the measurement
window is the same in every worker and in the parent that samples the server's CPU.

The targets speak the same turns: ``("ws", url)`` (the gateway, or the bare
websockets server, over the Realtime protocol), ``("responses", url)`` (the
gateway's Responses WebSocket dialect at ``/v1/responses``: one ``response.create``
per turn, on one lane or, with ``Workload.lanes``, on that many named lanes of one
connection), ``("http", base_url)`` (``POST /v1/responses`` over keep-alive HTTP/1.1,
streamed as server-sent events or answered as one JSON ``Response``: the gateway
or bench/baselines/fastapi_server.py), ``("chat", base_url)`` (``POST
/v1/chat/completions`` the same way, its chunks or one ``chat.completion``) and
``("engine", params)`` (the SimEngine in the
worker process itself, driven directly (EngineDriver): the bare-engine baseline,
no network, no gateway).

Every loop is bounded: by the window, by ``max_turns`` per session, and by
``turn_timeout`` per turn; whatever is still open at the end is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import random
import resource
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

import orjson

now = time.perf_counter

Mode = Literal["closed", "open", "idle"]


@dataclass(frozen=True)
class Workload:
    """What every session does. Times in seconds unless the name says otherwise."""

    sessions: int
    mode: Mode = "closed"
    warmup: float = 1.0  # from "go" to the start of the window (ramp-up, not measured)
    duration: float = 5.0  # the measurement window
    think: tuple[float, float] = (0.0, 0.04)  # uniform pause before each turn (closed loop)
    rate: float = 0.0  # open loop: arrivals per second, all workers together
    cancel_after: tuple[int, int] | None = None  # cancel after k delta frames, k uniform
    max_turns: int = 1000
    turn_timeout: float = 30.0
    drain: float = 10.0  # after the window, how long open turns may take to finish
    prompt: str = "Tell me about streaming gateways."
    # The Responses targets. lanes: 0, one unnamed lane per connection; N, N named lanes
    # (stream_id l0..) per connection, each a session of its own that runs its turns back
    # to back, all N at once. chain: each turn continues the session's previous response
    # (previous_response_id; over HTTP only with store). stream: HTTP answers as SSE.
    lanes: int = 0
    chain: bool = True
    store: bool = False
    stream: bool = True
    # Chat Completions: ask for log probabilities with this many alternatives (None: not).
    logprobs: int | None = None
    # Completions: the choices each request asks for (n), streamed interleaved.
    choices: int = 1


@dataclass
class Tally:
    """What one worker saw; merged across workers by the parent."""

    connected: int = 0
    connect_failed: int = 0
    turns: int = 0  # turns started inside the window (the ones with latency records)
    unfinished: int = 0  # turns still open when the drain ran out
    status: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    text_mismatch: int = 0
    dropped_arrivals: int = 0  # open loop: no free session at an arrival
    ttft: array[float] = field(default_factory=lambda: array("d"))
    tpot: array[float] = field(default_factory=lambda: array("d"))
    e2e: array[float] = field(default_factory=lambda: array("d"))
    gaps: array[float] = field(default_factory=lambda: array("d"))
    cancel_to_done: array[float] = field(default_factory=lambda: array("d"))
    # Arrivals inside the window, for rates.
    frames: int = 0
    delta_frames: int = 0
    chars: int = 0
    # Whole finished responses, for the tokens-per-character ratio.
    done_tokens: int = 0
    done_chars: int = 0
    cpu_s: float = 0.0  # this worker's own CPU over the window

    def merge(self, other: Tally) -> None:
        for name, mine in vars(self).items():
            theirs = getattr(other, name)
            if isinstance(mine, (Counter, array)):
                mine += theirs  # in place for Counter and array
            else:
                setattr(self, name, mine + theirs)

    @property
    def tokens_in_window(self) -> float:
        """Tokens delivered in the window: characters seen times tokens per character."""
        return self.chars * self.done_tokens / self.done_chars if self.done_chars else 0.0


@dataclass
class Window:
    go: float
    start: float
    end: float

    def __contains__(self, t: float) -> bool:
        return self.start <= t <= self.end


@dataclass
class _Turn:
    """One response as the client sees it."""

    started: float
    record: bool
    parts: list[str] = field(default_factory=list)
    first: float = 0.0
    last: float = 0.0
    cancel_at: float = 0.0
    final_text: str | None = None


def _finish_turn(tally: Tally, turn: _Turn, status: str, tokens: int, t: float) -> None:
    text = "".join(turn.parts)
    tally.done_tokens += tokens
    tally.done_chars += len(text)
    if not turn.record:
        return
    tally.status[status] += 1
    if turn.final_text is not None and turn.final_text != text:
        tally.text_mismatch += 1
    if turn.first:
        tally.ttft.append(turn.first - turn.started)
        if tokens > 1:
            tally.tpot.append((t - turn.first) / (tokens - 1))
    tally.e2e.append(t - turn.started)
    if turn.cancel_at:
        tally.cancel_to_done.append(t - turn.cancel_at)


# -- the two targets -----------------------------------------------------------------


class WsSession:
    """One Realtime session over a WebSocket: a user item, then a response, per turn."""

    def __init__(self, ws: Any, index: int) -> None:
        self.ws = ws
        self.index = index
        self.turns = 0

    @classmethod
    async def open(cls, url: str, index: int) -> WsSession:
        from websockets.asyncio.client import connect

        # Spread source addresses over 127.0.0.2-17 so thousands of sessions never
        # run out of ephemeral ports (each source address has its own port range).
        ws = await connect(
            url,
            compression=None,
            max_size=None,
            ping_interval=None,
            open_timeout=60,
            close_timeout=2,
            local_addr=(f"127.0.0.{2 + index % 16}", 0),
        )
        created = orjson.loads(await ws.recv())
        assert created["type"] == "session.created", created
        return cls(ws, index)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()

    async def turn(
        self, w: Workload, win: Window, tally: Tally, rng: random.Random, record: bool
    ) -> None:
        ws = self.ws
        self.turns += 1
        text = f"{w.prompt} (session {self.index}, turn {self.turns})"
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        }
        await ws.send(orjson.dumps({"type": "conversation.item.create", "item": item}).decode())
        turn = _Turn(now(), record)
        await ws.send('{"type":"response.create"}')
        cancel_k = rng.randint(*w.cancel_after) if w.cancel_after else 0
        created = False
        while True:
            frame = await ws.recv()
            t = now()
            inside = t in win
            tally.frames += inside
            event = orjson.loads(frame)
            kind = event["type"]
            if kind == "response.output_text.delta":
                delta = event["delta"]
                turn.parts.append(delta)
                if inside:
                    tally.delta_frames += 1
                    tally.chars += len(delta)
                if not turn.first:
                    turn.first = t
                elif record:
                    tally.gaps.append(t - turn.last)
                turn.last = t
                if cancel_k and len(turn.parts) == cancel_k:
                    turn.cancel_at = now()
                    await ws.send('{"type":"response.cancel"}')
            elif kind == "response.created":
                created = True
            elif kind == "response.output_text.done":
                turn.final_text = event["text"]
            elif kind == "response.done":
                response = event["response"]
                tokens = (response.get("usage") or {}).get("output_tokens", 0)
                _finish_turn(tally, turn, response["status"], tokens, t)
                return
            elif kind == "error":
                tally.errors[event["error"]["code"]] += 1
                if not created:  # refused (overloaded): no response will come
                    if record:
                        tally.status["refused"] += 1
                    return


def _local_addr(index: int) -> tuple[str, int]:
    """Source addresses 127.0.0.2-17: thousands of connections never run out of ports."""
    return (f"127.0.0.{2 + index % 16}", 0)


_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_LATE_CANCEL = ("response_not_found", "response_cancel_not_active")


@dataclass
class _ResponsesTurn(_Turn):
    """A Responses turn: what its events say, the same whether they came over a WebSocket
    or as server-sent events."""

    cancel_k: int = 0
    created: bool = False
    response_id: str = ""

    def on_event(self, event: dict[str, Any], t: float, win: Window, tally: Tally) -> str | None:
        """Account for one event; what the caller must do next: "cancel" (the turn
        reached its cancel point), "done" (the response ended, or was refused), or None."""
        kind = event["type"]
        if kind == "response.output_text.delta":
            delta = event["delta"]
            self.parts.append(delta)
            if t in win:
                tally.delta_frames += 1
                tally.chars += len(delta)
            if not self.first:
                self.first = t
            elif self.record:
                tally.gaps.append(t - self.last)
            self.last = t
            if self.cancel_k and len(self.parts) == self.cancel_k:
                self.cancel_at = now()
                return "cancel"
        elif kind == "response.created":
            self.created = True
            self.response_id = event["response"]["id"]
        elif kind == "response.output_text.done":
            self.final_text = event["text"]
        elif kind in _TERMINAL:
            response = event["response"]
            if kind == "response.failed":
                error = response.get("error") or {}
                tally.errors[error.get("code") or "failed"] += self.record
            tokens = (response.get("usage") or {}).get("output_tokens", 0)
            _finish_turn(tally, self, response["status"], tokens, t)
            return "done"
        elif kind == "error":
            code = event["error"]["code"]
            if code in _LATE_CANCEL:
                # A cancel that crossed the previous response's end on the wire: that
                # response is over, this turn's goes on.
                tally.status["late_cancel"] += 1
                return None
            tally.errors[code] += 1
            if not self.created:  # refused (overloaded, a bad request): no response comes
                if self.record:
                    tally.status["refused"] += 1
                return "done"
        return None


class _LaneMux:
    """One Responses connection shared by several lanes: a reader task hands each event to
    its lane's queue (by ``stream_id``), stamped with the time it arrived."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.queues: dict[str, asyncio.Queue[tuple[float, dict[str, Any]] | None]] = {}
        self.task = asyncio.get_running_loop().create_task(self._read())

    def lane(self, stream_id: str) -> asyncio.Queue[tuple[float, dict[str, Any]] | None]:
        queue: asyncio.Queue[tuple[float, dict[str, Any]] | None] = asyncio.Queue()
        self.queues[stream_id] = queue
        return queue

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                t = now()
                event = orjson.loads(frame)
                queue = self.queues.get(event.get("stream_id", ""))
                if queue is not None:
                    queue.put_nowait((t, event))
        except Exception:
            pass
        finally:
            for queue in self.queues.values():
                queue.put_nowait(None)  # the connection is gone: every lane's turn fails

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task


class ResponsesSession:
    """The Responses WebSocket dialect (``/v1/responses``): one ``response.create`` per
    turn, continuing the previous response (``previous_response_id``) when the workload
    chains. Alone on its connection it reads the socket itself; as one of several lanes
    (``stream_id``) it reads its queue of a shared connection (:class:`_LaneMux`)."""

    def __init__(
        self, ws: Any, index: int, mux: _LaneMux | None = None, stream_id: str = ""
    ) -> None:
        self.ws = ws
        self.index = index
        self.turns = 0
        self.previous: str | None = None
        self.mux = mux
        self.stream_id = stream_id
        self.queue = mux.lane(stream_id) if mux is not None else None

    @staticmethod
    async def connect(url: str, index: int) -> Any:
        from websockets.asyncio.client import connect

        return await connect(
            url,
            compression=None,
            max_size=None,
            ping_interval=None,
            open_timeout=60,
            close_timeout=2,
            local_addr=_local_addr(index),
        )

    @classmethod
    async def open(cls, url: str, index: int) -> ResponsesSession:
        return cls(await cls.connect(url, index), index)

    async def close(self) -> None:
        if self.mux is not None:
            await self.mux.close()  # the first lane closes it; the others find it closed
            return
        with contextlib.suppress(Exception):
            await self.ws.close()

    async def _next(self) -> tuple[float, dict[str, Any]]:
        if self.queue is None:
            frame = await self.ws.recv()
            return now(), orjson.loads(frame)
        item = await self.queue.get()
        if item is None:
            raise ConnectionError("the connection closed")
        return item

    async def turn(
        self, w: Workload, win: Window, tally: Tally, rng: random.Random, record: bool
    ) -> None:
        self.turns += 1
        body: dict[str, Any] = {
            "type": "response.create",
            "input": f"{w.prompt} (session {self.index}, turn {self.turns})",
            "store": w.store,
        }
        if self.stream_id:
            body["stream_id"] = self.stream_id
        if w.chain and self.previous:
            body["previous_response_id"] = self.previous
        cancel_k = rng.randint(*w.cancel_after) if w.cancel_after else 0
        turn = _ResponsesTurn(now(), record, cancel_k=cancel_k)
        await self.ws.send(orjson.dumps(body).decode())
        while True:
            t, event = await self._next()
            tally.frames += t in win
            action = turn.on_event(event, t, win, tally)
            if action == "done":
                ended = event["type"] in _TERMINAL and event["response"]["status"] != "failed"
                # Refused or failed: the next turn starts a new conversation.
                self.previous = turn.response_id if ended else None
                return
            if action == "cancel":
                cancel = {"type": "response.cancel", "response_id": turn.response_id}
                await self.ws.send(orjson.dumps(cancel).decode())


class HttpSession:
    """``POST /v1/responses`` on one keep-alive HTTP/1.1 connection, a request per turn:
    with ``stream`` the answer is ``text/event-stream`` (chunked), each event read as it
    arrives; without, one JSON ``Response`` (its time to first token is its whole time).
    A small client of its own (no httpx): the load generator must cost little CPU."""

    def __init__(self, host: str, port: int, index: int) -> None:
        self.host = host
        self.port = port
        self.index = index
        self.turns = 0
        self.previous: str | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.buffer = b""

    @classmethod
    async def open(cls, base_url: str, index: int) -> HttpSession:
        from urllib.parse import urlsplit

        parts = urlsplit(base_url)
        session = cls(parts.hostname or "127.0.0.1", parts.port or 80, index)
        await session._connect()
        return session

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(
            self.host, self.port, local_addr=_local_addr(self.index), limit=1 << 20
        )
        self.buffer = b""

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
            self.writer = None

    async def _more(self) -> float:
        assert self.reader is not None
        data = await self.reader.read(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data
        return now()

    async def _head(self) -> tuple[int, dict[bytes, bytes]]:
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            await self._more()
        head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        return status, headers

    async def _body(self, headers: dict[bytes, bytes]) -> tuple[float, bytes]:
        """A whole body (Content-Length or chunked) and when its last byte came."""
        t = now()
        if headers.get(b"transfer-encoding") == b"chunked":
            parts = []
            async for arrived, chunk in self._chunks():
                parts.append(chunk)
                t = arrived
            return t, b"".join(parts)
        length = int(headers.get(b"content-length", b"0"))
        while len(self.buffer) < length:
            t = await self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return t, body

    async def _chunks(self) -> Any:
        """Each chunk of a chunked body as it arrives: (the time its read returned, bytes)."""
        t = now()
        while True:
            while (eol := self.buffer.find(b"\r\n")) < 0:
                t = await self._more()
            size = int(self.buffer[:eol].split(b";", 1)[0], 16)
            if size == 0:
                while len(self.buffer) < eol + 4:  # the empty trailer's CRLF
                    t = await self._more()
                self.buffer = self.buffer[eol + 4 :]
                return
            end = eol + 2 + size
            while len(self.buffer) < end + 2:
                t = await self._more()
            chunk, self.buffer = self.buffer[eol + 2 : end], self.buffer[end + 2 :]
            yield t, chunk

    async def turn(
        self, w: Workload, win: Window, tally: Tally, rng: random.Random, record: bool
    ) -> None:
        if w.cancel_after:
            raise NotImplementedError("cancel over HTTP (a disconnect) is not driven")
        if self.writer is None:
            await self._connect()
        assert self.writer is not None
        self.turns += 1
        payload = orjson.dumps(self._request_body(w))
        request = (
            b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (self.PATH, self.host.encode(), len(payload), payload)
        )
        turn = self._new_turn(record)
        self.writer.write(request)
        try:
            status, headers = await self._head()
            if status != 200:
                _, raw = await self._body(headers)
                code = f"http_{status}"
                with contextlib.suppress(Exception):
                    code = orjson.loads(raw)["error"].get("code") or code
                tally.errors[code] += 1
                if record and status in (429, 503):
                    tally.status["refused"] += 1
            elif headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                await self._events(turn, win, tally)
            else:
                t, raw = await self._body(headers)
                self._whole(turn, orjson.loads(raw), t, win, tally)
            if headers.get(b"connection") == b"close":
                await self.close()
        except BaseException:
            await self.close()  # a turn cut short leaves the connection mid-answer
            raise

    PATH = b"/v1/responses"

    def _request_body(self, w: Workload) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input": f"{w.prompt} (session {self.index}, turn {self.turns})",
            "stream": w.stream,
            "store": w.store,
        }
        if w.chain and w.store and self.previous:
            body["previous_response_id"] = self.previous
        return body

    def _new_turn(self, record: bool) -> Any:
        return _ResponsesTurn(now(), record)

    async def _events(self, turn: Any, win: Window, tally: Tally) -> None:
        pending = b""
        async for t, chunk in self._chunks():
            pending += chunk
            while (end := pending.find(b"\n\n")) >= 0:
                block, pending = pending[:end], pending[end + 2 :]
                data = block.find(b"data: ")
                if data >= 0:
                    tally.frames += t in win
                    self._on_data(turn, block[data + 6 :], t, win, tally)

    def _on_data(self, turn: Any, data: bytes, t: float, win: Window, tally: Tally) -> None:
        event = orjson.loads(data)
        if turn.on_event(event, t, win, tally) == "done" and event["type"] in _TERMINAL:
            self.previous = turn.response_id

    def _whole(
        self, turn: Any, response: dict[str, Any], t: float, win: Window, tally: Tally
    ) -> None:
        text = "".join(
            part.get("text", "")
            for item in response.get("output") or []
            if item.get("type") == "message"
            for part in item.get("content") or []
        )
        turn.parts.append(text)
        turn.first = turn.last = t
        turn.final_text = text
        if t in win:
            tally.frames += 1
            tally.delta_frames += 1
            tally.chars += len(text)
        tokens = (response.get("usage") or {}).get("output_tokens", 0)
        self.previous = response.get("id")
        _finish_turn(tally, turn, response["status"], tokens, t)


class _ChatTurn(_Turn):
    """A Chat Completions turn: its ``chat.completion.chunk`` objects (usage last)."""

    finish_reason: str | None = None

    def on_chunk(self, chunk: dict[str, Any], t: float, win: Window, tally: Tally) -> None:
        if "error" in chunk:
            tally.errors[chunk["error"].get("code") or "failed"] += self.record
            _finish_turn(tally, self, "failed", 0, t)
            return
        for choice in chunk["choices"]:
            delta = self.text(choice)
            if delta:
                self.parts.append(delta)
                if t in win:
                    tally.delta_frames += 1
                    tally.chars += len(delta)
                if not self.first:
                    self.first = t
                elif self.record:
                    tally.gaps.append(t - self.last)
                self.last = t
            self.finish_reason = choice["finish_reason"] or self.finish_reason
        usage = chunk.get("usage")
        if usage is not None:  # the last chunk (stream_options.include_usage)
            status = "incomplete" if self.finish_reason == "length" else "completed"
            _finish_turn(tally, self, status, usage["completion_tokens"], t)

    @staticmethod
    def text(choice: dict[str, Any]) -> str | None:
        """A streamed choice's text."""
        content: str | None = choice["delta"].get("content")
        return content


class ChatHttpSession(HttpSession):
    """``POST /v1/chat/completions`` on one keep-alive connection, a request per turn; with
    ``stream``, its chunks as they arrive (``stream_options.include_usage``)."""

    PATH = b"/v1/chat/completions"

    def _request_body(self, w: Workload) -> dict[str, Any]:
        content = f"{w.prompt} (session {self.index}, turn {self.turns})"
        body: dict[str, Any] = {
            "model": "default",
            "messages": [{"role": "user", "content": content}],
            "stream": w.stream,
        }
        if w.stream:
            body["stream_options"] = {"include_usage": True}
        if w.logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, w.logprobs
        return body

    def _new_turn(self, record: bool) -> Any:
        return _ChatTurn(now(), record)

    def _on_data(self, turn: Any, data: bytes, t: float, win: Window, tally: Tally) -> None:
        if data != b"[DONE]":
            turn.on_chunk(orjson.loads(data), t, win, tally)

    def _whole(
        self, turn: Any, response: dict[str, Any], t: float, win: Window, tally: Tally
    ) -> None:
        choice = response["choices"][0]
        text = choice["message"]["content"] or ""
        turn.parts.append(text)
        turn.first = turn.last = t
        if t in win:
            tally.frames += 1
            tally.delta_frames += 1
            tally.chars += len(text)
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        _finish_turn(tally, turn, status, response["usage"]["completion_tokens"], t)


class _CompletionTurn(_ChatTurn):
    """A Completions turn: its ``text_completion`` chunks, every choice's (usage last)."""

    @staticmethod
    def text(choice: dict[str, Any]) -> str | None:
        text: str = choice["text"]
        return text


class CompletionsHttpSession(ChatHttpSession):
    """``POST /v1/completions`` on one keep-alive connection, a request per turn (its
    ``n`` choices interleaved); with ``stream``, its chunks as they arrive."""

    PATH = b"/v1/completions"

    def _request_body(self, w: Workload) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "default",
            "prompt": f"{w.prompt} (session {self.index}, turn {self.turns})",
            "max_tokens": 1_000_000,  # the sim's natural length, not OpenAI's default 16
            "stream": w.stream,
            "n": w.choices,
        }
        if w.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _new_turn(self, record: bool) -> Any:
        return _CompletionTurn(now(), record)

    def _whole(
        self, turn: Any, response: dict[str, Any], t: float, win: Window, tally: Tally
    ) -> None:
        text = "".join(choice["text"] for choice in response["choices"])
        turn.parts.append(text)
        turn.first = turn.last = t
        if t in win:
            tally.frames += 1
            tally.delta_frames += 1
            tally.chars += len(text)
        length = any(choice["finish_reason"] == "length" for choice in response["choices"])
        status = "incomplete" if length else "completed"
        _finish_turn(tally, turn, status, response["usage"]["completion_tokens"], t)


class EngineSession:
    """The bare-engine baseline: the same turns straight into the engine (an EngineDriver)."""

    def __init__(self, engine: Any, index: int) -> None:
        from gateway.engines.base import Message

        self.engine = engine
        self.index = index
        self.turns = 0
        self.messages: list[Message] = []

    async def close(self) -> None:
        return None

    async def turn(
        self, w: Workload, win: Window, tally: Tally, rng: random.Random, record: bool
    ) -> None:
        from gateway.engines.base import Finished, GenerationRequest, Message, TextDelta

        self.turns += 1
        self.messages.append(
            Message("user", f"{w.prompt} (session {self.index}, turn {self.turns})")
        )
        request = GenerationRequest(
            f"r{self.index}-{self.turns}", tuple(self.messages), affinity_key=f"c{self.index}"
        )
        cancel_k = rng.randint(*w.cancel_after) if w.cancel_after else 0
        turn = _Turn(now(), record)
        stream = self.engine.stream(request)
        status, tokens = "cancelled", 0
        try:
            async for item in stream:
                t = now()
                if isinstance(item, Finished):
                    status = "completed" if item.reason == "stop" else "incomplete"
                    tokens = item.usage.output_tokens
                    break
                if not isinstance(item, TextDelta):
                    continue  # the prompt's token count
                turn.parts.append(item.text)
                if t in win:
                    tally.frames += 1
                    tally.delta_frames += 1
                    tally.chars += len(item.text)
                if not turn.first:
                    turn.first = t
                elif record:
                    tally.gaps.append(t - turn.last)
                turn.last = t
                if cancel_k and len(turn.parts) == cancel_k:
                    turn.cancel_at = now()
                    tokens = len(turn.parts)
                    break
        finally:
            await stream.aclose()  # what the gateway's cancel does to the engine
        text = "".join(turn.parts)
        self.messages.append(Message("assistant", text))
        turn.final_text = text
        _finish_turn(tally, turn, status, tokens, now())


# -- the worker process ----------------------------------------------------------------


def raise_nofile() -> None:
    """Allow as many open files as the hard limit: thousands of sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ("ws", url), ("responses", url), ("http", base_url), ("chat", base_url) or ("engine",
# SimEngine keyword arguments)
Target = tuple[str, Any]


async def _open_sessions(
    target: Target, w: Workload, indices: list[int], tally: Tally
) -> tuple[list[Any], Callable[[], Awaitable[None]]]:
    kind, arg = target
    if kind == "engine":
        from gateway.engines.driver import EngineDriver
        from gateway.engines.sim import SimEngine

        engine = SimEngine(**arg)
        await engine.start()
        driver = await EngineDriver(engine).__aenter__()
        tally.connected = len(indices)

        async def close() -> None:
            await driver.__aexit__(None, None, None)
            await engine.close()

        return [EngineSession(driver, i) for i in indices], close

    gate = asyncio.Semaphore(64)  # handshakes in flight per worker
    opener: Callable[[str, int], Awaitable[Any]] = {
        "ws": WsSession.open,
        "responses": ResponsesSession.open,
        "http": HttpSession.open,
        "chat": ChatHttpSession.open,
        "completions": CompletionsHttpSession.open,
    }[kind]

    async def one(i: int) -> Any:
        async with gate:
            try:
                return await opener(arg, i)
            except Exception:
                return None

    async def lanes(group: list[int]) -> list[ResponsesSession]:
        """One connection, a lane (l0, l1, ...) of it per index of ``group``."""
        async with gate:
            try:
                ws = await ResponsesSession.connect(arg, group[0])
            except Exception:
                return []
        mux = _LaneMux(ws)
        return [ResponsesSession(ws, i, mux, f"l{i % w.lanes}") for i in group]

    if kind == "responses" and w.lanes:
        groups = [[i for i in indices if i // w.lanes == c] for c in _groups(indices, w)]
        sessions = [s for lane in await asyncio.gather(*map(lanes, groups)) for s in lane]
    else:
        opened = await asyncio.gather(*(one(i) for i in indices))
        sessions = [s for s in opened if s is not None]
    tally.connected = len(sessions)
    tally.connect_failed = len(indices) - len(sessions)

    async def nothing() -> None:
        return None

    return sessions, nothing


def _groups(indices: list[int], w: Workload) -> list[int]:
    """The connections ``indices`` fall in, ``w.lanes`` sessions to a connection."""
    return sorted({i // w.lanes for i in indices})


def _shares(w: Workload, workers: int) -> list[list[int]]:
    """The session indices each worker holds: round robin, or whole connections of lanes
    (a connection's lanes in one worker; a worker may get none)."""
    if not w.lanes:
        return [list(range(k, w.sessions, workers)) for k in range(workers)]
    connections = range(math.ceil(w.sessions / w.lanes))
    return [
        [
            i
            for c in connections[k::workers]
            for i in range(c * w.lanes, (c + 1) * w.lanes)
            if i < w.sessions
        ]
        for k in range(workers)
    ]


async def _guarded_turn(
    session: Any, w: Workload, win: Window, tally: Tally, rng: random.Random
) -> None:
    record = now() in win
    if record:
        tally.turns += 1
    try:
        async with asyncio.timeout(w.turn_timeout):
            await session.turn(w, win, tally, rng, record)
    except TimeoutError:
        if record:
            tally.status["timeout"] += 1
    except Exception as exc:  # a dropped connection: counted, never fatal to the run
        if record:
            tally.errors[type(exc).__name__] += 1


async def _closed_loop(session: Any, w: Workload, win: Window, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, min(w.warmup, 1.0)))  # spread the first turns
    for _ in range(w.max_turns):
        await asyncio.sleep(rng.uniform(*w.think))
        if now() >= win.end:
            return
        await _guarded_turn(session, w, win, tally, rng)


async def _open_loop(
    sessions: list[Any], w: Workload, win: Window, tally: Tally, share: float, seed: int
) -> None:
    """Poisson arrivals at ``share`` of the total rate; each takes a free session."""
    rng = random.Random(seed)
    free = list(sessions)
    running: set[asyncio.Task[None]] = set()

    async def serve(session: Any) -> None:
        try:
            await _guarded_turn(session, w, win, tally, rng)
        finally:
            free.append(session)

    next_at = now()
    while True:
        next_at += rng.expovariate(share)
        if next_at >= win.end:
            break
        await asyncio.sleep(max(0.0, next_at - now()))
        if not free:
            tally.dropped_arrivals += now() in win
            continue
        task = asyncio.get_running_loop().create_task(serve(free.pop()))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.wait(running)


async def _worker(conn: Connection, target: Target, w: Workload, indices: list[int]) -> None:
    tally = Tally()
    sessions, close_target = await _open_sessions(target, w, indices, tally)
    conn.send(("ready", tally.connected, tally.connect_failed))
    message = await asyncio.to_thread(conn.recv)
    if w.mode == "idle":
        for s in sessions:
            await s.close()
        conn.send(("result", tally))
        return
    go = message[1]
    win = Window(go, go + w.warmup, go + w.warmup + w.duration)
    await asyncio.sleep(max(0.0, go - now()))
    seed = indices[0] if indices else 0
    if w.mode == "closed":
        work = [_closed_loop(s, w, win, tally, seed + k) for k, s in enumerate(sessions)]
    else:
        share = w.rate * len(indices) / w.sessions
        work = [_open_loop(sessions, w, win, tally, share, seed)]
    tasks = [asyncio.ensure_future(c) for c in work]
    cpu = _CpuWindow(win)
    cpu_task = asyncio.ensure_future(cpu.run())
    pending: set[asyncio.Future[None]] = set()
    if tasks:  # a worker may hold no session (every lane of a connection is in another)
        _, pending = await asyncio.wait(tasks, timeout=win.end + w.drain - now())
    for task in pending:
        task.cancel()
    tally.unfinished = len(pending)
    await asyncio.gather(*pending, return_exceptions=True)
    await cpu_task
    tally.cpu_s = cpu.seconds
    await asyncio.gather(*(s.close() for s in sessions))
    await close_target()
    conn.send(("result", tally))


class _CpuWindow:
    """This process's CPU seconds between the window's start and end."""

    def __init__(self, win: Window) -> None:
        self.win = win
        self.seconds = 0.0

    async def run(self) -> None:
        await asyncio.sleep(max(0.0, self.win.start - now()))
        t0 = sum(os.times()[:2])
        await asyncio.sleep(max(0.0, self.win.end - now()))
        self.seconds = sum(os.times()[:2]) - t0


def _worker_entry(
    conn: Connection, target: Target, w: Workload, indices: list[int], loop: str
) -> None:
    from gateway.__main__ import loop_factory

    raise_nofile()
    try:
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            runner.run(_worker(conn, target, w, indices))
    finally:
        conn.close()


# -- the parent side ------------------------------------------------------------------


@dataclass
class LoadResult:
    tally: Tally
    window: Window
    server_cpu_s: float | None  # the measured server process's CPU over the window
    extra: dict[str, Any] = field(default_factory=dict)


def run_load(
    target: Target,
    w: Workload,
    *,
    workers: int,
    server_pid: int | None = None,
    also_sample: Sequence[int] = (),
    on_ready: Callable[[], dict[str, Any]] | None = None,
    ready_timeout: float = 120.0,
    loop: str = "asyncio",
) -> LoadResult:
    """Run ``w`` against ``target`` from ``workers`` processes; merge what they saw.

    ``on_ready`` runs once every session is connected (before "go"); what it returns
    lands in ``extra``. For an idle workload that is the measurement itself. The
    workers run on the event loop ``loop`` names (the bare engine baseline runs in
    them). ``also_sample``: more processes whose CPU over the window goes into
    ``extra["cpu_s"]`` (an upstream server behind the gateway); the whole machine's
    busy CPU over the window goes into ``extra["machine_busy_s"]``, so that work
    that is not the benchmark's shows.
    """
    from bench.procs import cpu_seconds, machine_busy_seconds

    ctx = mp.get_context("spawn")
    shares = _shares(w, workers)
    pipes, procs = [], []
    for share in shares:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_entry, args=(child, target, w, share, loop), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        for p in pipes:
            if not p.poll(ready_timeout):
                raise RuntimeError("a load worker did not connect its sessions in time")
            p.recv()
        extra = on_ready() if on_ready is not None else {}
        go = now() + 0.2
        win = Window(go, go + w.warmup, go + w.warmup + w.duration)
        for p in pipes:
            p.send(("go", go))
        server_cpu = None
        if w.mode != "idle":
            sampled = [server_pid, *also_sample] if server_pid is not None else []
            time.sleep(max(0.0, win.start - now()))
            cpu0 = [cpu_seconds(pid) for pid in sampled]
            busy0 = machine_busy_seconds()
            time.sleep(max(0.0, win.end - now()))
            cpu = [cpu_seconds(pid) - c for pid, c in zip(sampled, cpu0, strict=True)]
            extra["machine_busy_s"] = machine_busy_seconds() - busy0
            extra["cpu_s"] = dict(zip(sampled, cpu, strict=True))
            server_cpu = cpu[0] if cpu else None
        tally = Tally()
        limit = w.warmup + w.duration + w.drain + 30
        for p in pipes:
            if not p.poll(limit):
                raise RuntimeError("a load worker did not report in time")
            tally.merge(p.recv()[1])
        return LoadResult(tally, win, server_cpu, extra)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
