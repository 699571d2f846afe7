"""The Chat Completions dialect: one ``POST /v1/chat/completions`` over the session core.

A session of this dialect answers one request (as the Responses API over HTTP does): its
command is the decoded body (sessions/chat/codec.py), its prompt is the request's
messages (led by the engine's default instructions when the request brings no system
message, as the other routes' prompts are), and what the core reports becomes
``chat.completion.chunk`` objects in the outbox (``stream: true``) and one
``chat.completion`` for the observer (the HTTP route) at the end. The text deltas of the
answer leave as a bytes template (:class:`ChatFraming`), as on the other dialects.
Chunks carry no sequence number: a Chat Completions stream cannot be resumed.

Who owns what: the dialect's state (its request, the calls' indexes) is the actor's,
on its turn; the observer is told of the start, a refusal and the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from gateway.engines.base import Message, PromptLogprobs, SamplingParams, TokenLogprob
from gateway.scheduler import Outcome
from sessions import codec
from sessions.chat import codec as cc
from sessions.core import CallState, ResponseSpec, ResponseState, Session
from sessions.errors import ProtocolError

# A chunk of text: the head object (id, object, created, model), still open, then the
# choice; the head is spliced in once per response (ChatFraming.delta_ids). With log
# probabilities, they take the place of the null (a JSON key's quotes cannot occur
# unescaped inside the head's strings, so the first match is the choice's).
_DELTA = b'%b,"choices":[{"index":0,"delta":{"content":%%b},"logprobs":null,"finish_reason":null}]}'
_NO_LOGPROBS, _LOGPROBS = b'"logprobs":null', b'"logprobs":%b'


class ChatFraming:
    """A chunk's head (id, object, created, model) is set once its response starts."""

    __slots__ = ("head",)
    first_sequence_number = 0
    replays_first = True

    def __init__(self) -> None:
        self.head = b"{}"

    def numbered(self, seq: int, body: bytes) -> bytes:
        return body  # chunks carry no number

    def delta_ids(self, response_id: str, item_id: str) -> bytes:
        return _DELTA % self.head[:-1].replace(b"%", b"%%")  # the head object, still open

    def delta(self, seq: int, ids: bytes, text: str) -> bytes:
        return ids % orjson.dumps(text)

    def delta_logprobs(
        self, seq: int, ids: bytes, text: str, logprobs: Sequence[TokenLogprob]
    ) -> bytes:
        template = ids.replace(_NO_LOGPROBS, _LOGPROBS, 1)
        return template % (orjson.dumps(text), orjson.dumps(cc.logprobs_json(logprobs)))


class ChatObserver(Protocol):
    """The HTTP side of the one request (gateway/api/chat_http.py)."""

    def started(self, body: codec.JSON) -> None:
        """The answer was admitted: ``body`` is the chunks' head."""

    def ended(self, body: codec.JSON) -> None:
        """The ``chat.completion`` (or an error object, ``{"error": ...}``)."""

    def refused(self, err: ProtocolError) -> None:
        """The request was refused before it started."""


