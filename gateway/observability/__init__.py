"""Every request and answer, followed: the access log, the trace spans and the latency
histograms, all written from one place, once per request or answer, never per token.

Who calls what (each part tells the :class:`Observability` of its process):

- the HTTP layer (gateway/transport/http1.py) for every plain HTTP request, whatever its
  route: :meth:`Observability.http_request` as its head arrives, :meth:`http_answered` as
  its response ends (the ``x-request-id`` header, the error's ``code`` and ``param`` from
  its body, the tenant from its credential);
- the WebSocket endpoint for each upgrade: :meth:`connection`, then
  :meth:`connection_closed` (or :meth:`upgrade_refused`);
- the session core for each answer (sessions/observed.py): :meth:`answer` as it is
  admitted, :meth:`release` as it ends; and :meth:`refusal` for what a session refused.

An answer on an HTTP request is written on that request's line (and span), all of its
choices (``n``) on the one line, their figures added up; an answer on a socket, or one
that outlives its request (``background: true``), has its own. This layer
imports nothing of the gateway's but the metrics: every layer may call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import orjson
from websockets.datastructures import Headers

from gateway.metrics import Histogram as _Histogram
from gateway.metrics import Metrics
from gateway.observability import trace_context
from gateway.observability.access_log import AccessLog
from gateway.observability.record import Record, client_request_id, new_request_id, peer_address
from gateway.observability.trace_context import TraceContext

if TYPE_CHECKING:
    from gateway.observability.tracing import Tracing

__all__ = ["Observability", "Record", "TraceContext", "new_request_id", "peer_address"]

CLIENT_REQUEST_ID = "X-Client-Request-Id"
REQUEST_ID = "x-request-id"
CLIENT_GONE = 499  # nginx's status for a client that left before its response began
_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"))

TenantOf = Callable[[Headers], str | None]


class Observability:
    """One process's access log, tracer and latency histograms (see the module docstring)."""

    def __init__(
        self,
        access_log: str = "text",
        *,
        metrics: Metrics | None = None,
        otlp_traces_endpoint: str | None = None,
        provider_name: str = "llm-gateway",
        worker: str = "0",
        untraced_routes: Collection[str] = (),
    ) -> None:
        self.access_log = AccessLog(access_log)
        self.metrics = metrics
        self.tracing: Tracing | None = None
        if otlp_traces_endpoint:
            # Only here: without the flag the SDK is never imported.
            from gateway.observability.tracing import Tracing

            self.tracing = Tracing(otlp_traces_endpoint, provider_name=provider_name, worker=worker)
        self._untraced = frozenset(untraced_routes)
        # Each route and status's three histograms (bounded: routes and statuses are).
        self._histograms: dict[tuple[object, ...], tuple[_Histogram, _Histogram, _Histogram]] = {}
        # The tenant a request's credential names (the API layer's admission), for a
        # route that did not say.
        self.tenant_of: TenantOf | None = None

    # -- plain HTTP requests -------------------------------------------------------------

    def http_request(
        self,
        method: str,
        path: str,
        route: str,
        headers: Headers,
        client: str,
        started: float | None = None,
    ) -> Record:
        """A request whose head has arrived (``route``: its pattern, "" for none)."""
        record = Record(
            "http",
            route=route,
            method=method,
            path=path,
            client=client,
            request_id=new_request_id(),
            started=started,
            parent=trace_context.from_headers(headers.get_all),
        )
        record.client_request_id = client_request_id(headers.get(CLIENT_REQUEST_ID))
        if self.tracing is not None and route not in self._untraced:
            self.tracing.start(record)
        return record

    def http_answered(
        self, record: Record, status: int | None, error_body: bytes | None, headers: Headers
    ) -> None:
        """Its response is over (``status`` None: the client left before it began)."""
        record.status = CLIENT_GONE if status is None else status
        if error_body and record.error_code is None:
            code, param = _error_of(error_body)
            if code is not None:
                record.refused(code, param)
        if record.tenant is None and self.tenant_of is not None and "Authorization" in headers:
            record.tenant = self.tenant_of(headers)
        self.release(record)

    # -- WebSocket connections -------------------------------------------------------------

    def connection(self, path: str, headers: Headers, client: str) -> Record:
        """A WebSocket upgrade: its request id names the connection (``x-request-id`` of
        its answer, ``connection_id`` of its answers' lines)."""
        record = Record(
            "connection",
            route=path,
            method="GET",
            path=path,
            client=client,
            request_id=new_request_id(),
            parent=trace_context.from_headers(headers.get_all),
        )
        record.client_request_id = client_request_id(headers.get(CLIENT_REQUEST_ID))
        return record

    def upgrade_refused(self, record: Record, status: int, headers: Headers) -> None:
        record.status = status
        if self.tenant_of is not None and "Authorization" in headers:
            record.tenant = self.tenant_of(headers)
        self.release(record)

    def connection_closed(
        self, record: Record, close_code: int | None, session_id: str | None, tenant: str
    ) -> None:
        record.status, record.close_code = 101, close_code
        record.session_id, record.tenant = session_id, tenant
        self.release(record)

    # -- answers -----------------------------------------------------------------------------

    def answer(
        self,
        origin: Record | None,
        *,
        parent: TraceContext | None = None,
        link: TraceContext | None = None,
        own: bool = False,
    ) -> Record:
        """The record of an answer admitted now: its HTTP request's own (held till the
        answer ends too; each of a request's ``n`` choices holds it, and is written on its
        line), or, on a socket or past its request, one of its own (``own``). A takeover
        gives the ``parent`` and the span (``link``) of the answer it continues."""
        if (
            not own
            and origin is not None
            and origin.kind == "http"
            and origin.open
            and not origin.background
        ):
            origin.hold()
            return origin
        record = Record(
            "answer",
            route=origin.route if origin is not None else "",
            client=origin.client if origin is not None else "",
            event="response.create",
            parent=parent if own else (origin.parent if origin is not None else None),
        )
        record.link = link
        if origin is not None:
            record.client_request_id = origin.client_request_id
            if origin.kind == "http":  # a background answer: its POST's id, a child span
                record.request_id, record.background = origin.request_id, True
                record.method = origin.method
            else:
                record.connection_id = origin.request_id
        if self.tracing is not None:
            http = origin is not None and origin.kind == "http" and not own
            self.tracing.start(record, origin if http else None)
        return record

    def not_admitted(self, record: Record, code: str, param: str | None = None) -> None:
        """An answer :meth:`answer` made a record for was refused after all (the engine's
        queue is full, or it cannot serve what was asked): its span says so; its line is
        the refusal's (or its request's)."""
        record.response_id = None  # it never was
        record.refused(code, param)
        if record.kind == "http":
            self.release(record)
            return
        record.status = "refused"
        record.release()
        if self.tracing is not None:
            self.tracing.end(record)

    def refusal(
        self, origin: Record | None, code: str, param: str | None, event_id: str | None
    ) -> Record | None:
        """Something a session refused: on an HTTP request, that request's error; on a
        socket, a line of its own (returned, for the caller to name its session, then
        :meth:`release`)."""
        if origin is not None and origin.kind == "http" and origin.open:
            origin.refused(code, param)
            return None
        record = Record(
            "refusal",
            route=origin.route if origin is not None else "",
            client=origin.client if origin is not None else "",
            event="error",
        )
        record.status = "refused"
        record.refused(code, param)
        record.client_event_id = event_id
        if origin is not None:
            record.connection_id = origin.request_id
            record.client_request_id = origin.client_request_id
        return record

    def trace_fields(self, record: Record | None) -> tuple[tuple[str, str], ...]:
        """The W3C Trace Context a request sent upstream for ``record`` carries: the
        gateway's span, or (not tracing) the client's own context, passed on."""
        context = None if record is None else record.own or record.parent
        return context.fields() if context is not None else ()

    # -- the one place a record is written ---------------------------------------------------

    def release(self, record: Record) -> None:
        """A part of ``record`` is over; when it was the last, write its line, its span and
        its histograms."""
        if not record.release():
            return
        self.access_log.write(record)
        if self.tracing is not None:
            self.tracing.end(record)
        if self.metrics is not None and record.kind in ("http", "answer"):
            self._observe(self.metrics, record)

    def _observe(self, m: Metrics, record: Record) -> None:
        key = (record.kind, record.background, record.method, record.route, record.status)
        histograms = self._histograms.get(key)
        if histograms is None:  # the first of its route and status: its labels, once
            labels = {"route": route_label(record), "status": str(record.status)}
            histograms = self._histograms[key] = (
                m.request_duration.labels(**labels),
                m.ttft.labels(**labels),
                m.queue_wait.labels(**labels),
            )
        duration, ttft, wait = histograms
        duration.observe(record.duration)
        if record.first_token_at and record.submitted_at:
            ttft.observe(max(0.0, record.first_token_at - record.submitted_at))
        if record.slot_at and record.submitted_at:
            wait.observe(max(0.0, record.slot_at - record.submitted_at))

    async def close(self, grace: float = 2.0) -> None:
        """Export the spans still queued (for at most ``grace`` seconds), off the loop."""
        tracing = self.tracing
        if tracing is None:
            return
        self.tracing = None
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def close() -> None:
            try:
                tracing.close(grace)
            finally:
                loop.call_soon_threadsafe(done.set)

        # A daemon thread: a collector that never answers must not hold the process's exit.
        threading.Thread(target=close, name="otlp-close", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace + 1.0):
                await done.wait()

    @property
    def spans_dropped(self) -> int:
        return self.tracing.export.dropped if self.tracing is not None else 0


def route_label(record: Record) -> str:
    """The ``route`` label: the method and pattern of an HTTP route (bounded: a method no
    route knows is OTHER, a path no route matches is "(unmatched)"), ``WS PATH`` for an
    answer on a socket."""
    if record.kind == "answer" and not record.background:
        return f"WS {record.route}"
    if not record.route:
        return "(unmatched)"
    method = record.method if record.method in _METHODS else "OTHER"
    return f"{method} {record.route}"


def _error_of(body: bytes) -> tuple[str | None, str | None]:
    """The ``code`` and ``param`` of an OpenAI error object (None if it is not one)."""
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        return None, None
    param = error.get("param")
    return error["code"], param if isinstance(param, str) else None
