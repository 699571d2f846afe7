"""What the API's HTTP route classes share: the parts each is handed, admission (the
request's tenant, or OpenAI's error object for a request its key, Origin or the gateway's
state refuses), a :class:`~sessions.errors.ProtocolError` as OpenAI's error object with its
status, and the head of a Server-Sent Events answer."""

from __future__ import annotations

from gateway.api.admission import Admission, Entry
from gateway.api.status import ServerState
from gateway.config import GatewayConfig
from gateway.session_table import SessionTable
from gateway.tenants import retry_after_header
from gateway.transport.http1 import HttpReply, HttpRequest
from sessions import codec, errors

SSE_HEADERS = (
    ("Content-Type", "text/event-stream; charset=utf-8"),
    ("Cache-Control", "no-cache"),
    ("X-Accel-Buffering", "no"),  # nginx: pass each event on at once
)


def send_error(reply: HttpReply, err: errors.ProtocolError) -> None:
    """``err`` as OpenAI's error object, with its status (and ``Retry-After`` on 429, 503)."""
    status = codec.http_status(err)
    wait = retry_after_header(err.retry_after or 1.0)
    headers = {"Retry-After": wait} if status in (429, 503) else None
    reply.send_json(status, codec.error_json(err), headers)


class HttpApi:
    """A class of routes (see the module docstring); ``register`` puts them on a router."""

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

    def admitted(
        self, request: HttpRequest, reply: HttpReply, *, engine: bool = True
    ) -> str | None:
        """The request's tenant; None once it is answered as not to be served (its
        credentials, its Origin, or the gateway's state: not ready, with ``engine``)."""
        refused = self._admission.refuse_http(
            request.headers, ready=self._state.ready, need_engine=engine
        )
        if refused is None:
            return self._admission.tenant(request.headers, Entry.HTTP)
        err = errors.ProtocolError(refused.code, refused.message, error_type=refused.error_type)
        reply.send_json(refused.status, codec.error_json(err), refused.headers)
        return None
