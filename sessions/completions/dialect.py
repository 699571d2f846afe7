"""The Completions dialect: one ``POST /v1/completions`` over the session core.

A session of this dialect answers one request, as a Chat Completions session does: its
command is the decoded body (sessions/completions/codec.py), and each prompt of it, ``n``
times, is a response of its own (sessions/choices.py) whose prompt the engine takes raw:
no chat template, no instructions, nothing dropped to fit. What the core reports becomes
``text_completion`` chunks in the outbox (``stream: true``) and one ``text_completion``
for the observer (the HTTP route) at the end. Choice ``i * n + j`` is prompt ``i``'s
``j``-th, as OpenAI numbers them. With ``echo`` each choice's text starts with its prompt.

Who owns what: the dialect's state (its request, its choices) is the actor's, on its turn;
the observer is told of the start, a refusal and the end.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from gateway.engines.base import SamplingParams
from gateway.scheduler import Outcome
from sessions import codec
from sessions.choices import (
    ChoiceFraming,
    Choices,
    OneRequest,
    RequestObserver,
    check_choices,
    error_json,
    failed_error,
)
from sessions.completions import codec as kc
from sessions.core import CallState, ResponseSpec, ResponseState, Session
from sessions.errors import ProtocolError

_TEXT = b'%b,"text":%b,"logprobs":null,"finish_reason":null}]}'


def completion_framing() -> ChoiceFraming:
    """A text chunk of a ``text_completion`` stream, as bytes."""
    return ChoiceFraming(_TEXT)


class CompletionsDialect(OneRequest):
    name = "completions"
    decode = staticmethod(kc.decode)

    def __init__(self, framing: ChoiceFraming, observer: RequestObserver | None = None) -> None:
        self.framing = framing
        self.observer = observer
        self._core: Session | None = None
        self._choices: Choices | None = None
        self._body: kc.CompletionBody | None = None
        self._head: codec.JSON = {}
        self._prompt_of: dict[int, int] = {}  # choice index -> its prompt's index
        self._started = False

    @property
    def core(self) -> Session:
        assert self._core is not None
        return self._core

    @property
    def choices(self) -> Choices:
        assert self._choices is not None
        return self._choices

    def attach(self, core: Session, greet: bool) -> None:
        self._core = core

    def handle(self, command: object) -> None:
        if not isinstance(command, kc.CompletionCreate):
            raise ProtocolError("invalid_event", "A completions session takes one request.")
        if self._body is not None:
            raise ProtocolError("invalid_event", "A completions session answers one request.")
        self._start(command.body)

    def _start(self, body: kc.CompletionBody) -> None:
        core, c = self.core, self.core.config
        codec.check_model(body.model, core.limits.served_models)
        self._check_served(body)
        count = len(body.prompts) * body.generated
        param = "prompt" if len(body.prompts) > 1 else "best_of" if body.best_of else "n"
        check_choices(param, count, core.limits.max_choices)

        def chosen(value: Any, default: Any) -> Any:
            return default if value == codec.UNSET else value

        sampling = SamplingParams(
            max_output_tokens=body.max_tokens,
            temperature=chosen(body.temperature, c.temperature),
            top_p=chosen(body.top_p, c.top_p),
            seed=body.seed if body.seed is not None else c.seed,
            stop=chosen(body.stop, c.stop),
            frequency_penalty=chosen(body.frequency_penalty, c.frequency_penalty),
            presence_penalty=chosen(body.presence_penalty, c.presence_penalty),
        )
        self._body = body
        self._head = {
            "id": f"cmpl-{secrets.token_hex(12)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or c.model,
        }
        self.framing.head = orjson.dumps(self._head)
        specs: list[ResponseSpec] = []
        for number, prompt in enumerate(body.prompts):
            # A prompt's choices share an affinity key: the replica (or slot) whose cache
            # holds the prompt serves the others too.
            key = core.affinity(f"{self._head['id']}/{number}") if body.generated > 1 else None
            spec = ResponseSpec(
                messages=(),
                sampling=sampling,
                in_conversation=False,
                affinity_key=key,
                prompt=prompt,
                suffix=body.suffix,
            )
            for _ in range(body.generated):
                self._prompt_of[len(specs)] = number
                specs.append(spec)
        self._choices = Choices(core, self.framing)
        self._choices.start(specs, self._head["id"])

    def _check_served(self, body: kc.CompletionBody) -> None:
        """Refuse what this engine cannot do, before anything runs."""
        engine = self.core.scheduler.engine
        if body.suffix is not None and not engine.can_fill_in_middle:
            raise ProtocolError(
                "unsupported_value",
                f"The {engine.name} engine cannot fill in the middle: send the request "
                "without 'suffix'.",
                param="suffix",
            )
        if body.logprobs is not None:
            raise ProtocolError(
                "unsupported_value",
                "The engines here do not report log probabilities yet: send the request "
                "without 'logprobs'.",
                param="logprobs",
            )
        if body.best_of is not None and body.best_of > body.n:
            raise ProtocolError(
                "unsupported_value",
                "'best_of' ranks choices by their log probability, which the engines here do "
                "not report yet: send 'best_of' equal to 'n', or none.",
                param="best_of",
            )
        if body.echo and any(not isinstance(p, str) for p in body.prompts):
            raise ProtocolError(
                "unsupported_value",
                "An echo of a token-id prompt needs its text, which the engines here do not "
                "report yet: send the prompt as text, or no 'echo'.",
                param="echo",
            )

    def _echo(self, index: int) -> str:
        body = self._body
        assert body is not None
        prompt = body.prompts[self._prompt_of[index]]
        return prompt if body.echo and isinstance(prompt, str) else ""

    def _put(self, r: ResponseState, text: str, finish_reason: str | None = None) -> None:
        body = self._body
        if body is not None and body.stream:
            choice = kc.choice_json(self.choices.index(r), text, finish_reason, None)
            self.core.outbox.put({**self._head, "choices": [choice]})

    def error(self, err: ProtocolError) -> None:
        if not self._started:
            if self.observer is not None:
                self.observer.refused(err)
            return
        self._put_error(err)

    def _put_error(self, err: ProtocolError) -> None:
        if self._body is not None and self._body.stream:
            self.core.outbox.put(error_json(err))

    # -- what the core reports ---------------------------------------------------------

    def response_started(self, r: ResponseState) -> None:
        if not self._started:
            self._started = True
            if self.observer is not None:
                self.observer.started(self._head)
        if echoed := self._echo(self.choices.index(r)):
            self._put(r, echoed)

    def text_opened(self, r: ResponseState) -> None:
        """A completion has no items: its text is the choice's."""

    def text_delta(self, r: ResponseState, text: str) -> None:
        self._put(r, text)

    def call_opened(self, r: ResponseState, call: CallState) -> None:
        """Never: a completion has no tools."""

    def call_delta(self, r: ResponseState, call: CallState, arguments: str) -> None:
        """Never: a completion has no tools."""

    def response_ended(self, r: ResponseState, outcome: Outcome) -> None:
        choices = self.choices
        done = choices.end(r, outcome)
        if done is None:
            return
        if outcome.status == "failed":
            err = failed_error(outcome)
            choices.fail()
            self._put_error(err)
            self._end(error_json(err))
            return
        self._put(r, "", _finish_reason(outcome))
        if choices.over:
            self._complete()

    def _complete(self) -> None:
        """Every choice has ended: the usage chunk, and the ``text_completion``."""
        body = self._body
        assert body is not None
        usage = kc.usage_json(self.choices.usage(self._prompt_of))
        if body.stream and body.include_usage:
            self.core.outbox.put({**self._head, "choices": [], "usage": usage})
        choices = [
            kc.choice_json(
                index, self._echo(index) + ended.outcome.text, _finish_reason(ended.outcome), None
            )
            for index, ended in sorted(self.choices.ended.items())
        ]
        self._end({**self._head, "choices": choices, "usage": usage})

    def _end(self, body: codec.JSON) -> None:
        if self.observer is not None:
            self.observer.ended(body)


def _finish_reason(outcome: Outcome) -> str:
    return "length" if outcome.status == "incomplete" else "stop"
