"""Several answers to one HTTP request (``n``, and Completions' prompts and ``best_of``): what
the Chat Completions and Completions dialects share.

Each choice is a response of its own in the session core: its own job in the scheduler (so
admission counts every choice, and a client that goes ends every one in the engine), its
own seed (the request's plus its index: a seeded request is reproducible choice by
choice), its own deltas, which reach the client interleaved, each chunk naming its choice's
``index``. :class:`Choices` starts them all or none, and says when the last has ended;
:class:`ChoiceFraming` builds a text chunk from bytes, with the choice's index, as the
other dialects build their text deltas; :class:`OneRequestDialect` is what both dialects
do alike around them (the refusal, the error, usage and whole object at the end, and the
``Dialect`` hooks of a session that is never resumed or kept).

Who owns what: a dialect's :class:`Choices` is the actor's, changed on its turn (and on the
scheduler's fan-out call, where no handler runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

import orjson

from gateway.engines.base import TokenLogprob, Usage
from gateway.scheduler import Outcome
from sessions import codec
from sessions.core import ResponseSpec, ResponseState, Session
from sessions.errors import ProtocolError

SEEDS = 2**64  # seeds are unsigned 64-bit integers on every engine (TensorRT-LLM's range)


class RequestObserver(Protocol):
    """The HTTP side of the one request (gateway/api/chat_http.py, completions_http.py)."""

    def started(self, body: codec.JSON) -> None:
        """The answer was admitted: ``body`` is the chunks' head."""

    def ended(self, body: codec.JSON) -> None:
        """The whole object (a ``chat.completion``, a ``text_completion``), or an error
        object, ``{"error": ...}``."""

    def refused(self, err: ProtocolError) -> None:
        """The request was refused before it started."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: the request's plus the index, so that choice 0 of a request
    with ``n`` samples as the same request with one choice would, and each other its own."""
    return None if seed is None else (seed + index) % SEEDS


LogprobsJson = Callable[[Sequence[TokenLogprob], int], codec.JSON]
"""A text delta's tokens' log probabilities as its API's JSON, given where the delta's text
starts in its choice's text (the legacy shape's ``text_offset`` counts from there)."""


class ChoiceFraming:
    """A text chunk as bytes: the head (``id``, ``object``, ``created``, ``model``), set when
    the request starts, then the choice's index and ``template``'s rest, with the text (and,
    for a request that asked for them, its tokens' log probabilities)."""

    __slots__ = ("_ids", "_logprobs_json", "_offsets", "_template", "_template_logprobs", "head")
    first_sequence_number = 0
    replays_first = True

    def __init__(
        self, template: bytes, template_logprobs: bytes, logprobs_json: LogprobsJson
    ) -> None:
        # template: what follows '...,"choices":[{"index":N', with %b for the ids made by
        # delta_ids and %b for the text as JSON; template_logprobs: a third %b, for them.
        self._template = template
        self._template_logprobs = template_logprobs
        self._logprobs_json = logprobs_json
        self.head = b"{}"
        self._ids: dict[str, bytes] = {}  # by response id: the chunk up to its index
        self._offsets: dict[bytes, int] = {}  # by those ids: where the next text starts

    def add(self, response_id: str, index: int, offset: int = 0) -> None:
        """The response ``response_id`` is choice ``index``, whose text (as the client sees
        it: after an echoed prompt) has ``offset`` characters before its first delta."""
        ids = self._ids[response_id] = b'%b,"choices":[{"index":%d' % (self.head[:-1], index)
        self._offsets[ids] = offset

    def advance(self, response_id: str, chars: int) -> None:
        """Text the dialect sent in a chunk of its own (an echoed prompt) before the deltas."""
        self._offsets[self._ids[response_id]] += chars

    def numbered(self, seq: int, body: bytes) -> bytes:
        return body  # chunks carry no number

    def delta_ids(self, response_id: str, item_id: str) -> bytes:
        return self._ids[response_id]

    def delta(self, seq: int, ids: bytes, text: str) -> bytes:
        return self._template % (ids, orjson.dumps(text))

    def delta_logprobs(
        self, seq: int, ids: bytes, text: str, logprobs: Sequence[TokenLogprob]
    ) -> bytes:
        offset = self._offsets[ids]
        self._offsets[ids] = offset + len(text)
        encoded = orjson.dumps(self._logprobs_json(logprobs, offset))
        return self._template_logprobs % (ids, orjson.dumps(text), encoded)


