"""NVIDIA TensorRT-LLM engine (LLM API, PyTorch backend), streamed with ``generate_async``.

A thin adapter over exactly these calls (TensorRT-LLM 1.x; file names below are in its
``tensorrt_llm/`` tree, read at the 1.2 era):

- ``LLM(model=..., backend="pytorch", kv_cache_config=KvCacheConfig(...), max_batch_size=...,
  max_num_tokens=..., tensor_parallel_size=...)``, built in a worker thread because it takes
  minutes (``--load-on-main-thread``: in ``from_args``, before the server starts, instead);
  ``ready`` stays False until it is loaded.
- ``llm.generate_async(prompt_token_ids, SamplingParams(...), streaming=True)`` returns a
  ``RequestOutput`` at once. It binds to the event loop running at that call, so it is called
  inside the very coroutine that iterates it. ``async for out in request_output`` yields the
  same object, updated cumulatively. The prompt is sent as the token ids the adapter counted
  (a string would be tokenized again, on the event loop, by the input processor).
- ``request_output.abort()`` is fire-and-forget: a running request ends a step or two later
  with ``cancelled``; one still queued is dropped without any final output
  (``_torch/pyexecutor/py_executor.py``, ``_handle_canceled_requests``). So after an abort
  nothing waits for an answer: whenever the stream is left before its end (task cancelled,
  generator closed, error), ``abort()`` is called and the stream is forgotten.
- Log probabilities: ``SamplingParams(logprobs=20, prompt_logprobs=20)`` when a request asks
  for them, read from each output's ``logprobs`` (``logprobs_diff``) and ``prompt_logprobs``
  (gateway/engines/trtllm_logprobs.py says how, and why 20).
- ``llm.shutdown()`` joins the worker processes, so it runs on a thread. It queues aborts but
  promises no final outputs: :meth:`TrtllmEngine.close` ends its own streams first
  (``engine_closed``). It may re-raise a stored background error at its end
  (``executor/proxy.py``); that is logged, and closing still completes.

Fatal executor errors (a dead worker process, a C++ executor error): TensorRT-LLM keeps them
in the executor's error queue and acts on them the next time something submits a request or
handles a response, by shutting the executor down *on that thread* (the event loop) and
raising (``executor/executor.py``, ``_handle_background_error``); outputs already waiting get
nothing more. So the adapter looks first: before each request and every ``health_check_s``
it reads the executor's shutdown flag and error queue, which never blocks. On a failure it
ends every live stream with ``engine_unavailable``, shuts the LLM down on a thread, logs one
line and reports it through :meth:`Engine._fail` (``ready`` False; the CLI then exits so that
a supervisor restarts the gateway, as trtllm-serve does).

Blocking calls (loading, shutting down) each run on a thread of their own that the call
joins; ``close()`` also joins any such thread a cancelled ``start()`` left running, so no
thread of the engine outlives it.

``tensorrt_llm`` is imported only when the model is loaded; ``add_arguments`` never imports
it, so the gateway runs without it for the other engines.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import importlib
import importlib.util
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from gateway.engines import trtllm_guided
from gateway.engines.base import (
    MAX_TOP_LOGPROBS,
    ContextOverflowError,
    EngineError,
    EngineUnavailableError,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    LogprobsUnsupportedError,
    Message,
    PromptLogprobs,
    PromptTokens,
    SamplingParams,
    StreamEvent,
    StreamingEngine,
    TextDelta,
    Usage,
    chat_messages,
    check_token_ids,
    fit_to_context,
)
from gateway.engines.openai_chat import tools_body
from gateway.engines.structured import Plan
from gateway.engines.tool_format import CallText
from gateway.engines.toolparse import ToolCallText, ToolFormat, detect_format
from gateway.engines.trtllm_guided import Guided, guided
from gateway.engines.trtllm_logprobs import LogprobCursor, prompt_logprobs

log = logging.getLogger(__name__)
T = TypeVar("T")

# One line, printed by `--engine trtllm` when TensorRT-LLM cannot be imported. PyPI's
# tensorrt_llm is only a stub that fetches the real wheel from NVIDIA's own index; those
# wheels are for CPython 3.10 and 3.12 and need a libpython built as a shared library.
INSTALL_HINT = (
    "the trtllm engine needs NVIDIA TensorRT-LLM on Linux with an NVIDIA GPU, which PyPI "
    "alone cannot install: run the gateway in NVIDIA's TensorRT-LLM release container "
    "(pip install -e . there), or use CPython 3.12 built with --enable-shared and run "
    "pip install -e '.[trtllm]' with NVIDIA's package index as an extra index; "
    "see docs/trtllm.md"
)
# Used when a session leaves a field unset: TensorRT-LLM would otherwise decode greedily.
DEFAULT_TEMPERATURE = 0.8  # the OpenAI Realtime API's default
DEFAULT_TOP_P = 1.0
# Prompt budget kept free for the answer when the answer's own budget is "inf".
DEFAULT_ANSWER_RESERVE = 512
LOAD_HEARTBEAT_S = 15.0
HEALTH_CHECK_S = 1.0
TOKENS_PER_BLOCK = 32  # KvCacheConfig.tokens_per_block's default (llmapi/llm_args.py)


@dataclass(frozen=True, slots=True)
class TrtllmSettings:
    model: str
    max_batch_size: int = 16
    max_num_tokens: int = 8192
    max_seq_len: int | None = None  # None: from the loaded model's config
    kv_cache_tokens: int | None = None
    kv_cache_fraction: float | None = None
    tp_size: int = 1
    load_on_main_thread: bool = False
    health_check_s: float = HEALTH_CHECK_S  # how often the executor's health is read
    # LLM(guided_decoding_backend=...): None builds an LLM that cannot constrain.
    guided_decoding_backend: str | None = trtllm_guided.DEFAULT_BACKEND


@dataclass(frozen=True, slots=True)
class ContextLimit:
    """The context window the gateway fits prompts into, and what it was derived from."""

    tokens: int
    source: str


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Flags for ``--engine trtllm``; importing tensorrt_llm is deferred to loading."""
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
        help="KV cache size in tokens (KvCacheConfig.max_tokens), also a cap on the context;"
        " default: by memory fraction",
    )
    group.add_argument(
        "--kv-cache-fraction",
        type=float,
        default=None,
        help="share of free GPU memory for the KV cache (KvCacheConfig.free_gpu_memory_fraction,"
        " TensorRT-LLM's default 0.9)",
    )
    group.add_argument("--tp-size", type=int, default=1, help="tensor-parallel GPUs")
    group.add_argument(
        "--guided-decoding-backend",
        choices=trtllm_guided.BACKENDS,
        default=trtllm_guided.DEFAULT_BACKEND,
        metavar="B",
        help="TensorRT-LLM's constrained decoder, set when the LLM is built: llguidance"
        " (response formats, enforced tool calls, custom tools' Lark grammars), xgrammar"
        " (JSON response formats only) or none (such requests are refused with a 400,"
        " never answered unconstrained)",
    )
    group.add_argument(
        "--load-on-main-thread",
        action="store_true",
        help="build the TensorRT-LLM model on the main thread before the server starts"
        " (a fallback; by default it loads on a worker thread while /readyz says 503)",
    )


