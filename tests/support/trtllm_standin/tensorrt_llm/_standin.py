"""STAND-IN internals: test controls, counters, a toy tokenizer, the "worker" and the executor.

Not part of the real TensorRT-LLM API. Tests set ``controls`` before building an LLM and
read ``stats`` afterwards; ``reset()`` restores both. ``fail_executor`` injects a fatal
executor error. Each behaviour below names the real source file it mirrors (TensorRT-LLM
1.2-era), so that a reader can check it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorrt_llm.executor.result import Logprob, TokenLogprobs

try:  # what real chat templates raise through ``raise_exception``
    from jinja2.exceptions import TemplateError
except ImportError:  # jinja2 is not installed with the gateway's test dependencies

    class TemplateError(Exception):  # type: ignore[no-redef]
        """Stand-in for ``jinja2.exceptions.TemplateError`` (same name, same role)."""


BOS, EOS = "<s>", "</s>"
BOS_ID, EOS_ID = 1, 2
TOKENS_PER_BLOCK = 32  # KvCacheConfig.tokens_per_block's default (llmapi/llm_args.py)
DEFAULT_REPLY = "Hello from the stand-in engine, one word at a time."
UINT64_MAX = 2**64 - 1
WORKER_PROCESS_ENV = "TRTLLM_STANDIN_WORKER_PROCESS"
REPLY_ENV = "TRTLLM_STANDIN_REPLY"
STEP_ENV = "TRTLLM_STANDIN_STEP_S"

worker_log = logging.getLogger("tensorrt_llm")  # the real worker logs under this name


class RequestError(RuntimeError):
    """A per-request failure (the real one: tensorrt_llm/executor/utils.py)."""


@dataclass
class Controls:
    """What the next LLMs and requests do. Tests change these; ``reset()`` restores them."""

    # Text the "model" generates, then EOS; seconds per engine iteration. A gateway
    # process of a test takes them from the environment (TRTLLM_STANDIN_REPLY, _STEP_S).
    reply: str = field(default_factory=lambda: os.environ.get(REPLY_ENV, DEFAULT_REPLY))
    step_s: float = field(default_factory=lambda: float(os.environ.get(STEP_ENV, "0.002")))
    max_position_embeddings: int = 2048  # the model config's context length
    # The model config's vocab_size: the embedding table's rows. The toy tokenizer's ids
    # are a piece's bytes read as a number, unbounded: None (its default) bounds none.
    vocab_size: int | None = None
    # Tokens the KV cache gets from GPU memory when KvCacheConfig.max_tokens is unset
    # (None: plenty). The worker caps its max_seq_len to what the KV cache holds.
    kv_cache_capacity: int | None = None
    finish_with: str | None = None  # force "timeout" or "cancelled" ...
    finish_after: int = 2  # ... after this many generated tokens
    load_gate: threading.Event | None = None  # LLM() blocks until set: a slow load
    # The executor's worker runs in a child process (as with the real MPI worker), so
    # that a test can kill it. Also switched on by the environment (for bench scripts).
    worker_process: bool = field(default_factory=lambda: os.environ.get(WORKER_PROCESS_ENV) == "1")
    # "any": every conversation renders. "alternating": roles must alternate user/assistant
    # after an optional system message (Llama 2, Mistral). "no_system": no system role (Gemma).
    chat_template: str = "any"
    # The tokenizer's Jinja template text (HF's ``tokenizer.chat_template``), from which the
    # adapter tells the model's tool-call format.
    chat_template_text: str | None = None
    # Where the token the "model" generates ranks in its distribution (1: likeliest). A
    # rank beyond SamplingParams.logprobs leaves it out of the top-k the worker reports,
    # as the real PyTorch sampler does (_torch/pyexecutor/sampler.py, handle_logprobs).
    sampled_rank: int = 1


@dataclass
class RequestRecord:
    """What one generate_async call asked for and what became of it."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: Any
    streaming: bool
    aborted: bool = False  # the worker acted on an abort()
    tokens_after_abort: int = 0
    finish_reason: str | None = None  # None: never answered (queued abort, dead executor)
    generated: int = 0
    abort_requested: bool = False
    dropped_in_queue: bool = False  # aborted while still queued: no final output at all
    max_tokens: int | None = None  # what the worker ran with (after its own cap)
    error: str | None = None  # the request error the worker answered with


