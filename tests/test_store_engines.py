"""The session store's ``kill -9`` and rolling-restart scenarios on the real CPU engines:
the bundled model in each gateway (``--engine llamacpp``) and a pool of two real llama.cpp
servers behind both gateways (``--engine upstream``), with a real redis-server.

The gateway that takes a session over continues its answer from the text already sent
(llama.cpp prefills the open assistant turn; an upstream llama.cpp server is sent that
text as a final assistant message to continue), so the client sees one answer: events
numbered on without a gap, the deltas joined equal to the final text, ``usage`` for the
whole answer, never ``failed`` with ``gateway_restarted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import llama_server
from tests.support.gateway_processes import RollingPair, gateways
from tests.support.llama_server import LlamaServer
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401
from tests.test_store import Chat
from tests.test_upstream import all_idle

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None or not llama_server.model_available(),
    reason="needs xllamacpp and the bundled model",
)

MAX_TOKENS = 80  # greedy: each answer runs to this limit, long enough to be cut
STORY = "Write a long story about a dragon who learns to bake bread."


@pytest.fixture(scope="module")
def upstreams() -> Iterator[list[LlamaServer]]:
    """Two llama.cpp servers, shared by both gateways of each upstream case."""
    started = [llama_server.start(slots=2) for _ in range(2)]
    yield started
    for server in started:
        server.stop()


@dataclass(frozen=True)
class Engine:
    flags: tuple[str, ...]  # of both gateways
    upstreams: list[LlamaServer]  # the servers behind them (none: in-process)

    async def idle(self) -> None:
        """Until no upstream generates: nothing a dead or drained gateway started goes on."""
        async with asyncio.timeout(20):
            while not await all_idle(self.upstreams):
                await asyncio.sleep(0.1)


@pytest.fixture(params=["llamacpp", "upstream"])
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param == "llamacpp":
        flags = ("--engine", "llamacpp", "--threads", "1", "--slots", "2", "--ctx", "1024")
        return Engine(flags, [])
    servers: list[LlamaServer] = request.getfixturevalue("upstreams")
    urls = [f"--upstream={s.url}" for s in servers]
    return Engine(("--engine", "upstream", *urls, "--upstream-health-interval", "0.2"), servers)


async def greedy(chat: Chat) -> None:
    session = {"type": "realtime", "temperature": 0, "max_output_tokens": MAX_TOKENS}
    await chat.send({"type": "session.update", "session": session})
    await chat.until("session.updated")


async def until_closed(chat: Chat) -> int | None:
    """What was on its way, then the socket's close code."""
    with contextlib.suppress(Exception):
        while True:
            await chat.recv()
    assert chat.ws is not None
    return chat.ws.close_code


def check_answers(chat: Chat, answers: int, moved_after: list[int]) -> None:
    """Every event once, in order; each answer whole (deltas joined == its final text, its
    output tokens the limit's), none failed; and each answer got deltas after the event
    number in ``moved_after`` (it was cut there and went on on the other gateway)."""
    numbers = [e["sequence_number"] for e in chat.events]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    done = [e["response"] for e in chat.events if e["type"] == "response.done"]
    assert len(done) == answers
    for response, cut in zip(done, moved_after, strict=True):
        assert response["status"] == "incomplete", response  # by its limit: not failed
        assert response["status_details"]["reason"] == "max_output_tokens"
        assert response["usage"]["output_tokens"] == MAX_TOKENS, response["usage"]
        deltas = [
            e
            for e in chat.events
            if e["type"] == "response.output_text.delta" and e["response_id"] == response["id"]
        ]
        text = "".join(e["delta"] for e in deltas)
        assert text == response["output"][0]["content"][0]["text"], (text, response)
        # A token per delta at most: the continued part had the rest of the budget only.
        assert len(deltas) <= MAX_TOKENS, len(deltas)
        assert any(e["sequence_number"] > cut for e in deltas), "not continued after the cut"


async def test_kill_9_of_the_owner_mid_answer_and_the_takeover_continues_it(
    redis_server: RedisServer, engine: Engine
) -> None:
    async with gateways(redis_server.url, 2, engine=engine.flags) as (a, b):
        chat = Chat()
        await chat.open(a.url())
        await greedy(chat)
        await chat.ask(STORY)
        await chat.deltas(6)
        a.kill()
        await until_closed(chat)
        cut = chat.events[-1]["sequence_number"]
        # Until the dead owner's lease runs out B relays (nothing comes); then it closes
        # with 1012 and the next resume takes the session over.
        assert (await chat.resume(b.url()))["type"] == "session.resumed"
        await chat.finish(b.url())
        check_answers(chat, 1, [cut])
        assert any("took over session" in line for line in b.log)
        await engine.idle()


async def test_a_rolling_restart_mid_answer_continues_each_answer(
    redis_server: RedisServer, engine: Engine
) -> None:
    """SIGTERM to the gateway that holds the session, mid-answer, then a fresh one in its
    place; then the same to the other: each answer goes on on the gateway left."""
    cuts: list[int] = []
    async with RollingPair(redis_server.url, "--drain-timeout", "0.2", engine=engine.flags) as pair:
        chat = Chat()
        await chat.open(pair.gateways[0].url())
        await greedy(chat)
        for turn in range(2):
            await chat.ask(f"{STORY} Part {turn + 1}.")
            await chat.deltas(5)
            pair.begin_restart(turn)
            assert await until_closed(chat) == 1012  # drained: resume elsewhere
            cuts.append(chat.events[-1]["sequence_number"])
            other = pair.gateways[1 - turn]
            answer: dict[str, Any] = await chat.resume(other.url())
            assert answer["type"] == "session.resumed", answer
            await chat.until("response.done")
            if turn == 0:  # a fresh gateway in its place, for the next turn to move to
                await pair.finish_restart(turn)
        check_answers(chat, 2, cuts)
        await engine.idle()
