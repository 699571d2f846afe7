"""The outbox alone: numbering, the direct path, lossless merging while the socket pushes
back, replay, and hard limits."""

from __future__ import annotations

import asyncio
from typing import Any

from sessions.outbox import CloseRequest, Outbox, ReplayBudget
from sessions.realtime.dialect import RealtimeFraming
from tests.support.wires import MemoryWire


async def settle(wire: MemoryWire) -> list[dict[str, Any] | CloseRequest]:
    """Let the outbox's writer task (if any) run, then take what reached the wire."""
    for _ in range(5):
        await asyncio.sleep(0)
    return wire.drain()


def deltas(events: list[dict[str, Any] | CloseRequest]) -> list[tuple[str, str]]:
    return [(e["response_id"], e["delta"]) for e in events if isinstance(e, dict) and "delta" in e]


async def test_with_room_every_event_is_written_at_once_and_numbered() -> None:
    outbox, wire = Outbox(RealtimeFraming()), MemoryWire()
    outbox.attach(wire)
    outbox.put({"type": "session.created"})
    outbox.put_delta("r1", "i1", "Hel")
    outbox.put_delta("r1", "i1", "lo")
    # Written from the caller's own stack: no task had to run.
    events = wire.drain()
    assert [e["sequence_number"] for e in events if isinstance(e, dict)] == [1, 2, 3]
    assert deltas(events) == [("r1", "Hel"), ("r1", "lo")]
    assert len({e["event_id"] for e in events if isinstance(e, dict)}) == 3
    assert outbox.last_sequence_number == 3


async def test_event_ids_differ_across_sessions() -> None:
    wires = [MemoryWire() for _ in range(50)]
    for wire in wires:
        outbox = Outbox(RealtimeFraming())
        outbox.attach(wire)
        outbox.put({"type": "x"})
    ids = {e["event_id"] for w in wires for e in w.drain() if isinstance(e, dict)}
    assert len(ids) == 50


async def test_deltas_merge_per_response_while_the_socket_pushes_back() -> None:
    outbox, wire = Outbox(RealtimeFraming()), MemoryWire(room=False)
    outbox.attach(wire)
    outbox.put_delta("r1", "i1", "Hel")
    outbox.put_delta("r2", "i2", "안")
    outbox.put_delta("r1", "i1", "lo")
    outbox.put_delta("r2", "i2", "녕 🙂")
    outbox.put({"type": "response.output_text.done", "response_id": "r1"})
    outbox.put_delta("r2", "i2", "!")  # after another event: a new frame
    assert await settle(wire) == []
    wire.set_room(True)
    events = await settle(wire)
    assert deltas(events) == [("r1", "Hello"), ("r2", "안녕 🙂"), ("r2", "!")]
    assert [e["sequence_number"] for e in events if isinstance(e, dict)] == [1, 2, 3, 4]
    assert outbox.stats.deltas_in == 5 and outbox.stats.delta_frames_out == 3
    assert outbox.pending_bytes == 0


async def test_token_ids_go_with_the_frame_that_carries_their_text() -> None:
    """A session store logs them beside the frame (a TensorRT-LLM continuation's): merged
    text, merged ids; frames without any are not told."""
    outbox, wire = Outbox(RealtimeFraming()), MemoryWire()
    told: list[tuple[int, tuple[int, ...]]] = []
    outbox.on_token_ids = lambda seq, ids: told.append((seq, ids))
    outbox.attach(wire)
    outbox.put_delta("r1", "i1", "Hel", (7,))
    wire.set_room(False)
    outbox.put_delta("r1", "i1", "lo", (8,))
    outbox.put_delta("r1", "i1", " you", (9, 10))
    outbox.put({"type": "response.output_text.done", "response_id": "r1"})
    outbox.put_delta("r1", "i1", "!")
    wire.set_room(True)
    events = wire.drain() + await settle(wire)
    assert deltas(events) == [("r1", "Hel"), ("r1", "lo you"), ("r1", "!")]
    assert told == [(1, (7,)), (2, (8, 9, 10))]


async def test_many_merged_pieces_stay_one_string_and_lose_nothing() -> None:
    outbox, wire = Outbox(RealtimeFraming()), MemoryWire(room=False)
    outbox.attach(wire)
    pieces = [f"{i} " for i in range(10_000)]
    for piece in pieces:
        outbox.put_delta("r", "i", piece)
    assert len(outbox) == 1
    assert outbox.pending_bytes < 2 * len("".join(pieces)) + 64 * 256
    wire.set_room(True)
    (event,) = await settle(wire)
    assert isinstance(event, dict) and event["delta"] == "".join(pieces)
    assert outbox.pending_bytes == 0


async def test_without_coalescing_every_delta_is_a_frame() -> None:
    outbox, wire = Outbox(RealtimeFraming(), coalesce=False), MemoryWire(room=False)
    outbox.attach(wire)
    for piece in "abc":
        outbox.put_delta("r", "i", piece)
    wire.set_room(True)
    assert [e["delta"] for e in await settle(wire) if isinstance(e, dict)] == ["a", "b", "c"]


async def test_too_much_pending_is_dropped_and_the_socket_closed_with_1008() -> None:
    outbox, wire = Outbox(RealtimeFraming(), max_pending=10), MemoryWire(room=False)
    overflowed: list[bool] = []
    outbox.on_overflow = lambda: overflowed.append(True)
    outbox.attach(wire)
    for n in range(50):  # e.g. a flood of errors to a client that reads nothing
        outbox.put({"type": "error", "n": n})
    assert len(outbox) == 0 and outbox.lost and overflowed == [True]
    assert wire.closed == CloseRequest(1008, "client is not reading its events")
    outbox.put({"type": "late"})  # ignored once closed
    assert len(outbox) == 0