def from_args(args: argparse.Namespace) -> TrtllmEngine:
    """Check what can be checked cheaply (package present, model given) before loading."""
    if not tensorrt_llm_installed():
        raise EngineUnavailableError(INSTALL_HINT)
    if not args.model:
        raise EngineUnavailableError(
            "the trtllm engine needs --model: a Hugging Face model id or a local checkpoint "
            "directory, e.g. --model TinyLlama/TinyLlama-1.1B-Chat-v1.0"
        )
    settings = TrtllmSettings(
        model=args.model,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_fraction=args.kv_cache_fraction,
        tp_size=args.tp_size,
        load_on_main_thread=args.load_on_main_thread,
        guided_decoding_backend=None
        if args.guided_decoding_backend == "none"
        else args.guided_decoding_backend,
    )
    if settings.load_on_main_thread:
        log.info("trtllm: loading %s on the main thread (this can take minutes)", args.model)
        engine = TrtllmEngine(settings, llm=build_llm(settings))
        engine.built_on = threading.current_thread()
        return engine
    return TrtllmEngine(settings)


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
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EngineUnavailableError(f"{INSTALL_HINT} (import failed: {reason})") from exc
    return trtllm, llmapi


def build_llm(settings: TrtllmSettings) -> Any:
    """Import TensorRT-LLM and build the ``LLM`` on the calling thread (blocking, minutes)."""
    trtllm, llmapi = _import_tensorrt_llm()
    kv_cache = llmapi.KvCacheConfig(
        enable_block_reuse=True,  # conversations resend their prefix every turn
        **_without_none(
            max_tokens=settings.kv_cache_tokens,
            free_gpu_memory_fraction=settings.kv_cache_fraction,
        ),
    )
    return trtllm.LLM(
        model=settings.model,
        backend="pytorch",
        kv_cache_config=kv_cache,
        max_batch_size=settings.max_batch_size,
        max_num_tokens=settings.max_num_tokens,
        tensor_parallel_size=settings.tp_size,
        **_without_none(
            max_seq_len=settings.max_seq_len,
            guided_decoding_backend=settings.guided_decoding_backend,
        ),
    )


