"""Completions (``POST /v1/completions``) and several choices (``n``) on Chat Completions,
through openai-python (sync and async, streaming and not) and raw HTTP, on the sim engine;
every object validated strictly against openai-python's own types. The other engines and
the client libraries that speak this API: tests/test_completions_engines.py and
tests/test_completion_clients.py."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types import completion_create_params as params
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.engines import sim
from gateway.engines.base import TextDelta
from gateway.engines.sim import SimEngine
from sessions.completions import codec as kc
from tests.support.harness import RunningGateway, running_gateway
from tests.support.scripted_engine import ScriptedEngine
from tests.test_chat_completions import sse_chunks, strict


def strict_completion(body: dict[str, Any]) -> Completion:
    """A ``text_completion`` (or a chunk of one) as the SDK's ``Completion``, every field
    checked strictly but two that OpenAI sends and the SDK's types do not allow: a streamed
    choice's ``finish_reason`` is null until its last chunk (the type is shared by both
    shapes, it says), and an echoed prompt's first token has null ``token_logprobs`` and
    ``top_logprobs`` entries (nothing before it predicts it). Only those are read as
    something else, and only there."""
    choices = []
    for choice in body["choices"]:
        choice = {**choice, "finish_reason": choice["finish_reason"] or "stop"}
        if (lp := choice["logprobs"]) is not None and lp["token_logprobs"][:1] == [None]:
            assert lp["top_logprobs"][0] is None
            lp = {**lp, "token_logprobs": [0.0, *lp["token_logprobs"][1:]]}
            choice["logprobs"] = {**lp, "top_logprobs": [{}, *lp["top_logprobs"][1:]]}
        choices.append(choice)
    validated: Completion = strict(Completion, {**body, "choices": choices})
    return validated


strict_chunk = strict_completion


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=24)) as running:
        yield running
        await running.wait_idle()
        assert not running.gateway.sessions, "a completions session outlived its request"


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return gw.openai()


async def post(gw: RunningGateway, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http:
        return await http.post(path, json=body)


def texts(chunks: list[dict[str, Any]]) -> dict[int, str]:
    """Each choice's text, joined from its chunks."""
    joined: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            joined[choice["index"]] = joined.get(choice["index"], "") + choice["text"]
    return joined


async def test_the_sdk_completes_a_prompt_with_openais_default_of_16_tokens(
    gw: RunningGateway,
) -> None:
    async with client(gw) as c:
        raw = await c.completions.with_raw_response.create(model="any", prompt="Once upon a")
        completion = strict(Completion, raw.http_response.json())
    choice = completion.choices[0]
    assert completion.object == "text_completion" and completion.model == "any"
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text.strip()
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 16)
    async with client(gw) as c:
        whole = await c.completions.create(model="m", prompt="Once upon a", max_tokens=100)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    assert whole.choices[0].text.startswith(choice.text)  # the same prompt, the same answer


async def test_a_stream_joins_to_the_completion_with_usage_last(gw: RunningGateway) -> None:
    body = {"model": "m", "prompt": "The sky is", "max_tokens": 100, "stream": True}
    reply = await post(gw, {**body, "stream_options": {"include_usage": True}})
    assert reply.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(reply.text)
    for chunk in chunks:
        strict_chunk(chunk)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    whole = (await post(gw, {**body, "stream": False})).json()
    assert texts(chunks) == {0: whole["choices"][0]["text"]}
    # The SDK's own stream, no usage asked: over at the finish.
    async with client(gw) as c:
        stream = await c.completions.create(model="m", prompt="The sky is", stream=True)
        pieces = [chunk async for chunk in stream]
    assert pieces[-1].choices[0].finish_reason == "length" and pieces[-1].usage is None
    assert whole["choices"][0]["text"].startswith("".join(p.choices[0].text for p in pieces))


