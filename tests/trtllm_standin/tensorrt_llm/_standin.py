"""STAND-IN internals: test controls, counters, a toy tokenizer and the step thread.

Not part of the real TensorRT-LLM API. Tests set ``controls`` before building an LLM and
read ``stats`` afterwards; ``reset()`` restores both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

BOS, EOS = "<s>", "</s>"
BOS_ID, EOS_ID = 1, 2
TOKENS_PER_BLOCK = 8  # granularity of the stand-in's prefix (block) reuse
DEFAULT_REPLY = "Hello from the stand-in engine, one word at a time."


@dataclass
class Controls:
    """What the next requests do. Tests change these; ``reset()`` restores them."""

    reply: str = DEFAULT_REPLY  # text the "model" generates, then EOS
    step_s: float = 0.002  # seconds per engine iteration
    max_position_embeddings: int = 2048  # the model config's context length
    finish_with: str | None = None  # force "timeout" or "cancelled" ...
    finish_after: int = 2  # ... after this many generated tokens
    load_gate: threading.Event | None = None  # LLM() blocks until set: a slow load
    chat_template: str | None = None  # the tokenizer's Jinja template text (HF attribute)


@dataclass
class RequestRecord:
    """What one generate_async call asked for and what became of it."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: Any
    streaming: bool
    aborted: bool = False
    tokens_after_abort: int = 0
    finish_reason: str | None = None  # None if the engine shut down while it ran
    generated: int = 0
    abort_requested: bool = False  # abort() was called (``aborted``: the engine acted on it)