class ChatDialect:
    name = "chat"
    decode = staticmethod(cc.decode)

    def __init__(self, framing: ChatFraming, observer: ChatObserver | None = None) -> None:
        self.framing = framing
        self.observer = observer
        self._core: Session | None = None
        self._body: cc.ChatBody | None = None
        self._head: codec.JSON = {}
        self._calls: dict[str, int] = {}  # a call's item id -> its index in tool_calls
        self._started = False

    @property
    def core(self) -> Session:
        assert self._core is not None
        return self._core

    def attach(self, core: Session, greet: bool) -> None:
        self._core = core

    def handle(self, command: object) -> None:
        if not isinstance(command, cc.ChatCreate):
            raise ProtocolError("invalid_event", "A chat session takes one request.")
        if self._body is not None:
            raise ProtocolError("invalid_event", "A chat session answers one request.")
        self._start(command.body)

    def _start(self, body: cc.ChatBody) -> None:
        core, c = self.core, self.core.config
        codec.check_model(body.model, core.limits.served_models)
        messages = body.messages
        if not body.has_system and c.instructions:
            messages = (Message("system", c.instructions), *messages)

        def chosen(value: Any, default: Any) -> Any:
            return default if value == codec.UNSET else value

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
        self._body = body
        self._head = {
            "id": f"chatcmpl-{codec.random_hex(12)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.model or c.model,
        }
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
        if core.start_response(spec, response_id=self._head["id"]) is None:
            raise ProtocolError(
                "overloaded",
                "The gateway is at capacity (every engine slot and queue place is taken); "
                "retry shortly.",
                error_type="server_error",
            )

    def _put(
        self,
        delta: codec.JSON,
        finish_reason: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> None:
        body = self._body
        if body is not None and body.stream:
            self.core.outbox.put(cc.chunk_json(self._head, delta, finish_reason, logprobs))

    def error(self, err: ProtocolError) -> None:
        if not self._started:
            if self.observer is not None:
                self.observer.refused(err)
            return
        self._put_error(err)

    def _put_error(self, err: ProtocolError) -> None:
        if self._body is not None and self._body.stream:
            self.core.outbox.put(cc.error_json(err))

    # -- what the core reports ---------------------------------------------------------

    def response_started(self, r: ResponseState) -> None:
        self._started = True
        self.framing.head = orjson.dumps(self._head)
        if self.observer is not None:
            self.observer.started(self._head)
        self._put({"role": "assistant", "content": ""})

    def response_continued(self, r: ResponseState) -> None:
        """Never: a chat session is not kept in a store, so no process takes it over."""

    def text_opened(self, r: ResponseState) -> None:
        """The message has no item of its own on this API: its text is the content."""

    def text_delta(
        self, r: ResponseState, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> None:
        self._put({"content": text}, logprobs=logprobs)

    def prompt_logprobs(self, r: ResponseState, logprobs: PromptLogprobs) -> None:
        """Never asked for on this API (the prompt is messages, not text to echo)."""

    def call_opened(self, r: ResponseState, call: CallState) -> None:
        index = self._calls[call.item_id] = len(self._calls)
        function = {"name": call.name, "arguments": ""}
        opened = {"index": index, "id": call.call_id, "type": "function", "function": function}
        self._put({"tool_calls": [opened]})

    def call_delta(self, r: ResponseState, call: CallState, arguments: str) -> None:
        index = self._calls[call.item_id]
        self._put({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})

    def response_ended(self, r: ResponseState, outcome: Outcome) -> None:
        body = self._body
        assert body is not None
        if outcome.status == "failed":
            error = outcome.error
            err = ProtocolError(
                error.code if error else "engine_error",
                error.message if error else "The engine failed.",
                error_type=error.error_type if error else "server_error",
            )
            self._put_error(err)
            self._end(cc.error_json(err))
            return
        if outcome.status == "incomplete":
            finish_reason = "length"
        else:
            finish_reason = "tool_calls" if r.calls else "stop"
        usage = cc.usage_json(outcome.usage)
        self._put({}, finish_reason)
        if body.stream and body.include_usage:
            self.core.outbox.put({**self._head, "choices": [], "usage": usage})
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
        # The whole answer's log probabilities are for ``stream: false`` (the body the route
        # answers with): a stream's client has them all in its chunks already.
        logprobs = None
        if outcome.logprobs is not None and not body.stream:
            logprobs = cc.logprobs_json(outcome.logprobs)
        completion = {
            **self._head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason,
                    "logprobs": logprobs,
                }
            ],
            "usage": usage,
        }
        self._end(completion)

    def _end(self, body: codec.JSON) -> None:
        if self.observer is not None:
            self.observer.ended(body)

    def resumed(self, resume_token: str) -> bytes | None:
        return None

    def close(self) -> None:
        """Nothing but the response, which the core ends."""

    def expire(self) -> None:
        """An HTTP request has no maximum age here (the client's timeout is its own)."""

    def dump(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        """Nothing: a chat session is never restored (see :meth:`response_continued`)."""

    def dump_tag(self, tag: object) -> Any:
        return None

    def load_tag(self, data: Any) -> object:
        return None
