"""NVIDIA TensorRT-LLM engine (LLM API, PyTorch backend), streamed with ``generate_async``.

A thin adapter over exactly these calls (TensorRT-LLM 1.x):

- ``LLM(model=..., backend="pytorch", kv_cache_config=KvCacheConfig(...), max_batch_size=...,
  max_num_tokens=..., tensor_parallel_size=...)``, built in a worker thread because it takes
  minutes; ``ready`` stays False until it returns.
- ``llm.generate_async(prompt, SamplingParams(...), streaming=True)`` returns a
  ``RequestOutput`` at once. It binds to the event loop running at that call, so it is called
  inside the very coroutine that iterates it. ``async for out in request_output`` yields the
  same object, updated cumulatively.
- ``request_output.abort()`` is fire-and-forget; the engine drops the request within an
  iteration or two and frees its KV cache blocks. Whenever the stream is left before the
  request finished (task cancelled, generator closed, error), ``abort()`` is called.
- ``llm.shutdown()`` joins the MPI workers, so it runs on a thread. It queues aborts for the
  requests still running but does not promise them a final output: :meth:`TrtllmEngine.close`
  ends its own streams first (``engine_closed``), so no consumer waits on a dead executor.

Blocking calls (loading, shutting down) each run on a thread of their own that the call
joins; ``close()`` also joins any such thread a cancelled ``start()`` left running, so no
thread of the engine outlives it.

``tensorrt_llm`` is imported only in :meth:`TrtllmEngine.start`; ``add_arguments`` and
``from_args`` never import it, so the gateway runs without it for the other engines.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.engines.base import (
    ContextOverflowError,
    Engine,
    EngineError,
    EngineUnavailableError,
    Finished,
    FinishReason,
    GenerationRequest,
    Message,
    SamplingParams,
    StreamEvent,
    TextDelta,
    Usage,
    chat_messages,
    fit_to_context,
)
from gateway.engines.openai_chat import tools_body
from gateway.engines.toolparse import SUPPORTED, ToolCallText, detect_format

log = logging.getLogger(__name__)
T = TypeVar("T")

INSTALL_HINT = (
    "the trtllm engine needs NVIDIA TensorRT-LLM: on a machine with an NVIDIA GPU run "
    "pip install -e '.[trtllm]'"
)
# Used when a session leaves a field unset: TensorRT-LLM would otherwise decode greedily.
DEFAULT_TEMPERATURE = 0.8  # the OpenAI Realtime API's default
DEFAULT_TOP_P = 1.0
# Prompt budget kept free for the answer when the answer's own budget is "inf".
DEFAULT_ANSWER_RESERVE = 512
LOAD_HEARTBEAT_S = 15.0


@dataclass(frozen=True, slots=True)
class TrtllmSettings:
    model: str
    max_batch_size: int = 16
    max_num_tokens: int = 8192
    max_seq_len: int | None = None  # None: from the loaded model's config
    kv_cache_tokens: int | None = None
    kv_cache_fraction: float | None = None
    tp_size: int = 1


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Flags for ``--engine trtllm``; importing tensorrt_llm is deferred to start()."""
    group.add_argument(
        "--max-batch-size",
        type=int,
        default=16,
        help="requests TensorRT-LLM runs at once (the default --max-running)",
    )
    group.add_argument(
        "--max-num-tokens",
        type=int,
        default=8192,
        help="tokens per engine iteration; also the longest prompt TensorRT-LLM accepts",
    )
    group.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="context window (prompt + answer) in tokens; default: the model's own",
    )
    group.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens (KvCacheConfig.max_tokens); default: by memory fraction",
    )
    group.add_argument(
        "--kv-cache-fraction",
        type=float,
        default=None,
        help="share of free GPU memory for the KV cache (KvCacheConfig.free_gpu_memory_fraction,"
        " TensorRT-LLM's default 0.9)",
    )
    group.add_argument("--tp-size", type=int, default=1, help="tensor-parallel GPUs")


