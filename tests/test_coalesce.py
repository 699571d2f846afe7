"""One write per socket per batch of work (gateway/transport/coalesce.py): the frames one
engine step makes for one connection leave in one transport write, in order, in the same
loop turn; outside a batch every write goes at once."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.engines.sim import SimEngine
from gateway.transport.coalesce import CoalescedWrites, WriteBatch
from tests.support.harness import running_gateway
from tests.support.responses_harness import ResponsesClient


class RecordingTransport(asyncio.WriteTransport):
    """A transport that keeps what each write call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing


def test_outside_a_batch_each_write_goes_at_once() -> None:
    transport = RecordingTransport()
    writes = CoalescedWrites(transport, WriteBatch())
    writes.write(b"a")
    writes.write(b"b")
    assert transport.writes == [b"a", b"b"]


def test_a_batch_joins_each_transports_writes_in_order_when_the_outermost_closes() -> None:
    batch = WriteBatch()
    one, two = RecordingTransport(), RecordingTransport()
    first, second = CoalescedWrites(one, batch), CoalescedWrites(two, batch)
    with batch:
        first.write(b"1a")
        second.write(b"2a")
        with batch:
            first.write(b"1b")
        assert one.writes == [] and two.writes == []  # the inner batch is not the end
        first.write(b"1c")
    assert one.writes == [b"1a1b1c"]
    assert two.writes == [b"2a"]
    assert (batch.writes, batch.joined) == (2, 4)
    first.write(b"after")  # the batch is over: at once again
    assert one.writes == [b"1a1b1c", b"after"]
    assert (batch.writes, batch.joined) == (3, 5)


def test_a_transport_that_closed_during_the_batch_gets_nothing() -> None:
    batch, transport = WriteBatch(), RecordingTransport()
    writes = CoalescedWrites(transport, batch)
    with batch:
        writes.write(b"lost")
        transport.closing = True
    assert transport.writes == []


def test_an_exception_in_the_batch_still_writes_what_it_held() -> None:
    batch, transport = WriteBatch(), RecordingTransport()
    writes = CoalescedWrites(transport, batch)
    try:
        with batch:
            writes.write(b"held")
            raise RuntimeError("a bug in the fan-out")
    except RuntimeError:
        pass
    assert transport.writes == [b"held"]
    assert not batch.open


async def test_the_deltas_of_parallel_lanes_in_one_step_leave_in_one_write() -> None:
    # Four lanes of one Responses connection stream side by side: every 20 ms engine step
    # makes a delta for each, and the four leave in one write (the text is unchanged).
    engine = SimEngine(step_ms=20, response_tokens=12)
    async with running_gateway(engine) as gw:
        url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
        async with ResponsesClient.connect(url) as c:
            lanes = ["a", "b", "c", "d"]
            for lane in lanes:
                await c.create(input=f"lane {lane}", stream_id=lane)
            batch = gw.gateway.write_batch
            before_writes, before_joined = batch.writes, batch.joined
            turns = [await c.collect(lane) for lane in lanes]
            for turn in turns:
                assert turn.text == turn.output_text
            writes, joined = batch.writes - before_writes, batch.joined - before_joined
    deltas = [e["stream_id"] for e in c.events if e["type"] == "response.output_text.delta"]
    assert set(deltas) == set(lanes)
    # Each step's four deltas in one write (the closing events of a lane join its last
    # step's): about a write per step, never one per frame.
    assert joined >= len(deltas)
    assert writes <= joined / 3, (writes, joined, len(deltas))
