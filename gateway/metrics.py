"""Prometheus metrics for one gateway instance, on a registry of its own.

A registry per instance (not the global default) lets several gateways run in
one process, as the tests do, without their counts mixing.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
_GAP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)


class Metrics:
    def __init__(self, worker: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = {"worker": worker}
        self.info = Gauge(
            "gateway_info", "Gateway worker; value 1.", ["worker", "engine"], registry=r
        )
        self.sessions = Gauge("gateway_sessions", "Sessions connected now.", registry=r)
        self.sessions_total = Counter(
            "gateway_sessions_opened_total", "Sessions opened since start.", registry=r
        )
        self.running = Gauge(
            "gateway_responses_running", "Responses in the engine now.", registry=r
        )
        self.queued = Gauge("gateway_responses_queued", "Responses waiting for a slot.", registry=r)
        self.finished = Counter(
            "gateway_responses_finished_total",
            "Responses ended, by status.",
            ["status"],
            registry=r,
        )
        self.refused = Counter(
            "gateway_responses_refused_total",
            "Requests refused, by reason.",
            ["reason"],
            registry=r,
        )
        self.connections_refused = Counter(
            "gateway_connections_refused_total",
            "WebSocket handshakes refused, by HTTP status.",
            ["status"],
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "From response.create admitted to the first delta.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "gateway_inter_token_seconds",
            "Gap between deltas from the engine.",
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "gateway_response_duration_seconds",
            "From response.create to its end.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time a response waited for an engine slot.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cancel_latency = Histogram(
            "gateway_cancel_to_done_seconds",
            "From a cancel to the end of the response.",
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.deltas = Counter(
            "gateway_deltas_total", "Text deltas produced by the engine.", registry=r
        )
        self.output_tokens = Counter(
            "gateway_output_tokens_total", "Tokens generated for responses.", registry=r
        )
        self.frames = Counter("gateway_frames_sent_total", "WebSocket frames sent.", registry=r)
        self.delta_frames = Counter(
            "gateway_delta_frames_sent_total",
            "Frames carrying text deltas (fewer than deltas when coalescing).",
            registry=r,
        )
        self.bytes_out = Counter("gateway_bytes_sent_total", "Payload bytes sent.", registry=r)
        self.errors = Counter(
            "gateway_error_events_total", "Error events sent, by code.", ["code"], registry=r
        )
        self._labels = labels

    def set_engine(self, engine: str) -> None:
        self.info.labels(worker=self._labels["worker"], engine=engine).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
