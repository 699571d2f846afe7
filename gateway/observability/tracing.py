"""OpenTelemetry traces, exported over OTLP/HTTP (protobuf): ``--otlp-traces-endpoint URL``.

Imported only when that flag is given: a gateway without it never loads the SDK. A span
opens where its request or answer begins (so that the engine's requests upstream can name
it as their parent) and everything else is written on it once, as it ends: the GenAI
semantic conventions' attributes, an event for each thing that happened to it (the wait
for a slot, the first token, a cancel, a resume, a takeover, a move to another replica).
Nothing happens per token. Spans are exported from a thread of their own
(gateway/observability/export.py), never on the event loop, from a bounded queue.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.span import TraceFlags, TraceState
from opentelemetry.util.types import AttributeValue

from gateway.observability.export import QueuedExport
from gateway.observability.record import Record
from gateway.observability.trace_context import TraceContext

SERVICE_NAME = "llm-gateway"
EXPORT_TIMEOUT = 5.0  # seconds one export (with its retries) may take before it is dropped
_NS = 1_000_000_000


class Tracing:
    """The tracer of one gateway process and the queue its spans leave from."""

    def __init__(
        self,
        endpoint: str,
        *,
        provider_name: str,
        worker: str = "0",
    ) -> None:
        attributes: dict[str, AttributeValue] = {"service.instance.id": f"{os.getpid()}"}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = SERVICE_NAME
        attributes["gateway.worker"] = worker
        self.export = QueuedExport(
            OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT),
            endpoint=endpoint,
        )
        # Its own warnings would repeat for every batch while a collector is down; the
        # export queue says it once (export.py).
        logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.ERROR)
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(self.export)
        self._tracer = self.provider.get_tracer("gateway")
        self.provider_name = provider_name  # gen_ai.provider.name: the engine's name

    def start(self, record: Record, parent: Record | None = None) -> None:
        """Open ``record``'s span, the child of ``parent``'s span if it has one, else of
        the client's trace context, else a new trace's root."""
        context = None
        if parent is not None and isinstance(parent.span, trace.Span):
            context = trace.set_span_in_context(parent.span)
        elif record.parent is not None:
            context = trace.set_span_in_context(NonRecordingSpan(_span_context(record.parent)))
        links = []
        if record.link is not None:
            links.append(Link(_span_context(record.link), {"gateway.link": "continues"}))
        span = self._tracer.start_span(
            record.route,  # named for what it turned out to be, at its end
            context=context,
            kind=SpanKind.SERVER,
            links=links,
            start_time=int(record.wall * _NS),
        )
        record.span, record.traced = span, True
        c = span.get_span_context()
        traceparent = f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"
        state = c.trace_state.to_header() if c.trace_state else ""
        record.own = TraceContext(traceparent, state)  # what requests sent upstream carry

    def end(self, record: Record) -> None:
        span = record.span
        record.span = None
        if not isinstance(span, trace.Span):
            return
        if not span.is_recording():
            span.end()
            return
        span.update_name(_name(record))
        span.set_attributes(attributes(record, self.provider_name))
        for name, at, event_attributes in _events(record):
            span.add_event(name, event_attributes, timestamp=int(record.wall_time(at) * _NS))
        if record.error_code is not None and _is_error(record):
            span.set_status(Status(StatusCode.ERROR, record.error_code))
        span.end(end_time=int(record.wall_time(record.ended or record.started) * _NS))

    def close(self, timeout: float) -> None:
        """Export what is queued (for at most ``timeout`` seconds) and stop. Blocking:
        the caller runs it off the event loop."""
        self.export.close(timeout)
        self.provider.shutdown()


def attributes(record: Record, provider: str) -> dict[str, AttributeValue]:
    """The span's attributes: the GenAI conventions' for an answer, HTTP's for a request."""
    r = record
    out: dict[str, AttributeValue | None] = {
        "gateway.request_id": r.request_id,
        "gateway.client_request_id": r.client_request_id,
        "gateway.connection_id": r.connection_id,
        "gateway.session_id": r.session_id,
        "gateway.tenant": r.tenant or None,
        "client.address": r.client.rpartition(":")[0] or None,
        "error.type": r.error_code,
    }
    if r.kind == "http":
        out |= {
            "http.request.method": r.method,
            "http.route": r.route,
            "url.path": r.path,
            "http.response.status_code": r.status if isinstance(r.status, int) else None,
        }
    if r.operation is not None:
        out |= {
            "gen_ai.operation.name": r.operation,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": r.model,
            "gen_ai.response.id": r.response_id,
            "gen_ai.response.finish_reasons": list(r.finish_reasons) or None,
            "gen_ai.usage.input_tokens": r.input_tokens,
            "gen_ai.usage.output_tokens": r.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": r.cached_tokens or None,
            "gateway.response.status": r.response_status
            or (r.status if isinstance(r.status, str) else None),
            **r.request_attributes,
        }
    return {k: v for k, v in out.items() if v is not None}


def _name(record: Record) -> str:
    if record.operation is not None:
        return f"{record.operation} {record.model}" if record.model else record.operation
    return f"{record.method} {record.route}" if record.method else record.route


def _events(record: Record) -> list[tuple[str, float, Mapping[str, AttributeValue]]]:
    events: list[tuple[str, float, Mapping[str, AttributeValue]]] = []
    if record.slot_at and record.submitted_at:
        wait = record.slot_wait or 0.0
        events.append(("gateway.slot_acquired", record.slot_at, {"gateway.slot_wait": wait}))
    if record.first_token_at:
        events.append(("gateway.first_token", record.first_token_at, {}))
    events += [(f"gateway.{name}", at, attrs) for name, at, attrs in record.notes]
    events.sort(key=lambda event: event[1])
    return events


def _is_error(record: Record) -> bool:
    """A failed answer, or a request the server failed (a client's 4xx is no error of the
    server's span, as OpenTelemetry's HTTP conventions say; ``error.type`` still names it)."""
    status = record.response_status or record.status
    if isinstance(status, int):
        return status >= 500
    return status == "failed"


def _span_context(context: TraceContext) -> SpanContext:
    return SpanContext(
        trace_id=int(context.trace_id, 16),
        span_id=int(context.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(context.traceparent[53:55], 16)),
        trace_state=TraceState.from_header([context.tracestate]) if context.tracestate else None,
    )
