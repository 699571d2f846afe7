"""The outbox alone: lossless merging while the writer is behind, and hard limits."""

from __future__ import annotations

import orjson

from sessions.outbox import CloseRequest, Outbox


async def drain(outbox: Outbox) -> list[dict[str, object] | CloseRequest]:
    out: list[dict[str, object] | CloseRequest] = []
    while len(outbox):
        frame = await outbox.get()
        out.append(frame if isinstance(frame, CloseRequest) else orjson.loads(frame[0]))
    return out


async def test_deltas_merge_per_response_and_keep_their_order() -> None:
    outbox = Outbox()
    outbox.put_delta("r1", "i1", "Hel")
    outbox.put_delta("r2", "i2", "안")
    outbox.put_delta("r1", "i1", "lo")
    outbox.put_delta("r2", "i2", "녕 🙂")
    outbox.put({"type": "response.output_text.done", "response_id": "r1"})
    outbox.put_delta("r2", "i2", "!")  # after another event: a new frame
    events = await drain(outbox)
    deltas = [
        (e["response_id"], e["delta"]) for e in events if isinstance(e, dict) and "delta" in e
    ]
    assert deltas == [("r1", "Hello"), ("r2", "안녕 🙂"), ("r2", "!")]
    assert outbox.stats.deltas_in == 5 and outbox.stats.delta_frames_out == 3


async def test_many_merged_pieces_stay_one_string_and_lose_nothing() -> None:
    outbox = Outbox()
    pieces = [f"{i} " for i in range(10_000)]
    for piece in pieces:
        outbox.put_delta("r", "i", piece)
    assert len(outbox) == 1
    assert outbox.pending_bytes < 2 * len("".join(pieces)) + 64 * 256
    (event,) = await drain(outbox)
    assert isinstance(event, dict) and event["delta"] == "".join(pieces)
    assert outbox.pending_bytes == 0


async def test_without_coalescing_every_delta_is_a_frame() -> None:
    outbox = Outbox(coalesce=False)
    for piece in "abc":
        outbox.put_delta("r", "i", piece)
    assert [e["delta"] for e in await drain(outbox) if isinstance(e, dict)] == ["a", "b", "c"]


async def test_too_much_pending_closes_with_1008_instead_of_growing() -> None:
    outbox = Outbox(max_pending=10)
    for n in range(50):  # e.g. a flood of errors to a client that reads nothing
        outbox.put({"type": "error", "n": n})
    assert len(outbox) == 1
    (close,) = await drain(outbox)
    assert close == CloseRequest(1008, "client is not reading its events")
    outbox.put({"type": "late"})  # ignored once closed
    assert len(outbox) == 0
