"""The Chat Completions dialect: one ``POST /v1/chat/completions`` over the session core.

A session of this dialect answers one request (as the Responses API over HTTP does): its
command is the decoded body (sessions/chat/codec.py), its prompt is the request's
messages (led by the engine's default instructions when the request brings no system
message, as the other routes' prompts are), each of its ``n`` choices a response of its
own (sessions/choices.py), and what the core reports becomes ``chat.completion.chunk``
objects in the outbox (``stream: true``) and one ``chat.completion`` for the observer (the
HTTP route) at the end. The text deltas of the answer leave as a bytes template
(:func:`chat_framing`), as on the other dialects. Chunks carry no sequence number: a Chat
Completions stream cannot be resumed.

Who owns what: the dialect's state (its request, its choices, the calls' indexes) is the
actor's, on its turn; the observer is told of the start, a refusal and the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import orjson

from gateway.engines.base import Message, PromptLogprobs, SamplingParams, TokenLogprob
from gateway.scheduler import Outcome
from sessions import codec
from sessions.chat import codec as cc
from sessions.choices import (
    ChoiceFraming,
    Choices,
    OneRequestDialect,
    RequestObserver,
    check_choices,
)
from sessions.codec import chosen
from sessions.core import CallState, ResponseSpec, ResponseState

_DELTA = b'%b,"delta":{"content":%b},"logprobs":null,"finish_reason":null}]}'
_DELTA_LOGPROBS = b'%b,"delta":{"content":%b},"logprobs":%b,"finish_reason":null}]}'


def chat_framing() -> ChoiceFraming:
    """A content delta of a ``chat.completion.chunk``, as bytes."""
    return ChoiceFraming(
        _DELTA, _DELTA_LOGPROBS, lambda logprobs, _offset: cc.logprobs_json(logprobs)
    )


class ChatDialect(OneRequestDialect[cc.ChatBody]):
    name = "chat"
    command = cc.ChatCreate
    decode = staticmethod(cc.decode)

    def __init__(self, framing: ChoiceFraming, observer: RequestObserver | None = None) -> None:
        super().__init__(framing, observer)
        self._calls: dict[str, int] = {}  # a call's item id -> its index in tool_calls

    def _start(self, body: cc.ChatBody) -> None:
        core, c = self.core, self.core.config
        codec.check_model(body.model, core.limits.served_models)
        check_choices("n", body.n, core.limits.max_choices)
        messages = body.messages
        if not body.has_system and c.instructions:
            messages = (Message("system", c.instructions), *messages)
        sampling = SamplingParams(
            max_output_tokens=chosen(body.max_output_tokens, c.max_output_tokens),
            temperature=chosen(body.temperature, c.temperature),
            top_p=chosen(body.top_p, c.top_p),
            seed=body.seed if body.seed is not None else c.seed,
            stop=chosen(body.stop, c.stop),
            frequency_penalty=chosen(body.frequency_penalty, c.frequency_penalty),
            presence_penalty=chosen(body.presence_penalty, c.presence_penalty),
            logprobs=body.logprobs,
        )
        self._head = {
            "id": f"chatcmpl-{codec.random_hex(12)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.model or c.model,
        }
        self.framing.head = orjson.dumps(self._head)
        spec = ResponseSpec(
            messages=messages,
            sampling=sampling,
            tools=body.tools,
            tool_choice=body.tool_choice,
            in_conversation=False,
            affinity_key=core.affinity(body.affinity_key),
            metadata=body.metadata,
            constraint=body.constraint,
            parallel_tool_calls=body.parallel_tool_calls,
            model=body.model or "",
        )
        self._choices = Choices(core, self.framing)
        self._choices.start([spec], body.n, self._head["id"])

    def _put(
        self,
        r: ResponseState,
        delta: codec.JSON,
        finish_reason: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> None:
        if self.body.stream:
            index = self.choices.index(r)
            chunk = cc.chunk_json(self._head, delta, finish_reason, logprobs, index)
            self.core.outbox.put(chunk)

    # -- what the core reports ---------------------------------------------------------

    def _choice_started(self, r: ResponseState) -> None:
        self._put(r, {"role": "assistant", "content": ""})

    def text_opened(self, r: ResponseState) -> None:
        """The message has no item of its own on this API: its text is the content."""

    def text_delta(
        self, r: ResponseState, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> None:
        self._put(r, {"content": text}, logprobs=logprobs)

    def prompt_logprobs(self, r: ResponseState, logprobs: PromptLogprobs) -> None:
        """Never asked for on this API (the prompt is messages, not text to echo)."""

    def call_opened(self, r: ResponseState, call: CallState) -> None:
        index = self._calls[call.item_id] = len(r.calls) - 1  # counted within its choice
        function = {"name": call.name, "arguments": ""}
        opened = {"index": index, "id": call.call_id, "type": "function", "function": function}
        self._put(r, {"tool_calls": [opened]})

    def call_delta(self, r: ResponseState, call: CallState, arguments: str) -> None:
        index = self._calls[call.item_id]
        self._put(r, {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})

    def _choice_ended(self, r: ResponseState, outcome: Outcome) -> None:
        self._put(r, {}, self._finish_reason(r, outcome))

    @staticmethod
    def _finish_reason(r: ResponseState, outcome: Outcome) -> str:
        if outcome.status == "incomplete":
            return "length"
        return "tool_calls" if r.calls else "stop"

    def _whole(self) -> codec.JSON:
        """The ``chat.completion``."""
        choices = [
            {
                "index": index,
                "message": self._message(ended.response, ended.outcome),
                "finish_reason": self._finish_reason(ended.response, ended.outcome),
                # The whole answer's log probabilities are for ``stream: false`` (the body
                # the route answers with): a stream's client has them in its chunks.
                "logprobs": None
                if ended.outcome.logprobs is None or self.body.stream
                else cc.logprobs_json(ended.outcome.logprobs),
            }
            for index, ended in sorted(self.choices.ended.items())
        ]
        return {"object": "chat.completion", "choices": choices}

    def _message(self, r: ResponseState, outcome: Outcome) -> codec.JSON:
        message: codec.JSON = {
            "role": "assistant",
            "content": outcome.text if outcome.text or not r.calls else None,
            "refusal": None,
        }
        if r.calls:
            calls = sorted(r.calls.values(), key=lambda c: self._calls[c.item_id])
            message["tool_calls"] = [
                {
                    "id": c.call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        return message
