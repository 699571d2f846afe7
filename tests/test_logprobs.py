"""Log probabilities on both APIs, through the official openai-python client: Chat
Completions' ``logprobs``/``top_logprobs`` and the Responses API's ``include:
["message.output_text.logprobs"]`` with ``top_logprobs``, over HTTP and the WebSocket, on
the sim engine (whose values are known: ``sim.token_logprob``), through a lagging reader's
merged deltas and a takeover; an engine that cannot report them answers 400. Every object
validates strictly against openai-python's types. The bundled model, the upstream pool and
the TensorRT-LLM stand-in have their own file (tests/test_logprobs_engines.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from gateway.engines.base import (
    Finished,
    GenerationRequest,
    Message,
    PromptLogprobs,
    SamplingParams,
    TextDelta,
    TokenLogprob,
)
from gateway.engines.sim import SimEngine, prompt_logprobs, render, token_logprob
from gateway.scheduler import Scheduler
from sessions.core import Session
from sessions.outbox import CloseRequest, Outbox
from sessions.responses import codec as rp
from sessions.responses.dialect import ResponsesDialect, ResponsesFraming
from tests.support.gateway_processes import TIMEOUT, gateways
from tests.support.harness import RunningGateway, running_gateway
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401
from tests.support.responses_harness import ResponsesClient, drained_mid_answer, validate
from tests.support.scripted_engine import ScriptedEngine
from tests.support.wires import MemoryWire
from tests.test_chat_completions import raw_post, sse_chunks, strict

LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=12)) as running:
        yield running


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return gw.openai()


def expected(tokens: list[str], top: int) -> list[dict[str, Any]]:
    """What the sim reports for an answer of ``tokens``, as Chat's content entries."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": list(lp.bytes),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in lp.top
            ],
        }
        for lp in (token_logprob(t, i, top) for i, t in enumerate(tokens))
    ]


def without_bytes(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat's entries in the shape of a Responses delta (which has no bytes)."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]
            ],
        }
        for e in entries
    ]


# -- Chat Completions ------------------------------------------------------------------


async def test_chat_answers_each_token_with_its_logprob_and_top_alternatives(
    gw: RunningGateway,
) -> None:
    raw = (
        await client(gw).chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": "Hello"}],
            logprobs=True,
            top_logprobs=3,
        )
    ).http_response.json()
    completion = strict(ChatCompletion, raw)
    content = raw["choices"][0]["logprobs"]["content"]
    tokens = [entry["token"] for entry in content]
    assert "".join(tokens) == completion.choices[0].message.content != ""
    assert content == expected(tokens, 3)
    assert all(
        len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"] for e in content
    )
    assert raw["choices"][0]["logprobs"]["refusal"] is None


async def test_chat_streams_logprobs_in_every_chunk_and_joined_they_are_the_answer(
    gw: RunningGateway,
) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Stream it"}],
        "stream": True,
        "logprobs": True,
        "top_logprobs": 1,
    }
    response = await raw_post(gw, body)
    chunks = sse_chunks(response.text)
    for chunk in chunks:
        strict(ChatCompletionChunk, chunk)
    texts = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert texts and all(c["choices"][0]["logprobs"]["content"] for c in texts)
    content = [e for c in texts for e in c["choices"][0]["logprobs"]["content"]]
    answer = "".join(c["choices"][0]["delta"]["content"] for c in texts)
    assert "".join(e["token"] for e in content) == answer
    assert content == expected([e["token"] for e in content], 1)
    # The official client's own reading of the same stream.
    stream = await client(gw).chat.completions.create(**body)  # type: ignore[call-overload]
    seen = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            seen += chunk.choices[0].logprobs.content or []
    assert [lp.model_dump() for lp in seen] == content


