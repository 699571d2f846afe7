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
from gateway.api.http_api import HttpApi, send_error
from gateway.api.waiter import Waiter
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.router import Router
from gateway.transport.sse import chunk_messages
from sessions import errors
from sessions.completions import codec as kc
from sessions.completions.dialect import CompletionsDialect, completion_framing

PATHS = ("/v1/completions", "/completions")


class CompletionsHttp(HttpApi):
    """The route (see the module docstring)."""

    def register(self, router: Router) -> None:
        for path in PATHS:
            router.add("POST", path, self.create, body_limit=self._config.max_message_bytes)

    async def create(self, request: HttpRequest, reply: HttpReply) -> None:
        tenant = self.admitted(request, reply)
        if tenant is None:
            return
        try:
            command = kc.decode(request.body)
        except errors.ProtocolError as err:
            send_error(reply, err)
            return
        body, framing, waiter = command.body, completion_framing(), Waiter()
        choices = len(body.prompts) * body.n
        stream = chunk_messages(body.include_usage, choices) if body.stream else None
        dialect = CompletionsDialect(framing, waiter), framing
        await one_request.answer(
            self._table, request, reply, tenant, command, dialect, waiter, stream
        )
