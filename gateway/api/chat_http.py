"""OpenAI Chat Completions over HTTP: ``POST /v1/chat/completions``, and the models list.

Every ``POST`` gets a session of its own with the Chat Completions dialect
(sessions/chat/), one answer in it, as ``POST /v1/responses`` has: the scheduler, the
engine's defaults, cancel and the limits are the other routes'. ``stream: true`` answers
Server-Sent Events (``data: CHUNK`` each, ``data: [DONE]`` last) through an
:class:`~gateway.transport.sse.SseWire`; otherwise the handler waits for the one
``chat.completion``. A client that disconnects, streaming or not, ends its answer in the
engine within a step (the handler's task is cancelled, and its ``finally`` closes the
session).

``GET /v1/models`` lists the model the engine serves under each name it answers to
(``--served-model-name``, default the engine's own model id); ``GET /v1/models/{id}``
one of them.
"""

from __future__ import annotations

from gateway.api.admission import Admission, Entry
from gateway.api.status import ServerState
from gateway.api.waiter import Waiter
from gateway.config import GatewayConfig
from gateway.session_table import SessionTable
from gateway.tenants import retry_after_header
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.router import Router
from gateway.transport.sse import SseWire, chat_messages
from sessions import codec, errors
from sessions.chat import codec as cc
from sessions.chat.dialect import ChatDialect, ChatFraming

SSE_HEADERS = (
    ("Content-Type", "text/event-stream; charset=utf-8"),
    ("Cache-Control", "no-cache"),
    ("X-Accel-Buffering", "no"),  # nginx: pass each event on at once
)


class ChatCompletionsHttp:
    """The routes (see the module docstring); ``register`` puts them on a router."""

    def __init__(
        self,
        config: GatewayConfig,
        state: ServerState,
        table: SessionTable,
        admission: Admission,
    ) -> None:
        self._config = config
        self._state = state
        self._table = table
        self._admission = admission

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
        if self._refused(request, reply, engine=False):
            return
        data = [self._model_json(name) for name in self.served_names()]
        reply.send_json(200, {"object": "list", "data": data})

    async def model(self, request: HttpRequest, reply: HttpReply) -> None:
        if self._refused(request, reply, engine=False):
            return
        name = request.params["id"]
        try:
            codec.check_model(name, self.served_names())
        except errors.ProtocolError as err:
            _error(reply, err)
            return
        reply.send_json(200, self._model_json(name))

    # -- POST /v1/chat/completions -----------------------------------------------------

    async def create(self, request: HttpRequest, reply: HttpReply) -> None:
        if self._refused(request, reply):
            return
        tenant = self._admission.tenant(request.headers, Entry.HTTP)
        try:
            command = cc.decode(request.body)
        except errors.ProtocolError as err:
            _error(reply, err)
            return
        framing = ChatFraming()
        waiter = Waiter()
        session = self._table.open(
            ChatDialect(framing, waiter),
            framing,
            replay_bytes=0,
            kept=False,
            tenant=tenant,
            origin=request.record,
            unread=not command.body.stream,  # the handler waits for the chat.completion
        )
        try:
            await session.deliver(command)
            try:
                await waiter.start
            except errors.ProtocolError as err:
                _error(reply, err)
                return
            if command.body.stream:
                # The head goes first: attaching the wire writes what is pending at once
                # (with the head, in one write).
                wire = SseWire(reply, chat_messages(command.body.include_usage))
                with session.scheduler.write_batch:
                    reply.start(200, SSE_HEADERS)
                    session.outbox.attach(wire)
                await wire.over.wait()
                return
            body = await waiter.end
            error = body.get("error")
            if error is not None:
                failed = errors.ProtocolError(
                    error["code"], error["message"], error_type=error["type"]
                )
                _error(reply, failed)
            else:
                reply.send_json(200, body)
        finally:
            # Ends the answer in the engine within a step if it still runs (client gone).
            session.close("disconnected")

    def _refused(self, request: HttpRequest, reply: HttpReply, *, engine: bool = True) -> bool:
        refused = self._admission.refuse_http(
            request.headers, ready=self._state.ready, need_engine=engine
        )
        if refused is None:
            return False
        err = errors.ProtocolError(refused.code, refused.message, error_type=refused.error_type)
        reply.send_json(refused.status, cc.error_json(err), refused.headers)
        return True


def _error(reply: HttpReply, err: errors.ProtocolError) -> None:
    status = codec.http_status(err)
    wait = retry_after_header(err.retry_after or 1.0)
    headers = {"Retry-After": wait} if status in (429, 503) else None
    reply.send_json(status, cc.error_json(err), headers)