class TrtllmEngine(StreamingEngine):
    """One shared TensorRT-LLM ``LLM``; every generation is one streaming request."""

    name = "trtllm"
    # From the answer's own token ids (GenerationRequest.continuation_token_ids): the
    # prompt's ids, then the answer's, with no re-tokenization.
    can_continue = True
    reports_logprobs = True
    reports_prompt_logprobs = True

    def __init__(self, settings: TrtllmSettings, *, llm: Any = None) -> None:
        """``llm``: an already loaded ``tensorrt_llm.LLM`` to serve instead of loading one
        (``--load-on-main-thread``, bench/trtllm_smoke.py); ``settings.model`` must name it."""
        super().__init__()
        self.settings = settings
        self._llm: Any = None
        self._preloaded = llm
        self._sampling_cls: Any = None
        self._guided_cls: Any = None  # llmapi.GuidedDecodingParams
        self._request_error: type[BaseException] = _NeverRaised
        # start() may be cancelled while the loading thread runs on; whichever of the two
        # comes second shuts the new LLM down, so no engine outlives a cancelled start.
        self._load_lock = threading.Lock()
        self._abandoned = False
        self._closing = False
        self._context = ContextLimit(0, "not loaded")
        self._prompt_limit = 0
        self._threads: set[threading.Thread] = set()  # started by _in_thread, not yet joined
        self._live: set[_LiveStream] = set()  # streams between generate_async and their end
        self._watchdog: asyncio.Task[None] | None = None
        self._failure_shutdown: asyncio.Task[None] | None = None
        # The thread that built the LLM (for the log, /healthz and the smoke script).
        self.built_on: threading.Thread | None = None

    @property
    def capacity(self) -> int:
        return self.settings.max_batch_size

    @property
    def llm(self) -> Any:
        """The loaded ``tensorrt_llm.LLM`` (None before start), for benchmarks and diagnostics."""
        return self._llm

    @property
    def max_seq_len(self) -> int:
        """The context window (prompt + answer) prompts are fitted into, once started."""
        return self._context.tokens

    @property
    def context(self) -> ContextLimit:
        return self._context

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
        self._set_context(self._derive_context())
        self._watchdog = asyncio.create_task(self._watch_executor(self._llm))
        self._ready = True
        log.info(
            "trtllm: %s ready in %.1fs, built on thread %r (context %d tokens, from %s; batch %d)",
            self.settings.model,
            time.monotonic() - began,
            self.built_on.name if self.built_on else "(given)",
            self._context.tokens,
            self._context.source,
            self.settings.max_batch_size,
        )
        if not self._kv_cache_bounded():
            log.warning(
                "trtllm: the KV cache is sized from free GPU memory, and TensorRT-LLM caps the "
                "context at what it holds; until a prompt is refused the gateway assumes %d "
                "tokens (pass --kv-cache-tokens or --max-seq-len to be exact)",
                self._context.tokens,
            )

    async def _log_while_loading(self, began: float) -> None:
        while True:
            await asyncio.sleep(LOAD_HEARTBEAT_S)
            log.info("trtllm: still loading (%.0fs)", time.monotonic() - began)

    def _load(self) -> None:
        """In a worker thread: import, build the LLM, and keep it unless start() gave up."""
        _, llmapi = _import_tensorrt_llm()
        if self._preloaded is not None:
            llm = self._preloaded
        else:
            llm = build_llm(self.settings)
            self.built_on = threading.current_thread()
        with self._load_lock:
            if not self._abandoned:
                self._llm, self._sampling_cls = llm, llmapi.SamplingParams
                self._guided_cls = llmapi.GuidedDecodingParams
                self._request_error = getattr(llmapi, "RequestError", _NeverRaised)
                return
        log.info("trtllm: start was cancelled during loading; shutting the model down")
        llm.shutdown()

    async def _abandon(self) -> None:
        """Keep no LLM: one loaded already is shut down, one still loading shuts itself down."""
        with self._load_lock:
            self._abandoned = True
            llm, self._llm = self._llm, None
        if llm is not None:  # loaded just before the cancel landed
            await self._shutdown_llm(llm)

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

    async def _shutdown_llm(self, llm: Any) -> None:
        """``llm.shutdown()`` on a thread. TensorRT-LLM's proxy re-raises a stored background
        error at the end of its shutdown (executor/proxy.py), after its work is done: that
        error is logged, not raised, so that closing always completes."""
        try:
            await self._in_thread(llm.shutdown, "shutdown")
        except Exception as exc:
            log.warning("trtllm: TensorRT-LLM's shutdown reported: %s", _one_line(exc))

    async def close(self) -> None:
        """End every stream with ``engine_closed``, shut the LLM down, join every thread.

        The streams are ended here, before ``llm.shutdown()``: shutting down queues aborts
        but the workers may quit before answering them, so a consumer still waiting on a
        ``RequestOutput`` would wait forever. Their aborts are sent from here too, so that
        nothing but the shutdown thread talks to the executor once it runs.
        """
        self._closing = True
        self._ready = False
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.wait((self._watchdog,))
        closed = EngineError("engine_closed", CLOSED_MESSAGE)
        for live in list(self._live):
            live.end(closed, abort=True)
        with self._load_lock:
            self._abandoned = True  # a load still running shuts its LLM down itself
            llm, self._llm = self._llm, None
        if self._failure_shutdown is not None:
            await asyncio.wait((self._failure_shutdown,))
        if llm is not None:
            await self._shutdown_llm(llm)
        await self._join_threads()
        await super().close()  # the streams' tasks, ended above, are awaited here

    def describe(self) -> dict[str, object]:
        details: dict[str, object] = {
            "model": self.settings.model,
            "backend": "pytorch",
            "max_seq_len": self._context.tokens,
            "context_source": self._context.source,
            "max_batch_size": self.settings.max_batch_size,
            "tp_size": self.settings.tp_size,
            "guided_decoding_backend": self.settings.guided_decoding_backend,
            "built_on_thread": self.built_on.name if self.built_on else None,
        }
        if self.failure is not None:
            details["failure"] = self.failure
        return details

    # -- the context window (issue: the front end never learns the worker's limit) -------
    def _derive_context(self) -> ContextLimit:
        """The smallest limit we can know of, and where it comes from.

        With the PyTorch backend ``llm.args.max_seq_len`` is None unless passed; the worker
        settles the real limit itself: the model's maximum, capped by what the KV cache
        holds (executor/base_worker.py ``setup_engine``, _torch/pyexecutor/
        py_executor_creator.py, resource_manager.py), and never tells the front end. So:
        ``--max-seq-len``, the KV cache size when it is given in tokens (whole blocks of
        32), and the model config's ``max_position_embeddings`` (``llm._hf_model_config``,
        private; hence the fallbacks). A KV cache sized by memory can cap it lower still:
        then the first refused prompt tells us (see :meth:`_learn_limit`).
        """
        args = self._llm.args
        candidates: list[ContextLimit] = []
        if configured := getattr(args, "max_seq_len", None):
            candidates.append(ContextLimit(int(configured), "--max-seq-len"))
        if kv_tokens := self._kv_cache_tokens():
            blocks = kv_tokens // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
            candidates.append(ContextLimit(blocks, "--kv-cache-tokens (the KV cache's size)"))
        hf_config = getattr(self._llm, "_hf_model_config", None)
        if model_max := getattr(hf_config, "max_position_embeddings", None):
            candidates.append(
                ContextLimit(int(model_max), "the model config's max_position_embeddings")
            )
        if not candidates:
            raise EngineUnavailableError(
                "cannot tell the model's context length: pass --max-seq-len"
            )
        return min(candidates, key=lambda c: c.tokens)

    def _kv_cache_tokens(self) -> int | None:
        kv_config = getattr(self._llm.args, "kv_cache_config", None)
        tokens = getattr(kv_config, "max_tokens", None)
        return int(tokens) if tokens else None

    def _kv_cache_bounded(self) -> bool:
        return self._kv_cache_tokens() is not None

    def _set_context(self, context: ContextLimit) -> None:
        self._context = context
        max_num_tokens = getattr(self._llm.args, "max_num_tokens", None)
        if getattr(self._llm.args, "enable_chunked_prefill", False) or not max_num_tokens:
            max_num_tokens = context.tokens
        # A prompt of max_seq_len tokens or more leaves no room: the worker refuses it.
        self._prompt_limit = min(context.tokens - 1, int(max_num_tokens))

    def _learn_limit(self, message: str) -> bool:
        """From the worker's "prompt too long" refusal, which names its max_seq_len; True if
        that is smaller than what we assumed (the request can be fitted and sent again)."""
        found = _MAX_SEQ_LEN.search(message)
        if found is None or self._llm is None:
            return False
        tokens = int(found.group(1))
        if tokens >= self._context.tokens:
            return False
        log.warning(
            "trtllm: TensorRT-LLM's context is %d tokens, not %d (its KV cache caps it); "
            "using %d from now on",
            tokens,
            self._context.tokens,
            tokens,
        )
        self._set_context(ContextLimit(tokens, "TensorRT-LLM's worker (it refused a prompt)"))
        return True

    # -- prompts -----------------------------------------------------------------------
    def render(self, messages: Sequence[Message], tools: list[Any] | None = None) -> str:
        """The model's own chat template, ending where the assistant's answer begins;
        ``tools`` (OpenAI chat format) are rendered by the template too."""
        prompt: str = self._llm.tokenizer.apply_chat_template(
            chat_messages(messages), tools=tools, add_generation_prompt=True, tokenize=False
        )
        return prompt

    def encode(self, messages: Sequence[Message], tools: list[Any] | None = None) -> list[int]:
        """The prompt's token ids, from one rendering and one encoding."""
        # add_special_tokens=False: the template already holds BOS where the model wants it.
        prompt = self.render(messages, tools)
        ids: list[int] = self._llm.tokenizer.encode(prompt, add_special_tokens=False)
        return ids

    def count_tokens(self, messages: Sequence[Message]) -> int:
        return len(self.encode(messages))

    def _fit(self, request: GenerationRequest, the_plan: Plan) -> list[int]:
        """Drop old turns until prompt + answer reserve fit; return the prompt's token ids.

        Rendering and encoding run on the event loop, so each candidate is rendered once:
        the last encoding is kept, and it is the prompt sent when it fits. A request that
        needs no trimming renders its prompt exactly once.
        """
        limit = self._context.tokens
        budget = request.sampling.max_output_tokens
        reserve = min(budget or DEFAULT_ANSWER_RESERVE, limit // 2)
        prompt_budget = min(limit - reserve, self._prompt_limit)
        tools = tools_body(request).get("tools") if the_plan.native_tools else None
        last = _LastEncoding(lambda messages: self.encode(messages, tools))
        try:
            messages, dropped = fit_to_context(the_plan.messages, last.count, prompt_budget)
        except EngineError:
            raise
        except Exception as exc:
            if _is_template_error(exc):
                # Real templates reject what they cannot render (raise_exception in the
                # Jinja template: "roles must alternate", "System role not supported").
                raise InvalidRequestError(
                    "chat_template_error",
                    f"The model's chat template refused this conversation: {_one_line(exc)}",
                ) from None
            raise
        if dropped:
            log.info("trtllm: %s dropped %d old turns to fit", request.request_id, dropped)
        return last.get(messages)

    def _raw_ids(self, request: GenerationRequest) -> list[int]:
        """A raw prompt's token ids: text encoded as ``generate_async``'s input processor
        would (with the tokenizer's special tokens, BOS), or the ids checked against the
        model's vocabulary (an id beyond it fails a GPU kernel, not a request). Nothing is
        dropped to fit: a prompt that does not is refused."""
        prompt = request.prompt
        if isinstance(prompt, str):
            ids: list[int] = self._llm.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            assert prompt is not None  # its ids were checked against the vocabulary (check)
            ids = list(prompt)  # generate_async takes a list (a tuple is a TypeError)
        if len(ids) > self._prompt_limit:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens; at most {self._prompt_limit} fit the "
                f"context window ({self._context.tokens} tokens, the answer included)"
            )
        return ids

    def _answer_so_far(self, request: GenerationRequest) -> _AnswerSoFar:
        """A continued answer's token ids and what they decode to beyond the text sent.

        The ids are the ones the answer was generated from (kept in the store's log with
        its deltas), never the sent text encoded again: a re-tokenization can differ from
        the tokens the model chose, and the continuation would then not be the answer the
        model was giving. Text the first gateway held back (a possible stop string) is
        decoded from them and sent first."""
        if not request.continuation:
            return _AnswerSoFar((), "")
        ids = request.continuation_token_ids
        if not ids:
            raise EngineError(
                "gateway_restarted",
                "the answer so far has no token ids in the session store to continue from",
            )
        decoded: str = self._llm.tokenizer.decode(list(ids), skip_special_tokens=True)
        if not decoded.startswith(request.continuation):
            raise EngineError(
                "gateway_restarted",
                "the answer so far does not match the token ids kept with it",
            )
        return _AnswerSoFar(ids, decoded[len(request.continuation) :])

    def _sampling_params(
        self,
        sampling: SamplingParams,
        prompt_tokens: int,
        answered: int = 0,
        guide: dict[str, Any] | None = None,
    ) -> Any:
        """Every field explicit: TensorRT-LLM defaults to 32 tokens and greedy decoding.
        ``answered``: tokens of a continued answer, in the prompt and in its budget."""
        room = self._context.tokens - prompt_tokens - answered
        if room < 1:
            raise ContextOverflowError("the prompt leaves no room for an answer")
        wanted = sampling.max_output_tokens
        if wanted is not None:
            wanted = max(1, wanted - answered)
        return self._sampling_cls(
            max_tokens=room if wanted is None else min(wanted, room),
            temperature=DEFAULT_TEMPERATURE
            if sampling.temperature is None
            else sampling.temperature,
            top_p=DEFAULT_TOP_P if sampling.top_p is None else sampling.top_p,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            # None: the C++ runtime's default, 0 (off); any value is valid there.
            frequency_penalty=sampling.frequency_penalty,
            presence_penalty=sampling.presence_penalty,
            # Keep the stop string in token_ids and text: on a stop-word match TensorRT-LLM
            # otherwise removes its tokens from token_ids (executor/result.py,
            # _handle_sequence), and usage would miss tokens the model did generate. The
            # adapter cuts the stop string from the text itself (_StopHoldback).
            include_stop_str_in_output=True,
            **({"guided_decoding": self._guided_cls(**guide)} if guide else {}),
            # The top 20 whatever the client wants: see gateway/engines/trtllm_logprobs.py.
            **_without_none(
                logprobs=None if sampling.logprobs is None else MAX_TOP_LOGPROBS,
                prompt_logprobs=None if sampling.prompt_logprobs is None else MAX_TOP_LOGPROBS,
            ),
        )

    # -- generation --------------------------------------------------------------------
    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        yielded = False
        for attempt in (1, 2):
            self._check_usable()
            structure = self._guided(request)
            calls = self._tool_call_text(request, structure.plan)
            if request.prompt is None:
                prompt_ids = self._fit(request, structure.plan)
            else:
                prompt_ids = self._raw_ids(request)
            if request.sampling.max_output_tokens == 0:
                # Nothing to generate (a legacy echo of the prompt alone).
                async for event in self._prompt_only(request, prompt_ids):
                    yield event
                return
            answer = self._answer_so_far(request)
            params = self._sampling_params(
                request.sampling, len(prompt_ids), len(answer.ids), structure.guide
            )
            # Known before the first token: an answer cut short still reports its prompt.
            # (Not counted as yielded: a refused prompt is retried, and re-reported.)
            yield PromptTokens(len(prompt_ids))
            try:
                generation = self._generate(request, prompt_ids, params, calls, answer)
                async with contextlib.aclosing(generation) as gen:
                    async for event in gen:
                        yielded = True
                        yield event
                return
            except _PromptTooLong as exc:
                # The worker's own limit is lower than ours (a KV cache sized by memory):
                # learn it from the refusal and fit the conversation to it, once.
                if attempt == 1 and not yielded and self._learn_limit(exc.message):
                    continue
                raise ContextOverflowError(
                    f"TensorRT-LLM refused the prompt as too long for its context window "
                    f"({_one_line(exc.message)})"
                ) from None

    async def _prompt_only(
        self, request: GenerationRequest, prompt_ids: list[int]
    ) -> AsyncIterator[StreamEvent]:
        """The prompt counted, and its log probabilities where asked: TensorRT-LLM reports
        them with a generation, so one token is generated and dropped."""
        yield PromptTokens(len(prompt_ids))
        if request.sampling.prompt_logprobs is not None:
            one = replace(request.sampling, max_output_tokens=1, logprobs=None)
            params = self._sampling_params(one, len(prompt_ids))
            generation = self._generate(
                replace(request, sampling=one), prompt_ids, params, None, _AnswerSoFar((), "")
            )
            async with contextlib.aclosing(generation) as events:
                async for event in events:
                    if isinstance(event, PromptLogprobs):
                        yield event
        yield Finished("length", Usage(len(prompt_ids), 0))

    def check(self, request: GenerationRequest) -> None:
        """Also a raw prompt's token ids, against the model config's vocabulary: an id beyond
        it is an out-of-range read in a GPU kernel, which kills the executor."""
        config = getattr(self._llm, "_hf_model_config", None)
        vocab = getattr(config, "vocab_size", None)
        if vocab and isinstance(request.prompt, tuple):
            check_token_ids(request.prompt, int(vocab))
        super().check(request)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise EngineUnavailableError(_failed_message(self.failure))
        if self._llm is None:
            raise EngineError("engine_not_ready", "the TensorRT-LLM engine is not loaded")

    async def _generate(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        params: Any,
        calls: ToolCallText | CallText | None,
        answer: _AnswerSoFar,
    ) -> AsyncGenerator[StreamEvent, None]:
        llm = self._llm
        # generate_async would handle a pending fatal error by shutting the executor down
        # right here, on the event loop: look first (a non-blocking read).
        if (reason := _executor_failure(llm)) is not None:
            self._executor_failed(reason)
            raise EngineUnavailableError(_failed_message(reason))
        # Called here, inside the coroutine that iterates it: the output binds to this loop.
        try:
            output = llm.generate_async([*prompt_ids, *answer.ids], params, streaming=True)
        except self._request_error as exc:
            raise self._request_failed(exc) from None
        except (ValueError, TypeError) as exc:
            raise EngineError("engine_error", f"TensorRT-LLM refused the request: {exc}") from exc
        except Exception as exc:
            raise self._unexpected(exc) from exc
        live = _LiveStream(output, request.request_id, asyncio.current_task())
        self._live.add(live)  # no await since generate_async: close() cannot have missed it
        held = _StopHoldback(tuple(request.sampling.stop))
        ids = _TokenIds()
        sampling = request.sampling
        logprobs = None
        if sampling.logprobs is not None:
            logprobs = LogprobCursor(llm.tokenizer, sampling.logprobs)
        prompt_due = sampling.prompt_logprobs is not None
        lead = answer.held_text  # decoded from the answer's ids, not sent yet
        finished = False

        def attach(event: StreamEvent, completion: Any) -> StreamEvent:
            event = ids.attach(event, completion.token_ids)
            return event if logprobs is None else logprobs.attach(event, completion)

        try:
            async for out in output:
                completion = out.outputs[0]
                if prompt_due:  # before the first delta
                    prompt_due = False
                    yield self._prompt_logprobs(out, completion, sampling.prompt_logprobs)
                if completion.finish_reason is None:
                    if text := held.feed(lead + completion.text):
                        for event in calls.feed(text) if calls else [TextDelta(text)]:
                            yield attach(event, completion)
                    continue
                finished = True
                finish: FinishReason = _finish_reason(completion.finish_reason)
                text = held.flush(lead + completion.text)
                tail = [*calls.feed(text), *calls.finish()] if calls else [TextDelta(text)]
                for event in tail:
                    if not isinstance(event, TextDelta) or event.text:
                        yield attach(event, completion)
                if calls and calls.calls and finish == "stop":
                    finish = "tool_calls"
                yield Finished(finish, _usage(out, completion, len(answer.ids)))
                return
        except asyncio.CancelledError:
            if live.ending is None:
                raise
            # The engine ended this stream (closing, or a dead executor), not the consumer.
            if live.task is not None:
                live.task.uncancel()
            raise live.ending from None
        except EngineError:
            raise
        except self._request_error as exc:
            raise self._request_failed(exc) from None
        except Exception as exc:
            raise self._unexpected(exc) from exc
        finally:
            self._live.discard(live)
            # Cancelled task, closed generator or error: the request must not run on. An
            # aborted request may never get a final output (a queued one gets none): do
            # not wait for one.
            if not finished:
                live.abort()
        raise EngineError("engine_error", "TensorRT-LLM ended the stream without a finish reason")

    def _prompt_logprobs(self, out: Any, completion: Any, top: int | None) -> PromptLogprobs:
        reported = completion.prompt_logprobs
        if not reported:
            raise LogprobsUnsupportedError(
                "TensorRT-LLM returned no log probabilities for the prompt."
            )
        return prompt_logprobs(self._llm.tokenizer, out.prompt_token_ids, reported, top or 0)

    def check_structure(self, request: GenerationRequest) -> None:
        """Refuse (a 400) what the guided decoding backend cannot constrain, and compile
        the grammars it will be given (trtllm_guided.py)."""
        if self._llm is not None:
            self._guided(request)

    def continues(self, request: GenerationRequest) -> bool:
        """Not under guided decoding (see Engine.continues): here also a request's tools
        that the chat template cannot render, which go in the gateway's format under it."""
        try:
            return self.can_continue and self._llm is not None and not self._guided(request).guide
        except InvalidRequestError:
            return False

    def _guided(self, request: GenerationRequest) -> Guided:
        return guided(
            request,
            self.settings.guided_decoding_backend,
            template_renders_tools=self._tool_format() is not None,
        )

    def _tool_format(self) -> ToolFormat | None:
        """The tool-call format the model's chat template teaches, if this gateway reads it."""
        tokenizer = self._llm.tokenizer
        template = getattr(tokenizer, "chat_template", None) or getattr(
            getattr(tokenizer, "tokenizer", None), "chat_template", None
        )
        return detect_format(template if isinstance(template, str) else None)

    def _tool_call_text(
        self, request: GenerationRequest, the_plan: Plan
    ) -> ToolCallText | CallText | None:
        """The parser of the model's calls for a request with tools (None without): the
        gateway's format under guided decoding, else the template's (which the plan
        chose only when the gateway reads it)."""
        if not request.tools:
            return None
        if the_plan.generic:
            return CallText(request)
        fmt = self._tool_format()
        assert fmt is not None, "a template's own tools only where its format is read"
        return ToolCallText(fmt, request.request_id)

    def _request_failed(self, exc: BaseException) -> EngineError:
        """A per-request error from TensorRT-LLM's worker (executor/base_worker.py)."""
        message = str(exc)
        if _PROMPT_TOO_LONG.search(message):
            return _PromptTooLong(message)
        return EngineError("engine_error", f"TensorRT-LLM failed the request: {_one_line(exc)}")

    def _unexpected(self, exc: BaseException) -> EngineError:
        """Anything but a per-request error: TensorRT-LLM raises a background error only
        after shutting its executor down, so check whether the executor is gone."""
        reason = _executor_failure(self._llm) if self._llm is not None else None
        if reason is not None or "shutting down" in str(exc):
            # The error raised here is usually the background error itself, taken off the
            # queue by the output that raised it: it says more than a bare "shut down".
            if reason in (None, _SHUT_DOWN):
                reason = _one_line(exc)
            self._executor_failed(reason)
            return EngineUnavailableError(_failed_message(self.failure or reason))
        return EngineError("engine_error", f"TensorRT-LLM failed: {_one_line(exc)}")

    # -- a dead executor ---------------------------------------------------------------
    async def _watch_executor(self, llm: Any) -> None:
        """Every ``health_check_s``: has the executor failed? A dead worker sends nothing
        more to the outputs waiting on it, so without this they would wait forever."""
        while True:
            await asyncio.sleep(self.settings.health_check_s)
            if (reason := _executor_failure(llm)) is not None:
                self._executor_failed(reason)
                return

    def _executor_failed(self, reason: str) -> None:
        """Fatal: fail every live stream, shut the LLM down off the loop, report it once."""
        if self._closing or self.failure is not None:
            return
        live = list(self._live)
        log.error(
            "trtllm: the TensorRT-LLM executor failed (%s): %d live answers end with "
            "engine_unavailable; the engine cannot serve again until the gateway restarts",
            reason,
            len(live),
        )
        error = EngineUnavailableError(_failed_message(reason))
        for stream in live:
            stream.end(error, abort=False)  # nothing runs any more: there is nothing to abort
        with self._load_lock:
            llm, self._llm = self._llm, None
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        if llm is not None:
            self._failure_shutdown = asyncio.get_running_loop().create_task(
                self._shutdown_llm(llm), name="trtllm-failure-shutdown"
            )
        self._fail(reason)


