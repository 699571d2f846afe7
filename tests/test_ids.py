"""Ids: a client can neither predict the server's ids nor collide with them (issue 16, defect 1)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from gateway.engines.sim import SimEngine
from sessions import codec
from sessions.conversation import Conversation, Item
from sessions.errors import DuplicateItemId
from tests.support.harness import RawClient, running_gateway


def message(text: str, item_id: str | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    if item_id is not None:
        item["id"] = item_id
    return {"type": "conversation.item.create", "item": item}


def predicted_ids(session_id: str, event_id: str) -> list[str]:
    """The attack of the issue: the process tag from ``session.id``, the counter from the
    last ``event_id``, and the ten ids the server was about to make. With unguessable ids
    the guess is simply wrong; the attack must then change nothing."""
    tag = session_id.split("_")[1]
    try:
        counter = int(event_id.rsplit("_", 1)[1], 16)
    except ValueError:
        counter = 0
    return [f"item_{tag}_{counter + 20 + j:x}" for j in range(1, 11)]


async def test_a_client_cannot_take_the_id_of_the_next_answer() -> None:
    async with (
        running_gateway(SimEngine(step_ms=1, response_tokens=8)) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        session_id = c.events[0]["session"]["id"]
        done = await c.say("first")
        guesses = predicted_ids(session_id, done["event_id"])
        for j, guess in enumerate(guesses):
            await c.send(message(f"mine {j}", guess))
            await c.recv_until("conversation.item.done")
        await c.send({"type": "response.create"})
        events = [await c.recv()]
        while events[-1]["type"] not in ("response.done", "error"):
            events.append(await c.recv())
        if events[-1]["type"] == "error":  # anything after it would be the bug
            with pytest.raises(TimeoutError):
                events.append(await c.recv(timeout=0.3))
        kinds = [e["type"] for e in events]
        assert "error" not in kinds, events
        assert kinds[0] == "response.created"
        answer_id = events[-1]["response"]["output"][0]["id"]
        assert answer_id not in guesses
        for j, guess in enumerate(guesses):  # the client's items are untouched
            await c.send({"type": "conversation.item.retrieve", "item_id": guess})
            item = (await c.recv_until("conversation.item.retrieved"))["item"]
            assert item["content"][0]["text"] == f"mine {j}"


def test_server_ids_are_not_predictable() -> None:
    ids = [codec.new_id("item") for _ in range(1000)]
    assert len(set(ids)) == 1000
    suffixes = [i.removeprefix("item_") for i in ids]
    assert all(len(s) >= 16 for s in suffixes)  # at least 64 random bits each
    assert not any(a[:8] == b[:8] for a, b in itertools.pairwise(suffixes))
    # Event ids (unique per session and across sessions) are tested with the outbox.


def test_every_insert_refuses_a_taken_id() -> None:
    conversation = Conversation()
    conversation.insert(Item("a", "user", "hello"))
    with pytest.raises(DuplicateItemId):
        conversation.insert(Item("a", "assistant", "", "in_progress"))
    assert conversation.get("a") == Item("a", "user", "hello")
    assert len(conversation) == 1 and conversation.chars == 5


async def test_a_collision_costs_one_error_and_starts_no_response(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Even if the server's next item id were taken, one response.create gets one outcome."""
    async with (
        running_gateway(SimEngine(step_ms=1, response_tokens=8)) as gw,
        RawClient.connect(gw.ws_url) as c,
    ):
        await c.say("hello", role="user")
        await c.send(message("taken", "item_taken"))
        await c.recv_until("conversation.item.done")
        made = {"resp": iter(["resp_1", "resp_2"]), "item": iter(["item_taken", "item_free"])}
        monkeypatch.setattr(codec, "new_id", lambda prefix: next(made[prefix]))
        await c.send({"type": "response.create"})
        first = await c.recv()
        assert first["type"] in ("error", "response.created"), first
        if first["type"] == "error":
            with pytest.raises(TimeoutError):  # and nothing of a response after it
                await c.recv(timeout=0.3)
            done = (await c.respond()).terminal
        else:
            done = await c.recv_until("response.done")
            assert "error" not in [e["type"] for e in c.events]
        assert done["response"]["status"] == "completed"
        assert done["response"]["output"][0]["id"] != "item_taken"
        await c.send({"type": "conversation.item.retrieve", "item_id": "item_taken"})
        item = (await c.recv_until("conversation.item.retrieved"))["item"]
        assert item["content"][0]["text"] == "taken"
