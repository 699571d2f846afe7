"""The TensorRT-LLM adapter against the stand-in in tests/support/trtllm_standin (no GPU needed).

The stand-in follows the real LLM API where the adapter touches it (see
tests/support/trtllm_standin/README.md); it is put on sys.path only by the ``standin`` fixture, so
nothing else ever imports it. Tests tagged "item N" cover issue 14's items.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import openai
import pytest

from gateway.engines import trtllm
from gateway.engines.base import (
    ContextOverflowError,
    EngineError,
    EngineUnavailableError,
    Finished,
    GenerationRequest,
    Message,
    PromptTokens,
    SamplingParams,
    StreamEvent,
    TextDelta,
)
from tests.support.gateway_processes import gateways
from tests.support.harness import RawClient, running_gateway
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401
from tests.support.responses_harness import ResponsesClient
from tests.test_store import Chat

ROOT = Path(__file__).parent.parent
STANDIN_ROOT = Path(__file__).parent / "support" / "trtllm_standin"
MODEL = "standin/tiny-chat"
FAST_HEALTH_CHECK = 0.02  # seconds between the adapter's executor checks, in tests


def _forget_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """Put the stand-in ``tensorrt_llm`` on sys.path for this test only; yield its controls."""
    _forget_tensorrt_llm(monkeypatch)
    monkeypatch.delenv("TRTLLM_STANDIN_WORKER_PROCESS", raising=False)
    monkeypatch.syspath_prepend(str(STANDIN_ROOT))
    import tensorrt_llm._standin as standin_mod

    standin_mod.reset()
    yield standin_mod
    if standin_mod.controls.load_gate is not None:
        standin_mod.controls.load_gate.set()  # never leave a loading thread blocked
    _forget_tensorrt_llm(monkeypatch)


def make_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)  # the lead's common flag
    trtllm.add_arguments(parser.add_argument_group("trtllm engine"))
    return parser.parse_args(list(argv))


def standin_engine(*argv: str) -> trtllm.TrtllmEngine:
    return trtllm.from_args(make_args("--model", MODEL, *argv))


def watched_engine(**settings: Any) -> trtllm.TrtllmEngine:
    """An engine that checks its executor every few milliseconds."""
    return trtllm.TrtllmEngine(
        trtllm.TrtllmSettings(model=MODEL, health_check_s=FAST_HEALTH_CHECK, **settings)
    )


@pytest.fixture
async def engine(standin: ModuleType) -> AsyncIterator[trtllm.TrtllmEngine]:
    eng = standin_engine("--max-batch-size", "4")
    await eng.start()
    yield eng
    await eng.close()


def request(*texts: str, **sampling: Any) -> GenerationRequest:
    roles = ["user", "assistant"]
    messages = tuple(Message(roles[i % 2], t) for i, t in enumerate(texts))  # type: ignore[arg-type]
    return GenerationRequest("req-1", messages, SamplingParams(**sampling))


async def collect(eng: trtllm.TrtllmEngine, req: GenerationRequest) -> list[StreamEvent]:
    return [event async for event in eng.stream(req)]


def deltas(events: list[StreamEvent]) -> list[str]:
    return [e.text for e in events if isinstance(e, TextDelta)]


def finished(events: list[StreamEvent]) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    assert sum(isinstance(e, Finished) for e in events) == 1
    return events[-1]


def prompt_text(eng: trtllm.TrtllmEngine, record: Any) -> str:
    """What a request's prompt token ids say (the stand-in's token ids are per tokenizer)."""
    text: str = eng.llm.tokenizer.decode(record.prompt_token_ids, skip_special_tokens=False)
    return text


def tokens(text: str, standin: ModuleType) -> int:
    return len(standin.StandinTokenizer().encode(text, add_special_tokens=False))


async def off_loop(fn: Callable[[], bool]) -> bool:
    """``fn`` on a thread of its own, joined: unlike asyncio.to_thread it leaves no thread."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bool] = loop.create_future()
    thread = threading.Thread(
        target=lambda: loop.call_soon_threadsafe(done.set_result, fn()), daemon=True
    )
    thread.start()
    result = await done
    thread.join()
    return result


async def wait_idle(standin: ModuleType) -> None:
    assert await off_loop(lambda: standin.stats.wait_idle(5.0)), "a request is still running"