async def test_n_choices_stream_interleaved_with_their_index_and_usage_summed(
    gw: RunningGateway,
) -> None:
    async with client(gw) as c:
        whole = await c.completions.create(model="m", prompt="Hi", n=2, max_tokens=5)
        stream = await c.completions.create(
            model="m",
            prompt="Hi",
            n=2,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk.model_dump() async for chunk in stream]
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    assert whole.usage.prompt_tokens == 1  # the prompt, once: as OpenAI counts it
    indexes = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert indexes[:4] == [0, 1, 0, 1]  # interleaved, as the engine steps them
    finished = [
        c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert sorted(f["index"] for f in finished) == [0, 1]
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    assert texts(chunks[:-1]) == {c.index: c.text for c in whole.choices}


async def test_prompts_token_ids_and_echo(gw: RunningGateway) -> None:
    reply = await post(gw, {"prompt": ["One", "Two"], "n": 2, "max_tokens": 3, "echo": True})
    completion = strict(Completion, reply.json())
    by_index = {c.index: c.text for c in completion.choices}
    assert sorted(by_index) == [0, 1, 2, 3]  # prompt i's choice j is i * n + j
    assert by_index[0].startswith("One ") and by_index[2].startswith("Two ")
    assert by_index[0] == by_index[1] != by_index[2]  # the sim answers a prompt one way
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    ids = strict(Completion, (await post(gw, {"prompt": [1, 2, 3], "max_tokens": 3})).json())
    many = (await post(gw, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3})).json()
    assert ids.usage is not None and ids.usage.prompt_tokens == 3
    assert many["choices"][0]["text"] == ids.choices[0].text
    assert many["usage"]["prompt_tokens"] == 5
    # An echo streams the prompt first, in each choice's first chunk.
    reply = await post(gw, {"prompt": "Echo me", "echo": True, "max_tokens": 2, "stream": True})
    chunks = sse_chunks(reply.text)
    assert chunks[0]["choices"][0]["text"] == "Echo me"
    alone = (await post(gw, {"prompt": "Echo me", "echo": True, "max_tokens": 0})).json()
    assert alone["choices"][0] == {
        "index": 0,
        "text": "Echo me",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert alone["usage"]["completion_tokens"] == 0 and alone["usage"]["prompt_tokens"] == 2


async def test_suffix_is_filled_in_where_the_engine_can(gw: RunningGateway) -> None:
    with_suffix = (await post(gw, {"prompt": "def f(", "suffix": "):", "max_tokens": 4})).json()
    without = (await post(gw, {"prompt": "def f(", "max_tokens": 4})).json()
    assert with_suffix["choices"][0]["text"] != without["choices"][0]["text"]
    engine = ScriptedEngine([TextDelta(" x")])
    async with running_gateway(engine) as scripted:
        refused = await post(scripted, {"prompt": "def f(", "suffix": "):"})
    assert refused.status_code == 400
    assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == (
        "unsupported_value",
        "suffix",
    )


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"prompt": None}, "invalid_type", "prompt"),
        ({"prompt": ""}, "invalid_value", "prompt"),
        ({"prompt": []}, "invalid_value", "prompt"),
        ({"prompt": ["a", 1]}, "invalid_type", "prompt[1]"),
        ({"prompt": [[1], []]}, "invalid_type", "prompt[1]"),
        ({"prompt": [True]}, "invalid_type", "prompt[0]"),
        ({"max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"n": 17}, "invalid_value", "n"),
        ({"n": 3, "best_of": 2}, "invalid_value", "best_of"),
        ({"prompt": ["a"] * 9, "n": 2}, "invalid_value", "prompt"),
        ({"logit_bias": {"1": 5}}, "unsupported_value", "logit_bias"),
        ({"temperature": 3}, "invalid_value", "temperature"),
        ({"frobnicate": 1}, "unknown_parameter", "frobnicate"),
        ({"prompt": [70_000]}, "invalid_value", None),  # beyond the sim's vocabulary
    ],
)
async def test_a_client_mistake_is_an_openai_error_object(
    gw: RunningGateway, body: dict[str, Any], code: str, param: str | None
) -> None:
    reply = await post(gw, {"model": "m", "prompt": "hi", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        code,
        param,
        "invalid_request_error",
    )
    assert (await post(gw, {"prompt": "x", "max_tokens": 1})).status_code == 200


async def test_a_client_that_leaves_ends_every_choice_in_the_engine() -> None:
    engine = SimEngine(step_ms=5, response_tokens=10_000)
    async with running_gateway(engine) as gw:
        body = {"prompt": "on and on", "n": 3, "max_tokens": 10_000, "stream": True}
        async with (
            httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http,
            http.stream("POST", "/v1/completions", json=body) as streaming,
        ):
            async for _ in streaming.aiter_bytes():
                assert gw.gateway.scheduler.running == 3
                break
        await gw.wait_idle()
        assert not gw.gateway.scheduler.running and not engine.active


async def test_admission_counts_every_choice(tmp_path: Path) -> None:
    engine = SimEngine(step_ms=1, response_tokens=4)
    async with running_gateway(engine, max_running=1, max_queued=1) as gw:
        refused = await post(gw, {"prompt": "x", "n": 3})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        assert (await post(gw, {"prompt": "x", "n": 2})).status_code == 200
        await gw.wait_idle()
    keys = tmp_path / "keys"
    keys.write_text("k name=team max_running=2\n")
    engine = SimEngine(step_ms=1, response_tokens=4)
    async with (
        running_gateway(engine, api_key_file=str(keys)) as gw,
        httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http,
    ):
        auth = {"Authorization": "Bearer k"}
        over = await http.post("/v1/completions", json={"prompt": "x", "n": 3}, headers=auth)
        assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
        ok = await http.post("/v1/completions", json={"prompt": "x", "n": 2}, headers=auth)
        assert ok.status_code == 200


async def test_each_choice_gets_a_seed_of_its_own_reproducibly() -> None:
    engine = ScriptedEngine([TextDelta(" a")])
    async with running_gateway(engine) as gw:
        await post(gw, {"prompt": "x", "n": 3, "seed": 2**64 - 2})
        await post(gw, {"prompt": "x", "n": 2})
        body = {"messages": [{"role": "user", "content": "x"}], "n": 2, "seed": 7}
        await post(gw, body, "/v1/chat/completions")
        await gw.wait_idle()
    seeds = [r.sampling.seed for r in engine.requests]
    assert seeds == [2**64 - 2, 2**64 - 1, 0, None, None, 7, 8]
    assert engine.requests[0].prompt == "x" and engine.requests[0].messages == ()


async def test_served_model_names_apply_to_completions() -> None:
    engine = SimEngine(step_ms=1, response_tokens=4)
    async with running_gateway(engine, served_model_names=("alpha",)) as gw, client(gw) as c:
        assert (await c.completions.create(model="alpha", prompt="x")).model == "alpha"
        with pytest.raises(openai.NotFoundError) as refused:
            await c.completions.create(model="gamma", prompt="x")
        assert refused.value.code == "model_not_found"


async def test_chat_completions_serve_n_choices(gw: RunningGateway) -> None:
    def run() -> tuple[ChatCompletion, list[ChatCompletionChunk]]:
        with openai.OpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as c:
            messages: list[Any] = [{"role": "user", "content": "hello"}]
            raw = c.chat.completions.with_raw_response.create(
                model="m", messages=messages, n=2, max_tokens=4
            )
            whole = strict(ChatCompletion, raw.http_response.json())
            stream = c.chat.completions.create(
                model="m",
                messages=messages,
                n=2,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            return whole, list(stream)

    whole, chunks = await asyncio.to_thread(run)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]  # each choice opens with its role
    joined: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            joined[choice.index] += choice.delta.content or ""
    assert joined == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_every_field_the_sdk_can_send_has_an_answer() -> None:
    """Each field of openai-python's CompletionCreateParams is served, accepted and ignored,
    or refused with unsupported_value: a new SDK field fails here until it is placed."""
    sdk_fields = set(params.CompletionCreateParamsBase.__annotations__)
    sdk_fields |= set(params.CompletionCreateParamsStreaming.__annotations__)
    placed = kc.SERVED | set(kc.IGNORED) | set(kc.REFUSED)
    assert sdk_fields - placed == set(), "fields of the SDK with no answer"
    assert placed - sdk_fields == set(), "answers for fields the SDK does not have"
    for field in (*kc.IGNORED, *kc.REFUSED):
        assert kc.read_body({"prompt": "x", field: None}).prompts == ("x",)


def test_docs_give_every_field_its_answer() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    section = docs.split("\n## Completions\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1)[0] for line in section.splitlines() if line.startswith("| `")]
    documented = set(re.findall(r"`(\w+)`", " ".join(rows)))
    missing = (kc.SERVED | set(kc.IGNORED) | set(kc.REFUSED)) - documented
    assert not missing, f"fields docs/protocol.md's Completions table lacks: {missing}"


# -- log probabilities, in the legacy shape ------------------------------------------------


def check_legacy_shape(text: str, logprobs: dict[str, Any], start: int = 0) -> None:
    """Its four lists line up, its tokens' text is the text from ``start`` on, and each
    ``text_offset`` is where its token starts in the choice's text."""
    tokens = logprobs["tokens"]
    lengths = {len(logprobs[k]) for k in ("token_logprobs", "top_logprobs", "text_offset")}
    assert lengths == {len(tokens)}
    assert "".join(tokens) == text[start:]
    at = start
    for token, offset in zip(tokens, logprobs["text_offset"], strict=True):
        assert offset == at and text[offset : offset + len(token)] == token
        at += len(token)


async def test_logprobs_come_in_the_legacy_shape_streamed_or_not(gw: RunningGateway) -> None:
    body = {"prompt": "The sky is", "max_tokens": 6, "logprobs": 2}
    async with client(gw) as c:
        raw = await c.completions.with_raw_response.create(model="m", **body)  # type: ignore[arg-type]
    choice = strict(Completion, raw.http_response.json()).choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    check_legacy_shape(choice.text, choice.logprobs.model_dump())
    assert len(choice.logprobs.tokens) == 6
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs or [])
    assert choice.logprobs.token_logprobs == [
        sim.token_logprob(t, i, 2).logprob for i, t in enumerate(choice.logprobs.tokens)
    ]
    chunks = sse_chunks((await post(gw, {**body, "stream": True})).text)
    streamed: dict[str, list[Any]] = {"tokens": [], "text_offset": []}
    for chunk in chunks:
        strict_chunk(chunk)
        lp = chunk["choices"][0]["logprobs"]
        if chunk["choices"][0]["text"]:
            streamed["tokens"] += lp["tokens"]
            streamed["text_offset"] += lp["text_offset"]
    assert streamed == {
        "tokens": choice.logprobs.tokens,
        "text_offset": choice.logprobs.text_offset,
    }


async def test_echo_with_logprobs_scores_the_prompt_itself(gw: RunningGateway) -> None:
    """What evaluation harnesses send: the prompt's own log probabilities, nothing generated."""
    prompt = "The quick brown fox"
    reply = await post(gw, {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0})
    choice = strict_completion(reply.json()).choices[0]
    raw = reply.json()["choices"][0]["logprobs"]
    assert raw["token_logprobs"][0] is None and raw["top_logprobs"][0] is None
    assert choice.text == prompt and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    check_legacy_shape(choice.text, raw)
    assert logprobs.tokens == ["The", " quick", " brown", " fox"]
    expected = sim.prompt_logprobs(prompt, 1).tokens
    assert raw["token_logprobs"][1:] == [lp.logprob for lp in expected]
    # With an answer after it: the prompt's tokens, then the answer's, offsets running on.
    both = (await post(gw, {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 3})).json()
    text, lp = both["choices"][0]["text"], both["choices"][0]["logprobs"]
    check_legacy_shape(text, lp)
    assert len(lp["tokens"]) == 4 + 3 and text.startswith(prompt)
    streamed = sse_chunks(
        (
            await post(
                gw, {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 3, "stream": True}
            )
        ).text
    )
    assert streamed[0]["choices"][0]["text"] == prompt
    assert streamed[0]["choices"][0]["logprobs"]["tokens"] == lp["tokens"][:4]


async def test_the_echo_of_token_ids_is_their_text(gw: RunningGateway) -> None:
    reply = await post(gw, {"prompt": [1, 2, 3], "echo": True, "max_tokens": 2})
    choice = strict(Completion, reply.json()).choices[0]
    assert choice.text.startswith(sim.decode_ids([1, 2, 3])) and choice.logprobs is None


async def test_best_of_keeps_the_likeliest_answers() -> None:
    engine = ScriptedEngine([TextDelta(" a")])
    async with running_gateway(SimEngine(step_ms=1, response_tokens=8)) as gw:
        reply = await post(gw, {"prompt": ["x", "y"], "n": 1, "best_of": 3, "max_tokens": 4})
        completion = strict(Completion, reply.json())
        assert [c.index for c in completion.choices] == [0, 1]
        assert completion.choices[0].logprobs is None  # ranked by them, not asked for them
        assert completion.usage is not None and completion.usage.completion_tokens == 24
        streamed = await post(gw, {"prompt": "x", "best_of": 2, "stream": True})
        assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "best_of")
    async with running_gateway(engine) as scripted:
        refused = await post(scripted, {"prompt": "x", "best_of": 2})
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "best_of")