def from_args(args: argparse.Namespace) -> TrtllmEngine:
    """Check what can be checked cheaply (package present, model given) before loading."""
    if not tensorrt_llm_installed():
        raise EngineUnavailableError(INSTALL_HINT)
    if not args.model:
        raise EngineUnavailableError(
            "the trtllm engine needs --model: a Hugging Face model id or a local checkpoint "
            "directory, e.g. --model TinyLlama/TinyLlama-1.1B-Chat-v1.0"
        )
    return TrtllmEngine(
        TrtllmSettings(
            model=args.model,
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
            max_seq_len=args.max_seq_len,
            kv_cache_tokens=args.kv_cache_tokens,
            kv_cache_fraction=args.kv_cache_fraction,
            tp_size=args.tp_size,
        )
    )


def tensorrt_llm_installed() -> bool:
    """True if ``tensorrt_llm`` can be found, without importing it (importing is slow)."""
    try:
        return importlib.util.find_spec("tensorrt_llm") is not None
    except ValueError:  # sys.modules["tensorrt_llm"] is None: import deliberately blocked
        return False


def _import_tensorrt_llm() -> tuple[Any, Any]:
    """Import the package; return (tensorrt_llm, tensorrt_llm.llmapi)."""
    try:
        trtllm = importlib.import_module("tensorrt_llm")
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
    except ImportError as exc:
        raise EngineUnavailableError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return trtllm, llmapi