CLOSED_MESSAGE = "the TensorRT-LLM engine was closed during the answer"
# The worker's refusal of a prompt that leaves no room (executor/base_worker.py,
# _deduce_max_tokens): "`default_max_tokens` (-3) must be greater than 0, ... = max_seq_len
# (4096) - `splited_prompt_len` (4099)". Earlier 1.x releases only warned there and failed such
# a request later, in words the second pattern guesses at; bench/trtllm_smoke.py checks it.
_PROMPT_TOO_LONG = re.compile(r"default_max_tokens.*greater than 0|exceeds? .*max_seq_len", re.S)
_MAX_SEQ_LEN = re.compile(r"max_seq_len \((\d+)\)")


_SHUT_DOWN = "the executor shut down"


def _failed_message(reason: str) -> str:
    return f"the TensorRT-LLM engine failed ({reason}); the gateway must be restarted"


def _executor_failure(llm: Any) -> str | None:
    """Why the LLM's executor cannot serve any more, or None; never blocks.

    Reads what TensorRT-LLM itself consults (executor/executor.py): ``is_shutdown()`` and
    the queue its background threads and worker-process callbacks put fatal errors in
    (``_error_queue``, private: hence the defensive getattr). The error is only peeked at,
    so that TensorRT-LLM's own handling is unchanged.
    """
    executor = getattr(llm, "_executor", None)
    if executor is None:
        return "the executor is gone"
    errors = getattr(executor, "_error_queue", None)
    pending = getattr(errors, "queue", None)
    if pending:
        with contextlib.suppress(IndexError):
            return _one_line(pending[0])
    is_shutdown = getattr(executor, "is_shutdown", None)
    if callable(is_shutdown) and is_shutdown():
        return _SHUT_DOWN
    return None