@dataclass
class Stats:
    requests: list[RequestRecord] = field(default_factory=list)
    llm_kwargs: list[dict[str, Any]] = field(default_factory=list)
    llm_threads: list[threading.Thread] = field(default_factory=list)  # who built each LLM
    peak_running: int = 0
    shutdowns: int = 0
    shutdown_threads: list[threading.Thread] = field(default_factory=list)  # who shut down
    templates_rendered: int = 0  # apply_chat_template calls, on every tokenizer
    prompts_encoded: int = 0  # string prompts generate_async had to tokenize itself
    worker_pids: list[int] = field(default_factory=list)
    _running: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def running(self) -> int:
        """Requests the worker still holds (queued or generating)."""
        with self._cond:
            return self._running

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no request is left in any worker; True if that happened in time."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running == 0, timeout)

    def wait_llms(self, n: int, timeout: float = 5.0) -> bool:
        """Until ``n`` LLM constructors have been entered (they may still be loading)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.llm_kwargs) >= n, timeout)

    def wait_shutdowns(self, n: int, timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.shutdowns >= n, timeout)

    def wait_requests(self, n: int, timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.requests) >= n, timeout)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Until ``predicate()`` holds; checked after every worker step."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def _add_llm(self, kwargs: dict[str, Any]) -> None:
        with self._cond:
            self.llm_kwargs.append(kwargs)
            self.llm_threads.append(threading.current_thread())
            self._cond.notify_all()

    def _add_shutdown(self) -> None:
        with self._cond:
            self.shutdowns += 1
            self.shutdown_threads.append(threading.current_thread())
            self._cond.notify_all()

    def _add_running(self, delta: int) -> None:
        with self._cond:
            self._running += delta
            self.peak_running = max(self.peak_running, self._running)
            self._cond.notify_all()

    def _add_request(self, record: RequestRecord) -> None:
        with self._cond:
            self.requests.append(record)
            self._cond.notify_all()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


controls = Controls()
stats = Stats()


def reset() -> None:
    global controls, stats
    controls = Controls()
    stats = Stats()


def fail_executor(llm: Any, error: BaseException) -> None:
    """Test control: a fatal error in the executor (a C++ executor error, a dead thread).

    As in the real proxy (executor/proxy.py), the error lands in the executor's error
    queue and the worker answers nothing more; TensorRT-LLM acts on it only the next time
    something calls ``_handle_background_error`` (executor/executor.py).
    """
    executor = llm._executor
    executor._worker.halt()
    executor._error_queue.put(error)


_PIECE_IDS = 1000  # ids from here on stand for a piece's UTF-8 bytes, as one number


def _piece(token_id: int) -> str:
    raw = token_id - _PIECE_IDS
    return raw.to_bytes((raw.bit_length() + 7) // 8, "big").decode()


class StandinTokenizer:
    """A word-level toy tokenizer with the HF-style methods the LLM API exposes.

    Special tokens written in text (``<s>``, ``</s>``, ``<|user|>``) map to single ids, so a
    rendered chat template that already starts with ``<s>`` gets a second BOS id when encoded
    with ``add_special_tokens=True``, exactly the hazard real Llama-style templates have.
    """

    _pattern = re.compile(r"<s>|</s>|<\|[a-z]+\|>|\s+|[^\s<]+|<")
    bos_token = BOS
    eos_token = EOS
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = EOS_ID

    def __init__(self) -> None:
        self._ids: dict[str, int] = {BOS: BOS_ID, EOS: EOS_ID}
        self._pieces: dict[int, str] = {BOS_ID: BOS, EOS_ID: EOS}
        self._lock = threading.Lock()  # encode runs on the loop and on the worker thread

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        with self._lock:
            for piece in self._pattern.findall(text):
                if piece not in self._ids:
                    # The same id for a piece in every process, as a real vocabulary
                    # gives (a takeover sends one process's ids to another's engine).
                    self._ids[piece] = _PIECE_IDS + int.from_bytes(piece.encode(), "big")
                    self._pieces[self._ids[piece]] = piece
                ids.append(self._ids[piece])
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True, **_: Any) -> str:
        special = {BOS_ID, EOS_ID}
        with self._lock:
            return "".join(
                self._pieces.get(t) or _piece(t)
                for t in token_ids
                if not (skip_special_tokens and t in special)
            )

    @property
    def chat_template(self) -> str | None:
        return controls.chat_template_text

    def apply_chat_template(
        self,
        conversation: Sequence[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **_: Any,
    ) -> str | list[int]:
        with stats._cond:
            stats.templates_rendered += 1
        _check_roles([m["role"] for m in conversation], controls.chat_template)
        # Like a template with a tool section: the tools first, as JSON; calls and outputs
        # as their JSON too.
        text = BOS + (f"<|tools|>\n{json.dumps(tools)}{EOS}\n" if tools else "")
        for m in conversation:
            content = m.get("content") or ""
            if m.get("tool_calls"):
                content += json.dumps(m["tool_calls"])
            text += f"<|{m['role']}|>\n{content}{EOS}\n"
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _check_roles(roles: list[str], rule: str) -> None:
    """What strict real templates enforce, with their own messages (raise_exception)."""
    if rule == "no_system" and "system" in roles:
        raise TemplateError("System role not supported")
    if rule == "alternating":
        turns = roles[1:] if roles[:1] == ["system"] else roles
        for i, role in enumerate(turns):
            if role != ("user" if i % 2 == 0 else "assistant"):
                raise TemplateError(
                    "Conversation roles must alternate user/assistant/user/assistant/..."
                )


@dataclass(frozen=True)
class ErrorResponse:
    """A per-request error the worker answers with (executor/utils.py)."""

    message: str


# One item the worker posts to a request's loop: new token ids, finish reason, cached tokens,
# the new tokens' log probabilities and the prompt's (None when not asked); or an
# ErrorResponse.
Post = tuple[list[int], str | None, int, TokenLogprobs | None, TokenLogprobs | None] | ErrorResponse
# The top-k alternatives' words (each one id of the stand-in tokenizer).
_ALTERNATIVES = tuple(f"alt{n}" for n in range(1, 21))


def logprob_value(position: int, rank: int) -> float:
    """The stand-in model's log probability for the token of ``rank`` at ``position``."""
    return -0.1 - 0.5 * (rank - 1) - 0.01 * (position % 10)


