"""A raw client of the Responses dialect that validates every event it receives.

Each server event is validated in strict mode against openai-python's own
``ResponsesServerEvent`` member for its ``type`` (a pydantic ``TypeAdapter``), and a
field the official types do not declare fails the test too: these are the types the
SDKs and the Agents SDK read the events with.
"""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pydantic
from openai.types.responses import ResponsesServerEvent
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.support.gateway_processes import GatewayProcess
from tests.support.turn import Turn
from tests.test_conformance import extras

TIMEOUT = 10.0
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _members() -> dict[str, pydantic.TypeAdapter[Any]]:
    union = typing.get_args(ResponsesServerEvent)[0]
    adapters = {}
    for model in typing.get_args(union):
        for name in typing.get_args(model.model_fields["type"].annotation):
            adapters[name] = pydantic.TypeAdapter(model)
    return adapters


ADAPTERS = _members()


def validate(event: dict[str, Any]) -> None:
    """Strictly valid against the official type for its ``type``, with no extra field."""
    adapter = ADAPTERS.get(event.get("type", ""))
    assert adapter is not None, f"not an official Responses server event: {event}"
    parsed = adapter.validate_python(event, strict=True)
    unexpected = extras(parsed)
    assert not unexpected, f"fields the official types lack: {unexpected} in {event}"


class ResponsesClient:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._backlog: list[dict[str, Any]] = []  # read, not yet taken by a collect()

    @property
    def session_id(self) -> str:
        assert self.ws.response is not None
        return str(self.ws.response.headers["x-session-id"])

    @property
    def resume_token(self) -> str:
        assert self.ws.response is not None
        return str(self.ws.response.headers["x-resume-token"])

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str, **kwargs: Any) -> AsyncIterator[ResponsesClient]:
        # Unbounded: a test that closes with events left unread must not wait out the
        # close timeout (websockets stops reading at max_queue, so its close frame would
        # never be read). A test of a client that stops reading passes max_queue itself.
        kwargs.setdefault("max_queue", None)
        async with ws_connect(url, open_timeout=TIMEOUT, **kwargs) as ws:
            yield cls(ws)

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(orjson.dumps(event).decode())

    async def create(self, **body: Any) -> None:
        await self.send({"type": "response.create", **body})

    async def recv(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        if self._backlog:
            return self._backlog.pop(0)
        async with asyncio.timeout(timeout):
            event: dict[str, Any] = orjson.loads(await self.ws.recv())
        validate(event)
        self.events.append(event)
        return event

    async def recv_until(self, event_type: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                event = await self.recv()
                if event["type"] == event_type:
                    return event

    async def collect(self, stream_id: str | None = None, timeout: float = TIMEOUT) -> Turn:
        """The next response of lane ``stream_id``: its events up to its terminal one.
        Other lanes' events read meanwhile stay for their own collect()."""
        turn = Turn()
        kept: list[dict[str, Any]] = []
        async with asyncio.timeout(timeout):
            while True:
                event = await self.recv()
                if event.get("stream_id") != stream_id or event["type"].startswith(
                    "response.steer"
                ):
                    kept.append(event)
                    continue
                if event["type"] == "error":
                    self._backlog[:0] = kept
                    raise AssertionError(f"error instead of a response: {event}")
                turn.events.append(event)
                if event["type"] in TERMINAL:
                    self._backlog[:0] = kept
                    return turn

    async def respond(self, **body: Any) -> Turn:
        await self.create(**body)
        return await self.collect(body.get("stream_id"))

    async def error(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        event = await self.recv_until("error", timeout)
        return event


async def drained_mid_answer(
    a: GatewayProcess, b: GatewayProcess, first: int, **create: Any
) -> tuple[list[dict[str, Any]], Turn]:
    """A response created on gateway ``a``, which drains (a deploy) once the client has read
    ``first`` of its events; the client then resumes the session on ``b``. Returns the
    events read from ``a`` and the rest of the response, from ``b``."""
    async with ResponsesClient.connect(a.url("/v1/responses")) as c:
        await c.create(**create)
        seen = [await c.recv() for _ in range(first)]
        a.terminate()
        with contextlib.suppress(ConnectionClosed):
            while True:
                seen.append(await c.recv())
        session, token = c.session_id, c.resume_token
    assert await a.stop() == 0
    assert seen[-1]["type"] not in TERMINAL, "it ended before the drain: too short"
    headers = {
        "x-session-id": session,
        "x-resume-token": token,
        "x-last-sequence-number": str(seen[-1]["sequence_number"]),
    }
    async with ResponsesClient.connect(b.url("/v1/responses"), additional_headers=headers) as r:
        return seen, await r.collect()