@dataclass
class Stats:
    requests: list[RequestRecord] = field(default_factory=list)
    llm_kwargs: list[dict[str, Any]] = field(default_factory=list)
    peak_running: int = 0
    shutdowns: int = 0
    shutdown_threads: list[threading.Thread] = field(default_factory=list)  # who shut down
    templates_rendered: int = 0  # apply_chat_template calls, on every tokenizer
    _running: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def running(self) -> int:
        """Requests the engine still holds (queued or generating)."""
        with self._cond:
            return self._running

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no request is left in any engine; True if that happened in time."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running == 0, timeout)

    def wait_llms(self, n: int, timeout: float = 5.0) -> bool:
        """Until ``n`` LLM constructors have been entered (they may still be loading)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.llm_kwargs) >= n, timeout)

    def _add_llm(self, kwargs: dict[str, Any]) -> None:
        with self._cond:
            self.llm_kwargs.append(kwargs)
            self._cond.notify_all()

    def wait_shutdowns(self, n: int, timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.shutdowns >= n, timeout)

    def _add_shutdown(self) -> None:
        with self._cond:
            self.shutdowns += 1
            self.shutdown_threads.append(threading.current_thread())
            self._cond.notify_all()

    def wait_requests(self, n: int, timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.requests) >= n, timeout)

    def _add_running(self, delta: int) -> None:
        with self._cond:
            self._running += delta
            self.peak_running = max(self.peak_running, self._running)
            self._cond.notify_all()

    def _add_request(self, record: RequestRecord) -> None:
        with self._cond:
            self.requests.append(record)
            self._cond.notify_all()


controls = Controls()
stats = Stats()


def reset() -> None:
    global controls, stats
    controls = Controls()
    stats = Stats()


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
        self._lock = threading.Lock()  # encode runs on the loop and on the engine thread

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        with self._lock:
            for piece in self._pattern.findall(text):
                if piece not in self._ids:
                    self._ids[piece] = len(self._ids) + 1
                    self._pieces[self._ids[piece]] = piece
                ids.append(self._ids[piece])
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True, **_: Any) -> str:
        special = {BOS_ID, EOS_ID}
        with self._lock:
            return "".join(
                self._pieces[t] for t in token_ids if not (skip_special_tokens and t in special)
            )

    @property
    def chat_template(self) -> str | None:
        return controls.chat_template

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


# One item the engine thread posts to a request's loop: new token ids, finish reason, cached.
Post = tuple[list[int], str | None, int]


@dataclass
class _Active:
    record: RequestRecord
    plan: list[int]  # the tokens this request will generate, EOS last
    max_tokens: int
    ignore_eos: bool
    deliver: Callable[[Post], None]
    streaming: bool
    cached: int
    pending: list[int] = field(default_factory=list)  # held back when not streaming
    abort_seen_at: int | None = None  # step at which abort() was observed


class StepEngine:
    """The stand-in executor: a thread that runs one decoding iteration per ``step_s``.

    Requests wait in a queue and join the running batch when a slot is free (in-flight
    batching up to ``max_batch_size``). ``abort()`` only records a wish; the step after the
    one that observes it removes the request and posts a final "cancelled" output.

    ``shutdown()`` is as unforgiving as the real one: TensorRT-LLM's ``pre_shutdown`` queues
    aborts and tells the workers to quit, and the result thread stops once they have, so a
    request still running may never get a final output. Here it never does; and ``abort()``
    after shutdown raises, as the real one does on its closed request queue.
    """

    def __init__(self, tokenizer: StandinTokenizer, max_batch_size: int, block_reuse: bool) -> None:
        self._tokenizer = tokenizer
        self._max_batch = max_batch_size
        self._block_reuse = block_reuse
        self._cond = threading.Condition()
        self._waiting: list[_Active] = []
        self._running: list[_Active] = []
        self._abort_ids: set[int] = set()
        self._seen_prompts: list[list[int]] = []
        self._step_no = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="standin-trtllm-step", daemon=True)
        self._thread.start()

    # -- called from the event loop -------------------------------------------------------
    def submit(self, active: _Active) -> None:
        with self._cond:
            self._waiting.append(active)
            stats._add_running(1)
            self._cond.notify()

    def abort(self, request_id: int) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError("the executor is shut down: its request queue is closed")
            self._abort_ids.add(request_id)
            for active in self._waiting + self._running:
                if active.record.request_id == request_id:
                    active.record.abort_requested = True
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

    # -- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._waiting or self._running)
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
        # An abort observed in an earlier step takes effect now: one step later.
        for active in [a for a in self._waiting + self._running if self._abort_due(a)]:
            self._drop(active)
            self._finish(active, "cancelled", [])
        while self._waiting and len(self._running) < self._max_batch:
            self._running.append(self._waiting.pop(0))
        for active in list(self._running):
            self._generate_one(active)

    def _abort_due(self, active: _Active) -> bool:
        return active.abort_seen_at is not None and active.abort_seen_at < self._step_no

    def _drop(self, active: _Active) -> None:
        for queue in (self._waiting, self._running):
            if active in queue:
                queue.remove(active)
        self._abort_ids.discard(active.record.request_id)

    def _generate_one(self, active: _Active) -> None:
        record = active.record
        token = active.plan[min(record.generated, len(active.plan) - 1)]
        if token == EOS_ID and not active.ignore_eos:
            self._drop(active)
            self._finish(active, "stop", [])
            return
        record.generated += 1
        if record.aborted:
            record.tokens_after_abort += 1
        forced = controls.finish_with
        if forced is not None and record.generated >= controls.finish_after:
            self._drop(active)
            self._finish(active, forced, [token])
        elif record.generated >= active.max_tokens:
            self._drop(active)
            self._finish(active, "length", [token])
        elif active.streaming:
            self._post(active, ([token], None, active.cached))
        else:
            active.pending.append(token)

    def _finish(self, active: _Active, reason: str, tokens: list[int]) -> None:
        active.record.finish_reason = reason
        self._post(active, ([*active.pending, *tokens], reason, active.cached))
        active.pending = []
        stats._add_running(-1)

    def _post(self, active: _Active, item: Post) -> None:
        # The real executor notifies the loop with run_coroutine_threadsafe; a closed loop
        # raises there too, and the request is simply lost to its consumer.
        with contextlib.suppress(RuntimeError):
            active.deliver(item)


def make_deliver(loop: asyncio.AbstractEventLoop | None, queue: Any) -> Callable[[Post], None]:
    """How the engine thread hands an output to the loop the request is bound to."""
    if loop is None:
        return lambda item: queue.put(item)
    return lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)
