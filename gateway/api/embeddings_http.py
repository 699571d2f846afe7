"""``POST /v1/embeddings``: passed through to an engine that serves embeddings (an upstream
pool whose replicas do), with the keys, tenants and limits of the other routes; elsewhere
OpenAI's 404, saying that this engine serves none.

The gateway adds nothing to an embedding: the body goes to a replica as the client sent it
(its ``model`` too: an embedding model is the replica's own), and the replica's answer comes
back as it is. A tenant's ``max_running`` and ``requests_per_minute`` count each request.
"""

from __future__ import annotations

from gateway.api import one_request
from gateway.api.admission import Admission, Entry
from gateway.api.not_served import not_found
from gateway.api.status import ServerState
from gateway.config import GatewayConfig
from gateway.engines.base import EngineError
from gateway.session_table import SessionTable
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.router import Router
from sessions import errors

PATHS = ("/v1/embeddings", "/embeddings")


class EmbeddingsHttp:
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
        scheduler = self._table.scheduler
        engine, tenants = scheduler.engine, scheduler.tenants
        over = tenants.refuse_request(tenant)
        if over is not None:
            err = errors.ProtocolError(
                "rate_limit_exceeded",
                f"Rate limit reached: {over.message} Retry in {over.retry_after:.1f} s.",
                error_type="requests",
                retry_after=over.retry_after,
            )
            one_request.send_error(reply, err)
            return
        tenants.request_started(tenant)
        scheduler.metrics.tenant_requests.labels(tenant=tenant).inc()
        try:
            answered = await engine.embeddings(request.body)
        except EngineError as exc:
            failed = errors.ProtocolError(exc.code, exc.message, error_type=exc.error_type)
            one_request.send_error(reply, failed)
            return
        finally:
            tenants.request_ended(tenant, 0)
        if answered is None:
            await not_found(request, reply, f"the {engine.name} engine serves no embeddings.")
            return
        status, body = answered
        reply.send(status, body, "application/json")
