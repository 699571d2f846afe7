"""The session actor with no socket: feed it events, read what it puts in its outbox."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.engines.sim import SimEngine
from gateway.scheduler import Scheduler
from sessions.core import Session, SessionLimits
from sessions.outbox import CloseRequest, Outbox
from sessions.realtime import codec as rt
from sessions.realtime.dialect import RealtimeDialect, RealtimeFraming
from tests.support.wires import MemoryWire


class Harness:
    """A session wired to a real scheduler and sim engine; events decoded from its outbox."""

    def __init__(self, session: Session, engine: SimEngine) -> None:
        self.session = session
        self.engine = engine
        self.wire = MemoryWire()
        session.outbox.attach(self.wire)
        self.task = asyncio.get_running_loop().create_task(session.run())

    async def send(self, event: dict[str, Any]) -> None:
        await self.session.deliver(rt.decode(orjson.dumps(event).decode()))

    async def next(self) -> dict[str, Any]:
        event = await self.wire.next()
        assert not isinstance(event, CloseRequest), event
        return event

    async def until(self, event_type: str) -> list[dict[str, Any]]:
        events = []
        while not events or events[-1]["type"] != event_type:
            events.append(await self.next())
        return events


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    engine = SimEngine(step_ms=1, response_tokens=12)
    await engine.start()
    scheduler = Scheduler(engine, max_running=8, max_queued=8)
    session = Session(
        scheduler,
        Outbox(RealtimeFraming()),
        RealtimeDialect(max_parallel_out_of_band=2),
    )
    harness = Harness(session, engine)
    assert (await harness.next())["type"] == "session.created"
    yield harness
    session.close()
    await asyncio.wait_for(harness.task, 5)
    await scheduler.close()
    await engine.close()


def user(text: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        },
    }


async def test_a_response_emits_the_realtime_sequence_and_is_stored(h: Harness) -> None:
    await h.send(user("Hello"))
    added, done = await h.next(), await h.next()
    assert (added["type"], done["type"]) == ("conversation.item.added", "conversation.item.done")
    await h.send({"type": "response.create"})
    events = await h.until("response.done")
    types = [e["type"] for e in events]
    n = types.count("response.output_text.delta")
    assert types == [
        "response.created",
        "rate_limits.updated",
        "response.output_item.added",
        "conversation.item.added",  # the assistant item joins the conversation...
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",  # ...and is finished there before the response is done
        "response.done",
    ]
    assert events[3]["previous_item_id"] == added["item"]["id"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    text_done = events[types.index("response.output_text.done")]["text"]
    assert deltas == text_done == events[-2]["item"]["content"][0]["text"]
    response = events[-1]["response"]
    assert response["status"] == "completed"
    assert response["usage"]["output_tokens"] == 12
    stored = [m.text for m in h.session.conversation.to_messages()]
    assert stored == ["Hello", deltas]


async def test_second_turn_sees_the_first(h: Harness) -> None:
    await h.send(user("one"))
    await h.send({"type": "response.create"})
    first = (await h.until("response.done"))[-1]["response"]["usage"]["input_tokens"]
    await h.send(user("two"))
    await h.send({"type": "response.create"})
    second = (await h.until("response.done"))[-1]["response"]["usage"]["input_tokens"]
    assert second > first + 12  # the first answer and the second question are in the prompt


async def test_one_active_response_per_conversation(h: Harness) -> None:
    await h.send({"type": "response.create"})
    await h.send({"type": "response.create", "event_id": "again"})
    events = await h.until("error")
    assert events[-1]["error"]["code"] == "conversation_already_has_active_response"
    assert events[-1]["error"]["event_id"] == "again"
    await h.until("response.done")


async def test_cancel_keeps_the_partial_answer_as_incomplete(h: Harness) -> None:
    h.engine.step_s = 0.01
    await h.send(user("Tell me a story"))
    await h.send({"type": "response.create"})
    events = await h.until("response.output_text.delta")
    await h.send({"type": "response.cancel"})
    events += await h.until("response.done")
    sent = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"]["reason"] == "client_cancelled"
    item = h.session.conversation.get(done["output"][0]["id"])
    assert item is not None and item.status == "incomplete" and item.text == sent
    # The prompt's tokens are reported although the answer was cut short.
    assert done["usage"]["input_tokens"] > 0 and done["usage"]["output_tokens"] >= 1
    generated = h.engine.tokens_generated
    await asyncio.sleep(0.03)  # three engine steps: the aborted stream must be gone
    assert h.engine.active == 0 and h.engine.tokens_generated == generated


async def test_cancel_with_nothing_active_is_an_error_and_harmless(h: Harness) -> None:
    await h.send({"type": "response.cancel", "event_id": "c1"})
    error = await h.next()
    assert error["error"]["code"] == "response_cancel_not_active"
    await h.send({"type": "response.create"})
    assert (await h.until("response.done"))[-1]["response"]["status"] == "completed"


async def test_out_of_band_responses_run_in_parallel_up_to_the_limit(h: Harness) -> None:
    oob = {"type": "response.create", "response": {"conversation": "none", "metadata": {"n": "1"}}}
    for _ in range(3):
        await h.send(oob)
    await h.send({"type": "response.create"})  # the conversation's own may still run
    events = await h.until("error")
    assert events[-1]["error"]["code"] == "too_many_parallel_responses"
    done = []
    while len(done) < 3:
        event = await h.next()
        if event["type"] == "response.done":
            done.append(event["response"])
    assert sorted(r["conversation_id"] is None for r in done) == [False, True, True]
    assert all(r["metadata"] == {"n": "1"} for r in done if r["conversation_id"] is None)
    assert len(h.session.conversation) == 1  # only the in-conversation answer was stored


async def test_item_delete_retrieve_and_unknown_ids(h: Harness) -> None:
    await h.send(user("keep me"))
    item = (await h.until("conversation.item.done"))[-1]["item"]
    await h.send({"type": "conversation.item.retrieve", "item_id": item["id"]})
    assert (await h.next())["item"]["content"][0]["text"] == "keep me"
    await h.send({"type": "conversation.item.delete", "item_id": "nope", "event_id": "d"})
    error = (await h.next())["error"]
    assert (error["code"], error["param"], error["event_id"]) == ("item_not_found", "item_id", "d")
    await h.send({"type": "conversation.item.delete", "item_id": item["id"]})
    assert (await h.next())["type"] == "conversation.item.deleted"
    assert len(h.session.conversation) == 0


async def test_session_update_changes_later_responses(h: Harness) -> None:
    await h.send(
        {"type": "session.update", "session": {"instructions": "Be terse.", "max_output_tokens": 3}}
    )
    updated = await h.next()
    assert updated["session"]["instructions"] == "Be terse."
    await h.send({"type": "response.create"})
    done = (await h.until("response.done"))[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert done["usage"]["output_tokens"] == 3


async def test_closing_cancels_work_and_frees_the_engine(h: Harness) -> None:
    h.engine.step_s = 0.01
    await h.send({"type": "response.create"})
    await h.until("response.output_text.delta")
    h.session.close()
    await asyncio.wait_for(h.task, 1)  # ends at once: the engine confirms later
    # The engine lets go of the request at its next step, and with it the slot.
    async with asyncio.timeout(0.5):
        while h.session.scheduler.draining or h.engine.active:
            await asyncio.sleep(0.002)


async def test_engine_failure_ends_failed_with_an_error() -> None:
    engine = SimEngine(step_ms=1, response_tokens=12, fail_after=3)
    await engine.start()
    scheduler = Scheduler(engine, max_running=2, max_queued=2)
    h = Harness(Session(scheduler, Outbox(RealtimeFraming()), RealtimeDialect()), engine)
    await h.next()
    await h.send({"type": "response.create"})
    events = await h.until("response.done")
    assert any(e["type"] == "error" for e in events)
    done = events[-1]["response"]
    assert done["status"] == "failed"
    assert done["status_details"]["error"]["code"] == "engine_error"
    assert len(done["output"][0]["content"][0]["text"].split()) == 3
    await h.send({"type": "conversation.item.retrieve", "item_id": "x"})  # still serving
    assert (await h.next())["error"]["code"] == "item_not_found"
    h.session.close()
    await h.task
    await engine.close()


async def test_the_conversation_is_bounded_by_items_and_text() -> None:
    engine = SimEngine(step_ms=0, response_tokens=2)
    await engine.start()
    scheduler = Scheduler(engine, max_running=2, max_queued=2)
    limits = SessionLimits(max_items=3, max_conversation_chars=100)
    h = Harness(
        Session(scheduler, Outbox(RealtimeFraming()), RealtimeDialect(), limits=limits), engine
    )
    await h.next()
    await h.send(user("x" * 101))
    assert (await h.next())["error"]["code"] == "conversation_full"
    for _ in range(3):  # answers count too: three turns fill the three items
        await h.send({"type": "response.create"})
        await h.until("response.done")
    await h.send({"type": "response.create", "event_id": "fourth"})
    error = (await h.next())["error"]
    assert (error["code"], error["event_id"]) == ("conversation_full", "fourth")
    assert len(h.session.conversation) == 3
    # Out-of-band responses store nothing, so they still run.
    await h.send({"type": "response.create", "response": {"conversation": "none"}})
    assert (await h.until("response.done"))[-1]["response"]["status"] == "completed"
    h.session.close()
    await h.task
    await engine.close()


async def test_events_after_close_are_dropped_not_waited_on(h: Harness) -> None:
    h.session.close()
    await asyncio.wait_for(h.task, 1)
    # A reader still delivering a burst after the actor ended must never block.
    async with asyncio.timeout(1):
        for _ in range(10 * h.session.limits.max_unhandled_events):
            await h.send({"type": "response.cancel"})