@dataclass(frozen=True, slots=True)
class Ended:
    """A choice that ended: its response and how."""

    index: int
    response: ResponseState
    outcome: Outcome


class Choices:
    """The choices of one request, started together; see the module docstring."""

    def __init__(self, core: Session, framing: ChoiceFraming) -> None:
        self._core = core
        self._framing = framing
        self._index: dict[str, int] = {}  # response id -> choice index
        self.ended: dict[int, Ended] = {}
        self.count = 0
        self.failed = False  # one choice failed: the others were cancelled

    def index(self, r: ResponseState) -> int:
        return self._index[r.id]

    def start(self, specs: Sequence[ResponseSpec], each: int, request_id: str) -> None:
        """Start ``each`` responses per spec, all or none: choice ``i`` is
        ``specs[i // each]``, its seed made its own. Raises ``overloaded`` or
        ``rate_limit_exceeded`` otherwise. Choice 0's response id is ``request_id`` (what
        the client sees, and the access log says), the others' ``request_id-i``. The
        dialect's ``response_started`` runs for each before this returns."""
        core = self._core
        count = len(specs) * each
        if core.scheduler.room < count:
            raise overloaded()
        core.check_rate_limits(count, specs[0].sampling.max_output_tokens)
        self.count = count
        ids = [request_id, *(f"{request_id}-{i}" for i in range(1, count))]
        self._index = {response_id: i for i, response_id in enumerate(ids)}
        for i, response_id in enumerate(ids):
            spec = specs[i // each]
            seeded = replace(spec.sampling, seed=choice_seed(spec.sampling.seed, i))
            # A prompt's tokens count once in the request's usage, as OpenAI counts them.
            choice = replace(spec, sampling=seeded, counts_prompt=i % each == 0)
            self._framing.add(response_id, i)
            if core.start_response(choice, response_id=response_id):
                continue
            # The room was checked: only a scheduler that began to close gets here.
            self.fail()
            raise overloaded()

    def end(self, r: ResponseState, outcome: Outcome) -> Ended | None:
        """Record ``r``'s end; None once the request failed (what a cancel ends then is
        nobody's business)."""
        if self.failed:
            return None
        done = Ended(self._index[r.id], r, outcome)
        self.ended[done.index] = done
        return done

    @property
    def over(self) -> bool:
        """Every choice has ended."""
        return len(self.ended) == self.count

    def fail(self) -> None:
        """End the other choices: the request failed as a whole."""
        self.failed = True
        for response in self._core.responses:
            self._core.cancel_response(response, "disconnected")

    def usage(self) -> Usage:
        """The request's usage: every choice's output tokens, and each prompt's tokens once
        (from the choices that count them: ``ResponseSpec.counts_prompt``)."""
        inputs = output = cached = 0
        for ended in self.ended.values():
            usage = ended.outcome.usage
            output += usage.output_tokens
            if ended.response.spec.counts_prompt:
                inputs, cached = inputs + usage.input_tokens, cached + usage.cached_tokens
        return Usage(inputs, output, cached)


def check_choices(param: str, count: int, limit: int) -> None:
    """Refuse more choices than ``--max-choices`` allows."""
    if count > limit:
        raise ProtocolError(
            "invalid_value",
            f"'{param}' asks for {count} choices; this gateway makes at most {limit} per "
            "request (--max-choices).",
            param=param,
        )


def overloaded() -> ProtocolError:
    return ProtocolError(
        "overloaded",
        "The gateway is at capacity (every engine slot and queue place is taken); retry shortly.",
        error_type="server_error",
    )


def failed_error(outcome: Outcome) -> ProtocolError:
    """A failed answer's error, as the client sees it."""
    error = outcome.error
    return ProtocolError(
        error.code if error else "engine_error",
        error.message if error else "The engine failed.",
        error_type=error.error_type if error else "server_error",
    )


class RequestBody(Protocol):
    """What :class:`OneRequestDialect` reads of a decoded request body."""

    @property
    def stream(self) -> bool: ...

    @property
    def include_usage(self) -> bool: ...


BodyT = TypeVar("BodyT", bound=RequestBody)


class OneRequestDialect(Generic[BodyT]):
    """A dialect whose session answers one HTTP request with its :class:`Choices` (Chat
    Completions, Completions): the request and its observer, the refusal, the stream's
    error and usage chunks, the whole object at the end; and the ``Dialect`` hooks such a
    session has nothing to do in: it is never resumed, taken over or kept in a store, and
    has no maximum age.

    A dialect names its ``command`` class (whose ``body`` is a ``BodyT``) and gives
    :meth:`_start` (which fills ``_head`` and starts ``_choices``), :meth:`_choice_started`,
    :meth:`_choice_ended` and :meth:`_whole`."""

    name: str
    command: type[Any]  # the one command: its ``body`` is the request's

    def __init__(self, framing: ChoiceFraming, observer: RequestObserver | None = None) -> None:
        self.framing = framing
        self.observer = observer
        self._core: Session | None = None
        self._choices: Choices | None = None
        self._body: BodyT | None = None
        self._head: codec.JSON = {}  # every chunk's id, object, created and model
        self._started = False

    @property
    def core(self) -> Session:
        assert self._core is not None
        return self._core

    @property
    def choices(self) -> Choices:
        assert self._choices is not None
        return self._choices

    @property
    def body(self) -> BodyT:
        assert self._body is not None
        return self._body

    def attach(self, core: Session, greet: bool) -> None:
        self._core = core

    def handle(self, command: object) -> None:
        if not isinstance(command, self.command):
            raise ProtocolError("invalid_event", f"A {self.name} session takes one request.")
        if self._body is not None:
            raise ProtocolError("invalid_event", f"A {self.name} session answers one request.")
        self._body = command.body
        self._start(command.body)

    def _start(self, body: BodyT) -> None:
        """Start the request's choices (or raise :class:`ProtocolError`: a refusal)."""
        raise NotImplementedError

    def _choice_started(self, r: ResponseState) -> None:
        """Choice ``r`` was admitted: what its stream opens with."""
        raise NotImplementedError

    def _choice_ended(self, r: ResponseState, outcome: Outcome) -> None:
        """Choice ``r`` ended (not failed): its stream's last chunk."""
        raise NotImplementedError

    def _whole(self) -> codec.JSON:
        """Every choice has ended: the whole object's ``object`` (if not the chunks') and
        ``choices``."""
        raise NotImplementedError

    def error(self, err: ProtocolError) -> None:
        if not self._started:
            if self.observer is not None:
                self.observer.refused(err)
            return
        self._put_error(err)

    def _put_error(self, err: ProtocolError) -> None:
        if self._body is not None and self._body.stream:
            self.core.outbox.put(codec.error_json(err))

    # -- what the core reports ---------------------------------------------------------

    def response_started(self, r: ResponseState) -> None:
        if not self._started:
            self._started = True
            if self.observer is not None:
                self.observer.started(self._head)
        self._choice_started(r)

    def response_ended(self, r: ResponseState, outcome: Outcome) -> None:
        choices = self.choices
        if choices.end(r, outcome) is None:
            return
        if outcome.status == "failed":
            err = failed_error(outcome)
            choices.fail()
            self._put_error(err)
            self._end(codec.error_json(err))
            return
        self._choice_ended(r, outcome)
        if choices.over:
            self._complete()

    def _complete(self) -> None:
        """Every choice has ended: the usage chunk, and the whole object."""
        usage = codec.completion_usage_json(self.choices.usage())
        if self.body.stream and self.body.include_usage:
            self.core.outbox.put({**self._head, "choices": [], "usage": usage})
        self._end({**self._head, **self._whole(), "usage": usage})

    def _end(self, body: codec.JSON) -> None:
        if self.observer is not None:
            self.observer.ended(body)

    # -- what a session that answers one request has nothing to do in --------------------

    def response_continued(self, r: ResponseState) -> None:
        """Never: such a session is not kept in a store, so no process takes it over."""

    def resumed(self, resume_token: str) -> bytes | None:
        return None

    def close(self) -> None:
        """Nothing but the responses, which the core ends."""

    def expire(self) -> None:
        """An HTTP request has no maximum age here (the client's timeout is its own)."""

    def dump(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        """Nothing: such a session is never restored."""

    def dump_tag(self, tag: object) -> Any:
        return None

    def load_tag(self, data: Any) -> object:
        return None