def _is_template_error(exc: BaseException) -> bool:
    """Jinja's TemplateError (and subclasses), without importing jinja2 here."""
    return any(cls.__name__ == "TemplateError" for cls in type(exc).__mro__)


def _one_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, BaseException):
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return first


class _NeverRaised(Exception):
    """Stands for ``RequestError`` if a TensorRT-LLM release lacks it in ``llmapi``."""


class _PromptTooLong(EngineError):
    """Internal: the worker refused the prompt as too long (learned from, then mapped)."""

    def __init__(self, message: str) -> None:
        super().__init__("context_length_exceeded", message)


@dataclass(eq=False, slots=True)
class _LiveStream:
    """One request's ``RequestOutput`` and the task iterating it, for close and failure."""

    output: Any
    request_id: str
    task: asyncio.Task[Any] | None
    ending: EngineError | None = None  # set when the engine itself ends the stream
    aborted: bool = False

    def end(self, error: EngineError, *, abort: bool) -> None:
        """From the engine: wake the stream by cancelling its task (waiting on the output
        alone could last forever); the stream turns that cancel into ``error``. No
        per-token cost. ``abort``: tell TensorRT-LLM first, while its executor runs."""
        if abort:
            self.abort()
        else:
            self.aborted = True  # the executor is gone: aborting would only raise
        if self.ending is not None:
            return
        self.ending = error
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


