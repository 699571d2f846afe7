"""Admission to the one shared engine, and fan-out of its streams.

The scheduler is the only code that talks to the engine. It admits at most
``max_running`` jobs, keeps at most ``max_queued`` waiting, refuses the rest at
once, and picks the next job fairly across sessions (FIFO within one), so
a session firing a batch of out-of-band responses cannot starve the others.

Admission is synchronous (in :meth:`submit` and when a job ends) rather than a
wake-up of a separate task: everything runs on one event loop thread, so the
scheduler is still the single owner of the queue, and a response starts
without an extra loop hop. Each running job gets one consumer task that
iterates ``engine.stream``; cancelling that task is how the engine is told to
abort (the stream's ``finally`` runs inside the engine adapter).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gateway.engines.base import (
    Engine,
    EngineError,
    Finished,
    GenerationRequest,
    ToolCallDelta,
    Usage,
)
from gateway.metrics import Metrics

log = logging.getLogger(__name__)

Status = Literal["completed", "incomplete", "cancelled", "failed"]
CancelReason = Literal["client_cancelled", "disconnected", "server_shutdown"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a job ended. ``text`` is exactly the deltas delivered, joined."""

    status: Status
    text: str
    usage: Usage
    error: EngineError | None = None
    cancel_reason: CancelReason | None = None


class JobSink(Protocol):
    """Where a job's results go (the owning session). Called on the event loop thread."""

    def on_delta(self, job: Job, text: str) -> None: ...

    def on_tool_call_delta(self, job: Job, delta: ToolCallDelta) -> None: ...

    def on_finish(self, job: Job, outcome: Outcome) -> None: ...


@dataclass(eq=False, slots=True)
class Job:
    request: GenerationRequest
    session_key: str
    sink: JobSink
    state: Literal["new", "queued", "running", "done"] = "new"
    parts: list[str] = field(default_factory=list)
    output_tokens: int = 0
    task: asyncio.Task[None] | None = None
    cancel_reason: CancelReason | None = None
    submitted_at: float = 0.0
    started_at: float = 0.0
    last_token_at: float = 0.0
    cancel_at: float = 0.0


