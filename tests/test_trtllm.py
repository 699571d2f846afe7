"""The TensorRT-LLM adapter against the stand-in in tests/trtllm_standin (no GPU needed).

The stand-in follows the documented LLM API (see tests/trtllm_standin/README.md); it is put
on sys.path only by the ``standin`` fixture, so nothing else ever imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway.engines import trtllm
from gateway.engines.base import (
    ContextOverflowError,
    EngineError,
    EngineUnavailableError,
    Finished,
    GenerationRequest,
    Message,
    SamplingParams,
    StreamEvent,
    TextDelta,
)
from tests.harness import RawClient, running_gateway

STANDIN_ROOT = Path(__file__).parent / "trtllm_standin"
MODEL = "standin/tiny-chat"


def _forget_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """Put the stand-in ``tensorrt_llm`` on sys.path for this test only; yield its controls."""
    _forget_tensorrt_llm(monkeypatch)
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


@pytest.fixture
async def engine(standin: ModuleType) -> AsyncIterator[trtllm.TrtllmEngine]:
    eng = trtllm.from_args(make_args("--model", MODEL, "--max-batch-size", "4"))
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
        request("hi", max_output_tokens=7, temperature=0.3, top_p=0.9, seed=42, stop=("END",)),
    )
    sp = standin.stats.requests[-1].sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.stop) == (7, 0.3, 0.9, 42, ["END"])
    assert sp.add_special_tokens is False
    assert standin.stats.requests[-1].streaming is True


async def test_unset_fields_are_not_left_to_engine_defaults(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    # TensorRT-LLM would stop at 32 tokens and decode greedily.
    await collect(engine, request("hi"))
    record = standin.stats.requests[-1]
    sp = record.sampling_params
    assert sp.max_tokens == engine.max_seq_len - len(record.prompt_token_ids)
    assert not sp.is_greedy
    assert (sp.temperature, sp.top_p) == (trtllm.DEFAULT_TEMPERATURE, trtllm.DEFAULT_TOP_P)


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
    assert record.prompt == template
    assert record.prompt_token_ids.count(standin.BOS_ID) == 1


async def test_a_prompt_that_fits_is_rendered_once(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    # Rendering the template runs on the event loop: once per request, not once per check.
    before = standin.stats.templates_rendered
    await collect(engine, request("hello", "hi there", "how are you?"))
    assert standin.stats.templates_rendered - before == 1


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
    first = asyncio.Event()

    async def consume() -> None:
        async for event in engine.stream(request("long answer please")):
            if isinstance(event, TextDelta):
                first.set()

    task = asyncio.create_task(consume())
    await first.wait()
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
    async for _ in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_idle(standin)
    assert standin.stats.requests[-1].aborted


# -- usage and context -------------------------------------------------------------------


async def test_usage_counts_prompt_answer_and_cached_prefix(
    engine: trtllm.TrtllmEngine, standin: ModuleType
) -> None:
    standin.controls.reply = "short reply"
    first = finished(await collect(engine, request("tell me about the weather " * 4)))
    record = standin.stats.requests[-1]
    assert first.usage.input_tokens == len(record.prompt_token_ids)
    assert first.usage.output_tokens == len(standin.StandinTokenizer().encode("short reply", False))
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert first.usage.cached_tokens == 0
    second = finished(
        await collect(engine, request("tell me about the weather " * 4, "short reply", "and now?"))
    )
    assert second.usage.cached_tokens > 0  # the first turn's blocks were reused


async def test_prompt_beyond_context_is_refused_before_the_engine(
    standin: ModuleType,
) -> None:
    eng = trtllm.from_args(make_args("--model", MODEL, "--max-seq-len", "64"))
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
    eng = trtllm.from_args(make_args("--model", MODEL, "--max-seq-len", "96"))
    await eng.start()
    try:
        events = await collect(
            eng, request("oldest " * 60, "reply", "newest question", max_output_tokens=16)
        )
        assert finished(events).reason == "stop"
        prompt = standin.stats.requests[-1].prompt
        assert "newest question" in prompt and "oldest" not in prompt
        assert standin.stats.templates_rendered == 2  # once per candidate: all, then trimmed
    finally:
        await eng.close()


# -- lifecycle ---------------------------------------------------------------------------


async def test_not_ready_until_loaded_and_loading_keeps_the_loop_free(
    standin: ModuleType,
) -> None:
    gate = threading.Event()
    standin.controls.load_gate = gate
    eng = trtllm.from_args(make_args("--model", MODEL))
    starting = asyncio.create_task(eng.start())
    await asyncio.to_thread(lambda: None)  # the loop still runs other work meanwhile
    assert not eng.ready
    gate.set()
    await starting
    assert eng.ready
    kwargs = standin.stats.llm_kwargs[-1]
    assert kwargs["backend"] == "pytorch" and kwargs["max_batch_size"] == 16
    assert eng.capacity == 16
    await eng.close()
    assert not eng.ready and standin.stats.shutdowns == 1


async def test_a_start_cancelled_during_loading_leaves_no_engine_running(
    standin: ModuleType,
) -> None:
    gate = threading.Event()
    standin.controls.load_gate = gate
    eng = trtllm.from_args(make_args("--model", MODEL))
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
    eng = trtllm.from_args(make_args("--model", MODEL))

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
    eng = trtllm.from_args(make_args("--model", MODEL))
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
    eng = trtllm.from_args(make_args("--model", MODEL))
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
    eng = trtllm.from_args(make_args("--model", MODEL))
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
    eng = trtllm.from_args(make_args("--model", MODEL))
    await eng.start()
    first = asyncio.Event()

    async def consume() -> None:
        async for event in eng.stream(request("long answer please")):
            if isinstance(event, TextDelta):
                first.set()

    consumer = asyncio.create_task(consume())
    await first.wait()
    await asyncio.wait_for(eng.close(), 10)
    with pytest.raises(EngineError) as info:
        await asyncio.wait_for(consumer, 10)
    assert info.value.code == "engine_closed"
    record = standin.stats.requests[-1]
    assert record.abort_requested  # sent while the executor still ran
    assert standin.stats.running == 0


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


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # as if not installed
    with pytest.raises(EngineUnavailableError) as info:
        trtllm.from_args(make_args("--model", MODEL))
    message = str(info.value)
    assert "pip install -e '.[trtllm]'" in message and "NVIDIA GPU" in message
    assert "\n" not in message


def test_model_is_required(standin: ModuleType) -> None:
    with pytest.raises(EngineUnavailableError, match="--model"):
        trtllm.from_args(make_args())


def test_adding_flags_does_not_import_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_tensorrt_llm(monkeypatch)
    make_args("--model", MODEL)
    assert "tensorrt_llm" not in sys.modules


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

    assert SamplingParams().max_tokens == 32 and SamplingParams().is_greedy
    with pytest.raises(TypeError):
        SamplingParams(max_new_tokens=5)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="invalid argument"):
        LLM(model=MODEL, max_seq_length=10)


# -- the whole gateway on the stand-in, through a real socket -------------------------------


def standin_engine(*argv: str) -> trtllm.TrtllmEngine:
    return trtllm.from_args(make_args("--model", MODEL, *argv))


async def test_gateway_serves_trtllm_end_to_end(standin: ModuleType) -> None:
    standin.controls.reply = "Paris is the capital of France."
    async with running_gateway(standin_engine()) as gw:
        assert (await gw.get_json("/healthz"))["engine"] == "trtllm"
        async with RawClient.connect(gw.ws_url) as client:
            await client.say("What is the capital of France?")
            turn = await client.respond(max_output_tokens=50)
        assert turn.status == "completed"
        assert turn.text == turn.final_text == "Paris is the capital of France."
        usage = turn.response["usage"]
        record = standin.stats.requests[-1]
        assert usage["input_tokens"] == len(record.prompt_token_ids)
        assert usage["output_tokens"] == len(standin.StandinTokenizer().encode(turn.text, False))
        assert "What is the capital of France?" in record.prompt


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


def test_cli_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.__main__ import main

    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # as if not installed
    assert main(["--engine", "trtllm", "--model", MODEL]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install -e '.[trtllm]'" in err


def test_smoke_script_runs_on_the_standin() -> None:
    # bench/trtllm_smoke.py is for GPU machines; on the stand-in it checks the script's
    # own logic (three modes, gateway in-process, mid-stream cancel) so it cannot rot.
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(STANDIN_ROOT)}
    result = subprocess.run(
        [sys.executable, str(root / "bench" / "trtllm_smoke.py"), "--model", MODEL],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for label in ("[sync llm.generate]", "[async gather]", "[async streaming]", "cancelled"):
        assert label in result.stdout