async def test_each_of_n_choices_has_its_own_logprobs_streamed_or_not(
    gw: RunningGateway,
) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Two, please"}],
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    completion = strict(ChatCompletion, (await raw_post(gw, body)).json())
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        tokens = [t.token for t in choice.logprobs.content]
        assert "".join(tokens) == choice.message.content
        assert [t.model_dump() for t in choice.logprobs.content] == expected(tokens, 2)
    chunks = sse_chunks((await raw_post(gw, {**body, "stream": True})).text)
    texts: dict[int, str] = {0: "", 1: ""}
    joined: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in chunks:
        strict(ChatCompletionChunk, chunk)
        for choice in chunk["choices"]:
            if choice["delta"].get("content"):
                texts[choice["index"]] += choice["delta"]["content"]
                joined[choice["index"]] += choice["logprobs"]["content"]
    assert texts == {c.index: c.message.content for c in completion.choices}
    assert all("".join(e["token"] for e in joined[i]) == texts[i] for i in (0, 1))


async def test_chat_top_logprobs_zero_gives_the_token_alone(gw: RunningGateway) -> None:
    completion = await client(gw).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], logprobs=True
    )
    assert completion.choices[0].logprobs is not None
    content = completion.choices[0].logprobs.content or []
    assert content and all(lp.top_logprobs == [] for lp in content)


async def test_chat_without_logprobs_is_unchanged(gw: RunningGateway) -> None:
    response = await raw_post(
        gw, {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "logprobs": False}
    )
    chunks = sse_chunks(response.text)
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])


