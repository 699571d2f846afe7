"""Every server event the gateway can send validates against openai-python's own types.

The official ``RealtimeServerEvent`` union (``openai.types.realtime``), through a
pydantic ``TypeAdapter`` in strict mode: each event is validated, never built with
the SDK's lenient ``construct``. The Agents SDK validates every server event with
these types and turns an invalid one into an error, so one bad field breaks agents.

The types allow fields they do not declare (their models keep extras); the fields
this gateway adds are checked against the documented list, so a misspelt field is
caught rather than passed along as an extra.
"""

from __future__ import annotations

import asyncio
import re
import typing
from pathlib import Path
from typing import Any

import pydantic
import pytest
from openai.types.realtime import RealtimeServerEvent
from openai.types.realtime.realtime_response_status import RealtimeResponseStatus

from gateway.engines.base import EngineError, Usage
from gateway.engines.sim import SimEngine
from gateway.scheduler import CancelReason, Outcome
from sessions.realtime.dialect import status_details
from tests.support.harness import RawClient, running_gateway
from tests.support.scripted_engine import ScriptedEngine, text_then_two_calls
from tests.test_tools import TIME, WEATHER, output_item, respond_all, set_tools

ROOT = Path(__file__).resolve().parent.parent
SERVER_EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RealtimeServerEvent)

# Fields the gateway adds where the official types have none, by where they appear.
ADDED_FIELDS = {
    # sequence_number: on every event; resume_token: on session.created, the secret a
    # session.resume presents (resume, issue 12).
    "": {"sequence_number", "resume_token"},
    "session": {"object", "id", "temperature", "top_p", "seed", "stop"}
    | {"frequency_penalty", "presence_penalty"},
    "response.status_details": {"gateway_reason"},
}


def official_event_types() -> set[str]:
    """Every ``type`` of the official server event union."""
    union = typing.get_args(RealtimeServerEvent)[0]
    names: set[str] = set()
    for model in typing.get_args(union):
        names.update(typing.get_args(model.model_fields["type"].annotation))
    return names


def extras(value: Any, path: str = "") -> set[str]:
    """``path.field`` of every field a validated model kept as an extra, recursively."""
    found: set[str] = set()
    if isinstance(value, pydantic.BaseModel):
        for name in value.model_extra or {}:
            found.add(f"{path}.{name}" if path else name)
        for name in type(value).model_fields:
            found |= extras(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list):
        for item in value:
            found |= extras(item, path)
    return found


def unexpected_extras(event: dict[str, Any]) -> set[str]:
    parsed = SERVER_EVENTS.validate_python(event, strict=True)
    unexpected = set()
    for extra in extras(parsed):
        where, _, name = extra.rpartition(".")
        if name not in ADDED_FIELDS.get(where, set()):
            unexpected.add(extra)
    return unexpected


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def keep(self, client: RawClient) -> None:
        self.events.extend(client.events)


