"""The Completions dialect: one ``POST /v1/completions`` over the session core.

A session of this dialect answers one request, as a Chat Completions session does: its
command is the decoded body (sessions/completions/codec.py), and each prompt of it, ``n``
times (``best_of`` times, the best ``n`` kept), is a response of its own
(sessions/choices.py) whose prompt the engine takes raw: no chat template, no
instructions, nothing dropped to fit. What the core reports becomes ``text_completion``
chunks in the outbox (``stream: true``) and one ``text_completion`` for the observer (the
HTTP route) at the end. Choice ``i * n + j`` is prompt ``i``'s ``j``-th, as OpenAI numbers
them.

With ``echo`` each choice's text starts with its prompt: a text prompt's own, or the text
of a token-id prompt's tokens as the engine reports them (its ``PromptLogprobs``, asked
for then). ``logprobs`` is encoded in the legacy shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``), a thin layer over the engine's log probabilities: the
prompt's (for ``echo``: its first token's entries null) then the answer's, whose
``text_offset`` counts from the start of the choice's text (the echoed prompt included).
``best_of`` ranks each prompt's candidates by their tokens' mean log probability.

Who owns what: the dialect's state (its request, its choices) is the actor's, on its turn;
the observer is told of the start, a refusal and the end.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import orjson

from gateway.engines.base import PromptLogprobs, SamplingParams, TokenLogprob
from gateway.scheduler import Outcome
from sessions import codec
from sessions.choices import (
    ChoiceFraming,
    Choices,
    Ended,
    OneRequestDialect,
    RequestObserver,
    check_choices,
)
from sessions.codec import chosen
from sessions.completions import codec as kc
from sessions.core import CallState, ResponseSpec, ResponseState
from sessions.errors import ProtocolError

_TEXT = b'%b,"text":%b,"logprobs":null,"finish_reason":null}]}'
_TEXT_LOGPROBS = b'%b,"text":%b,"logprobs":%b,"finish_reason":null}]}'


def completion_framing() -> ChoiceFraming:
    """A text chunk of a ``text_completion`` stream, as bytes."""
    return ChoiceFraming(_TEXT, _TEXT_LOGPROBS, kc.logprobs_json)


class CompletionsDialect(OneRequestDialect[kc.CompletionBody]):
    name = "completions"
    command = kc.CompletionCreate
    decode = staticmethod(kc.decode)

    def __init__(self, framing: ChoiceFraming, observer: RequestObserver | None = None) -> None:
        super().__init__(framing, observer)
        self._echo: dict[int, str] = {}  # candidate -> the prompt text its text starts with
        self._echo_logprobs: dict[int, codec.JSON] = {}  # ...and its legacy log probabilities

    def _start(self, body: kc.CompletionBody) -> None:
        core, c = self.core, self.core.config
        codec.check_model(body.model, core.limits.served_models)
        self._check_served(body)
        count = len(body.prompts) * body.generated
        param = "prompt" if len(body.prompts) > 1 else "best_of" if body.best_of else "n"
        check_choices(param, count, core.limits.max_choices)

        # best_of ranks by log probability: the engine reports them even if the client
        # asked for none (which it then does not get).
        ranked = body.generated > body.n
        sampling = SamplingParams(
            max_output_tokens=body.max_tokens,
            temperature=chosen(body.temperature, c.temperature),
            top_p=chosen(body.top_p, c.top_p),
            seed=body.seed if body.seed is not None else c.seed,
            stop=chosen(body.stop, c.stop),
            frequency_penalty=chosen(body.frequency_penalty, c.frequency_penalty),
            presence_penalty=chosen(body.presence_penalty, c.presence_penalty),
            logprobs=0 if ranked and body.logprobs is None else body.logprobs,
        )
        self._head = {
            "id": f"cmpl-{codec.random_hex(12)}",
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
                sampling=replace(sampling, prompt_logprobs=self._prompt_logprobs(prompt)),
                in_conversation=False,
                affinity_key=key,
                prompt=prompt,
                suffix=body.suffix,
                logprobs_param=self._logprobs_param(prompt),
                model=body.model or "",
                operation="text_completion",  # the GenAI conventions' name for a raw prompt
            )
            if body.echo and isinstance(prompt, str):
                for candidate in range(number * body.generated, (number + 1) * body.generated):
                    self._echo[candidate] = prompt
            specs.append(spec)
        self._choices = Choices(core, self.framing)
        self._choices.start(specs, body.generated, self._head["id"])

    def _prompt_logprobs(self, prompt: Any) -> int | None:
        """What a prompt asks of the engine about its own tokens: an echo with
        ``logprobs`` shows theirs, and a token-id prompt's echo needs their text."""
        body = self.body
        if not body.echo or (body.logprobs is None and isinstance(prompt, str)):
            return None
        return body.logprobs or 0

    def _logprobs_param(self, prompt: Any) -> str:
        """The field a 400 names when the engine cannot report what a prompt asks."""
        body = self.body
        engine = self.core.scheduler.engine
        if self._prompt_logprobs(prompt) is not None and not engine.reports_prompt_logprobs:
            return "echo"
        return "logprobs" if body.logprobs is not None else "best_of"

    def _check_served(self, body: kc.CompletionBody) -> None:
        """Refuse what cannot be served, before anything runs (the engine refuses the log
        probabilities it cannot report, Engine.check)."""
        engine = self.core.scheduler.engine
        if body.suffix is not None and not engine.can_fill_in_middle:
            raise ProtocolError(
                "unsupported_value",
                f"The {engine.name} engine cannot fill in the middle: send the request "
                "without 'suffix'.",
                param="suffix",
            )
        if body.stream and body.generated > body.n:
            raise ProtocolError(
                "invalid_value",
                "'best_of' picks the best answers once all are done: it cannot be streamed.",
                param="best_of",
            )

    def _put(
        self,
        r: ResponseState,
        text: str,
        finish_reason: str | None = None,
        logprobs: codec.JSON | None = None,
    ) -> None:
        if self.body.stream:
            choice = kc.choice_json(self.choices.index(r), text, finish_reason, logprobs)
            self.core.outbox.put({**self._head, "choices": [choice]})

    # -- what the core reports ---------------------------------------------------------

    def _choice_started(self, r: ResponseState) -> None:
        index = self.choices.index(r)
        if r.spec.sampling.prompt_logprobs is None and (echoed := self._echo.get(index)):
            self._put(r, echoed)
            self.framing.advance(r.id, len(echoed))

    def prompt_logprobs(self, r: ResponseState, logprobs: PromptLogprobs) -> None:
        """The echoed prompt's tokens, before the first delta: its text (a token-id
        prompt's as the engine decodes it) and, if asked, its legacy log probabilities."""
        body = self.body
        index = self.choices.index(r)
        text = self._echo.get(index)
        if text is None:
            text = logprobs.first + "".join(lp.token for lp in logprobs.tokens)
            self._echo[index] = text
        encoded = None
        if body.logprobs is not None:
            encoded = self._echo_logprobs[index] = kc.prompt_logprobs_json(logprobs)
        self._put(r, text, logprobs=encoded)
        self.framing.advance(r.id, len(text))

    def text_opened(self, r: ResponseState) -> None:
        """A completion has no items: its text is the choice's."""

    def text_delta(
        self, r: ResponseState, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> None:
        """Never: without tools, a response's text is output 0's (the framing's)."""

    def call_opened(self, r: ResponseState, call: CallState) -> None:
        """Never: a completion has no tools."""

    def call_delta(self, r: ResponseState, call: CallState, arguments: str) -> None:
        """Never: a completion has no tools."""

    def _choice_ended(self, r: ResponseState, outcome: Outcome) -> None:
        self._put(r, "", _finish_reason(outcome))

    def _whole(self) -> codec.JSON:
        """The ``text_completion``: of the best ``n`` of each prompt's candidates, with
        ``best_of``."""
        kept = self._kept(self.choices.ended)
        return {"choices": [self._choice(index, ended) for index, ended in enumerate(kept)]}

    def _kept(self, ended: dict[int, Ended]) -> list[Ended]:
        """The returned choices, in order: each prompt's candidates, the best ``n`` of
        them by their tokens' mean log probability when there are more."""
        body = self.body
        kept: list[Ended] = []
        for number in range(len(body.prompts)):
            first = number * body.generated  # a prompt's candidates are consecutive
            candidates = [ended[i] for i in range(first, first + body.generated)]
            if len(candidates) > body.n:
                candidates.sort(key=lambda e: -kc.mean_logprob(e.outcome.logprobs))
            kept += candidates[: body.n]
        return kept

    def _choice(self, index: int, ended: Ended) -> codec.JSON:
        body = self.body
        echoed = self._echo.get(ended.index, "")
        text, finish = echoed + ended.outcome.text, _finish_reason(ended.outcome)
        if body.logprobs is None:
            return kc.choice_json(index, text, finish, None)
        answer = ended.outcome.logprobs or ()
        parts = [self._echo_logprobs.get(ended.index), kc.logprobs_json(answer, len(echoed))]
        logprobs = kc.joined_logprobs([part for part in parts if part is not None])
        return kc.choice_json(index, text, finish, logprobs)


def _finish_reason(outcome: Outcome) -> str:
    return "length" if outcome.status == "incomplete" else "stop"
