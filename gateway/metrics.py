"""Prometheus metrics for one gateway instance, on a registry of its own.

A registry per instance (not the global default) lets several gateways run in
one process, as the tests do, without their counts mixing.

The counters, gauges and histograms here are plain numbers, not
``prometheus_client``'s metric objects: those take a lock on every update, and
the gateway updates a few of them for every token and every frame (a few
percent of its CPU under load, see docs/performance.md). Every update runs on
the event loop thread, so no lock is needed; ``prometheus_client`` still
renders the exposition text, from :meth:`_Collector.collect` at scrape time,
which runs on the same thread.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
)
# How long a socket's frames wait for the session store to log them (what the store
# adds to a first token): fine below 5 ms, where its target is.
_HOLD_BUCKETS = (
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    1.0,
)
_GAP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)

LabelValues = tuple[str, ...]
ROUTE_STATUS = ("route", "status")


class _Value:
    """One number with the update methods of a counter or gauge."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _Family:
    """A counter or gauge, or (with label names) one per combination of label values."""

    def __init__(self, kind: str, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        self.kind = kind
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._children: dict[LabelValues, _Value] = {}
        self._value = _Value()
        if not self.labelnames:
            self._children[()] = self._value

    def labels(self, **labels: str) -> _Value:
        names = self.labelnames
        key = (labels[names[0]],) if len(names) == 1 else tuple([labels[n] for n in names])
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _Value()
        return child

    # Unlabelled use: the family is its own only child.
    def inc(self, amount: float = 1.0) -> None:
        self._value.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self._value.value -= amount

    def set(self, value: float) -> None:
        self._value.value = float(value)

    @property
    def value(self) -> float:
        return self._value.value

    def collect(self) -> Metric:
        family: Metric
        if self.kind == "counter":
            family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        else:
            family = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self._children.items():
            family.add_metric(list(key), child.value)
        return family


class Histogram:
    """Counts per bucket (``le`` is inclusive, as Prometheus defines it) and a sum."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append((_bound(bound), running))
        return out

    def collect(self) -> Metric:
        return HistogramMetricFamily(
            self.name, self.doc, buckets=self.cumulative(), sum_value=self.sum
        )


class HistogramFamily:
    """A histogram per combination of label values."""

    def __init__(
        self, name: str, doc: str, buckets: Sequence[float], labelnames: Sequence[str]
    ) -> None:
        self.name = name
        self.doc = doc
        self.buckets = buckets
        self.labelnames = tuple(labelnames)
        self._children: dict[LabelValues, Histogram] = {}

    def labels(self, **labels: str) -> Histogram:
        key = tuple(labels[n] for n in self.labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = Histogram(self.name, self.doc, self.buckets)
        return child

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self._children.items():
            family.add_metric(list(key), child.cumulative(), child.sum)
        return family


def _bound(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


_Any = _Family | Histogram | HistogramFamily


class _Collector:
    def __init__(self, metrics: list[_Any]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield metric.collect()


class Metrics:
    def __init__(self, worker: str = "0") -> None:
        self._worker = worker
        self._all: list[_Any] = []
        self.info = self._gauge("gateway_info", "Gateway worker; value 1.", ["worker", "engine"])
        self.sessions = self._gauge("gateway_sessions", "Sessions connected now.")
        self.sessions_total = self._counter(
            "gateway_sessions_opened_total", "Sessions opened since start."
        )
        self.running = self._gauge("gateway_responses_running", "Responses in the engine now.")
        self.queued = self._gauge("gateway_responses_queued", "Responses waiting for a slot.")
        self.finished = self._counter(
            "gateway_responses_finished_total", "Responses ended, by status.", ["status"]
        )
        self.refused = self._counter(
            "gateway_responses_refused_total", "Requests refused, by reason.", ["reason"]
        )
        # Per tenant, by its name (never a key: gateway/api/auth.py names tenants).
        self.tenant_requests = self._counter(
            "gateway_tenant_requests_total", "Answers started, by tenant.", ["tenant"]
        )
        self.tenant_output_tokens = self._counter(
            "gateway_tenant_output_tokens_total", "Output tokens, by tenant.", ["tenant"]
        )
        self.tenant_sessions = self._gauge(
            "gateway_tenant_sessions",
            "Sessions connected (not those waiting for a resume), by tenant.",
            ["tenant"],
        )
        self.tenant_refused = self._counter(
            "gateway_tenant_refused_total",
            "Requests and sessions refused over a tenant's limit, by tenant and limit.",
            ["tenant", "reason"],
        )
        self.connections_refused = self._counter(
            "gateway_connections_refused_total",
            "WebSocket handshakes refused, by HTTP status.",
            ["status"],
        )
        self.upstream_moves = self._counter(
            "gateway_upstream_moves_total",
            "Answers moved to another upstream replica mid-stream (its text so far continued).",
        )
        self.websocket_connections = self._counter(
            "gateway_websocket_connections_total",
            "WebSocket connections accepted, by API (realtime, responses).",
            ["api"],
        )
        self.handshakes_dropped = self._counter(
            "gateway_handshakes_dropped_total",
            "Connections dropped before sending a whole request: too many waiting "
            "(--max-handshakes, the oldest goes) or shutdown.",
            ["reason"],
        )
        # The three below are observed once per request or answer, as its access log
        # line is written (gateway/observability/): by route and status, as the line says.
        self.request_duration = self._histograms(
            "gateway_request_duration_seconds",
            "HTTP requests and answers on a WebSocket, from the request's head (or the "
            "response.create) to the end of its response (and answer), by route and status.",
            _LATENCY_BUCKETS,
        )
        self.ttft = self._histograms(
            "gateway_time_to_first_token_seconds",
            "From an answer asking for a slot to its first delta, by route and status.",
            _LATENCY_BUCKETS,
        )
        self.inter_token = self._histogram(
            "gateway_inter_token_seconds", "Gap between deltas from the engine.", _GAP_BUCKETS
        )
        self.e2e = self._histogram(
            "gateway_response_duration_seconds",
            "From response.create to its end.",
            _LATENCY_BUCKETS,
        )
        self.queue_wait = self._histograms(
            "gateway_queue_wait_seconds",
            "Time an answer waited for an engine slot, by route and status.",
            _LATENCY_BUCKETS,
        )
        self.trace_spans_dropped = self._counter(
            "gateway_trace_spans_dropped_total",
            "Spans not exported: the export queue was full or the collector refused them "
            "(--otlp-traces-endpoint).",
        )
        self.abort_latency = self._histogram(
            "gateway_abort_confirm_seconds",
            "From a cancel to the engine letting go of the request (its slot is free again).",
            _GAP_BUCKETS,
        )
        self.generation_timeouts = self._counter(
            "gateway_generation_timeouts_total",
            "Responses failed by the watchdog: no progress for --generation-timeout seconds.",
        )
        self.deltas = self._counter("gateway_deltas_total", "Text deltas produced by the engine.")
        self.output_tokens = self._counter(
            "gateway_output_tokens_total", "Tokens generated for responses."
        )
        self.frames = self._counter("gateway_frames_sent_total", "WebSocket frames sent.")
        self.delta_frames = self._counter(
            "gateway_delta_frames_sent_total",
            "Frames carrying text deltas (fewer than deltas when coalescing).",
        )
        self.bytes_out = self._counter("gateway_bytes_sent_total", "Payload bytes sent.")
        self.detached = self._gauge(
            "gateway_sessions_detached",
            "Sessions whose connection dropped, kept for --resume-window seconds.",
        )
        self.resumes = self._counter(
            "gateway_session_resumes_total",
            "session.resume attempts, by outcome (resumed, session_not_found, resume_gap).",
            ["outcome"],
        )
        self.replayed_events = self._counter(
            "gateway_replayed_events_total", "Events sent again to a resumed session."
        )
        self.stalled = self._counter(
            "gateway_stalled_connections_total",
            "Connections closed (1008) because the client read nothing for --stall-timeout.",
        )
        self.errors = self._counter(
            "gateway_error_events_total", "Error events sent, by code.", ["code"]
        )
        self.store_up = self._gauge(
            "gateway_session_store_up",
            "1 while the Redis session store answers; 0 while the gateway is memory-only.",
        )
        self.store_errors = self._counter(
            "gateway_session_store_errors_total", "Session store writes that failed (retried)."
        )
        self.store_dropped = self._counter(
            "gateway_session_store_dropped_total",
            "Session logs dropped from the write buffer while the store was away.",
        )
        self.store_leases_lost = self._counter(
            "gateway_session_store_leases_lost_total",
            "Sessions ended here because another gateway holds their lease now (this one "
            "was paused, cut off, or a failover lost its lease): their clients resume there.",
        )
        self.store_rewrites = self._counter(
            "gateway_session_store_rewrites_total",
            "Session logs written again from memory because the store lost frames (a "
            "failover to a replica that lacked them).",
        )
        self.store_flush_seconds = self._histogram(
            "gateway_session_store_flush_seconds",
            "One pipelined write of a loop turn's frames and state to the store.",
            _GAP_BUCKETS,
        )
        self.store_hold_seconds = self._histogram(
            "gateway_session_store_hold_seconds",
            "How long a socket's frames were held for the store to log them (and their "
            "session's state): what the store adds to a token's way out.",
            _HOLD_BUCKETS,
        )
        self.takeovers = self._counter(
            "gateway_session_takeovers_total",
            "Sessions taken over from a process that was gone, by outcome.",
            ["outcome"],
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self._all))

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> _Family:
        family = _Family("counter", name, doc, labels)
        self._all.append(family)
        return family

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> _Family:
        family = _Family("gauge", name, doc, labels)
        self._all.append(family)
        return family

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        histogram = Histogram(name, doc, buckets)
        self._all.append(histogram)
        return histogram

    def _histograms(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ROUTE_STATUS
    ) -> HistogramFamily:
        family = HistogramFamily(name, doc, buckets, labels)
        self._all.append(family)
        return family

    def set_engine(self, engine: str) -> None:
        self.info.labels(worker=self._worker, engine=engine).set(1)

    def render(self) -> bytes:
        text: bytes = generate_latest(self.registry)
        return text