class Scheduler:
    def __init__(
        self, engine: Engine, *, max_running: int, max_queued: int, metrics: Metrics | None = None
    ) -> None:
        self.engine = engine
        self.max_running = max_running
        self.max_queued = max_queued
        self.metrics = metrics or Metrics()
        self._running: set[Job] = set()
        self._queues: dict[str, deque[Job]] = {}  # waiting jobs per session, FIFO each
        self._queued = 0
        self._running_by_session: Counter[str] = Counter()
        self._last_served: dict[str, int] = {}
        self._served = 0
        self._closing = False

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return self._queued

    def submit(self, job: Job) -> bool:
        """Queue ``job`` and start what fits. False (and nothing kept) if full."""
        if self._closing or (
            self._queued >= self.max_queued and len(self._running) >= self.max_running
        ):
            self.metrics.refused.labels(reason="overloaded").inc()
            return False
        job.submitted_at = time.perf_counter()
        job.state = "queued"
        self._queues.setdefault(job.session_key, deque()).append(job)
        self._queued += 1
        self._admit()
        self._update_gauges()
        return True

    def cancel(self, job: Job, reason: CancelReason) -> None:
        """Stop ``job``. Its sink's ``on_finish`` runs exactly once: now if it was
        queued, or when the engine stream has unwound if it was running."""
        if job.state in ("done", "new") or job.cancel_reason is not None:
            return
        job.cancel_reason = reason
        job.cancel_at = time.perf_counter()
        if job.state == "queued":
            queue = self._queues[job.session_key]
            queue.remove(job)
            if not queue:
                del self._queues[job.session_key]
            self._queued -= 1
            self._forget_if_idle(job.session_key)
            self._finish(job, Outcome("cancelled", "", Usage(0, 0), cancel_reason=reason))
            self._update_gauges()
        elif job.task is not None:
            job.task.cancel()

    def drain(self) -> None:
        """Refuse new work and start nothing more; what runs goes on."""
        self._closing = True

    async def close(self) -> None:
        """Refuse new work, cancel everything, and wait until the engine is idle."""
        self.drain()
        for queue in list(self._queues.values()):
            for job in list(queue):
                self.cancel(job, "server_shutdown")
        tasks = [job.task for job in self._running if job.task is not None]
        for job in list(self._running):
            self.cancel(job, "server_shutdown")
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- internals ---------------------------------------------------------

    def _admit(self) -> None:
        while self._queues and len(self._running) < self.max_running:
            # The waiting session with the fewest responses running goes first, ties
            # to the one served longest ago: a newcomer overtakes a session that was
            # just served, which is what keeps one batch from starving everyone else.
            session_key = min(self._queues, key=self._priority)
            queue = self._queues.pop(session_key)
            job = queue.popleft()
            if queue:  # back of the line with what it has left
                self._queues[session_key] = queue
            self._queued -= 1
            self._served += 1
            self._last_served[session_key] = self._served
            self._start(job)

    def _priority(self, session_key: str) -> tuple[int, int]:
        return self._running_by_session[session_key], self._last_served.get(session_key, 0)

    def _forget_if_idle(self, session_key: str) -> None:
        if not self._running_by_session[session_key] and session_key not in self._queues:
            del self._running_by_session[session_key]
            self._last_served.pop(session_key, None)

    def _start(self, job: Job) -> None:
        job.state = "running"
        job.started_at = job.last_token_at = time.perf_counter()
        self.metrics.queue_wait.observe(job.started_at - job.submitted_at)
        self._running.add(job)
        self._running_by_session[job.session_key] += 1
        job.task = asyncio.get_running_loop().create_task(
            self._consume(job), name=f"job-{job.request.request_id}"
        )
        # A task cancelled before its first step never runs its body: the done
        # callback ends such a job, so every job still ends exactly once.
        job.task.add_done_callback(lambda _: self._end_unstarted(job))

    async def _consume(self, job: Job) -> None:
        try:
            outcome = await self._stream(job)
        except asyncio.CancelledError:
            # Our own cancel (response.cancel, disconnect, shutdown): the engine
            # stream was closed on the way out, which aborted the generation.
            self._end(job, self._partial(job, "cancelled"))
            raise
        except EngineError as exc:
            outcome = self._partial(job, "failed", exc)
        except Exception as exc:  # an engine bug must not take the gateway down
            log.exception("engine stream for %s crashed", job.request.request_id)
            outcome = self._partial(job, "failed", EngineError("engine_error", str(exc)))
        self._end(job, outcome)

    def _end_unstarted(self, job: Job) -> None:
        if job.state != "done":
            self._end(job, self._partial(job, "cancelled"))
        # Break job -> task -> CancelledError -> traceback -> frame -> job: left to the
        # cycle collector, thousands of cancels a second cost 45 ms full collections.
        job.task = None

    def _end(self, job: Job, outcome: Outcome) -> None:
        self._running.discard(job)
        self._running_by_session[job.session_key] -= 1
        self._forget_if_idle(job.session_key)
        self._finish(job, outcome)
        if not self._closing:
            self._admit()
        self._update_gauges()

    async def _stream(self, job: Job) -> Outcome:
        sink, metrics = job.sink, self.metrics
        stream = self.engine.stream(job.request)
        try:
            async for item in stream:
                if isinstance(item, Finished):
                    status: Status = "incomplete" if item.reason == "length" else "completed"
                    return Outcome(status, "".join(job.parts), item.usage)
                if isinstance(item, ToolCallDelta):
                    job.output_tokens += item.tokens
                    sink.on_tool_call_delta(job, item)
                    continue
                now = time.perf_counter()
                if job.parts:
                    metrics.inter_token.observe(now - job.last_token_at)
                else:
                    metrics.ttft.observe(now - job.submitted_at)
                job.last_token_at = now
                job.parts.append(item.text)
                job.output_tokens += item.tokens
                sink.on_delta(job, item.text)
        finally:
            # Close the engine's generator now, in this task, even when cancelled:
            # its cleanup is what aborts the generation in the engine.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        raise EngineError("engine_error", "the engine stream ended without a finish reason")

    def _partial(self, job: Job, status: Status, error: EngineError | None = None) -> Outcome:
        usage = Usage(0, job.output_tokens)
        return Outcome(status, "".join(job.parts), usage, error, job.cancel_reason)

    def _finish(self, job: Job, outcome: Outcome) -> None:
        job.state = "done"
        now = time.perf_counter()
        m = self.metrics
        m.finished.labels(status=outcome.status).inc()
        m.output_tokens.inc(outcome.usage.output_tokens)
        m.deltas.inc(len(job.parts))
        m.e2e.observe(now - job.submitted_at)
        if job.cancel_at:
            m.cancel_latency.observe(now - job.cancel_at)
        job.sink.on_finish(job, outcome)

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self._running))
        self.metrics.queued.set(self._queued)
