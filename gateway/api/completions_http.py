"""OpenAI's Completions over HTTP: ``POST /v1/completions`` (and ``/completions``).

Every ``POST`` gets a session of its own with the Completions dialect
(sessions/completions/): each of its prompts, ``n`` times, is an answer of the engine to
that raw prompt, with no chat template. The keys, tenants, limits, scheduler and engine
defaults are the other routes'; ``stream: true`` answers Server-Sent Events, otherwise one
``text_completion`` (gateway/api/one_request.py says how, and what a client that goes
away ends).
"""

from __future__ import annotations

from gateway.api import one_request
from gateway.api.admission import Admission, Entry
from gateway.api.status import ServerState
from gateway.api.waiter import Waiter
from gateway.config import GatewayConfig
from gateway.session_table import SessionTable
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.router import Router
from gateway.transport.sse import chunk_messages
from sessions import errors
from sessions.completions import codec as kc
from sessions.completions.dialect import CompletionsDialect, completion_framing

PATHS = ("/v1/completions", "/completions")


class CompletionsHttp:
    """The route (see the module docstring); ``register`` puts it on a router."""

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
        for path in PATHS:
            router.add("POST", path, self.create, body_limit=self._config.max_message_bytes)

    async def create(self, request: HttpRequest, reply: HttpReply) -> None:
        if one_request.refused(self._admission, self._state, request, reply):
            return
        tenant = self._admission.tenant(request.headers, Entry.HTTP)
        try:
            command = kc.decode(request.body)
        except errors.ProtocolError as err:
            one_request.send_error(reply, err)
            return
        body, framing, waiter = command.body, completion_framing(), Waiter()
        choices = len(body.prompts) * body.n
        stream = chunk_messages(body.include_usage, choices) if body.stream else None
        dialect = CompletionsDialect(framing, waiter), framing
        await one_request.answer(
            self._table, request, reply, tenant, command, dialect, waiter, stream
        )
