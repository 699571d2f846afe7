"""Several answers to one HTTP request (``n``, and Completions' prompts and ``best_of``): what
the Chat Completions and Completions dialects share.

Each choice is a response of its own in the session core: its own job in the scheduler (so
admission counts every choice, and a client that goes ends every one in the engine), its
own seed (the request's plus its index: a seeded request is reproducible choice by
choice), its own deltas, which reach the client interleaved, each chunk naming its choice's
``index``. :class:`Choices` starts them all or none, and says when the last has ended;
:class:`ChoiceFraming` builds a text chunk from bytes, with the choice's index, as the
other dialects build their text deltas; :class:`OneRequest` is the rest of the ``Dialect``
protocol for a session that answers one request and is never resumed or kept.

Who owns what: a dialect's :class:`Choices` is the actor's, changed on its turn (and on the
scheduler's fan-out call, where no handler runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

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


def error_json(err: ProtocolError) -> codec.JSON:
    """OpenAI's error object: a response's body, or a stream's last ``data:`` (which the
    SDK raises as an ``APIError``)."""
    return {
        "error": {
            "message": err.message,
            "type": err.error_type,
            "param": err.param,
            "code": err.code,
        }
    }


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

    def start(self, specs: list[ResponseSpec], request_id: str) -> None:
        """Start one response per spec (choice ``i`` is ``specs[i]``, its seed made its
        own), all or none: raises ``overloaded`` or ``rate_limit_exceeded`` otherwise.
        The dialect's ``response_started`` runs for each before this returns."""
        core = self._core
        if core.scheduler.room < len(specs):
            raise overloaded()
        core.check_rate_limits(len(specs))
        self.count = len(specs)
        ids = [request_id if len(specs) == 1 else f"{request_id}-{i}" for i in range(len(specs))]
        self._index = {response_id: i for i, response_id in enumerate(ids)}
        for i, (spec, response_id) in enumerate(zip(specs, ids, strict=True)):
            seeded = replace(spec.sampling, seed=choice_seed(spec.sampling.seed, i))
            self._framing.add(response_id, i)
            if core.start_response(replace(spec, sampling=seeded), response_id=response_id):
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

    def usage(self, prompt_of: dict[int, int] | None = None) -> Usage:
        """The request's usage: every choice's output tokens; each prompt's tokens once
        (as OpenAI counts a prompt with ``n``), from the first choice of that prompt.
        ``prompt_of`` maps a choice to its prompt's number (all choices share prompt 0
        without it)."""
        prompt_of = prompt_of or {}
        first: dict[int, Usage] = {}
        output = 0
        for index in sorted(self.ended):
            usage = self.ended[index].outcome.usage
            first.setdefault(prompt_of.get(index, 0), usage)
            output += usage.output_tokens
        inputs = sum(u.input_tokens for u in first.values())
        cached = sum(u.cached_tokens for u in first.values())
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


class OneRequest:
    """The ``Dialect`` hooks that a session answering one HTTP request has nothing to do in:
    it is never resumed, taken over or kept in a store, and has no maximum age."""

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
