"""OpenAI Chat Completions over HTTP: ``POST /v1/chat/completions``, and the models list.

Every ``POST`` gets a session of its own with the Chat Completions dialect
(sessions/chat/), its ``n`` choices in it, as ``POST /v1/responses`` has: the scheduler,
the engine's defaults, cancel and the limits are the other routes'. ``stream: true``
answers Server-Sent Events, otherwise the one ``chat.completion`` (gateway/api/one_request.py
says how, and what a client that goes away ends).

``GET /v1/models`` lists the model the engine serves under each name it answers to
(``--served-model-name``, default the engine's own model id); ``GET /v1/models/{id}``
one of them.
"""

from __future__ import annotations

from gateway.api import one_request
from gateway.api.http_api import HttpApi, send_error
from gateway.api.waiter import Waiter
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.router import Router
from gateway.transport.sse import chunk_messages
from sessions import codec, errors
from sessions.chat import codec as cc
from sessions.chat.dialect import ChatDialect, chat_framing


class ChatCompletionsHttp(HttpApi):
    """The routes (see the module docstring)."""

    def register(self, router: Router) -> None:
        limit = self._config.max_message_bytes
        for path in ("/v1/chat/completions", "/chat/completions"):
            router.add("POST", path, self.create, body_limit=limit)
        router.add("GET", "/v1/models", self.models)
        router.add("GET", "/v1/models/{id}", self.model)

    # -- the models ------------------------------------------------------------------

    def served_names(self) -> tuple[str, ...]:
        """The names the engine's model answers to on every route."""
        return self._config.served_model_names or (self._table.defaults.model,)

    def _model_json(self, name: str) -> codec.JSON:
        return {
            "id": name,
            "object": "model",
            "created": int(self._state.started_at),
            "owned_by": "llm-gateway",
        }

    async def models(self, request: HttpRequest, reply: HttpReply) -> None:
        if self.admitted(request, reply, engine=False) is None:
            return
        data = [self._model_json(name) for name in self.served_names()]
        reply.send_json(200, {"object": "list", "data": data})

    async def model(self, request: HttpRequest, reply: HttpReply) -> None:
        if self.admitted(request, reply, engine=False) is None:
            return
        name = request.params["id"]
        try:
            codec.check_model(name, self.served_names())
        except errors.ProtocolError as err:
            send_error(reply, err)
            return
        reply.send_json(200, self._model_json(name))

    # -- POST /v1/chat/completions -----------------------------------------------------

    async def create(self, request: HttpRequest, reply: HttpReply) -> None:
        tenant = self.admitted(request, reply)
        if tenant is None:
            return
        try:
            command = cc.decode(request.body)
        except errors.ProtocolError as err:
            send_error(reply, err)
            return
        body, framing, waiter = command.body, chat_framing(), Waiter()
        stream = chunk_messages(body.include_usage, body.n) if body.stream else None
        dialect = ChatDialect(framing, waiter), framing
        await one_request.answer(
            self._table, request, reply, tenant, command, dialect, waiter, stream
        )
