"""A fleet of OpenAI-compatible servers behind the gateway (trtllm-serve, Dynamo, vLLM, SGLang).

The gateway keeps what those servers lack (WebSocket sessions, server-side
conversations, an explicit cancel) and leaves batching, KV caches and GPUs to
them. Each generation is one streaming ``POST /v1/chat/completions`` (a raw
prompt's: ``POST /v1/completions``) on the replica the :class:`Router` picks;
its SSE chunks become :class:`TextDelta` (and :class:`ToolCallDelta` for the
``tool_calls`` of a request with tools, which are forwarded as
``tools``/``tool_choice``) and its finish reason and usage one :class:`Finished`.
A request that asks for log probabilities sends ``logprobs`` and ``top_logprobs`` on
(a raw prompt's, ``logprobs: N``) and takes the replica's back with each delta (in the
chat shape, or the legacy completion shape vLLM answers ``/v1/completions`` in); a
replica that sends text without them fails the request with a 400 that says so (never
an answer with an empty list). Prompt log probabilities are refused: a streamed
completion carries none (vLLM refuses ``prompt_logprobs`` with ``stream``).

Cancelling closes the HTTP response before its body is read to the end, which
closes that connection: every one of these servers aborts a generation whose
client went away, so the slot is free again within a token or two.

Failures are handled by whether the client has seen text yet. Before the first
delta a broken replica is invisible: it is taken out of rotation and the
request goes to the next one. After it, retrying would duplicate or splice
text, so the stream raises :class:`EngineError` and the gateway ends that
response ``failed`` while the session carries on.

A background task probes every replica (``GET /health``, or ``/v1/models``
where there is no ``/health``); a replica that fails a probe or a request is
probed again with exponential backoff and rejoins once it answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import orjson

from gateway.engines import answer_check
from gateway.engines.base import (
    ContextOverflowError,
    EngineError,
    EngineUnavailableError,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    LogprobsUnsupportedError,
    Message,
    Moved,
    StreamEvent,
    StreamingEngine,
    TextDelta,
    TokenLogprob,
    Usage,
    chat_messages,
    clamp_logprob,
)
from gateway.engines.http_client import HttpError, Pool, Response
from gateway.engines.http_client import ReadError as _ReadError
from gateway.engines.http_client import RemoteProtocolError as _RemoteProtocolError
from gateway.engines.http_client import WriteError as _WriteError
from gateway.engines.openai_chat import (
    choice_logprobs,
    logprobs_body,
    response_format_body,
    tool_call_deltas,
    tools_body,
)

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 16
DEFAULT_MAX_MOVES = 2  # an answer's moves to another replica after its first token
DEFAULT_HEALTH_INTERVAL = 2.0
MAX_BACKOFF = 30.0
PROBE_TIMEOUT = 2.0
CONNECT_TIMEOUT = 5.0
AFFINITY_ENTRIES = 100_000  # conversations never say they ended: keep the most recent
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"  # a raw prompt's (GenerationRequest.prompt)
EMBEDDINGS_PATH = "/v1/embeddings"
# What a replica that serves no embeddings answers: 404 (vLLM, SGLang without an
# embedding model), 501 (llama.cpp's server without --embeddings).
NO_EMBEDDINGS = (404, 405, 501)
TOKENIZE_PATH = "/tokenize"  # llama.cpp's server and vLLM's
CHARS_PER_TOKEN = 4  # a taken-over answer's tokens, estimated where a replica cannot count


@dataclass(eq=False, slots=True)
class Replica:
    """One upstream server as this gateway process sees it."""

    url: str
    slots: int  # what /props reported, else --upstream-slots
    client: Pool | None = None  # its connections (gateway/engines/http_client.py)
    model: str | None = None
    healthy: bool = False
    outstanding: int = 0  # this process's requests in flight there
    failures: int = 0  # consecutive failed probes/requests, for the backoff
    next_probe: float = 0.0
    health_path: str = "/health"
    served: int = 0  # generations sent here (attempts, retried ones included)
    streaming: int = 0  # attempts here that have sent text and not yet ended
    # How it continues a final assistant message (an answer so far): "prefill" (llama.cpp's
    # server does so by itself), "continue_final_message" (vLLM's and SGLang's flags), or
    # "none" (it would answer anew: such a replica is not given a continuation).
    continuation: str = "none"

    @property
    def load(self) -> float:
        return self.outstanding / max(self.slots, 1)


@dataclass(slots=True)
class Router:
    """Least outstanding requests across healthy replicas, with conversation affinity.

    No I/O: the engine tells it which replicas are healthy and how busy. A
    conversation's next turn goes back to the replica that served its last
    one (which holds its prefix in the KV cache) while that replica is healthy
    and has a free slot; otherwise to the least loaded one, which then holds it.
    """

    replicas: list[Replica]
    _affinity: OrderedDict[str, Replica] = field(default_factory=OrderedDict)
    _turn: int = 0

    def choose(self, key: str | None, exclude: Sequence[Replica] = ()) -> Replica | None:
        candidates = [r for r in self.replicas if r.healthy and r not in exclude]
        if not candidates:
            return None
        pinned = self._affinity.get(key) if key is not None else None
        if pinned in candidates and pinned is not None and pinned.outstanding < pinned.slots:
            replica = pinned
        else:
            replica = min(candidates, key=self._rank)
            self._turn += 1
        if key is not None:
            self._remember(key, replica)
        return replica

    def _rank(self, replica: Replica) -> tuple[float, int]:
        # Ties rotate, so idle replicas share new conversations evenly.
        n = len(self.replicas)
        return replica.load, (self.replicas.index(replica) - self._turn) % n

    def _remember(self, key: str, replica: Replica) -> None:
        self._affinity[key] = replica
        self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)


class _ReplicaFailed(Exception):
    """A replica broke (connection, 5xx, garbage): retryable if no text was sent yet."""

    def __init__(self, reason: str, *, down: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.down = down  # False for "busy" answers (429): try elsewhere, keep it in


class UpstreamEngine(StreamingEngine):
    name = "upstream"
    reports_logprobs = True  # as the replicas do: one that sends none fails the request

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        api_key: str | None = None,
        slots: int = DEFAULT_SLOTS,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
        read_timeout: float = 120.0,
        continuation: str = "auto",
        max_moves: int = DEFAULT_MAX_MOVES,
        affinity_header: str | None = None,
    ) -> None:
        if not urls:
            raise EngineUnavailableError("the upstream engine needs at least one --upstream URL")
        if slots < 1 or health_interval <= 0:
            raise EngineUnavailableError(
                "--upstream-slots must be at least 1 and the health interval positive"
            )
        super().__init__()
        self.model = model
        self.api_key = api_key
        self.health_interval = health_interval
        self.read_timeout = read_timeout
        self.continuation = continuation  # "auto": what /props says (llama.cpp: prefill)
        self.max_moves = max_moves  # an answer moves to another replica at most this often
        # A header naming the conversation, for a distributed engine's own router behind
        # one URL (Dynamo, llm-d, vllm-router, SGLang's router keep affinity themselves).
        self.affinity_header = affinity_header
        self.moves = 0
        self.replicas = [Replica(_base_url(url), slots) for url in urls]
        if continuation != "auto":
            for replica in self.replicas:
                replica.continuation = continuation
        self.router = Router(self.replicas)
        self._health_task: asyncio.Task[None] | None = None

    @property
    def capacity(self) -> int:
        """The sum of every replica's slots (reported ones once the first probe ran)."""
        return sum(r.slots for r in self.replicas)

    @property
    def ready(self) -> bool:
        """Started and at least one replica healthy: ``/readyz`` tells the load balancer."""
        return self._ready and any(r.healthy for r in self.replicas)

    def describe(self) -> dict[str, object]:
        return {
            "model": self.model or next((r.model for r in self.replicas if r.model), "upstream"),
            "replicas": [
                {"healthy": r.healthy, "slots": r.slots, "running": r.outstanding}
                for r in self.replicas
            ],
        }

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Open a connection pool per replica, probe them all once, then keep probing.

        A second call (also one made while the first still probes) does nothing:
        it must not open a second set of pools or a second health task.
        """
        if any(r.client is not None for r in self.replicas):
            return
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for replica in self.replicas:
            # Reached directly, never through a proxy from the environment.
            replica.client = Pool(
                replica.url,
                headers=headers,
                connect_timeout=CONNECT_TIMEOUT,
                read_timeout=self.read_timeout,
            )
        await asyncio.gather(*(self._probe(r) for r in self.replicas))
        healthy = sum(r.healthy for r in self.replicas)
        if not healthy:
            log.warning("upstream: no replica is healthy yet; /readyz stays 503 until one is")
        self._health_task = asyncio.get_running_loop().create_task(
            self._health_loop(), name="upstream-health"
        )
        await super().start()

    async def close(self) -> None:
        await super().close()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for replica in self.replicas:
            if replica.client is not None:
                await replica.client.close()
                replica.client = None

    # -- health ----------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            now = time.monotonic()
            due = [r for r in self.replicas if r.next_probe <= now]
            try:
                await asyncio.gather(*(self._probe(r) for r in due))
            except Exception:  # a bug here must not silently end all health checking
                log.exception("upstream health probe crashed")
                for replica in due:
                    replica.next_probe = max(replica.next_probe, now + self.health_interval)
            wake_at = min(r.next_probe for r in self.replicas)
            await asyncio.sleep(max(0.0, wake_at - time.monotonic()))

    async def _probe(self, replica: Replica) -> None:
        try:
            reason = await self._check(replica)
            if reason is None and not replica.healthy:
                await self._discover(replica)
        except HttpError as exc:
            reason = _describe_error(exc)
        if reason is not None:
            self._mark_down(replica, reason)
            return
        # A request may have marked it down while this probe was in flight; the
        # probe's answer wins. If the replica really is gone, the next request to
        # it fails before its first token and is retried elsewhere, so no harm.
        if not replica.healthy:
            log.info("upstream %s is healthy (%d slots)", replica.url, replica.slots)
        replica.healthy = True
        replica.failures = 0
        replica.next_probe = time.monotonic() + self.health_interval

    async def _check(self, replica: Replica) -> str | None:
        """None if the replica answers its health route; else why not."""
        assert replica.client is not None
        status, _ = await _get(replica.client, replica.health_path)
        if status == 404 and replica.health_path == "/health":
            replica.health_path = "/v1/models"  # no /health here: the model list will do
            status, _ = await _get(replica.client, replica.health_path)
        if status != 200:
            return f"GET {replica.health_path} answered {status}"
        return None

    async def _discover(self, replica: Replica) -> None:
        """Learn the slot count (llama.cpp's /props) and the served model, where offered."""
        assert replica.client is not None
        slots = _json_field(await _get(replica.client, "/props"), "total_slots")
        if isinstance(slots, int) and slots > 0:
            replica.slots = slots
            if self.continuation == "auto":
                replica.continuation = "prefill"  # llama.cpp's server: its /props says so
        if self.model is None:
            models = _json_field(await _get(replica.client, "/v1/models"))
            data = models.get("data") if isinstance(models, dict) else None
            if isinstance(data, list) and data and isinstance(data[0], dict):
                replica.model = str(data[0].get("id")) if data[0].get("id") else None

    def _mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("upstream %s taken out of rotation: %s", replica.url, reason)
        replica.healthy = False
        replica.failures += 1
        backoff = min(self.health_interval * 2 ** (replica.failures - 1), MAX_BACKOFF)
        replica.next_probe = time.monotonic() + backoff

    # -- generation --------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        if request.sampling.prompt_logprobs is not None:
            raise LogprobsUnsupportedError(
                "The upstream pool streams its completions, which carry no log "
                "probabilities for the prompt's own tokens."
            )
        if request.sampling.max_output_tokens == 0:
            # llama.cpp's server would still make a token, and vLLM refuses it.
            raise InvalidRequestError(
                "unsupported_value",
                "The upstream pool generates at least one token: 'max_tokens' must be 1 or more.",
            )
        super().check(request)

    @property
    def can_continue(self) -> bool:  # type: ignore[override]
        """Whether a takeover's continuation can go to some replica of the pool."""
        return any(r.continuation != "none" for r in self.replicas)

    def check_structure(self, request: GenerationRequest) -> None:
        """Structure is passed on to the replica (and its answer checked at its end: see
        gateway/engines/answer_check.py); only a grammar for the whole answer has no
        field of the Chat Completions API to go in."""
        if request.constraint is not None and request.constraint.kind in ("lark", "regex"):
            raise InvalidRequestError(
                "structured_output_unsupported",
                "an upstream server takes JSON response formats only",
            )

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        answer = self._answer(request)
        return answer_check.checked(request, answer) if request.asks_structure else answer

    async def _answer(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """One answer on the pool: retried on another replica when one fails before its
        first token; after it, continued on another replica that can continue a final
        assistant message (the text so far as its prefix, at most ``max_moves`` times),
        so that the client sees one answer; else it fails with ``upstream_failed``."""
        tried: list[Replica] = []
        self._check_ready()
        prefix, earlier_tokens, moves = request.continuation, 0, 0
        # A takeover's answer so far (another gateway's) counts in this answer's budget
        # and usage as the text a replica streamed before a move does.
        counted = not prefix
        while (replica := self._choose(request, tried, prefix)) is not None:
            if not counted:
                earlier_tokens = len(request.continuation_token_ids) or await self._count_tokens(
                    replica, prefix
                )
                counted = True
            tried.append(replica)
            sent_text = False
            replica.outstanding += 1
            replica.served += 1
            attempt = replace(request, continuation=prefix)
            tokens, streamed = 0, False
            try:
                # aclosing: if our consumer is cancelled or closes us, the inner
                # generator (and with it the HTTP response) is closed right now.
                async with contextlib.aclosing(
                    self._generate(replica, attempt, earlier_tokens)
                ) as events:
                    async for event in events:
                        if isinstance(event, TextDelta):
                            if not streamed:
                                streamed = True
                                replica.streaming += 1
                            prefix += event.text
                            tokens += event.tokens
                        elif isinstance(event, Finished) and earlier_tokens:
                            # The usage of the whole answer, its earlier parts too.
                            usage = event.usage
                            event = replace(
                                event,
                                usage=replace(
                                    usage, output_tokens=usage.output_tokens + earlier_tokens
                                ),
                            )
                        sent_text = sent_text or not isinstance(event, Finished)
                        yield event
                return
            except _ReplicaFailed as exc:
                # close() closed the pools under this stream: not the replica's fault,
                # and there is nothing to retry on.
                self._check_ready(exc)
                if exc.down:
                    self._mark_down(replica, exc.reason)
                earlier_tokens += tokens
                if sent_text:
                    movable = moves < self.max_moves and any(
                        r.healthy and self._continues(r, request) and r not in tried
                        for r in self.replicas
                    )
                    if not movable:
                        # The client holds part of this answer, and no replica can go on
                        # from it (another would start over: duplicated or spliced text).
                        log.warning("upstream %s failed mid-answer: %s", replica.url, exc.reason)
                        raise EngineError(
                            "upstream_failed",
                            "the upstream server failed mid-answer; the text so far is kept, "
                            "ask again to retry",
                        ) from exc
                    moves += 1
                    self.moves += 1
                    yield Moved()
                    log.warning(
                        "upstream %s failed mid-answer (%s): continuing on another replica",
                        replica.url,
                        exc.reason,
                    )
                    continue
                # Replica addresses go to the log, not to the client.
                log.warning("upstream %s failed before the first token (%s)", replica.url, exc)
            finally:
                replica.outstanding -= 1
                if streamed:
                    replica.streaming -= 1
        detail = f"{len(tried)} tried, all failed" if tried else "none is healthy"
        raise EngineError("upstream_unavailable", f"no upstream server could answer ({detail})")

    async def _count_tokens(self, replica: Replica, text: str) -> int:
        """How many tokens ``text`` is, by ``replica``'s own tokenizer (``POST /tokenize``:
        llama.cpp's shape for a prefilling replica, vLLM's and SGLang's otherwise); where it
        cannot tell, an estimate of :data:`CHARS_PER_TOKEN` characters a token."""
        estimate = max(1, len(text) // CHARS_PER_TOKEN)
        client = replica.client
        if client is None:
            return estimate
        if replica.continuation == "prefill":
            body: dict[str, Any] = {"content": text, "add_special": False}
        else:
            body = {"prompt": text, "add_special_tokens": False}
            if model := self.model or replica.model:
                body["model"] = model
        tokens = None
        try:
            response = await _send(
                client,
                "POST",
                TOKENIZE_PATH,
                body=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                io_timeout=PROBE_TIMEOUT,
            )
            answer = await response.read()
            if response.status_code == 200:
                tokens = orjson.loads(answer).get("tokens")
        except (HttpError, orjson.JSONDecodeError, AttributeError):
            pass
        if not isinstance(tokens, list):
            log.info("upstream %s cannot count tokens: the answer so far is estimated", replica.url)
            return estimate
        return len(tokens)

    def _choose(
        self, request: GenerationRequest, tried: list[Replica], prefix: str
    ) -> Replica | None:
        """The next replica; one that can continue when there is text to continue."""
        if not prefix:
            return self.router.choose(request.affinity_key, tried)
        cannot = [r for r in self.replicas if not self._continues(r, request)]
        return self.router.choose(request.affinity_key, [*tried, *cannot])

    @staticmethod
    def _continues(replica: Replica, request: GenerationRequest) -> bool:
        """Whether ``replica`` can go on with ``request``'s answer so far: none for an
        answer under a constraint (see Engine.continues), any replica for a text prompt (the
        prompt and the text so far are one longer prompt), none for token ids, and for a
        conversation one that continues a final assistant message."""
        if request.asks_structure:
            return False
        if request.prompt is not None:
            return isinstance(request.prompt, str)
        return replica.continuation != "none"

    async def embeddings(self, body: bytes) -> tuple[int, bytes] | None:
        """The body to the least loaded healthy replica's ``/v1/embeddings``, and its answer
        as it came; the next replica when one cannot be reached. None when the replica
        serves no embeddings."""
        self._check_ready()
        tried: list[Replica] = []
        while (replica := self.router.choose(None, tried)) is not None:
            tried.append(replica)
            assert replica.client is not None
            headers = {"Content-Type": "application/json"}
            replica.outstanding += 1
            try:
                response = await _send(
                    replica.client, "POST", EMBEDDINGS_PATH, body=body, headers=headers
                )
                content = await response.read()
            except HttpError as exc:
                self._mark_down(replica, _describe_error(exc))
                continue
            finally:
                replica.outstanding -= 1
            if response.status_code in NO_EMBEDDINGS:
                return None
            return response.status_code, content
        detail = f"{len(tried)} tried, all failed" if tried else "none is healthy"
        raise EngineError("upstream_unavailable", f"no upstream server could answer ({detail})")

    def _check_ready(self, cause: Exception | None = None) -> None:
        """Before the first attempt and each retry: not started, or close() began."""
        if not self._ready:
            raise EngineError(
                "engine_not_ready", "the upstream engine is not running (not started, or closing)"
            ) from cause

    async def _generate(
        self, replica: Replica, request: GenerationRequest, earlier_tokens: int = 0
    ) -> AsyncGenerator[StreamEvent, None]:
        """One attempt on one replica; transport trouble becomes :class:`_ReplicaFailed`."""
        client = replica.client
        if client is None:  # stream() checks readiness first; this guards the use itself
            raise EngineError(
                "engine_not_ready", "the upstream engine is not running (not started, or closing)"
            )
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        headers.update(request.trace_context)  # the gateway's span is the parent upstream
        if self.affinity_header is not None and request.affinity_key is not None:
            headers[self.affinity_header] = affinity_id(request.affinity_key)
        path = CHAT_PATH if request.prompt is None else COMPLETIONS_PATH
        body = orjson.dumps(self._body(replica, request, earlier_tokens))
        try:
            response = await _send(client, "POST", path, body=body, headers=headers)
            try:
                if response.status_code != 200:
                    raise _status_error(response.status_code, await response.read())
                async for event in _events(response, request.sampling.logprobs):
                    yield event
            finally:
                await response.aclose()  # pools the connection only if the body was read to its end
        except HttpError as exc:
            raise _ReplicaFailed(_describe_error(exc)) from exc

    def _body(
        self, replica: Replica, request: GenerationRequest, earlier_tokens: int = 0
    ) -> dict[str, Any]:
        s = request.sampling
        body: dict[str, Any] = {
            **self._prompt(request),
            "stream": True,
            "stream_options": {"include_usage": True},
            **tools_body(request),
            **response_format_body(request.constraint),
            **logprobs_body(request),
        }
        if request.tools and not request.parallel_tool_calls:
            body["parallel_tool_calls"] = False
        if (
            request.prompt is None
            and request.continuation
            and replica.continuation == "continue_final_message"
        ):
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        model = self.model or replica.model
        budget = s.max_output_tokens
        if budget is not None and earlier_tokens:
            budget = max(1, budget - earlier_tokens)  # the whole answer's budget
        optional = {
            "model": model,
            "max_tokens": budget,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            "stop": list(s.stop) or None,
            "frequency_penalty": s.frequency_penalty,
            "presence_penalty": s.presence_penalty,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if request.prompt is not None and s.logprobs is not None:
            # /v1/completions takes its alternatives as an integer ``logprobs``.
            del body["top_logprobs"]
            body["logprobs"] = max(1, s.logprobs)
        return body

    @staticmethod
    def _prompt(request: GenerationRequest) -> dict[str, Any]:
        """The body's prompt: a conversation's messages (the answer so far as an open final
        assistant message), or a raw prompt for ``/v1/completions`` (text or token ids, the
        text so far after it)."""
        prompt = request.prompt
        if prompt is None:
            messages = request.messages
            if request.continuation:
                messages = (*messages, Message("assistant", request.continuation))
            return {"messages": chat_messages(messages)}
        if isinstance(prompt, str):
            return {"prompt": prompt + request.continuation}
        return {"prompt": list(prompt)}  # stream() never continues token ids elsewhere


# -- the wire format ---------------------------------------------------------------


async def _send(
    client: Pool,
    method: str,
    path: str,
    *,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    io_timeout: float | None = None,
) -> Response:
    """Send ``request``; once more if the server dropped the connection without answering.

    A kept-alive connection can be closed by the server just as it is reused:
    uvicorn (vLLM, SGLang, trtllm-serve) closes idle ones after 5 s, and
    llama.cpp closes every one after a streamed answer although it announces
    keep-alive. The request then fails before any byte of a response came back,
    which says nothing about the replica; the pool has dropped that connection,
    so the second try goes out on another. A replica that is really gone fails
    that one too (a refused connection), and only then counts as down.
    """
    try:
        return await client.request(method, path, body=body, headers=headers, io_timeout=io_timeout)
    except (_RemoteProtocolError, _ReadError, _WriteError) as exc:
        log.debug("upstream %s dropped a connection unanswered (%s)", path, exc)
        return await client.request(method, path, body=body, headers=headers, io_timeout=io_timeout)


async def _get(client: Pool, path: str) -> tuple[int, bytes]:
    """A probe's GET: its status and body, within PROBE_TIMEOUT."""
    response = await _send(client, "GET", path, io_timeout=PROBE_TIMEOUT)
    return response.status_code, await response.read()


async def _events(response: Response, logprobs: int | None = None) -> AsyncIterator[StreamEvent]:
    """Server-sent ``chat.completion.chunk`` (or ``text_completion``) events -> deltas,
    then one Finished. ``logprobs``: the request's (each delta then carries its text's,
    from the chunk).

    The Finished comes only after the body is read to its very end: ``[DONE]``
    is followed by the chunked terminator, and a response left before that is
    closed with its connection instead of returning it to the pool (a new TCP
    connection per generation).
    """
    reason: FinishReason | None = None
    usage: Usage | None = None
    deltas = 0
    done = False
    async for line in response.lines():
        if done:
            continue  # nothing is expected after [DONE]; read on to the end of the body
        name, _, payload = line.partition(":")
        payload = payload.strip()
        if name == "error":  # llama.cpp reports a failed generation this way
            raise _chunk_error(_parse_chunk(payload), started=deltas > 0)
        if name != "data":
            continue  # blank separators, comments (": ping"), event names
        if payload == "[DONE]":
            done = True
            continue
        chunk = _parse_chunk(payload)
        if isinstance(chunk.get("error"), dict):
            raise _chunk_error(chunk["error"], started=deltas > 0)
        usage = _usage(chunk.get("usage")) or usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            # A chat chunk's text is its delta's content; a completion chunk's, its text.
            text = delta.get("content") or choice.get("text")
            if text and logprobs is not None:
                deltas += 1
                yield TextDelta(text, logprobs=_text_logprobs(choice, logprobs))
            elif text:
                deltas += 1
                yield TextDelta(text)
            for call in tool_call_deltas(delta):
                deltas += call.tokens
                yield call
            if choice.get("finish_reason"):
                reason = _finish_reason(choice["finish_reason"])
    if reason is None:
        raise _ReplicaFailed("the stream ended without a finish reason")
    yield Finished(reason, usage or Usage(0, deltas))


def _text_logprobs(choice: dict[str, Any], top: int) -> tuple[TokenLogprob, ...]:
    """The log probabilities that come with a choice's text; a replica that sends none
    cannot report them (a 400: the client asked for what this pool cannot give)."""
    logprobs = choice_logprobs(choice, top) or legacy_logprobs(choice.get("logprobs"), top)
    if logprobs is None:
        raise LogprobsUnsupportedError(
            "The upstream server returned no log probabilities with its text: it cannot "
            "report them; ask without logprobs."
        )
    return logprobs


def legacy_logprobs(raw: object, top: int) -> tuple[TokenLogprob, ...] | None:
    """A completion choice's log probabilities in the legacy shape (``tokens``,
    ``token_logprobs``, ``top_logprobs`` as ``{token: logprob}``), as vLLM sends them;
    None when ``raw`` is not that shape."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tokens"), list):
        return None
    values, tops = raw.get("token_logprobs") or [], raw.get("top_logprobs") or []
    out = []
    for i, token in enumerate(raw["tokens"]):
        value = values[i] if i < len(values) and isinstance(values[i], int | float) else None
        logprob = clamp_logprob(float(value) if value is not None else float("-inf"))
        alternatives = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        ranked = sorted(alternatives.items(), key=lambda kv: -float(kv[1]))[:top] if top else []
        out.append(
            TokenLogprob(
                str(token),
                logprob,
                str(token).encode(),
                tuple(TokenLogprob(t, clamp_logprob(float(v)), t.encode()) for t, v in ranked),
            )
        )
    return tuple(out)


FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "content_filter": "stop",  # the server ended the answer on purpose
}


def _finish_reason(raw: object) -> FinishReason:
    """An OpenAI finish reason, or :class:`_ReplicaFailed` for anything else.

    vLLM and SGLang end a request they dropped (engine error, preemption,
    shutdown) with ``"abort"``, others with ``"error"``: the answer was cut off,
    so it must not be reported as completed.
    """
    reason = FINISH_REASONS.get(raw) if isinstance(raw, str) else None
    if reason is None:
        raise _ReplicaFailed(
            f"the server ended the generation with finish_reason {raw!r}", down=False
        )
    return reason


def _parse_chunk(payload: str) -> dict[str, Any]:
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise _ReplicaFailed(f"unreadable stream chunk: {payload[:80]!r}") from exc
    if not isinstance(chunk, dict):
        raise _ReplicaFailed(f"unexpected stream chunk: {payload[:80]!r}")
    return chunk


def _usage(raw: object) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    details = raw.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return Usage(
        int(raw.get("prompt_tokens") or 0),
        int(raw.get("completion_tokens") or 0),
        int(cached or 0),
    )


def affinity_id(key: str) -> str:
    """A conversation's affinity key as a header value: stable, opaque (it names no
    tenant and holds no client text), ASCII."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _error_message(body: bytes) -> str:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace").strip()[:500]
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict):
        return " ".join(str(error.get(k, "")) for k in ("type", "code", "message")).strip()
    return str(error)[:500]


def _is_context_error(message: str) -> bool:
    """vLLM, SGLang, trtllm-serve, llama.cpp and OpenAI word it differently; all say context."""
    text = message.lower()
    return "context" in text and any(w in text for w in ("length", "size", "exceed", "window"))


def _status_error(status: int, body: bytes) -> Exception:
    message = _error_message(body)
    if status in (400, 413, 422) and _is_context_error(message):
        return ContextOverflowError(
            f"the conversation is too long for the upstream model: {message}"
        )
    if status in (429, 500):  # busy, or this request broke it: try another
        return _ReplicaFailed(f"HTTP {status}: {message}", down=False)
    if status >= 500:  # 502/503/504: the replica (or what is in front of it) is down
        return _ReplicaFailed(f"HTTP {status}: {message}")
    if status == 400 and "logprob" in message.lower():
        return LogprobsUnsupportedError(
            f"The upstream server cannot report these log probabilities: {message}"
        )
    if status in (401, 403):
        return EngineError(
            "upstream_auth",
            f"the upstream server refused the key ({status}): check --upstream-api-key",
        )
    return EngineError("upstream_rejected", f"the upstream server refused the request: {message}")


def _chunk_error(error: dict[str, Any], *, started: bool) -> Exception:
    message = " ".join(str(error.get(k, "")) for k in ("type", "message")).strip()
    if not started and _is_context_error(message):
        return ContextOverflowError(
            f"the conversation is too long for the upstream model: {message}"
        )
    return _ReplicaFailed(f"error in the stream: {message}", down=False)


def _describe_error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _json_field(answer: tuple[int, bytes], name: str | None = None) -> Any:
    status, content = answer
    if status != 200:
        return None
    try:
        parsed = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    if name is None:
        return parsed
    return parsed.get(name) if isinstance(parsed, dict) else None


def _base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EngineUnavailableError(f"--upstream {url}: expected a URL like http://HOST:PORT")
    # Accept a trailing /v1 as OpenAI client settings have it; routes are added here.
    return url.rstrip("/").removesuffix("/v1")


# -- command line --------------------------------------------------------------------


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Register the engine's flags."""
    group.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8001 (repeatable);"
        " response_format, tool_choice, strict tools and parallel_tool_calls are passed on, and"
        " an answer that does not hold to them (a replica that does not constrain its output)"
        " fails with upstream_unconstrained",
    )
    group.add_argument(
        "--upstream-model",
        default=None,
        help="model name sent upstream; unset: --model, else the first one /v1/models lists",
    )
    group.add_argument("--upstream-api-key", default=None, help="Bearer key for the upstreams")
    group.add_argument(
        "--upstream-slots",
        type=int,
        default=DEFAULT_SLOTS,
        help="concurrent generations per replica when it does not report its slots",
    )
    group.add_argument(
        "--upstream-continuation",
        choices=("auto", "prefill", "continue_final_message", "none"),
        default="auto",
        metavar="HOW",
        help="how replicas continue an answer (auto: llama.cpp's prefill)",
    )
    group.add_argument(
        "--upstream-affinity-header",
        default=None,
        metavar="H",
        help="header naming each conversation upstream",
    )
    group.add_argument(
        "--upstream-health-interval",
        type=float,
        default=DEFAULT_HEALTH_INTERVAL,
        help="seconds between health probes of a healthy replica",
    )


def from_args(args: argparse.Namespace) -> UpstreamEngine:
    if not args.upstream:
        raise EngineUnavailableError(
            "the upstream engine needs --upstream URL (repeatable), "
            "e.g. --upstream http://127.0.0.1:8001"
        )
    return UpstreamEngine(
        args.upstream,
        model=args.upstream_model or getattr(args, "model", None),
        api_key=args.upstream_api_key,
        slots=args.upstream_slots,
        health_interval=args.upstream_health_interval,
        continuation=args.upstream_continuation,
        affinity_header=args.upstream_affinity_header,
    )