def top_logprobs(
    tokenizer: StandinTokenizer, token: int, position: int, k: int, rank: int = 1
) -> dict[int, Logprob]:
    """The top ``k`` of the distribution at ``position`` whose token ``token`` ranks
    ``rank``: as the real sampler reports them (top-k only, ranks from 1), the other ranks
    held by the alternative words."""
    others = iter(tokenizer.encode(w, add_special_tokens=False)[0] for w in _ALTERNATIVES)
    ranked = {}
    for r in range(1, k + 1):
        tid = token if r == rank else next(others)
        ranked[tid] = Logprob(logprob_value(position, r), r)
    return ranked


@dataclass
class _Active:
    record: RequestRecord
    plan: list[int]  # the tokens this request will generate, EOS last
    max_tokens: int
    ignore_eos: bool
    stop_words: list[list[int]]
    deliver: Callable[[Post], None]
    streaming: bool
    cached: int
    logprobs: int = 0  # top-k per token (SamplingParams.logprobs; 0: none)
    prompt_logprobs: TokenLogprobs | None = None  # reported with every response
    output_ids: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # held back when not streaming
    pending_logprobs: TokenLogprobs = field(default_factory=list)
    abort_seen_at: int | None = None  # step at which abort() was observed


class StepEngine:
    """The stand-in worker: a thread that runs one decoding iteration per ``step_s``.

    - Admission (executor/base_worker.py ``_enqueue_request``): the worker decides
      ``max_seq_len`` itself (``min(max_seq_len or the model's, KV cache capacity)``,
      _torch/pyexecutor/py_executor_creator.py and resource_manager.py). A prompt that
      leaves no room (``default_max_tokens <= 0``) gets a request error; a ``max_tokens``
      above the room is cut back with a warning; a seed that is not an unsigned 64-bit
      integer fails the request (the C++ SamplingConfig binding).
    - In-flight batching up to ``max_batch_size``; requests wait in a queue meanwhile.
    - ``abort()`` only records a wish. A running request is finished one step later with
      "cancelled"; one still waiting in the queue is dropped with no output at all
      (_torch/pyexecutor/py_executor.py ``_handle_canceled_requests``).
    - Stop words: the worker ends a request whose output ends with a stop word's tokens
      (finish reason STOP_WORDS).
    """

    def __init__(
        self,
        tokenizer: StandinTokenizer,
        max_batch_size: int,
        max_seq_len: int,
        block_reuse: bool,
        guided_backend: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._guided_backend = guided_backend
        self._max_batch = max_batch_size
        self.max_seq_len = max_seq_len
        self._block_reuse = block_reuse
        self._cond = threading.Condition()
        self._waiting: list[_Active] = []
        self._running: list[_Active] = []
        self._abort_ids: set[int] = set()
        self._seen_prompts: list[list[int]] = []
        self._step_no = 0
        self._stopped = False
        self._halted = False
        self._thread = threading.Thread(target=self._run, name="standin-trtllm-step", daemon=True)
        self._thread.start()

    # -- called from the front end ------------------------------------------------------
    def submit(self, record: RequestRecord, deliver: Callable[[Post], None]) -> None:
        sp = record.sampling_params
        error = self._refusal(record)
        if error is not None:
            record.error = error
            worker_log.error("submit request failed: %s", error)
            _post(deliver, ErrorResponse(error))
            return
        room = self.max_seq_len - len(record.prompt_token_ids)
        max_tokens = sp.max_tokens
        if max_tokens > room:
            worker_log.warning(
                "User-specified `max_tokens` (%d) is greater than deduced "
                "`default_max_tokens` (%d), using default_max_tokens instead.",
                max_tokens,
                room,
            )
            max_tokens = room
        record.max_tokens = max_tokens
        try:
            reply = self._reply(record)
        except ValueError as exc:  # the grammar matcher's own error, as the worker's
            record.error = str(exc)
            _post(deliver, ErrorResponse(str(exc)))
            return
        plan = self._tokenizer.encode(reply, add_special_tokens=False)
        plan = plan[self._answered(record.prompt_token_ids, plan) :]
        active = _Active(
            record=record,
            plan=[*plan, EOS_ID],
            max_tokens=max_tokens,
            ignore_eos=sp.ignore_eos,
            stop_words=sp._get_stop_words(),
            deliver=deliver,
            streaming=record.streaming,
            cached=self.cached_prefix(record.prompt_token_ids),
            logprobs=sp.logprobs or 0,
            prompt_logprobs=self._prompt_logprobs(record.prompt_token_ids, plan, sp),
        )
        with self._cond:
            self._waiting.append(active)
            stats._add_running(1)
            self._cond.notify()

    def _reply(self, record: RequestRecord) -> str:
        """What the toy model answers: ``controls.reply``, or, under guided decoding with
        a backend, a text the guide accepts (``controls.reply`` when it does, else one
        walked from the grammar). Without a backend the guide is ignored, as the real
        LLM ignores it (it answers unconstrained: NVIDIA/TensorRT#4855)."""
        guide = record.sampling_params.guided_decoding
        if guide is None or self._guided_backend is None:
            return controls.reply
        return guided_reply(self._guided_backend, guide, seed=record.request_id)

    def _prompt_logprobs(self, prompt: list[int], plan: list[int], sp: Any) -> TokenLogprobs | None:
        """From the context logits, as the real worker computes them (executor/result.py,
        compute_logprobs): position t's top-k predicts token t + 1 (the last one the first
        generated token), and only the top-k is kept, the actual token's or not."""
        if not sp.prompt_logprobs:
            return None
        following = [*prompt[1:], plan[0] if plan else EOS_ID]
        return [
            top_logprobs(self._tokenizer, token, t, sp.prompt_logprobs)
            for t, token in enumerate(following)
        ]

    def _answered(self, prompt: list[int], plan: list[int]) -> int:
        """Tokens of the reply the prompt already holds after its last generation prompt.

        The toy model goes on from there, as a greedy model continues its own answer
        from its tokens; the real worker has no such rule, it just generates."""
        marker = self._tokenizer.encode("<|assistant|>\n", add_special_tokens=False)
        for at in range(len(prompt) - len(marker), -1, -1):
            if prompt[at : at + len(marker)] == marker:
                tail = prompt[at + len(marker) :]
                return len(tail) if tail == plan[: len(tail)] else 0
        return 0

    def fatal(self, record: RequestRecord) -> str | None:
        """What kills the executor: a prompt token id beyond the embedding table is an
        out-of-range read in a GPU kernel (a device-side assert), not a request error."""
        vocab = controls.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in record.prompt_token_ids):
            return "CUDA error: device-side assert triggered (an embedding index out of range)"
        return None

    def _refusal(self, record: RequestRecord) -> str | None:
        seed = record.sampling_params.seed
        if seed is not None and not 0 <= seed <= UINT64_MAX:
            return (
                "__init__(): incompatible function arguments: SamplingConfig(seed) takes an "
                f"unsigned 64-bit integer, got {seed}"
            )
        room = self.max_seq_len - len(record.prompt_token_ids)
        if room <= 0:
            return (
                f"`default_max_tokens` ({room}) must be greater than 0, `default_max_tokens` "
                f"({room}) = max_seq_len ({self.max_seq_len}) - `splited_prompt_len` "
                f"({len(record.prompt_token_ids)})"
            )
        return None

    def abort(self, request_id: int) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError("the executor is shut down: its request queue is closed")
            for active in self._waiting + self._running:
                if active.record.request_id == request_id:
                    active.record.abort_requested = True
                    self._abort_ids.add(request_id)
            # An id the worker no longer holds (finished): nothing to do, as in
            # base_worker.py's abort_request ("is finished, cannot abort it").
            self._cond.notify()

    def cached_prefix(self, prompt_ids: list[int]) -> int:
        """Prompt tokens a previous prompt already put in the KV cache, in whole blocks."""
        if not self._block_reuse:
            return 0
        with self._cond:
            best = 0
            for seen in self._seen_prompts:
                n = 0
                for a, b in zip(seen, prompt_ids, strict=False):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            self._seen_prompts.append(list(prompt_ids))
            del self._seen_prompts[:-64]
        return best // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK

    def halt(self) -> None:
        """The worker dies: nothing it holds is ever answered."""
        with self._cond:
            self._halted = True
            leftovers = self._waiting + self._running
            self._waiting, self._running = [], []
            self._cond.notify()
        stats._add_running(-len(leftovers))

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)
        with self._cond:
            leftovers = self._waiting + self._running
            self._waiting, self._running = [], []
        # No final output for these: their consumers wait for one that never comes.
        stats._add_running(-len(leftovers))

    # -- the worker thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopped or (not self._halted and (self._waiting or self._running))
                )
                if self._stopped:
                    return
                self._step()
            # Sleep outside the lock so abort()/submit() never wait for a whole step.
            with self._cond:
                self._cond.wait_for(lambda: self._stopped, timeout=controls.step_s)

    def _step(self) -> None:
        self._step_no += 1
        for active in self._waiting + self._running:
            if active.record.request_id in self._abort_ids and active.abort_seen_at is None:
                active.abort_seen_at = self._step_no
                active.record.aborted = True
        # A waiting request that is aborted is removed from the queue, unanswered.
        for active in [a for a in self._waiting if a.abort_seen_at is not None]:
            self._drop(active)
            active.record.dropped_in_queue = True
            stats._add_running(-1)
        # An abort of a running request observed in an earlier step takes effect now.
        for active in [a for a in self._running if self._abort_due(a)]:
            self._drop(active)
            self._finish(active, "cancelled", [])
        while self._waiting and len(self._running) < self._max_batch:
            self._running.append(self._waiting.pop(0))
        for active in list(self._running):
            self._generate_one(active)
        stats._notify()

    def _abort_due(self, active: _Active) -> bool:
        return active.abort_seen_at is not None and active.abort_seen_at < self._step_no

    def _drop(self, active: _Active) -> None:
        for waiting_or_running in (self._waiting, self._running):
            if active in waiting_or_running:
                waiting_or_running.remove(active)
        self._abort_ids.discard(active.record.request_id)

    def _generate_one(self, active: _Active) -> None:
        record = active.record
        token = active.plan[min(record.generated, len(active.plan) - 1)]
        if token == EOS_ID and not active.ignore_eos:
            self._drop(active)
            self._finish(active, "end_id", [])
            return
        logprobs = []
        if active.logprobs:
            position = len(active.output_ids)
            rank = controls.sampled_rank
            logprobs.append(top_logprobs(self._tokenizer, token, position, active.logprobs, rank))
        record.generated += 1
        if record.aborted:
            record.tokens_after_abort += 1
        active.output_ids.append(token)
        forced = controls.finish_with
        if forced is not None and record.generated >= controls.finish_after:
            self._drop(active)
            self._finish(active, forced, [token], logprobs)
        elif any(active.output_ids[-len(w) :] == w for w in active.stop_words if w):
            self._drop(active)
            self._finish(active, "stop_words", [token], logprobs)
        elif record.generated >= active.max_tokens:
            self._drop(active)
            self._finish(active, "length", [token], logprobs)
        elif active.streaming:
            _post(active.deliver, ([token], None, active.cached, *self._logprobs(active, logprobs)))
        else:
            active.pending.append(token)
            active.pending_logprobs += logprobs

    def _logprobs(
        self, active: _Active, new: TokenLogprobs
    ) -> tuple[TokenLogprobs | None, TokenLogprobs | None]:
        """What a response carries of them: the new tokens' (when asked) and the prompt's
        (every response, as the PyTorch worker returns them)."""
        return (new if active.logprobs else None), active.prompt_logprobs

    def _finish(
        self, active: _Active, reason: str, tokens: list[int], logprobs: TokenLogprobs | None = None
    ) -> None:
        active.record.finish_reason = reason
        new = [*active.pending_logprobs, *(logprobs or [])]
        tail = self._logprobs(active, new)
        _post(active.deliver, ([*active.pending, *tokens], reason, active.cached, *tail))
        active.pending = []
        active.pending_logprobs = []
        stats._add_running(-1)


