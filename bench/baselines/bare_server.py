"""The bare websockets baseline: a plain ``websockets`` server, a task per stream that sends
the gateway's frames with ``await ws.send``.

No gateway logic at all: no session actor, no scheduler, no engine, no outbox, no
metrics. It answers the load generator's Realtime turns with the same event sequence
and the same JSON delta events (the same fields, the SimEngine's own words, so the same
sizes), one delta frame per token, each built with ``orjson.dumps`` and sent by
``await ws.send``: what a server written plainly on websockets costs. It is "bare", not
the floor (bench/baselines/floor_server.py is that: prebuilt frames, one loop turn, no
task per stream).

Flat out (``--step-ms 0``) a stream sends its frames back to back, with no step clock
(``ws.send`` waits only while the socket pushes back). With ``--step-ms`` above 0 it
keeps the sim engine's schedule, so that latency scenarios compare servers, not clocks:
one shared step clock whose steps fall due on a fixed clock, missed steps counted at
once when the loop comes back late (each stream then sends every token it is owed, still
one frame each), exactly as SimEngine's step loop does.

It runs on the event loop the gateway would (``--loop``, the same default), so
that a comparison is between servers, not loops.

Run: ``python -m bench.baselines.bare_server --port 8800 --step-ms 20 --response-tokens 64``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from typing import Any

import orjson
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from bench.loadgen import raise_nofile
from gateway.__main__ import LOOPS, default_loop, loop_factory
from gateway.engines.sim import _MAX_CATCH_UP as MAX_CATCH_UP  # the same catch-up cap
from gateway.engines.sim import answer_tokens

_ids = itertools.count(1)


def _id(prefix: str) -> str:
    return f"{prefix}_bare00{next(_ids):x}"


def _frame(kind: str, **fields: Any) -> bytes:
    return orjson.dumps({"type": kind, "event_id": _id("event"), **fields})


class Ticker:
    """One step clock for every stream, kept like SimEngine's step loop.

    Steps fall due on a fixed clock (not a sleep after each step), so a busy loop
    does not slow the clock down: when it comes back late, the missed steps count
    at once (up to the engine's cap), and every stream is owed one token per step
    it was in. Idle (no stream) it waits, and the first stream's step runs at
    once, as the engine's does. ``steps`` only grows; a stream remembers the count
    it last saw, so a step that ran while it was busy sending is not lost.
    """

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.steps = 0
        self._streams = 0
        self._wake = asyncio.Event()
        self._next: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    def join(self) -> int:
        """A stream starts: the step count it starts after (its first token is the next step)."""
        self._streams += 1
        self._wake.set()
        if self._task is None and self.step_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self.steps

    def leave(self) -> None:
        self._streams -= 1

    async def wait(self, seen: int) -> int:
        """The step count once it is past ``seen`` (at once if it already is)."""
        if self.step_s <= 0:
            await asyncio.sleep(0)  # flat out: one token per loop turn
            return seen + 1
        if self.steps > seen:
            return self.steps
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        # Shielded: a cancelled stream must not cancel the future the others await.
        await asyncio.shield(self._next)
        return self.steps

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if not self._streams:
                self._wake.clear()
                await self._wake.wait()
                due = loop.time()
            late = loop.time() - due
            steps = 1 + min(MAX_CATCH_UP, int(late / self.step_s))
            self.steps += steps
            due_now, self._next = self._next, None
            if due_now is not None:
                due_now.set_result(None)
            due += steps * self.step_s
            await asyncio.sleep(max(0.0, due - loop.time()))


def _item(item_id: str, role: str, text: str, status: str) -> dict[str, Any]:
    part = "input_text" if role == "user" else "output_text"
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": [{"type": part, "text": text}],
    }


def _response(rid: str, status: str, output: list[Any], usage: Any) -> dict[str, Any]:
    return {
        "object": "realtime.response",
        "id": rid,
        "status": status,
        "status_details": {"type": status} if status == "completed" else None,
        "output": output,
        "conversation_id": "conv_bare",
        "output_modalities": ["text"],
        "max_output_tokens": "inf",
        "metadata": None,
        "usage": usage,
    }


class BareServer:
    def __init__(self, step_ms: float, response_tokens: int) -> None:
        self.ticker = Ticker(step_ms / 1000)
        self.response_tokens = response_tokens
        self.turns = 0

    async def handle(self, ws: ServerConnection) -> None:
        await ws.send(
            _frame("session.created", session={"id": _id("sess"), "type": "realtime"}), text=True
        )
        prompt, task = "", None
        try:
            async for message in ws:
                event = orjson.loads(message)
                kind = event["type"]
                if kind == "conversation.item.create":
                    prompt = event["item"]["content"][0]["text"]
                    item = _item(_id("item"), "user", prompt, "completed")
                    for k in ("conversation.item.added", "conversation.item.done"):
                        await ws.send(_frame(k, previous_item_id=None, item=item), text=True)
                elif kind == "response.create":
                    self.turns += 1
                    task = asyncio.create_task(self.respond(ws, f"{prompt}{self.turns}"))
                elif kind == "response.cancel" and task is not None:
                    task.cancel()
        finally:
            if task is not None:
                task.cancel()

    async def respond(self, ws: ServerConnection, prompt: str) -> None:
        rid, item_id = _id("resp"), _id("item")
        ids = {"response_id": rid, "item_id": item_id, "output_index": 0, "content_index": 0}
        created = _frame("response.created", response=_response(rid, "in_progress", [], None))
        await ws.send(created, text=True)
        added = _item(item_id, "assistant", "", "in_progress")
        await ws.send(_frame("response.output_item.added", response_id=rid, item=added), text=True)
        part = _frame("response.content_part.added", **ids, part={"type": "text"})
        await ws.send(part, text=True)
        tokens = answer_tokens(prompt, self.response_tokens)
        sent: list[str] = []
        status = "completed"
        try:
            if self.ticker.step_s <= 0:
                for token in tokens:  # flat out: no clock, each frame as soon as it can go
                    delta = _frame("response.output_text.delta", **ids, delta=token)
                    await ws.send(delta, text=True)
                    sent.append(token)
            else:
                await self._on_clock(ws, ids, tokens, sent)
        except asyncio.CancelledError:
            status = "cancelled"
        text = "".join(sent)
        usage = {"input_tokens": 10, "output_tokens": len(sent), "total_tokens": 10 + len(sent)}
        item = _item(item_id, "assistant", text, "completed")
        for frame in (
            _frame("response.output_text.done", **ids, text=text),
            _frame("response.content_part.done", **ids, part={"type": "text", "text": text}),
            _frame("response.output_item.done", response_id=rid, output_index=0, item=item),
            _frame("response.done", response=_response(rid, status, [item], usage)),
        ):
            await ws.send(frame, text=True)

    async def _on_clock(
        self, ws: ServerConnection, ids: dict[str, Any], tokens: list[str], sent: list[str]
    ) -> None:
        """One token per step of the shared clock, each in a frame of its own."""
        seen = self.ticker.join()
        try:
            while len(sent) < len(tokens):
                now = await self.ticker.wait(seen)
                for token in tokens[len(sent) : len(sent) + now - seen]:
                    delta = _frame("response.output_text.delta", **ids, delta=token)
                    await ws.send(delta, text=True)
                    sent.append(token)
                seen = now
        finally:
            self.ticker.leave()


def ready_route(connection: ServerConnection, request: Request) -> Response | None:
    """``GET /readyz`` (and any plain GET) answers; a WebSocket upgrade goes on."""
    if "websocket" in request.headers.get("Upgrade", "").lower():
        return None
    body = b'{"ready": true}'
    headers = Headers({"Content-Type": "application/json", "Content-Length": str(len(body))})
    return Response(200, "OK", headers, body)


async def main(args: argparse.Namespace) -> None:
    bare = BareServer(args.step_ms, args.response_tokens)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve(
        bare.handle,
        "127.0.0.1",
        args.port,
        process_request=ready_route,
        compression=None,
        max_size=1 << 20,
        close_timeout=2,
    ):
        await stop.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8800)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--loop", choices=LOOPS, default=default_loop())
    arguments = parser.parse_args()
    raise_nofile()
    with asyncio.Runner(loop_factory=loop_factory(arguments.loop)) as runner:
        runner.run(main(arguments))
