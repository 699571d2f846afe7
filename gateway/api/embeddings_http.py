"""``POST /v1/embeddings``: passed through to an engine that serves embeddings (an upstream
pool whose replicas do), with the keys, tenants and limits of the other routes; elsewhere
OpenAI's 404, saying that this engine serves none.

The gateway adds nothing to an embedding: the body goes to a replica as the client sent it
(its ``model`` too: an embedding model is the replica's own), and the replica's answer comes
back as it is. A tenant's ``max_running`` and ``requests_per_minute`` count each request.
"""

from __future__ import annotations

from gateway.api.http_api import HttpApi, send_error
from gateway.api.not_served import not_found
from gateway.engines.base import EngineError
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.router import Router
from sessions import errors
from sessions.core import rate_limited

PATHS = ("/v1/embeddings", "/embeddings")


class EmbeddingsHttp(HttpApi):
    """The route (see the module docstring)."""

    def register(self, router: Router) -> None:
        for path in PATHS:
            router.add("POST", path, self.create, body_limit=self._config.max_message_bytes)

    async def create(self, request: HttpRequest, reply: HttpReply) -> None:
        tenant = self.admitted(request, reply)
        if tenant is None:
            return
        scheduler = self._table.scheduler
        engine, tenants = scheduler.engine, scheduler.tenants
        over = tenants.refuse_request(tenant)
        if over is not None:
            scheduler.metrics.tenant_refused.labels(tenant=tenant, reason="request").inc()
            send_error(reply, rate_limited(over))
            return
        tenants.request_started(tenant)
        scheduler.metrics.tenant_requests.labels(tenant=tenant).inc()
        try:
            answered = await engine.embeddings(request.body)
        except EngineError as exc:
            send_error(
                reply, errors.ProtocolError(exc.code, exc.message, error_type=exc.error_type)
            )
            return
        finally:
            tenants.request_ended(tenant, 0)
        if answered is None:
            await not_found(request, reply, f"the {engine.name} engine serves no embeddings.")
            return
        status, body = answered
        reply.send(status, body, "application/json")