def _post(deliver: Callable[[Post], None], item: Post) -> None:
    # The real worker notifies the loop with call_soon_threadsafe; a closed loop raises
    # there too, and the request is simply lost to its consumer.
    with contextlib.suppress(RuntimeError):
        deliver(item)


class Executor:
    """The stand-in for the front end's executor (executor/proxy.py, executor/executor.py).

    - ``_error_queue`` collects background errors; a dead worker process puts one there
      (``mpi_done_callback`` in proxy.py).
    - ``_handle_background_error`` runs on the *calling* thread: ``generate_async`` and
      every response a ``RequestOutput`` handles call it. A per-request error is raised as
      ``RequestError``; any other error first shuts the executor down, right there on that
      thread (the event loop, for streaming outputs), and is then raised.
    - ``shutdown()`` re-raises a stored background error at its end, after it has done
      its work.
    """

    def __init__(self, worker: StepEngine, process: subprocess.Popen[bytes] | None) -> None:
        self._worker = worker
        self._process = process
        self._error_queue: queue.Queue[BaseException] = queue.Queue()
        self.doing_shutdown = False
        self._monitor: threading.Thread | None = None
        if process is not None:
            self._monitor = threading.Thread(
                target=self._watch_worker, name="standin-trtllm-monitor", daemon=True
            )
            self._monitor.start()

    def is_shutdown(self) -> bool:
        return self.doing_shutdown

    def submit(self, record: RequestRecord, deliver: Callable[[Post], None]) -> None:
        self._handle_background_error()
        if (fatal := self._worker.fatal(record)) is not None:
            self._worker.halt()
            self._error_queue.put(RuntimeError(fatal))
            return
        self._worker.submit(record, deliver)
        self._handle_background_error()

    def abort_request(self, request_id: int) -> None:
        self._worker.abort(request_id)

    def _watch_worker(self) -> None:
        assert self._process is not None
        code = self._process.wait()
        if not self.doing_shutdown:
            self._worker.halt()
            self._error_queue.put(RuntimeError(f"Executor worker died (exit code {code})"))

    def _handle_background_error(self, error: BaseException | str | None = None) -> None:
        if error is not None:
            if isinstance(error, str):
                error = RequestError(error)
            if not isinstance(error, RequestError):
                self.shutdown()
            raise error
        if not self._error_queue.empty():
            stored = self._error_queue.get()
            self.shutdown()
            raise stored

    def shutdown(self) -> None:
        if self.doing_shutdown:
            return
        self.doing_shutdown = True
        self._worker.shutdown()
        if self._process is not None:
            assert self._process.stdin is not None
            with contextlib.suppress(OSError):
                self._process.stdin.close()  # the worker process exits on EOF
            self._process.wait()
        if self._monitor is not None:
            self._monitor.join()
        stats._add_shutdown()
        self._handle_background_error()