class _LastEncoding:
    """``encode`` that remembers its latest call, for :func:`fit_to_context`."""

    def __init__(self, encode: Callable[[Sequence[Message]], list[int]]) -> None:
        self._encode = encode
        self._messages: tuple[Message, ...] | None = None
        self._ids: list[int] = []

    def get(self, messages: Sequence[Message]) -> list[int]:
        key = tuple(messages)
        if key != self._messages:
            self._messages, self._ids = key, self._encode(key)
        return self._ids

    def count(self, messages: Sequence[Message]) -> int:
        return len(self.get(messages))


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


def _usage(out: Any, completion: Any, answered: int) -> Usage:
    # token_ids holds every generated token, the stop string's included
    # (include_stop_str_in_output=True). A continued answer's earlier tokens were sent
    # as prompt; they are the answer's output, not its input.
    prompt = len(out.prompt_token_ids) - answered
    return Usage(
        input_tokens=prompt,
        output_tokens=len(completion.token_ids) + answered,
        cached_tokens=min(prompt, int(getattr(out, "cached_tokens", 0) or 0)),
    )


@dataclass(frozen=True, slots=True)
class _AnswerSoFar:
    """A continued answer: its token ids, and the part of their text not sent yet."""

    ids: tuple[int, ...]
    held_text: str