class TrtllmEngine(Engine):
    """One shared TensorRT-LLM ``LLM``; every generation is one streaming request."""

    name = "trtllm"

    def __init__(self, settings: TrtllmSettings, *, llm: Any = None) -> None:
        """``llm``: an already loaded ``tensorrt_llm.LLM`` to serve instead of loading one
        (bench/trtllm_smoke.py shares its LLM this way); ``settings.model`` must name it."""
        self.settings = settings
        self._llm: Any = None
        self._preloaded = llm
        self._sampling_cls: Any = None
        # start() may be cancelled while the loading thread runs on; whichever of the two
        # comes second shuts the new LLM down, so no engine outlives a cancelled start.
        self._load_lock = threading.Lock()
        self._abandoned = False
        self._max_seq_len = 0
        self._prompt_limit = 0
        self._threads: set[threading.Thread] = set()  # started by _in_thread, not yet joined
        self._live: set[_LiveStream] = set()  # streams between generate_async and their end

    @property
    def capacity(self) -> int:
        return self.settings.max_batch_size

    @property
    def llm(self) -> Any:
        """The loaded ``tensorrt_llm.LLM`` (None before start), for benchmarks and diagnostics."""
        return self._llm

    @property
    def max_seq_len(self) -> int:
        """The context window (prompt + answer), known once started."""
        return self._max_seq_len

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Import and load off the event loop, logging progress; then mark ready."""
        began = time.monotonic()
        if self._preloaded is None:
            log.info("trtllm: loading %s (this can take minutes)", self.settings.model)
        heartbeat = asyncio.create_task(self._log_while_loading(began))
        try:
            try:
                await self._in_thread(self._load, "load")
            finally:
                heartbeat.cancel()
                # asyncio.wait never raises the heartbeat's own cancellation, so a cancel
                # of start() that lands here still propagates, and is handled below.
                await asyncio.wait((heartbeat,))
        except asyncio.CancelledError:
            await self._abandon()
            raise
        if self._llm is None:  # close() ran while the model was loading
            raise EngineError("engine_closed", "the TensorRT-LLM engine was closed while loading")
        self._max_seq_len = self._resolve_max_seq_len()
        self._prompt_limit = min(self._max_seq_len - 1, self._max_num_tokens())
        self._ready = True
        log.info(
            "trtllm: %s ready in %.1fs (context %d tokens, batch %d)",
            self.settings.model,
            time.monotonic() - began,
            self._max_seq_len,
            self.settings.max_batch_size,
        )

    async def _log_while_loading(self, began: float) -> None:
        while True:
            await asyncio.sleep(LOAD_HEARTBEAT_S)
            log.info("trtllm: still loading (%.0fs)", time.monotonic() - began)

    def _load(self) -> None:
        """In a worker thread: import, build the LLM, and keep it unless start() gave up."""
        trtllm, llmapi = _import_tensorrt_llm()
        llm = self._preloaded if self._preloaded is not None else self._build(trtllm, llmapi)
        with self._load_lock:
            if not self._abandoned:
                self._llm, self._sampling_cls = llm, trtllm.SamplingParams
                return
        log.info("trtllm: start was cancelled during loading; shutting the model down")
        llm.shutdown()

    async def _abandon(self) -> None:
        """Keep no LLM: one loaded already is shut down, one still loading shuts itself down."""
        with self._load_lock:
            self._abandoned = True
            llm, self._llm = self._llm, None
        if llm is not None:  # loaded just before the cancel landed
            await self._in_thread(llm.shutdown, "shutdown")

    async def _in_thread(self, fn: Callable[[], T], name: str) -> T:
        """Run blocking ``fn`` on a thread of its own, joined once it has handed back its result.

        Not ``asyncio.to_thread``: the default executor's threads outlive the call. If the
        caller is cancelled the work (which cannot be interrupted) still completes on its
        thread; that thread stays in ``_threads`` and :meth:`close` joins it.
        """
        # wrap_future hands the outcome to the loop, and drops it if that loop is gone.
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        thread = threading.Thread(target=run, name=f"trtllm-{name}", daemon=True)
        self._threads.add(thread)
        thread.start()
        value = await asyncio.shield(asyncio.wrap_future(done))
        thread.join()  # it has handed over its result: only its exit is left
        self._threads.discard(thread)
        return value

    async def _join_threads(self) -> None:
        """Wait, off the loop, for threads whose callers were cancelled (a load, a shutdown)."""
        while leftovers := list(self._threads):
            log.info("trtllm: waiting for %s to finish", ", ".join(t.name for t in leftovers))

            def join_all(threads: list[threading.Thread] = leftovers) -> None:
                for thread in threads:
                    thread.join()

            await self._in_thread(join_all, "join")
            self._threads.difference_update(leftovers)

    def _build(self, trtllm: Any, llmapi: Any) -> Any:
        s = self.settings
        kv_cache = llmapi.KvCacheConfig(
            enable_block_reuse=True,  # conversations resend their prefix every turn
            **_without_none(
                max_tokens=s.kv_cache_tokens, free_gpu_memory_fraction=s.kv_cache_fraction
            ),
        )
        return trtllm.LLM(
            model=s.model,
            backend="pytorch",
            kv_cache_config=kv_cache,
            max_batch_size=s.max_batch_size,
            max_num_tokens=s.max_num_tokens,
            tensor_parallel_size=s.tp_size,
            **_without_none(max_seq_len=s.max_seq_len),
        )

    def _resolve_max_seq_len(self) -> int:
        """--max-seq-len, else what the LLM was configured with, else the model config.

        With the PyTorch backend ``llm.args.max_seq_len`` is None unless passed: the worker
        infers it from the model's config (max_position_embeddings), which the front end
        keeps as ``llm._hf_model_config``. That attribute is private, hence the fallback.
        """
        configured = self.settings.max_seq_len or getattr(self._llm.args, "max_seq_len", None)
        if configured:
            return int(configured)
        hf_config = getattr(self._llm, "_hf_model_config", None)
        inferred = getattr(hf_config, "max_position_embeddings", None)
        if not inferred:
            raise EngineUnavailableError(
                "cannot tell the model's context length: pass --max-seq-len"
            )
        return int(inferred)

    def _max_num_tokens(self) -> int:
        value = getattr(self._llm.args, "max_num_tokens", None) or self.settings.max_num_tokens
        return int(value)

    async def close(self) -> None:
        """End every stream with ``engine_closed``, shut the LLM down, join every thread.

        The streams are ended here, before ``llm.shutdown()``: shutting down queues aborts
        but the workers may quit before answering them, so a consumer still waiting on a
        ``RequestOutput`` would wait forever. Their aborts are sent from here too, so that
        nothing but the shutdown thread talks to the executor once it runs.
        """
        self._ready = False
        for live in list(self._live):
            live.close()
        with self._load_lock:
            self._abandoned = True  # a load still running shuts its LLM down itself
            llm, self._llm = self._llm, None
        if llm is not None:
            await self._in_thread(llm.shutdown, "shutdown")
        await self._join_threads()

    def describe(self) -> dict[str, object]:
        return {
            "model": self.settings.model,
            "backend": "pytorch",
            "max_seq_len": self._max_seq_len,
            "max_batch_size": self.settings.max_batch_size,
            "tp_size": self.settings.tp_size,
        }

    # -- prompts -----------------------------------------------------------------------
    def render(self, messages: Sequence[Message], tools: list[Any] | None = None) -> str:
        """The model's own chat template, ending where the assistant's answer begins;
        ``tools`` (OpenAI chat format) are rendered by the template too."""
        prompt: str = self._llm.tokenizer.apply_chat_template(
            chat_messages(messages), tools=tools, add_generation_prompt=True, tokenize=False
        )
        return prompt

    def render_and_count(
        self, messages: Sequence[Message], tools: list[Any] | None = None
    ) -> tuple[str, int]:
        """The prompt and its length in tokens, from one rendering and one encoding."""
        prompt = self.render(messages, tools)
        # add_special_tokens=False: the template already holds BOS where the model wants it.
        return prompt, len(self._llm.tokenizer.encode(prompt, add_special_tokens=False))

    def count_tokens(self, messages: Sequence[Message]) -> int:
        return self.render_and_count(messages)[1]

    def _fit(self, request: GenerationRequest) -> tuple[str, int]:
        """Drop old turns until prompt + answer reserve fit; return (prompt, its tokens).

        Rendering and encoding run on the event loop, so each candidate is rendered once:
        the last rendering is kept, and it is the prompt sent when it fits. A request that
        needs no trimming renders its prompt exactly once.
        """
        budget = request.sampling.max_output_tokens
        reserve = min(budget or DEFAULT_ANSWER_RESERVE, self._max_seq_len // 2)
        limit = min(self._max_seq_len - reserve, self._prompt_limit)
        tools = tools_body(request).get("tools")
        last = _LastRendering(lambda messages: self.render_and_count(messages, tools))
        messages, dropped = fit_to_context(request.messages, last.count, limit)
        if dropped:
            log.info("trtllm: %s dropped %d old turns to fit", request.request_id, dropped)
        return last.get(messages)

    def _sampling_params(self, sampling: SamplingParams, prompt_tokens: int) -> Any:
        """Every field explicit: TensorRT-LLM defaults to 32 tokens and greedy decoding."""
        room = self._max_seq_len - prompt_tokens
        if room < 1:
            raise ContextOverflowError("the prompt leaves no room for an answer")
        wanted = sampling.max_output_tokens
        return self._sampling_cls(
            max_tokens=room if wanted is None else min(wanted, room),
            temperature=DEFAULT_TEMPERATURE
            if sampling.temperature is None
            else sampling.temperature,
            top_p=DEFAULT_TOP_P if sampling.top_p is None else sampling.top_p,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            add_special_tokens=False,  # a SamplingParams field, read by the input processor
        )

    # -- generation --------------------------------------------------------------------
    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        if self._llm is None:
            raise EngineError("engine_not_ready", "the TensorRT-LLM engine is not loaded")
        calls = self._tool_call_text(request)
        prompt, prompt_tokens = self._fit(request)
        params = self._sampling_params(request.sampling, prompt_tokens)
        # Called here, inside the coroutine that iterates it: the output binds to this loop.
        try:
            output = self._llm.generate_async(prompt, params, streaming=True)
        except Exception as exc:
            raise EngineError("engine_error", f"TensorRT-LLM refused the request: {exc}") from exc
        live = _LiveStream(output, request.request_id, asyncio.current_task())
        self._live.add(live)  # no await since generate_async: close() cannot have missed it
        held = _StopHoldback(tuple(request.sampling.stop))
        finished = False
        try:
            async for out in output:
                completion = out.outputs[0]
                if completion.finish_reason is None:
                    if text := held.feed(completion.text):
                        for event in calls.feed(text) if calls else [TextDelta(text)]:
                            yield event
                    continue
                finished = True
                reason = _finish_reason(completion.finish_reason)
                text = held.flush(completion.text)
                tail = [*calls.feed(text), *calls.finish()] if calls else [TextDelta(text)]
                for event in tail:
                    if not isinstance(event, TextDelta) or event.text:
                        yield event
                if calls and calls.calls and reason == "stop":
                    reason = "tool_calls"
                yield Finished(reason, _usage(out, completion))
                return
        except asyncio.CancelledError:
            if not live.closed:
                raise
            # close() cancelled us: that was the engine ending, not the consumer giving up.
            if live.task is not None:
                live.task.uncancel()
            raise EngineError("engine_closed", CLOSED_MESSAGE) from None
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError("engine_error", f"TensorRT-LLM failed: {exc}") from exc
        finally:
            self._live.discard(live)
            # Cancelled task, closed generator or error: the request must not run on.
            if not finished:
                live.abort()
        raise EngineError("engine_error", "TensorRT-LLM ended the stream without a finish reason")

    def _tool_call_text(self, request: GenerationRequest) -> ToolCallText | None:
        """The parser of the model's calls for a request with tools (None without); a model
        whose template has no call format this gateway reads cannot take tools."""
        if not request.tools:
            return None
        tokenizer = self._llm.tokenizer
        template = getattr(tokenizer, "chat_template", None) or getattr(
            getattr(tokenizer, "tokenizer", None), "chat_template", None
        )
        fmt = detect_format(template if isinstance(template, str) else None)
        if fmt is None:
            raise EngineError(
                "tools_unsupported",
                f"the model {self.settings.model} has no tool-call format this gateway can read "
                f"in its chat template (supported: {SUPPORTED}); send the request without tools",
            )
        return ToolCallText(fmt, request.request_id)


CLOSED_MESSAGE = "the TensorRT-LLM engine was closed during the answer"


@dataclass(eq=False, slots=True)
class _LiveStream:
    """One request's ``RequestOutput`` and the task iterating it, for :meth:`TrtllmEngine.close`."""

    output: Any
    request_id: str
    task: asyncio.Task[Any] | None
    closed: bool = False
    aborted: bool = False

    def close(self) -> None:
        """From close(): abort the request while the executor still runs, then wake the
        stream by cancelling its task (waiting on the output alone could last forever);
        the stream turns that cancel into ``engine_closed``. No per-token cost."""
        self.abort()
        if self.closed:
            return
        self.closed = True
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    def abort(self) -> None:
        """Fire-and-forget, once; an error here must not hide the cancellation behind it."""
        if self.aborted or self.output.finished:
            return
        self.aborted = True
        try:
            self.output.abort()
        except Exception:  # e.g. the executor is already shut down: nothing runs any more
            log.warning("trtllm: abort of %s failed", self.request_id, exc_info=True)
        else:
            log.debug("trtllm: aborted %s", self.request_id)