def start_worker_process() -> subprocess.Popen[bytes]:
    """A child process standing for the MPI worker: it lives until its stdin closes."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.buffer.read()"],
        stdin=subprocess.PIPE,
    )
    with stats._cond:
        stats.worker_pids.append(process.pid)
    return process


def make_deliver(loop: asyncio.AbstractEventLoop | None, queue_: Any) -> Callable[[Post], None]:
    """How the worker hands an output to the loop the request is bound to."""
    if loop is None:
        return lambda item: queue_.put(item)
    return lambda item: loop.call_soon_threadsafe(queue_.put_nowait, item)


def guided_reply(backend: str, guide: Any, *, seed: int) -> str:
    """A text ``guide`` accepts, as the backend would compile it
    (_torch/pyexecutor/grammar_matcher.py): LLGuidance takes Lark for ``grammar``;
    xgrammar takes EBNF there, which this stand-in cannot compile, so it refuses one."""
    import llguidance

    if guide.json_object:
        grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    elif guide.json is not None:
        schema = guide.json if isinstance(guide.json, str) else json.dumps(guide.json)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    elif guide.regex is not None:
        grammar = llguidance.LLMatcher.grammar_from_regex(guide.regex)
    elif guide.grammar is not None and backend == "llguidance":
        grammar = llguidance.LLMatcher.grammar_from_lark(guide.grammar)
    elif guide.grammar is not None:
        raise ValueError("xgrammar: this stand-in cannot compile an EBNF grammar")
    else:
        raise ValueError(f"Unsupported guide type: {guide!r}.")
    if controls.reply and _accepts(grammar, controls.reply):
        return controls.reply
    return _walk(grammar, seed)


class _Bytes:
    """A byte vocabulary for LLGuidance (the stand-in has no real one)."""

    eos_token_id = 256
    bos_token_id = None

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _matcher(grammar: str) -> Any:
    import llguidance

    matcher = llguidance.LLMatcher(
        llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes())), grammar, log_level=0
    )
    if matcher.is_error():
        raise ValueError(f"LLGuidance matcher error: {matcher.get_error()}")
    return matcher


def _accepts(grammar: str, text: str) -> bool:
    matcher = _matcher(grammar)
    data = list(text.encode())
    return bool(matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting())


def _walk(grammar: str, seed: int) -> str:
    """A random walk through the grammar, one byte at a time, ending where it may."""
    import random

    rng = random.Random(seed)
    matcher = _matcher(grammar)
    out = bytearray()
    while len(out) < 4096:
        if matcher.is_accepting():
            return out.decode(errors="replace")
        mask = matcher.compute_logit_bias()
        allowed = [b for b in range(0x20, 0x7F) if mask[b]] + ([0x0A] if mask[0x0A] else [])
        if not allowed:
            break
        byte = rng.choice(allowed)
        matcher.consume_token(byte)
        out.append(byte)
    raise ValueError("LLGuidance matcher error: the stand-in found no text for this guide")