async def exercise_everything(rec: Recorder) -> None:
    """Drive the gateway through every kind of server event and response ending."""
    async with running_gateway(SimEngine(step_ms=2, response_tokens=16)) as gw:
        async with RawClient.connect(gw.ws_url) as c:
            await c.send({"type": "session.update", "session": {"temperature": 0.5}})
            await c.recv_until("session.updated")
            user = await c.say("Hello")
            await respond_all(c, metadata={"turn": "1"})  # completed, text
            await respond_all(c, max_output_tokens=2)  # incomplete
            await c.send({"type": "response.create"})  # cancelled by the client
            await c.recv_until("response.output_text.delta")
            await c.send({"type": "response.cancel"})
            await c.recv_until("response.done")
            await set_tools(c, [WEATHER, TIME])
            await c.say("get_weather please")
            events = await respond_all(c)  # a function call
            call = next(e["item"] for e in events if e["type"] == "response.output_item.done")
            await c.send(output_item(call["call_id"], "Sunny"))
            await c.recv_until("conversation.item.done")
            await respond_all(c)
            await respond_all(c, conversation="none", tool_choice="required")
            await c.send({"type": "conversation.item.retrieve", "item_id": call["id"]})
            await c.recv_until("conversation.item.retrieved")
            await c.send({"type": "conversation.item.delete", "item_id": user["item"]["id"]})
            await c.recv_until("conversation.item.deleted")
            for bad in (
                {"type": "nope"},
                {"type": "session.update", "session": {"tools": [{"name": "a b"}]}},
                {"type": "conversation.item.truncate", "item_id": "x"},
                {"type": "response.cancel"},
            ):
                await c.send(bad)
                await c.recv_until("error")
            rec.keep(c)
        async with RawClient.connect(gw.ws_url) as c:  # cancelled by shutdown
            await c.send({"type": "response.create"})
            await c.recv_until("response.output_text.delta")
            stopping = asyncio.create_task(gw.gateway.stop())
            await c.recv_until("response.done")
            rec.keep(c)
            await stopping
    async with (
        running_gateway(SimEngine(step_ms=2, fail_after=2)) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await respond_all(c)  # failed, with its error event
        rec.keep(c)
    async with (
        running_gateway(ScriptedEngine(text_then_two_calls())) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await set_tools(c, [WEATHER, TIME])
        await respond_all(c)  # text and two calls
        rec.keep(c)
    async with (
        running_gateway(SimEngine(step_ms=50), max_running=1, max_queued=0) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await c.send({"type": "response.create", "response": {"conversation": "none"}})
        await c.send({"type": "response.create", "response": {"conversation": "none"}})
        await c.recv_until("error")  # overloaded, then rate_limits.updated
        await c.recv_until("rate_limits.updated")
        await c.recv_until("response.done")
        rec.keep(c)


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, Any]]:
    rec = Recorder()
    asyncio.run(exercise_everything(rec))
    return rec.events


def test_every_event_validates_strictly(recorded: list[dict[str, Any]]) -> None:
    problems = {}
    for event in recorded:
        try:
            unexpected = unexpected_extras(event)
        except pydantic.ValidationError as exc:
            problems[event["type"]] = str(exc)
        else:
            if unexpected:
                problems[event["type"]] = f"fields the types do not have: {sorted(unexpected)}"
    assert not problems, problems


def test_every_event_type_and_ending_was_exercised(recorded: list[dict[str, Any]]) -> None:
    seen = {e["type"] for e in recorded}
    # Every official event type named anywhere in the gateway's code is one it may send.
    source = "\n".join(
        path.read_text()
        for folder in ("gateway", "sessions")
        for path in (ROOT / folder).rglob("*.py")
    )
    named = {t for t in official_event_types() if re.search(rf'"{re.escape(t)}"', source)}
    assert named - seen == set()
    assert {
        "session.created",
        "session.updated",
        "conversation.item.added",
        "conversation.item.done",
        "conversation.item.retrieved",
        "conversation.item.deleted",
        "response.created",
        "rate_limits.updated",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.done",
        "error",
    } <= seen
    endings = {
        (e["response"]["status"], str(e["response"]["status_details"]))
        for e in recorded
        if e["type"] == "response.done"
    }
    assert {status for status, _ in endings} == {"completed", "incomplete", "cancelled", "failed"}
    assert any("server_shutdown" in details for _, details in endings)
    assert any("client_cancelled" in details for _, details in endings)
    items = {
        item["type"]
        for e in recorded
        if e["type"] == "response.done"
        for item in e["response"]["output"]
    }
    assert items == {"message", "function_call"}


@pytest.mark.parametrize("reason", typing.get_args(CancelReason))
def test_every_cancel_reason_validates(reason: CancelReason) -> None:
    # A dropped socket's reason is seen only by a client that resumes; check it here.
    details = status_details(Outcome("cancelled", "", Usage(0, 0), cancel_reason=reason))
    RealtimeResponseStatus.__pydantic_validator__.validate_python(details, strict=True)
    failed = Outcome("failed", "", Usage(0, 0), EngineError("engine_error", "boom"))
    RealtimeResponseStatus.__pydantic_validator__.validate_python(
        status_details(failed), strict=True
    )


def test_the_types_keep_added_fields_and_catch_wrong_ones() -> None:
    # The check above can fail: a wrong shape is refused, an extra field is reported.
    event = {"type": "rate_limits.updated", "event_id": "e", "rate_limits": []}
    assert unexpected_extras({**event, "sequence_number": 7}) == set()
    assert unexpected_extras({**event, "sequence_numbr": 7}) == {"sequence_numbr"}
    with pytest.raises(pydantic.ValidationError):
        SERVER_EVENTS.validate_python({**event, "rate_limits": [{"name": "gpus"}]}, strict=True)
    with pytest.raises(pydantic.ValidationError):
        SERVER_EVENTS.validate_python(
            {
                "type": "response.done",
                "event_id": "e",
                "response": {"status_details": {"type": "cancelled", "reason": "server_shutdown"}},
            },
            strict=True,
        )