class _LastRendering:
    """``render_and_count`` that remembers its latest call, for :func:`fit_to_context`."""

    def __init__(self, render_and_count: Callable[[Sequence[Message]], tuple[str, int]]) -> None:
        self._render_and_count = render_and_count
        self._messages: tuple[Message, ...] | None = None
        self._rendering = ("", 0)

    def get(self, messages: Sequence[Message]) -> tuple[str, int]:
        key = tuple(messages)
        if key != self._messages:
            self._messages, self._rendering = key, self._render_and_count(key)
        return self._rendering

    def count(self, messages: Sequence[Message]) -> int:
        return self.get(messages)[1]


def _finish_reason(reason: str) -> FinishReason:
    """stop/length map directly; timeout and an abort we did not ask for are failures.

    ``timeout`` is not mapped to ``length``: the answer was cut by the engine's deadline, not
    by the token budget the client set, and reporting max_output_tokens would mislead.
    """
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    if reason == "timeout":
        raise EngineError("engine_timeout", "TensorRT-LLM stopped the request at its time limit")
    raise EngineError("engine_cancelled", f"TensorRT-LLM ended the request ({reason})")


def _usage(out: Any, completion: Any) -> Usage:
    return Usage(
        input_tokens=len(out.prompt_token_ids),
        output_tokens=len(completion.token_ids),
        cached_tokens=int(getattr(out, "cached_tokens", 0) or 0),
    )


def _without_none(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


class _StopHoldback:
    """Turns cumulative text into deltas that never need taking back.

    TensorRT-LLM cuts a stop string out of ``text`` only once it is complete, so text that
    may be the start of a stop string is held back until it is confirmed or ruled out;
    ``text_diff`` alone would already have sent it. With no stop strings nothing is held.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._sent = 0

    def feed(self, text: str) -> str:
        safe = len(text) - self._partial_stop_len(text)
        return self._take(text, safe)

    def flush(self, text: str) -> str:
        return self._take(text, len(text))

    def _take(self, text: str, upto: int) -> str:
        if upto <= self._sent:
            return ""
        delta, self._sent = text[self._sent : upto], upto
        return delta

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
