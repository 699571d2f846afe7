"""Ended spans leave from a bounded queue, on a thread of their own.

What the event loop does for a span is append it to a deque under a lock: never a network
call, never a wait. One daemon thread sends them in batches to the collector. When the
collector is down or slow the queue fills and further spans are dropped and counted
(``gateway_trace_spans_dropped_total``), not logged one by one: memory stays bounded and
the log says once that the collector does not answer, and once that it answers again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

MAX_QUEUE = 4096  # spans waiting; beyond, new ones are dropped
BATCH = 512  # spans per export request
DELAY = 0.5  # seconds a span may wait for a batch to fill


class QueuedExport(SpanProcessor):
    """A span processor: see the module docstring."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        endpoint: str = "",
        max_queue: int = MAX_QUEUE,
        batch: int = BATCH,
        delay: float = DELAY,
    ) -> None:
        self._exporter = exporter
        self._endpoint = endpoint
        self._max_queue = max_queue
        self._batch = batch
        self._delay = delay
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._failing = False  # the last export failed (logged once until one succeeds)
        # Spans the queue had no room for, or the collector refused (under the lock: both
        # threads count; /metrics reads it).
        self.dropped = 0
        self.exported = 0
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    # -- SpanProcessor (called on the event loop thread, as spans start and end) -------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self._lock:
            if self._stopping or len(self._queue) >= self._max_queue:
                self.dropped += 1
                return
            self._queue.append(span)
            if len(self._queue) >= self._batch:
                self._wake.set()

    def shutdown(self) -> None:
        self.close(0.0)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        self._wake.set()
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue

    # -- the export thread --------------------------------------------------------------

    def close(self, timeout: float) -> None:
        """Send what is queued, for at most ``timeout`` seconds, then stop (blocking)."""
        if not self._stopping:
            self._stopping = True
            self._wake.set()
            self._thread.join(timeout)
            self._exporter.shutdown()  # ends an export still retrying, at once

    def _run(self) -> None:
        while True:
            self._wake.wait(self._delay)
            self._wake.clear()
            while self._queue:
                with self._lock:
                    count = min(self._batch, len(self._queue))
                    batch = [self._queue.popleft() for _ in range(count)]
                self._send(batch)
            if self._stopping:
                return

    def _send(self, batch: list[ReadableSpan]) -> None:
        try:
            result = self._exporter.export(batch)
        except Exception:  # an exporter bug must not end the thread
            log.exception("tracing: exporting %d spans failed", len(batch))
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(batch)
            if self._failing:
                self._failing = False
                log.info("tracing: the collector at %s answers again", self._endpoint)
            return
        with self._lock:
            self.dropped += len(batch)
        if not self._failing:
            self._failing = True
            log.warning(
                "tracing: the collector at %s does not take spans; they are dropped "
                "(gateway_trace_spans_dropped_total) until it does",
                self._endpoint,
            )