async def first_delta(eng: trtllm.TrtllmEngine, req: GenerationRequest) -> asyncio.Task[None]:
    """A task consuming ``req``'s stream, returned once the first text has arrived."""
    arrived = asyncio.Event()

    async def consume() -> None:
        async for event in eng.stream(req):
            if isinstance(event, TextDelta):
                arrived.set()

    task = asyncio.create_task(consume())
    waiting = asyncio.create_task(arrived.wait())
    await asyncio.wait({task, waiting}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    assert arrived.is_set(), "no text arrived"
    return task


# -- streaming ---------------------------------------------------------------------------


async def test_streams_new_text_in_order_then_finishes(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.reply = "one two three four five"
    events = await collect(engine, request("count to five", max_output_tokens=100))
    assert "".join(deltas(events)) == "one two three four five"
    assert len(deltas(events)) > 3, "text should arrive token by token, not in one piece"
    assert finished(events).reason == "stop"


async def test_several_requests_run_at_once(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.reply = "a b c d e f g h"
    results = await asyncio.gather(*(collect(engine, request(f"q{i}")) for i in range(3)))
    assert all("".join(deltas(r)) == "a b c d e f g h" for r in results)
    assert standin.stats.peak_running == 3


# -- what reaches the engine -------------------------------------------------------------


async def test_passes_every_sampling_field(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    await collect(
        engine,
        request(
            "hi",
            max_output_tokens=7,
            temperature=0.3,
            top_p=0.9,
            seed=42,
            stop=("END",),
            frequency_penalty=0.5,
            presence_penalty=-1.5,
        ),
    )
    sp = standin.stats.requests[-1].sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.stop) == (7, 0.3, 0.9, 42, ["END"])
    assert (sp.frequency_penalty, sp.presence_penalty) == (0.5, -1.5)
    assert standin.stats.requests[-1].streaming is True


async def test_unset_fields_are_not_left_to_engine_defaults(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    # TensorRT-LLM would stop at 32 tokens and decode greedily.
    await collect(engine, request("hi"))
    record = standin.stats.requests[-1]
    sp = record.sampling_params
    assert sp.max_tokens == engine.max_seq_len - len(record.prompt_token_ids)
    from tensorrt_llm import SamplingParams as TrtSamplingParams

    greedy = TrtSamplingParams.params_imply_greedy_decoding
    assert not greedy(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)
    assert (sp.temperature, sp.top_p) == (trtllm.DEFAULT_TEMPERATURE, trtllm.DEFAULT_TOP_P)
    # Unset penalties are None: the C++ runtime's default, 0 (off).
    assert (sp.frequency_penalty, sp.presence_penalty) == (None, None)


async def test_prompt_is_the_chat_template_with_a_single_bos(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    req = GenerationRequest(
        "r", (Message("system", "be brief"), Message("user", "hello")), SamplingParams()
    )
    await collect(engine, req)
    record = standin.stats.requests[-1]
    template = standin.StandinTokenizer().apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt_text(engine, record) == template
    assert record.prompt_token_ids.count(standin.BOS_ID) == 1


async def test_a_prompt_that_fits_is_rendered_once(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    # Rendering the template runs on the event loop: once per request, not once per check.
    before = standin.stats.templates_rendered
    await collect(engine, request("hello", "hi there", "how are you?"))
    assert standin.stats.templates_rendered - before == 1


async def test_the_prompt_is_sent_as_token_ids_and_tokenized_once(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    # item 9: a text prompt would be tokenized a second time by generate_async, on the loop.
    end = finished(await collect(engine, request("what is in a name?")))
    record = standin.stats.requests[-1]
    assert standin.stats.prompts_encoded == 0
    assert record.prompt is None and record.prompt_token_ids
    assert end.usage.input_tokens == len(record.prompt_token_ids)


# -- continuing an answer (a takeover: issue 31) ----------------------------------------


async def test_a_continued_answer_is_the_prompts_ids_then_the_answers_own_ids(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    """The ids the deltas carried (the store keeps them in its log) go back as they
    were, after the prompt's: no re-tokenization, and the client sees one answer."""
    standin.controls.reply = "one two three four five six seven"
    whole = await collect(engine, request("count", max_output_tokens=50))
    uninterrupted = [e for e in whole if isinstance(e, TextDelta)]
    assert all(e.token_ids for e in uninterrupted)
    prompt_ids = standin.stats.requests[-1].prompt_token_ids
    sent = uninterrupted[:3]  # what the stopped gateway had sent
    so_far = "".join(e.text for e in sent)
    ids = tuple(i for e in sent for i in e.token_ids)
    events = await collect(
        engine,
        replace(
            request("count", max_output_tokens=50),
            continuation=so_far,
            continuation_token_ids=ids,
        ),
    )
    assert standin.stats.requests[-1].prompt_token_ids == [*prompt_ids, *ids]
    assert so_far + "".join(deltas(events)) == "one two three four five six seven"
    assert finished(events).usage == finished(whole).usage  # the whole answer's
    # And its budget is the whole answer's: 5 tokens in all, 3 of them sent before.
    cut = await collect(
        engine,
        replace(
            request("count", max_output_tokens=5),
            continuation=so_far,
            continuation_token_ids=ids,
        ),
    )
    assert finished(cut).reason == "length" and finished(cut).usage.output_tokens == 5
    assert so_far + "".join(deltas(cut)) == "one two three"


async def test_an_answer_without_its_token_ids_is_not_continued_from_its_text(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    before = len(standin.stats.requests)
    with pytest.raises(EngineError) as caught:
        await collect(engine, replace(request("count"), continuation="one two"))
    assert caught.value.code == "gateway_restarted"
    assert len(standin.stats.requests) == before  # never sent


async def test_a_chat_template_error_is_an_invalid_request(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    # item 9: strict templates (Llama 2, Mistral) refuse two user turns in a row.
    standin.controls.chat_template = "alternating"
    req = GenerationRequest(
        "r", (Message("user", "hi"), Message("user", "again")), SamplingParams()
    )
    with pytest.raises(EngineError) as info:
        await collect(engine, req)
    assert info.value.code == "chat_template_error"
    assert getattr(info.value, "error_type", None) == "invalid_request_error"
    assert "roles must alternate" in info.value.message
    assert standin.stats.requests == []


# -- finish reasons ----------------------------------------------------------------------


async def test_token_budget_ends_with_length(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.reply = "w " * 50
    events = await collect(engine, request("talk", max_output_tokens=5))
    end = finished(events)
    assert (end.reason, end.usage.output_tokens) == ("length", 5)


async def test_stop_string_is_never_streamed(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.reply = "alpha beta ST OP gamma"
    events = await collect(engine, request("go", stop=("ST OP",)))
    # "ST" alone might have been the start of the stop string: it must not leak out.
    assert "".join(deltas(events)) == "alpha beta "
    assert finished(events).reason == "stop"
    await wait_idle(standin)  # the engine side was aborted, not left generating


async def test_usage_counts_the_stop_string_tokens_that_were_generated(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    # item 8: TensorRT-LLM removes a matched stop word from token_ids; the model still
    # generated it, and usage must say so.
    standin.controls.reply = "alpha beta ST OP gamma"
    events = await collect(engine, request("go", stop=("ST OP",)))
    assert "".join(deltas(events)) == "alpha beta "
    assert finished(events).usage.output_tokens == tokens("alpha beta ST OP", standin)


async def test_a_stop_string_found_only_in_the_text_ends_the_answer(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    # "TOP" is inside the token "STOP": only the text can show it, not the token ids.
    standin.controls.reply = "alpha STOP beta gamma delta"
    events = await collect(engine, request("go", stop=("TOP",)))
    assert "".join(deltas(events)) == "alpha S"
    end = finished(events)
    assert end.reason == "stop" and end.usage.output_tokens == tokens("alpha STOP", standin)


async def test_engine_timeout_is_a_failure(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.finish_with = "timeout"
    with pytest.raises(EngineError) as info:
        await collect(engine, request("slow"))
    assert info.value.code == "engine_timeout"


async def test_cancel_we_did_not_ask_for_is_a_failure(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.finish_with = "cancelled"
    with pytest.raises(EngineError) as info:
        await collect(engine, request("x"))
    assert info.value.code == "engine_cancelled"


# -- cancellation ------------------------------------------------------------------------


async def test_cancelling_the_consumer_aborts_the_request(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.reply = "x " * 500
    task = await first_delta(engine, request("long answer please"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(standin)
    record = standin.stats.requests[-1]
    # Dropped by the abort, not run to its end (that would finish with "stop").
    assert record.aborted and record.finish_reason == "cancelled"


async def test_leaving_the_stream_early_aborts_the_request(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.reply = "y " * 500
    stream = engine.stream(request("go"))
    async for event in stream:
        if isinstance(event, TextDelta):  # after the prompt's count: the answer has begun
            break
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_idle(standin)
    assert standin.stats.requests[-1].aborted


async def test_the_prompts_tokens_come_first_so_a_cut_answer_reports_them(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    events = await collect(engine, request("count me"))
    first = events[0]
    assert isinstance(first, PromptTokens)
    assert first.input_tokens == finished(events).usage.input_tokens > 0


async def test_cancelling_an_answer_still_queued_in_tensorrt_llm(
    standin: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # item 6: TensorRT-LLM drops an aborted request that is still queued and never gives it
    # a final output. The cancel must end at once and leave nothing behind.
    standin.controls.reply = "z " * 500
    eng = standin_engine("--max-batch-size", "1")  # a second request waits in the queue
    await eng.start()
    outputs: list[weakref.ref[Any]] = []
    generate = eng.llm.generate_async

    def tracked(*args: Any, **kwargs: Any) -> Any:
        output = generate(*args, **kwargs)
        outputs.append(weakref.ref(output))
        return output

    monkeypatch.setattr(eng.llm, "generate_async", tracked)
    try:
        running = await first_delta(eng, request("first"))
        queued = asyncio.create_task(collect(eng, request("second")))
        assert await off_loop(lambda: standin.stats.wait_requests(2, 5.0))
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(queued, 1.0)
        record = standin.stats.requests[1]
        assert await off_loop(lambda: standin.stats.wait_until(lambda: record.dropped_in_queue))
        assert record.finish_reason is None  # never answered
        del queued
        gc.collect()
        assert outputs[1]() is None, "the adapter still holds the cancelled request's output"
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
    finally:
        await eng.close()


# -- usage and context -------------------------------------------------------------------


async def test_usage_counts_prompt_answer_and_cached_prefix(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.reply = "short reply"
    question = "tell me about the weather " * 5
    first = finished(await collect(engine, request(question)))
    record = standin.stats.requests[-1]
    assert first.usage.input_tokens == len(record.prompt_token_ids)
    assert first.usage.output_tokens == tokens("short reply", standin)
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert first.usage.cached_tokens == 0
    second = finished(await collect(engine, request(question, "short reply", "and now?")))
    # The first turn's blocks (32 tokens each) were reused.
    assert second.usage.cached_tokens > 0 and second.usage.cached_tokens % 32 == 0


async def test_prompt_beyond_context_is_refused_before_the_engine(
    standin: ModuleType,
) -> None:
    eng = standin_engine("--max-seq-len", "64")
    await eng.start()
    try:
        with pytest.raises(ContextOverflowError) as info:
            await collect(eng, request("word " * 200))
        assert info.value.code == "context_length_exceeded"
        assert "context window" in info.value.message
        assert standin.stats.requests == []
    finally:
        await eng.close()


async def test_old_turns_are_dropped_to_fit(standin: ModuleType) -> None:
    standin.controls.reply = "ok"
    eng = standin_engine("--max-seq-len", "96")
    await eng.start()
    try:
        events = await collect(
            eng, request("oldest " * 60, "reply", "newest question", max_output_tokens=16)
        )
        assert finished(events).reason == "stop"
        prompt = prompt_text(eng, standin.stats.requests[-1])
        assert "newest question" in prompt and "oldest" not in prompt
        assert standin.stats.templates_rendered == 2  # once per candidate: all, then trimmed
    finally:
        await eng.close()


async def test_the_kv_cache_size_caps_the_context(standin: ModuleType) -> None:
    # item 1: the model allows 2048 tokens, but a 256-token KV cache makes TensorRT-LLM's
    # worker cap its context at 256. The gateway must trim to that, not to 2048.
    standin.controls.reply = "ok"
    eng = standin_engine("--kv-cache-tokens", "256")
    await eng.start()
    try:
        assert eng.describe()["max_seq_len"] == 256
        assert "--kv-cache-tokens" in str(eng.describe()["context_source"])
        events = await collect(
            eng, request("oldest " * 150, "reply", "newest question", max_output_tokens=32)
        )
        assert finished(events).reason == "stop"
        prompt = prompt_text(eng, standin.stats.requests[-1])
        assert "newest question" in prompt and "oldest" not in prompt
    finally:
        await eng.close()


async def test_a_prompt_the_engine_finds_too_long_is_context_length_exceeded(
    standin: ModuleType,
) -> None:
    # item 1: the KV cache is sized by GPU memory (no flag says how big): the worker refuses
    # a prompt at or over its real limit with a request error.
    standin.controls.kv_cache_capacity = 128
    eng = standin_engine()
    await eng.start()
    try:
        with pytest.raises(EngineError) as info:
            await collect(eng, request("word " * 100))
        assert info.value.code == "context_length_exceeded"
    finally:
        await eng.close()


async def test_the_limit_learned_from_a_refusal_trims_old_turns(standin: ModuleType) -> None:
    # item 1: the refusal names the worker's max_seq_len; the gateway trims to it and retries.
    standin.controls.reply = "ok"
    standin.controls.kv_cache_capacity = 160
    eng = standin_engine()
    await eng.start()
    try:
        assert eng.describe()["max_seq_len"] == 2048  # all the front end can know at first
        events = await collect(
            eng, request("oldest " * 100, "reply", "newest question", max_output_tokens=16)
        )
        assert finished(events).reason == "stop"
        assert len(standin.stats.requests) == 2  # refused once, then trimmed and sent again
        assert "oldest" not in prompt_text(eng, standin.stats.requests[-1])
        assert eng.describe()["max_seq_len"] == 160
    finally:
        await eng.close()


# -- lifecycle ---------------------------------------------------------------------------


async def test_not_ready_until_loaded_and_loading_keeps_the_loop_free(
    standin: ModuleType,
) -> None:
    gate = threading.Event()
    standin.controls.load_gate = gate
    eng = standin_engine()
    starting = asyncio.create_task(eng.start())
    await asyncio.to_thread(lambda: None)  # the loop still runs other work meanwhile
    assert not eng.ready
    gate.set()
    await starting
    assert eng.ready
    kwargs = standin.stats.llm_kwargs[-1]
    assert kwargs["backend"] == "pytorch" and kwargs["max_batch_size"] == 16
    assert standin.stats.llm_threads[-1] is not threading.main_thread()  # item 10
    assert eng.capacity == 16
    await eng.close()
    assert not eng.ready and standin.stats.shutdowns == 1


async def test_load_on_main_thread_builds_before_the_server_starts(standin: ModuleType) -> None:
    # item 10: the documented fallback if building on a worker thread fails on a GPU.
    eng = standin_engine("--load-on-main-thread")
    assert standin.stats.llm_threads == [threading.main_thread()]  # built in from_args
    await eng.start()
    try:
        assert eng.ready and len(standin.stats.llm_kwargs) == 1
        assert finished(await collect(eng, request("hi"))).reason == "stop"
    finally:
        await eng.close()
    assert standin.stats.shutdowns == 1


async def test_a_start_cancelled_during_loading_leaves_no_engine_running(
    standin: ModuleType,
) -> None:
    gate = threading.Event()
    standin.controls.load_gate = gate
    eng = standin_engine()
    starting = asyncio.create_task(eng.start())
    assert await asyncio.to_thread(standin.stats.wait_llms, 1, 5.0)  # loading has begun
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    gate.set()  # the load finishes after start() gave up on it
    assert await asyncio.to_thread(standin.stats.wait_shutdowns, 1, 5.0)
    assert not eng.ready and eng.llm is None


async def test_a_cancel_while_start_winds_down_is_not_swallowed(
    standin: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = standin_engine()

    async def heartbeat(self: trtllm.TrtllmEngine, began: float) -> None:
        try:
            await asyncio.Event().wait()
        finally:  # start() loaded the model and is stopping this heartbeat: cancel it now
            starting.cancel()

    monkeypatch.setattr(trtllm.TrtllmEngine, "_log_while_loading", heartbeat)
    starting = asyncio.create_task(eng.start())
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not eng.ready and eng.llm is None
    assert standin.stats.shutdowns == 1  # the model it had loaded is gone


async def test_a_model_loaded_as_start_is_cancelled_is_shut_down_off_the_loop(
    standin: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real shutdown joins MPI workers: on the event loop it would stall every session.
    eng = standin_engine()
    loop = asyncio.get_running_loop()
    real_load = trtllm.TrtllmEngine._load

    def load_then_cancel(self: trtllm.TrtllmEngine) -> None:
        real_load(self)
        loop.call_soon_threadsafe(starting.cancel)  # reaches the loop before the result

    monkeypatch.setattr(trtllm.TrtllmEngine, "_load", load_then_cancel)
    starting = asyncio.create_task(eng.start())
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not eng.ready and eng.llm is None
    assert len(standin.stats.shutdown_threads) == 1
    assert standin.stats.shutdown_threads[0] is not threading.current_thread()


async def test_close_leaves_no_thread_of_the_engine(standin: ModuleType) -> None:
    threads_before = set(threading.enumerate())
    eng = standin_engine()
    await eng.start()
    finished(await collect(eng, request("hi")))
    await eng.close()
    assert standin.stats.shutdown_threads[0] is not threading.current_thread()
    assert set(threading.enumerate()) <= threads_before


async def test_close_after_a_cancelled_start_waits_for_the_loading_thread(
    standin: ModuleType,
) -> None:
    threads_before = set(threading.enumerate())
    gate = threading.Event()
    standin.controls.load_gate = gate
    eng = standin_engine()
    starting = asyncio.create_task(eng.start())
    assert await off_loop(lambda: standin.stats.wait_llms(1, 5.0))  # loading has begun
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    closing = asyncio.create_task(eng.close())
    gate.set()  # the load finishes only now, after start() gave up on it
    await asyncio.wait_for(closing, 10)
    assert standin.stats.shutdowns == 1  # the late model was shut down before close returned
    assert set(threading.enumerate()) <= threads_before


async def test_close_ends_a_running_stream_with_an_error(standin: ModuleType) -> None:
    # TensorRT-LLM's shutdown gives running requests no final output (the stand-in neither):
    # the engine must end its streams itself, or their consumers wait forever.
    standin.controls.reply = "x " * 500
    eng = standin_engine()
    await eng.start()
    consumer = await first_delta(eng, request("long answer please"))
    await asyncio.wait_for(eng.close(), 10)
    with pytest.raises(EngineError) as info:
        await asyncio.wait_for(consumer, 10)
    assert info.value.code == "engine_closed"
    record = standin.stats.requests[-1]
    assert record.abort_requested  # sent while the executor still ran
    assert standin.stats.running == 0


async def test_close_finishes_when_shutdown_reraises_a_background_error(
    standin: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    # item 7: TensorRT-LLM's shutdown re-raises a stored background error at its end.
    threads_before = set(threading.enumerate())
    eng = standin_engine()
    await eng.start()
    standin.fail_executor(eng.llm, RuntimeError("CUDA error: an illegal memory access"))
    await asyncio.wait_for(eng.close(), 10)  # must not raise
    assert standin.stats.shutdowns == 1 and not eng.ready
    assert set(threading.enumerate()) <= threads_before
    assert any("illegal memory access" in r.getMessage() for r in caplog.records)


async def test_flags_reach_the_llm(standin: ModuleType) -> None:
    args = make_args(
        "--model", MODEL, "--kv-cache-tokens", "4096", "--kv-cache-fraction", "0.5",
        "--max-batch-size", "8", "--tp-size", "1", "--max-num-tokens", "2048",
    )  # fmt: skip
    eng = trtllm.from_args(args)
    await eng.start()
    kwargs = standin.stats.llm_kwargs[-1]
    kv = kwargs["kv_cache_config"]
    assert (kv.max_tokens, kv.free_gpu_memory_fraction, kv.enable_block_reuse) == (4096, 0.5, True)
    assert (kwargs["max_batch_size"], kwargs["max_num_tokens"]) == (8, 2048)
    assert kwargs["tensor_parallel_size"] == 1 and kwargs["model"] == MODEL
    assert eng.capacity == 8 and eng.describe()["max_seq_len"] == 2048
    await eng.close()


# -- a dead executor (item 3) --------------------------------------------------------------


async def test_a_dead_worker_fails_live_answers_and_the_engine(
    standin: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    # The worker process dies: TensorRT-LLM's pending outputs never get another response.
    standin.controls.reply = "x " * 500
    standin.controls.worker_process = True
    eng = watched_engine()
    await eng.start()
    try:
        caplog.set_level(logging.INFO, logger="gateway.engines.trtllm")
        live = await first_delta(eng, request("long answer please"))
        os.kill(standin.stats.worker_pids[-1], signal.SIGKILL)
        with pytest.raises(EngineError) as info:
            await asyncio.wait_for(live, 5)
        assert info.value.code == "engine_unavailable"
        assert not eng.ready and eng.failure is not None and "died" in eng.failure
        requests_so_far = len(standin.stats.requests)
        with pytest.raises(EngineError) as later:
            await collect(eng, request("hello?"))
        assert later.value.code == "engine_unavailable"
        assert len(standin.stats.requests) == requests_so_far  # never sent to TensorRT-LLM
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "died" in errors[0].getMessage()
    finally:
        await eng.close()
    assert threading.main_thread() not in standin.stats.shutdown_threads


async def test_a_fatal_executor_error_is_never_handled_on_the_event_loop(
    standin: ModuleType,
) -> None:
    # TensorRT-LLM shuts a failed executor down on whichever thread next submits or reads
    # a response. The adapter must find out first, and shut down off the loop.
    eng = standin_engine()  # the periodic check is far away: only the request notices
    await eng.start()
    try:
        standin.fail_executor(eng.llm, RuntimeError("Executor worker died"))
        with pytest.raises(EngineError) as info:
            await collect(eng, request("hello"))
        assert info.value.code == "engine_unavailable" and not eng.ready
        assert standin.stats.requests == []
    finally:
        await eng.close()
    assert standin.stats.shutdowns == 1
    assert threading.main_thread() not in standin.stats.shutdown_threads


async def test_a_fatal_error_an_output_raises_is_the_failure_reported(
    standin: ModuleType,
) -> None:
    # The worker's death can reach a streaming output before the periodic check sees it:
    # TensorRT-LLM then takes the error off its queue, shuts the executor down and raises
    # it. The failure the gateway reports must be that error, not a bare "shut down".
    standin.controls.reply = "z " * 1000
    eng = standin_engine()  # the periodic check is far away: only the output notices
    await eng.start()
    try:
        stream = eng.stream(request("ramble"))
        while not isinstance(await anext(stream), TextDelta):
            pass
        eng.llm._executor._error_queue.put(RuntimeError("Executor worker died (exit code -9)"))
        with pytest.raises(EngineError) as info:
            async for _ in stream:
                pass
        assert info.value.code == "engine_unavailable"
        assert "Executor worker died" in str(info.value)
        assert "Executor worker died" in (eng.failure or "")
    finally:
        await eng.close()


async def test_the_gateway_reports_a_dead_engine(standin: ModuleType) -> None:
    standin.controls.reply = "z " * 1000
    standin.controls.worker_process = True
    async with running_gateway(watched_engine()) as gw:
        assert (await gw.get("/readyz"))[0] == 200
        async with RawClient.connect(gw.ws_url) as client:
            await client.say("ramble")
            await client.send({"type": "response.create"})
            await client.recv_until("response.output_text.delta")
            os.kill(standin.stats.worker_pids[-1], signal.SIGKILL)
            done = await client.recv_until("response.done")
            assert done["response"]["status"] == "failed"
            error = done["response"]["status_details"]["error"]
            assert error["code"] == "engine_unavailable"
        assert (await gw.get("/readyz"))[0] == 503
        assert gw.gateway.engine_failed.is_set()
        assert "died" in (await gw.get_json("/healthz"))["engine_details"]["failure"]


def _children(pid: int) -> list[int]:
    """Child process ids of ``pid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_the_cli_exits_when_the_engine_dies() -> None:
    # item 3: like trtllm-serve, the gateway stops (exit status 2) so a supervisor restarts it.
    env = {**os.environ, "PYTHONPATH": str(STANDIN_ROOT), "TRTLLM_STANDIN_WORKER_PROCESS": "1"}
    command = [sys.executable, "-m", "gateway", "--engine", "trtllm", "--model", MODEL]
    process = subprocess.Popen(
        [*command, "--port", "0", "--log-level", "WARNING"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not (workers := _children(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.05)
        time.sleep(0.2)  # let the engine finish starting (its check begins once ready)
        os.kill(workers[0], signal.SIGKILL)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 2, err
    lines = err.strip().splitlines()
    assert any("ERROR" in line and "died" in line for line in lines), err
    assert lines[-1].startswith("llm-gateway: ") and "restart" in lines[-1], err


# -- installing and the command line (items 4 and 5) ---------------------------------------


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # as if not installed
    with pytest.raises(EngineUnavailableError) as info:
        trtllm.from_args(make_args("--model", MODEL))
    message = str(info.value)
    assert "pip install -e '.[trtllm]'" in message and "NVIDIA GPU" in message
    assert "container" in message and "3.12" in message  # the routes that work
    assert "\n" not in message


def test_model_is_required(standin: ModuleType) -> None:
    with pytest.raises(EngineUnavailableError, match="--model"):
        trtllm.from_args(make_args())


def test_adding_flags_does_not_import_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_tensorrt_llm(monkeypatch)
    make_args("--model", MODEL)
    assert "tensorrt_llm" not in sys.modules


def test_cli_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.__main__ import main

    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # as if not installed
    assert main(["--engine", "trtllm", "--model", MODEL]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install -e '.[trtllm]'" in err
    assert "container" in err


def test_cli_prints_the_install_route_when_the_import_fails(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # item 4: the package is there but cannot be imported (a Python without a shared
    # libpython, a CUDA mismatch): one line with the route and the import error.
    from gateway.__main__ import main

    package = tmp_path / "tensorrt_llm"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libpython3.12.so.1.0: cannot open shared object file')\n"
    )
    _forget_tensorrt_llm(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--engine", "trtllm", "--model", MODEL, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("llm-gateway: ") and "container" in err and "libpython3.12" in err


def test_cli_refuses_several_workers_with_trtllm(
    standin: ModuleType, capfd: pytest.CaptureFixture[str]
) -> None:
    # item 5: each worker would build its own LLM and claim most of the GPU for its cache.
    from gateway.__main__ import main

    assert main(["--engine", "trtllm", "--model", MODEL, "--workers", "2"]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--workers" in err and "upstream" in err
    assert standin.stats.llm_kwargs == []


# -- the stand-in itself is as strict as the real API --------------------------------------


def test_standin_output_is_bound_to_the_loop_it_was_created_on(standin: ModuleType) -> None:
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM(model=MODEL)
    try:

        async def create() -> Any:
            return llm.generate_async("hi", SamplingParams(max_tokens=2), streaming=True)

        output = asyncio.run(create())

        async def iterate() -> None:
            async for _ in output:
                pass

        with pytest.raises(RuntimeError, match="different event loop"):
            asyncio.run(iterate())
    finally:
        llm.shutdown()


def test_standin_rejects_what_the_real_api_rejects(standin: ModuleType) -> None:
    from tensorrt_llm import LLM, SamplingParams

    assert SamplingParams().max_tokens == 32
    assert not hasattr(SamplingParams, "is_greedy") and not hasattr(SamplingParams, "stop_strings")
    with pytest.raises(TypeError):
        SamplingParams(max_new_tokens=5)  # type: ignore[call-arg]
    for bad in ({"top_p": 1.5}, {"top_p": -0.1}, {"temperature": -1.0}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="invalid argument"):
        LLM(model=MODEL, max_seq_length=10)
    llm = LLM(model=MODEL)
    try:
        assert llm.args.max_seq_len is None and not hasattr(llm, "_max_seq_len")
    finally:
        llm.shutdown()


async def test_standin_worker_refuses_a_seed_outside_uint64(standin: ModuleType) -> None:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import RequestError

    llm = LLM(model=MODEL)
    try:
        output = llm.generate_async([5, 6, 7], SamplingParams(seed=-1), streaming=True)
        with pytest.raises(RequestError, match="unsigned 64-bit"):
            async for _ in output:
                pass
    finally:
        await off_loop(lambda: llm.shutdown() is None)


async def test_standin_worker_cuts_max_tokens_and_refuses_a_full_prompt(
    standin: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import RequestError

    standin.controls.reply = "w " * 100
    llm = LLM(model=MODEL, max_seq_len=40)
    try:
        out = await llm.generate_async([5] * 30, SamplingParams(max_tokens=50), streaming=True)
        assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
        assert any("greater than deduced" in r.getMessage() for r in caplog.records)
        full = llm.generate_async([5] * 40, SamplingParams(max_tokens=1), streaming=True)
        with pytest.raises(RequestError, match=r"max_seq_len \(40\)"):
            async for _ in full:
                pass
    finally:
        await off_loop(lambda: llm.shutdown() is None)


# -- the whole gateway on the stand-in, through a real socket -------------------------------


async def test_gateway_serves_trtllm_end_to_end(standin: ModuleType) -> None:
    standin.controls.reply = "Paris is the capital of France."
    async with running_gateway(standin_engine()) as gw:
        health = await gw.get_json("/healthz")
        assert health["engine"] == "trtllm"
        details = health["engine_details"]  # item 1: the context limit and where it came from
        assert details["max_seq_len"] == 2048 and "max_position_embeddings" in str(
            details["context_source"]
        )
        async with RawClient.connect(gw.ws_url) as client:
            await client.say("What is the capital of France?")
            turn = await client.respond(max_output_tokens=50)
        assert turn.status == "completed"
        assert turn.text == turn.final_text == "Paris is the capital of France."
        usage = turn.response["usage"]
        record = standin.stats.requests[-1]
        assert usage["input_tokens"] == len(record.prompt_token_ids)
        assert usage["output_tokens"] == tokens(turn.text, standin)
        assert "What is the capital of France?" in prompt_text(gw.gateway.engine, record)  # type: ignore[arg-type]


async def test_a_seed_outside_uint64_is_refused_at_the_protocol_boundary(
    standin: ModuleType,
) -> None:
    # item 2: a negative seed would reach TensorRT-LLM and fail the answer in its worker.
    async with running_gateway(standin_engine()) as gw:
        async with RawClient.connect(gw.ws_url) as client:
            for seed in ("-1", "18446744073709551616"):  # 2**64: past what orjson can write
                await client.ws.send(f'{{"type": "session.update", "session": {{"seed": {seed}}}}}')
                error = await client.recv_until("error")
                assert error["error"]["type"] == "invalid_request_error"
                assert error["error"]["param"] == "session.seed"
            await client.send({"type": "session.update", "session": {"seed": 2**64 - 1}})
            assert (await client.recv_until("session.updated"))["session"]["seed"] == 2**64 - 1
            await client.say("hello")
            turn = await client.respond(max_output_tokens=8)
        assert turn.status in ("completed", "incomplete")
        assert standin.stats.requests[-1].sampling_params.seed == 2**64 - 1


async def test_a_chat_template_error_reaches_the_client_as_an_invalid_request(
    standin: ModuleType,
) -> None:
    # item 9: Gemma-style templates refuse the system role.
    standin.controls.chat_template = "no_system"
    async with running_gateway(standin_engine()) as gw, RawClient.connect(gw.ws_url) as client:
        await client.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        await client.recv_until("session.updated")
        await client.say("hello")
        await client.send({"type": "response.create"})
        error = await client.recv_until("error")
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["code"] == "chat_template_error"
        assert "System role not supported" in error["error"]["message"]
        done = await client.recv_until("response.done")
        assert done["response"]["status"] == "failed"
        # The connection keeps working: without instructions the template renders.
        await client.send({"type": "session.update", "session": {"instructions": ""}})
        await client.recv_until("session.updated")
        assert (await client.respond(max_output_tokens=8)).status in ("completed", "incomplete")


async def test_response_cancel_aborts_in_the_engine(standin: ModuleType) -> None:
    standin.controls.reply = "z " * 1000
    async with running_gateway(standin_engine()) as gw:
        async with RawClient.connect(gw.ws_url) as client:
            await client.say("ramble")
            await client.send({"type": "response.create"})
            await client.recv_until("response.output_text.delta")
            await client.send({"type": "response.cancel"})
            done = await client.recv_until("response.done")
        assert done["response"]["status"] == "cancelled"
        await wait_idle(standin)
        record = standin.stats.requests[-1]
        assert record.aborted and record.finish_reason == "cancelled"


async def test_disconnect_aborts_in_the_engine(standin: ModuleType) -> None:
    standin.controls.reply = "z " * 1000
    async with running_gateway(standin_engine()) as gw:
        async with RawClient.connect(gw.ws_url) as client:
            await client.say("ramble")
            await client.send({"type": "response.create"})
            await client.recv_until("response.output_text.delta")
        # The socket is closed mid-answer: the gateway must abort the request.
        await gw.wait_idle()
        await wait_idle(standin)
        record = standin.stats.requests[-1]
        assert record.aborted and record.finish_reason == "cancelled"


def test_smoke_script_runs_on_the_standin() -> None:
    # bench/trtllm_smoke.py is for GPU machines; on the stand-in it checks the script's
    # own logic (the three modes, the gateway in-process, a mid-stream cancel, and the
    # checks of items 1, 3 and 10 and of issues 31, 38 and 39) so that it cannot rot.
    env = {**os.environ, "PYTHONPATH": str(STANDIN_ROOT), "TRTLLM_STANDIN_WORKER_PROCESS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trtllm_smoke.py"), "--model", MODEL],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for label in ("[sync llm.generate]", "[async gather]", "[async streaming]", "cancelled"):
        assert label in result.stdout
    for item in (
        "item 1",
        "item 3",
        "item 10",
        "issue 31",
        "issue 38",
        "issue 38 structured",
        "issue 39",
    ):
        assert f"[{item}] PASS" in result.stdout, result.stdout


async def test_chat_completions_serve_trtllm(standin: ModuleType) -> None:
    standin.controls.reply = "Paris is the capital of France."
    async with running_gateway(standin_engine()) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0)
        async with client:
            question: Any = [{"role": "user", "content": "What is the capital of France?"}]
            stream = await client.chat.completions.create(
                model="default", messages=question, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "Paris is the capital of France."
            usage = chunks[-1].usage
            assert usage is not None
            assert usage.prompt_tokens == len(standin.stats.requests[-1].prompt_token_ids)
            whole = await client.chat.completions.create(model="default", messages=question)
            assert whole.choices[0].message.content == text
            assert whole.choices[0].finish_reason == "stop"


async def test_the_responses_websocket_serves_trtllm(standin: ModuleType) -> None:
    standin.controls.reply = "Paris is the capital of France."
    async with running_gateway(standin_engine()) as gw:
        url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
        async with ResponsesClient.connect(url) as client:
            turn = await client.respond(input="What is the capital of France?")
            assert turn.text == turn.output_text == "Paris is the capital of France."
            usage = turn.response["usage"]
            assert usage["input_tokens"] == len(standin.stats.requests[-1].prompt_token_ids)
            warm = await client.respond(input="More?", previous_response_id=turn.id, generate=False)
            assert warm.response["output"] == []


async def test_a_takeover_continues_the_answer_from_the_token_ids_in_the_store(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31: the gateway generating an answer is killed; the one that takes the session
    over sends the stand-in the prompt's ids and then the ids the answer's deltas were
    generated from, read back from Redis (without them it could not continue at all: see
    test_an_answer_without_its_token_ids_is_not_continued_from_its_text). The client sees
    one answer, and usage counts all of it."""
    reply = " ".join(f"w{i}" for i in range(40))
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(filter(None, [str(STANDIN_ROOT), os.environ.get("PYTHONPATH")])),
    )
    monkeypatch.setenv("TRTLLM_STANDIN_REPLY", reply)
    monkeypatch.setenv("TRTLLM_STANDIN_STEP_S", "0.02")
    engine = ("--engine", "trtllm", "--model", MODEL)
    async with gateways(redis_server.url, 2, engine=engine) as (a, b):
        chat = Chat()
        await chat.open(a.url())
        await chat.ask("Count")
        await chat.deltas(10)
        a.kill()
        with contextlib.suppress(Exception):
            while True:
                await chat.recv()
        assert (await chat.resume(b.url()))["type"] == "session.resumed"
        await chat.finish(b.url())
        chat.check_whole()
        moved = [e for e in chat.events if e["type"] == "response.done"][-1]["response"]
        assert moved["output"][0]["content"][0]["text"] == reply
        assert any("took over session" in line for line in b.log)
        # The same question, uninterrupted, on B: the same usage.
        fresh = Chat()
        await fresh.open(b.url())
        await fresh.ask("Count")
        whole = (await fresh.until("response.done"))["response"]
        assert moved["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
        assert moved["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