@dataclass(slots=True)
class _TokenIds:
    """Gives each text delta the ids of the tokens generated since the last one, so that
    the store's log holds, with the text, the tokens it came from (a continuation's)."""

    given: int = 0

    def attach(self, event: StreamEvent, token_ids: Sequence[int]) -> StreamEvent:
        if not isinstance(event, TextDelta) or len(token_ids) <= self.given:
            return event
        new = tuple(token_ids[self.given :])
        self.given = len(token_ids)
        return TextDelta(event.text, event.tokens, new)


def _without_none(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


class _StopHoldback:
    """Turns cumulative text into deltas that never need taking back.

    TensorRT-LLM keeps a matched stop string in the text (``include_stop_str_in_output``)
    and may only match it once it is complete, so text that may be the start of a stop
    string is held back until it is confirmed or ruled out, and the text is cut where a
    stop string begins. With no stop strings nothing is held.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._sent = 0

    def feed(self, text: str) -> str:
        safe = min(len(text) - self._partial_stop_len(text), self._stop_at(text))
        return self._take(text, safe)

    def flush(self, text: str) -> str:
        return self._take(text, self._stop_at(text))

    def _take(self, text: str, upto: int) -> str:
        if upto <= self._sent:
            return ""
        delta, self._sent = text[self._sent : upto], upto
        return delta

    def _stop_at(self, text: str) -> int:
        """Where the first complete stop string begins (the text's end if none does)."""
        found = [i for stop in self._stops if (i := text.find(stop)) >= 0]
        return min(found, default=len(text))

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