@pytest.mark.parametrize(
    ("fields", "code", "param", "message"),
    [
        (
            {"top_logprobs": 2},
            "invalid_value",
            "top_logprobs",
            "The 'top_logprobs' parameter is only allowed when 'logprobs' is enabled.",
        ),
        (
            {"logprobs": True, "top_logprobs": 21},
            "integer_above_max_value",
            "top_logprobs",
            "Invalid 'top_logprobs': integer above maximum value. Expected a value <= 20, "
            "but got 21 instead.",
        ),
        (
            {"logprobs": True, "top_logprobs": -1},
            "integer_below_min_value",
            "top_logprobs",
            "Invalid 'top_logprobs': integer below minimum value. Expected a value >= 0, "
            "but got -1 instead.",
        ),
        ({"logprobs": "yes"}, "invalid_type", "logprobs", "'logprobs' must be a boolean."),
    ],
)
async def test_chat_refuses_what_openai_refuses(
    gw: RunningGateway, fields: dict[str, Any], code: str, param: str, message: str
) -> None:
    response = await raw_post(gw, {"messages": [{"role": "user", "content": "Hi"}], **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"], error["message"]) == (code, param, message)
    assert error["type"] == "invalid_request_error"


# -- Responses --------------------------------------------------------------------------


async def test_responses_over_http_serve_logprobs_on_the_part_and_keep_them_stored(
    gw: RunningGateway,
) -> None:
    raw = (
        await client(gw).responses.with_raw_response.create(
            model="m",
            input="Hello",
            include=LOGPROBS,
            top_logprobs=2,  # type: ignore[arg-type]
        )
    ).http_response.json()
    response = strict(Response, raw)
    part = raw["output"][0]["content"][0]
    tokens = [lp["token"] for lp in part["logprobs"]]
    assert "".join(tokens) == part["text"] == response.output_text != ""
    assert part["logprobs"] == expected(tokens, 2)
    assert raw["top_logprobs"] == 2
    async with httpx.AsyncClient(base_url=gw.http_url) as http:
        stored = (await http.get(f"/v1/responses/{raw['id']}")).json()
    assert stored["output"][0]["content"][0]["logprobs"] == part["logprobs"]


async def test_responses_stream_logprobs_on_every_delta_and_on_the_done_event(
    gw: RunningGateway,
) -> None:
    stream = await client(gw).responses.create(
        model="m", input="Stream it", include=LOGPROBS, top_logprobs=1, stream=True
    )
    events = [event async for event in stream]
    raw = [event.model_dump(mode="json", exclude_unset=True) for event in events]
    for event in raw:
        validate(event)
    deltas = [e for e in raw if e["type"] == "response.output_text.delta"]
    assert deltas and all(e["logprobs"] for e in deltas)
    joined = [lp for e in deltas for lp in e["logprobs"]]
    done = next(e for e in raw if e["type"] == "response.output_text.done")
    assert done["logprobs"] == joined
    assert (
        "".join(lp["token"] for lp in joined) == done["text"] == "".join(e["delta"] for e in deltas)
    )
    assert joined == without_bytes(expected([lp["token"] for lp in joined], 1))
    part = next(e for e in raw if e["type"] == "response.content_part.done")["part"]
    assert part["logprobs"] == expected([lp["token"] for lp in joined], 1)


async def test_responses_without_the_include_keep_empty_logprobs_as_openai_does(
    gw: RunningGateway,
) -> None:
    response = await client(gw).responses.create(model="m", input="Hi", top_logprobs=3)
    part = response.output[0].content[0]
    assert part.type == "output_text" and part.logprobs == []
    assert response.top_logprobs == 3


async def test_the_responses_websocket_serves_them_too(gw: RunningGateway) -> None:
    url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
    async with ResponsesClient.connect(url) as c:  # validates every event it receives
        turn = await c.respond(input="Hello", include=LOGPROBS, top_logprobs=2)
        follow = await c.respond(input="More", previous_response_id=turn.response["id"])
    deltas = [e for e in turn.events if e["type"] == "response.output_text.delta"]
    joined = [lp for e in deltas for lp in e["logprobs"]]
    done = next(e for e in turn.events if e["type"] == "response.output_text.done")
    assert joined and done["logprobs"] == joined
    assert joined == without_bytes(expected([lp["token"] for lp in joined], 2))
    # The next turn asked for none: its deltas carry the empty list the type requires.
    assert all(
        e["logprobs"] == [] for e in follow.events if e["type"] == "response.output_text.delta"
    )


# -- engines that cannot ----------------------------------------------------------------


async def test_an_engine_that_cannot_report_them_refuses_with_a_400() -> None:
    engine = ScriptedEngine([TextDelta("Hi")])
    async with running_gateway(engine) as gw:
        chat = await raw_post(
            gw, {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
        )
        assert chat.status_code == 400
        assert chat.json()["error"]["param"] == "logprobs"
        assert "does not report log probabilities" in chat.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            await client(gw).responses.create(model="m", input="Hi", include=LOGPROBS)
        assert refused.value.body["param"] == "include"  # type: ignore[index]
        assert refused.value.body["code"] == "unsupported_value"  # type: ignore[index]
        # Without them the same engine answers.
        ok = await raw_post(gw, {"messages": [{"role": "user", "content": "Hi"}]})
        assert ok.status_code == 200
        assert engine.requests[-1].sampling.logprobs is None
        # A generate: false turn only warms the cache: it asks the engine for none.
        url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
        async with ResponsesClient.connect(url) as c:
            warmed = await c.respond(input="Hi", include=LOGPROBS, generate=False)
        assert warmed.response["status"] == "completed"
        assert engine.requests[-1].sampling.logprobs is None


async def test_the_sim_reports_the_prompts_own_logprobs_first() -> None:
    """The engine side of a legacy echo: PromptLogprobs before the first delta, its tokens
    the rendered prompt's."""
    engine = SimEngine(step_ms=0, response_tokens=3)
    await engine.start()
    messages = (Message("user", "Tell me, gateway"),)
    sampling = SamplingParams(logprobs=1, prompt_logprobs=2)
    engine.submit(GenerationRequest("r", messages, sampling))
    outputs: list[object] = []
    while not outputs or not isinstance(outputs[-1], Finished):
        outputs += [output for _, output in await engine.outputs.get()]
    await engine.close()
    kinds = [type(o) for o in outputs]
    assert kinds.index(PromptLogprobs) < kinds.index(TextDelta)
    prompt = next(o for o in outputs if isinstance(o, PromptLogprobs))
    assert prompt == prompt_logprobs(render(messages), 2)
    assert prompt.first + "".join(t.token for t in prompt.tokens) == render(messages)
    assert all(len(t.top) == 2 for t in prompt.tokens)


# -- a lagging reader, a takeover ---------------------------------------------------------


async def test_a_lagging_readers_merged_deltas_keep_every_tokens_logprob_in_order() -> None:
    """The socket pushes back for the whole answer: its deltas merge into one frame, which
    carries every token's log probability, in order, as the done event has them."""
    engine = SimEngine(step_ms=0, response_tokens=40)
    await engine.start()
    scheduler = Scheduler(engine, max_running=4, max_queued=4)
    session = Session(scheduler, Outbox(ResponsesFraming()), ResponsesDialect())
    wire = MemoryWire(room=False)
    session.outbox.attach(wire)
    task = asyncio.get_running_loop().create_task(session.run())
    create = {"type": "response.create", "input": "Merge", "include": LOGPROBS, "top_logprobs": 2}
    await session.deliver(rp.decode(orjson.dumps(create).decode()))
    async with asyncio.timeout(TIMEOUT):
        while session.outbox.stats.deltas_in < 40 or session.live_responses:
            await asyncio.sleep(0.01)
    wire.set_room(True)
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(TIMEOUT):
        while not events or events[-1]["type"] != "response.completed":
            frame = await wire.frames.get()
            assert not isinstance(frame, CloseRequest)
            events.append(frame)
    session.close()
    await asyncio.wait_for(task, TIMEOUT)
    await scheduler.close()
    await engine.close()
    for event in events:
        validate(event)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) < 40 and session.outbox.stats.deltas_in == 40  # merged
    joined = [lp for e in deltas for lp in e["logprobs"]]
    assert len(joined) == 40
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == joined
    assert joined == without_bytes(expected([lp["token"] for lp in joined], 2))


async def test_the_outbox_counts_merged_logprobs_against_its_byte_cap() -> None:
    """A reader that never reads cannot make the gateway hold unbounded log probabilities."""
    outbox = Outbox(ResponsesFraming(), max_pending_bytes=64 << 10)
    outbox.attach(MemoryWire(room=False))
    lost: list[bool] = []
    outbox.on_overflow = lambda: lost.append(True)
    alternatives = tuple(TokenLogprob(f" w{k}", -1.0, b"w") for k in range(20))
    sent = 0
    while not lost and sent < 2000:
        outbox.put_delta("r", "i", "x", (), (TokenLogprob("x", -0.5, b"x", alternatives),))
        sent += 1
    assert lost and sent < 100 and outbox.lost  # about 2 KiB each: the cap, not 2000 tokens


async def test_a_takeover_continues_the_logprobs_where_the_first_gateway_left_them(
    redis_server: RedisServer,
) -> None:
    """The gateway streaming the answer drains mid-answer (a deploy): the other one takes
    the session over and continues the answer, whose log probabilities go on from those
    the client has, as the done event and the stored output have them all."""
    async with gateways(redis_server.url, 2, "--drain-timeout", "0.2", tokens=60) as (a, b):
        create = {"input": "A long one", "include": LOGPROBS, "top_logprobs": 1}
        seen, rest = await drained_mid_answer(a, b, 8, **create)
    events = seen + rest.events
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    joined = [lp for e in deltas for lp in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert rest.response["status"] == "completed" and len(joined) == 60
    assert 0 < sum(e["type"] == "response.output_text.delta" for e in seen) < len(deltas)
    assert done["text"] == "".join(e["delta"] for e in deltas)
    assert done["logprobs"] == joined  # the first gateway's, then the second's
    # As the sim reports them for the whole answer: continued where they stopped.
    assert joined == without_bytes(expected([lp["token"] for lp in joined], 1))
    part = rest.response["output"][0]["content"][0]
    assert [lp["token"] for lp in part["logprobs"]] == [lp["token"] for lp in joined]
