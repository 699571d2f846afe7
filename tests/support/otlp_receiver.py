"""A real OTLP/HTTP trace receiver on loopback, as a collector is: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` in protobuf (decoded with ``opentelemetry-proto``), answered
with an empty ``ExportTraceServiceResponse``. Gateways in the test process and in processes
of their own export to it; a test awaits the spans it is looking for."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

TIMEOUT = 20.0


@dataclass
class Span:
    """One received span, its ids as hex."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    status_code: int
    resource: dict[str, Any] = field(default_factory=dict)

    def event(self, name: str) -> dict[str, Any] | None:
        return next((attrs for n, attrs in self.events if n == name), None)


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._arrived = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1/traces"

    async def __aenter__(self) -> OtlpReceiver:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # an exporter's idle keep-alive connection
        await self._server.wait_closed()

    async def span(self, match: Callable[[Span], bool], timeout: float = TIMEOUT) -> Span:
        """The first span received (or to come) that ``match`` accepts."""
        async with asyncio.timeout(timeout), self._arrived:
            while True:
                found = next((s for s in self.spans if match(s)), None)
                if found is not None:
                    return found
                await self._arrived.wait()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        self._writers.add(writer)
        with contextlib.suppress(ConnectionError, h11.RemoteProtocolError):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    conn.receive_data(data)
                    if not data:
                        break
                    continue
                if isinstance(event, h11.Request):
                    gzipped = any(
                        n == b"content-encoding" and v == b"gzip" for n, v in event.headers
                    )
                    body = bytearray()
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    payload = gzip.decompress(body) if gzipped else bytes(body)
                    await self._received(payload)
                    answer = ExportTraceServiceResponse().SerializeToString()
                    headers = [
                        ("Content-Type", "application/x-protobuf"),
                        ("Content-Length", str(len(answer))),
                    ]
                    writer.write(conn.send(h11.Response(status_code=200, headers=headers)))
                    writer.write(conn.send(h11.Data(data=answer)))
                    writer.write(conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    break
        self._writers.discard(writer)
        writer.close()

    async def _received(self, payload: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(payload)
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[
                                (e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in s.events
                            ],
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            status_code=s.status.code,
                            resource=resource,
                        )
                    )
        async with self._arrived:
            self.requests += 1
            self.spans += spans
            self._arrived.notify_all()


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