async def test_close_sends_what_is_pending_then_closes() -> None:
    outbox, wire = Outbox(RealtimeFraming()), MemoryWire(room=False)
    outbox.attach(wire)
    outbox.put({"type": "response.done"})
    outbox.close(1001, "bye")
    wire.set_room(True)
    events = await settle(wire)
    assert isinstance(events[0], dict) and events[0]["type"] == "response.done"
    assert events[1] == CloseRequest(1001, "bye")


async def test_events_wait_for_a_socket_then_replay_keeps_their_numbers() -> None:
    outbox = Outbox(RealtimeFraming())
    outbox.put({"type": "session.created"})  # no socket yet: pending
    first = MemoryWire()
    outbox.attach(first)
    outbox.put_delta("r", "i", "a")
    outbox.put_delta("r", "i", "b")
    assert [e["sequence_number"] for e in first.drain() if isinstance(e, dict)] == [1, 2, 3]
    outbox.detach(first)
    outbox.put_delta("r", "i", "c")  # while detached: pending, not numbered yet
    outbox.put_delta("r", "i", "d")
    replay = outbox.replay_after(1)
    assert replay is not None and len(replay) == 2
    second = MemoryWire()
    outbox.attach(second, replay)
    events = await settle(second)
    assert [e["sequence_number"] for e in events if isinstance(e, dict)] == [2, 3, 4]
    assert "".join(d for _, d in deltas(events)) == "abcd"
    assert outbox.replay_after(outbox.last_sequence_number) == []


async def test_replay_is_bounded_and_says_when_it_cannot_cover_a_gap() -> None:
    budget = ReplayBudget(10_000)
    outbox, wire = Outbox(RealtimeFraming(), replay_bytes=2_000, replay_budget=budget), MemoryWire()
    outbox.attach(wire)
    for n in range(100):
        outbox.put({"type": "x", "n": n})
    assert budget.used <= 2_000
    assert outbox.replay_after(0) is None  # the first events are gone: a gap
    assert outbox.replay_after(99) is not None
    assert outbox.replay_after(101) is None  # never sent
    outbox.release()
    assert budget.used == 0


async def test_the_shared_budget_bounds_all_sessions_together() -> None:
    budget = ReplayBudget(5_000)
    outboxes = [
        Outbox(RealtimeFraming(), replay_bytes=4_000, replay_budget=budget) for _ in range(10)
    ]
    for outbox in outboxes:
        outbox.attach(MemoryWire())
        for n in range(50):
            outbox.put({"type": "x", "n": n})
    assert budget.used <= 5_000


async def test_attaching_a_second_socket_closes_the_first_with_4001() -> None:
    outbox, first, second = Outbox(RealtimeFraming()), MemoryWire(), MemoryWire()
    outbox.attach(first)
    outbox.attach(second)
    assert first.closed is not None and first.closed.code == 4001
    outbox.put({"type": "x"})
    assert len(second.drain()) == 1 and first.drain()[-1] == first.closed


async def test_a_second_resume_sends_nothing_twice() -> None:
    """Found in review: a replay still pending for a socket that dropped was sent again,
    beside the next resume's own replay, repeating sequence numbers."""
    outbox, first = Outbox(RealtimeFraming()), MemoryWire()
    outbox.attach(first)
    for n in range(5):
        outbox.put({"type": "x", "n": n})  # numbered 1..5
    outbox.detach(first)
    blocked = MemoryWire(room=False)  # the first resume's socket pushes back...
    outbox.attach(blocked, outbox.replay_after(2) or [])
    await settle(blocked)
    outbox.detach(blocked)  # ...and drops before it sent anything
    last = MemoryWire()
    outbox.attach(last, outbox.replay_after(2) or [])
    events = await settle(last)
    assert [e["sequence_number"] for e in events if isinstance(e, dict)] == [3, 4, 5]


async def test_a_resume_does_not_wait_for_a_writer_stuck_on_the_old_socket() -> None:
    outbox, old = Outbox(RealtimeFraming()), MemoryWire(room=False)
    outbox.put({"type": "session.created"})  # 1
    outbox.attach(old)
    for n in range(3):
        outbox.put({"type": "x", "n": n})  # pending: the old socket has no room
    await settle(old)  # its writer took 1 and waits on the old socket
    new = MemoryWire()
    outbox.attach(new, outbox.replay_after(1) or [])  # the client saw only 1
    events = await settle(new)  # at once, not after the old socket's close times out
    assert [e["sequence_number"] for e in events if isinstance(e, dict)] == [2, 3, 4]
    assert old.closed is not None and old.closed.code == 4001


async def test_replayed_frames_do_not_count_against_the_pending_cap() -> None:
    outbox, first = Outbox(RealtimeFraming(), max_pending=10), MemoryWire()
    outbox.attach(first)
    for n in range(40):
        outbox.put({"type": "x", "n": n})
    outbox.detach(first)
    blocked = MemoryWire(room=False)
    outbox.attach(blocked, outbox.replay_after(5) or [])  # 35 frames to send again
    outbox.put({"type": "y"})
    assert not outbox.lost and len(outbox) == 1
