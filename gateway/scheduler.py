"""Admission to the one shared engine, and fan-out of everything it produces.

The scheduler is the only code that talks to the engine. It admits at most
``max_running`` jobs, keeps at most ``max_queued`` waiting, refuses the rest at
once, and picks the next job fairly across sessions (FIFO within one), so
a session firing a batch of out-of-band responses cannot starve the others.

One central task (:meth:`Scheduler._fan_out_loop`) drains the engine's output
channel: each wake-up takes everything the engine produced since the last one
(a whole step for every running request) and hands each piece to the owning
session in one pass. No task runs per job, and a token costs no wake-up of its
own. Admission is synchronous (in :meth:`submit` and when a job ends) rather
than a wake-up of that task: everything runs on one event loop thread, so the
scheduler is still the single owner of the queue, and a response starts
without an extra loop hop.

A cancel ends its job at once (the session sends ``response.done`` without
waiting for the engine), asks the engine to abort, and admits the next job:
for at most one engine step, until the engine confirms with the request's
terminal output, the engine holds one request more than ``max_running``
(every engine queues what exceeds its batch). Counting the slot busy until
then would refuse a client's next question as ``overloaded`` right after its
own cancel. The watchdog fails a job that has made no progress for
``generation_timeout`` seconds and frees its slot whether or not the engine
ever confirms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from gateway.engines.base import (
    Engine,
    EngineError,
    Finished,
    GenerationRequest,
    Moved,
    Output,
    PromptLogprobs,
    PromptTokens,
    StepOutput,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from gateway.metrics import Metrics
from gateway.tenants import TenantBook

log = logging.getLogger(__name__)

Status = Literal["completed", "incomplete", "cancelled", "failed"]
CancelReason = Literal["client_cancelled", "disconnected", "server_shutdown"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a job ended. ``text`` is exactly the deltas delivered, joined; ``logprobs``
    their log probabilities, joined (None when the request asked for none)."""

    status: Status
    text: str
    usage: Usage
    error: EngineError | None = None
    cancel_reason: CancelReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


class JobSink(Protocol):
    """Where a job's results go (the owning session). Called on the event loop thread."""

    def on_delta(self, job: Job, text: str, token_ids: tuple[int, ...] = ()) -> None:
        """``token_ids``: what the text was decoded from, where the engine gave them
        (TextDelta.token_ids), for the session store's log; () otherwise."""

    def on_logprobs_delta(
        self,
        job: Job,
        text: str,
        logprobs: tuple[TokenLogprob, ...],
        token_ids: tuple[int, ...] = (),
    ) -> None:
        """A text delta of a request that asked for log probabilities, with its tokens'
        (a method of its own: a request without them pays nothing for them)."""

    def on_prompt_logprobs(self, job: Job, logprobs: PromptLogprobs) -> None:
        """The prompt's own log probabilities (asked by SamplingParams.prompt_logprobs),
        before the job's first delta."""

    def on_tool_call_delta(self, job: Job, delta: ToolCallDelta) -> None: ...

    def on_finish(self, job: Job, outcome: Outcome) -> None: ...


@dataclass(eq=False, slots=True)
class Job:
    request: GenerationRequest
    session_key: str
    sink: JobSink
    tenant: str = ""  # the scheduler shares the engine across tenants first
    # Where plain text deltas go, when the sink has a direct way for them (the session:
    # its outbox's put_delta, bound to the response); None: ``sink.on_delta``.
    on_text: Callable[[str], None] | None = None
    state: Literal["new", "queued", "running", "done"] = "new"
    parts: list[str] = field(default_factory=list)
    # The delivered text's log probabilities, when the request asked (set by _start).
    logprobs: list[TokenLogprob] | None = None
    output_tokens: int = 0
    input_tokens: int = 0  # known once the engine reports the prompt's tokens
    cached_tokens: int = 0
    cancel_reason: CancelReason | None = None
    reserved_tokens: int = 0  # of its tenant's tokens_per_minute, till it ends
    submitted_at: float = 0.0
    started_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0  # also the watchdog's "last progress"
    ended_at: float = 0.0
    moves: tuple[float, ...] = ()  # when it moved to another replica mid-stream

    @property
    def request_id(self) -> str:
        return self.request.request_id


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        max_running: int,
        max_queued: int,
        metrics: Metrics | None = None,
        generation_timeout: float = 0.0,
        merge_deltas: bool = True,
        tenants: TenantBook | None = None,
        write_batch: contextlib.AbstractContextManager[object] | None = None,
    ) -> None:
        self.engine = engine
        # Open while a batch is fanned out (and while a session actor handles a command):
        # what it writes to one socket leaves in one write as it closes (the server gives
        # gateway/transport/coalesce.py's; none here: each write at once).
        self.write_batch = write_batch or contextlib.nullcontext()
        self.max_running = max_running
        self.max_queued = max_queued
        self.metrics = metrics or Metrics()
        self.generation_timeout = generation_timeout  # 0: no watchdog
        self.merge_deltas = merge_deltas  # False: a frame per token (--no-coalesce)
        self._running: dict[str, Job] = {}  # by request id: the jobs that get output
        self._draining: dict[str, float] = {}  # aborted, engine not yet confirmed: since when
        self._queues: dict[str, deque[Job]] = {}  # waiting jobs per session, FIFO each
        self._queued = 0
        self._running_by_session: Counter[str] = Counter()
        self._last_served: dict[str, int] = {}
        self._served = 0
        self._closing = False
        # Each tenant's limits and use: its answers in flight and in the engine (fairness).
        self.tenants = tenants or TenantBook()
        self._tasks: list[asyncio.Task[None]] = []
        self._all_confirmed: asyncio.Event | None = None  # close() waits on it

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def draining(self) -> int:
        """Aborted requests the engine has not confirmed yet (each for at most a step)."""
        return len(self._draining)

    @property
    def queued(self) -> int:
        return self._queued

    def check(self, request: GenerationRequest) -> None:
        """Raise the engine's :class:`InvalidRequestError` if it cannot constrain
        ``request`` as asked (see ``Engine.check``): before the request is admitted."""
        self.engine.check(request)

    @property
    def room(self) -> int:
        """How many jobs :meth:`submit` would take now (each a free slot or queue place):
        a request with several choices starts all of them or none."""
        if self._closing:
            return 0
        free = max(0, self.max_running - len(self._running))
        return free + max(0, self.max_queued - self._queued)

    def submit(self, job: Job) -> bool:
        """Queue ``job`` and start what fits. False (and nothing kept) if full."""
        if self._closing or (
            self._queued >= self.max_queued and len(self._running) >= self.max_running
        ):
            self.metrics.refused.labels(reason="overloaded").inc()
            return False
        job.submitted_at = time.perf_counter()
        job.state = "queued"
        job.reserved_tokens = self.tenants.request_started(
            job.tenant, job.request.sampling.max_output_tokens
        )
        self.metrics.tenant_requests.labels(tenant=job.tenant).inc()
        self._queues.setdefault(job.session_key, deque()).append(job)
        self._queued += 1
        self._admit()
        self._update_gauges()
        return True

    def cancel(self, job: Job, reason: CancelReason) -> None:
        """Stop ``job``; its sink's ``on_finish`` runs now, exactly once."""
        if job.state in ("done", "new"):
            return
        job.cancel_reason = reason
        if job.state == "queued":
            queue = self._queues[job.session_key]
            queue.remove(job)
            if not queue:
                del self._queues[job.session_key]
            self._queued -= 1
            self._forget_if_idle(job.session_key)
            self._finish(job, self._partial(job, "cancelled"))
            self._update_gauges()
            return
        # Running: the engine confirms at its next step.
        self._draining[job.request_id] = time.perf_counter()
        self.engine.abort(job.request_id)
        self._end(job, self._partial(job, "cancelled"))

    def drain(self) -> None:
        """Refuse new work and start nothing more; what runs goes on."""
        self._closing = True

    async def close(self, confirm_timeout: float = 5.0) -> None:
        """Refuse new work, cancel everything, wait (a bounded time) until the engine has
        let go of every request, and stop the fan-out task."""
        self.drain()
        for queue in list(self._queues.values()):
            for job in list(queue):
                self.cancel(job, "server_shutdown")
        for job in list(self._running.values()):
            self.cancel(job, "server_shutdown")
        if self._draining and self._tasks:
            self._all_confirmed = asyncio.Event()
            try:
                async with asyncio.timeout(confirm_timeout):
                    await self._all_confirmed.wait()
            except TimeoutError:
                log.warning("scheduler: the engine still holds %d aborted requests", self.draining)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    # -- admission -----------------------------------------------------------

    def _admit(self) -> None:
        while self._queues and len(self._running) < self.max_running:
            # The waiting tenant with the fewest answers running per unit of its weight
            # goes first; within it, the session with the fewest running, ties to the one
            # served longest ago: a newcomer overtakes a session that was just served,
            # which is what keeps one batch (or one busy tenant) from starving the rest.
            eligible = [k for k in self._queues if self._may_take_slot(k)]
            if not eligible:
                break  # what waits is one busy tenant's, and the free slots are the reserve
            session_key = min(eligible, key=self._priority)
            queue = self._queues.pop(session_key)
            job = queue.popleft()
            if queue:  # back of the line with what it has left
                self._queues[session_key] = queue
            self._queued -= 1
            self._served += 1
            self._last_served[session_key] = self._served
            self._start(job)

    @property
    def reserve(self) -> int:
        """Slots no one tenant may fill while others are configured: admission does not
        preempt, so without them one tenant flat out holds every slot and another's next
        answer waits for a whole answer to end. A thirty-second of the slots (at least
        one); none on a gateway with one tenant (no keys, or one)."""
        if len(self.tenants.limits) < 2:
            return 0
        return min(max(1, self.max_running // 32), self.max_running - 1)

    def _may_take_slot(self, session_key: str) -> bool:
        reserve = self.reserve
        if not reserve:
            return True
        tenant = self._queues[session_key][0].tenant
        return self.tenants.running[tenant] < self.max_running - reserve

    def _priority(self, session_key: str) -> tuple[float, int, int]:
        tenant = self._queues[session_key][0].tenant
        share = self.tenants.running[tenant] / self.tenants.weight(tenant)
        return share, self._running_by_session[session_key], self._last_served.get(session_key, 0)

    def _forget_if_idle(self, session_key: str) -> None:
        if not self._running_by_session[session_key] and session_key not in self._queues:
            del self._running_by_session[session_key]
            self._last_served.pop(session_key, None)

    def _start(self, job: Job) -> None:
        if not self._tasks:
            self._start_tasks()
        job.state = "running"
        job.started_at = job.last_token_at = time.perf_counter()
        if job.request.sampling.logprobs is not None and job.logprobs is None:
            job.logprobs = []
        self._running[job.request_id] = job
        self._running_by_session[job.session_key] += 1
        self.tenants.running[job.tenant] += 1
        try:
            self.engine.submit(job.request)
        except Exception as exc:  # an engine bug: this job fails, the gateway goes on
            log.exception("scheduler: the engine refused %s", job.request_id)
            self._end(job, self._partial(job, "failed", EngineError("engine_error", repr(exc))))

    def _start_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._fan_out_loop(), name="scheduler-fan-out"))
        if self.generation_timeout > 0:
            self._tasks.append(loop.create_task(self._watchdog(), name="scheduler-watchdog"))

    # -- fan-out: the one task that reads the engine ------------------------------

    async def _fan_out_loop(self) -> None:
        outputs = self.engine.outputs
        while True:
            batch = await outputs.get()
            try:
                with self.write_batch:
                    self._fan_out(batch)
            except Exception:  # a bug here must not stop every stream for good
                log.exception("scheduler: fan-out of %d outputs failed", len(batch))

    def _fan_out(self, batch: list[StepOutput]) -> None:
        now = time.perf_counter()
        running = self._running
        # More outputs than running jobs: some job got several tokens since the last
        # wake-up (this task fell behind the engine, which ran steps meanwhile). Merging
        # each job's text of the batch into one delta is then what lets a saturated
        # gateway catch up: a frame costs far more than a token.
        merged: dict[Job, list[str]] | None = (
            {} if self.merge_deltas and len(batch) > len(running) else None
        )
        # The merged text's log probabilities, for jobs that asked for them (made when one
        # does: a batch without them never builds it).
        merged_logprobs: dict[Job, list[TokenLogprob]] | None = None
        # The inter-token histogram's counts, updated inline on the hot path below.
        gaps = self.metrics.inter_token
        gap_bounds, gap_counts, gap_sum = gaps.bounds, gaps.counts, 0.0
        for request_id, output in batch:
            job = running.get(request_id)
            if job is None:
                if isinstance(output, Finished | EngineError):
                    self._confirmed(request_id)
                continue  # the tail of a job that already ended (cancelled, timed out)
            if output.__class__ is str:  # the hot path: one token of text
                text: str = output
                job.output_tokens += 1
                if merged is None and job.parts and job.on_text is not None:
                    # _deliver, inline, for a job past its first token with a direct sink.
                    gap = now - job.last_token_at
                    gap_counts[bisect_left(gap_bounds, gap)] += 1
                    gap_sum += gap
                    job.last_token_at = now
                    try:
                        job.on_text(text)
                    except Exception as exc:  # a bug costs its job, not the batch's others
                        self._sink_failed(job, exc)
                        continue
                    job.parts.append(text)
                    continue
            elif isinstance(output, TextDelta) and not output.token_ids:
                text = output.text
                job.output_tokens += output.tokens
                if output.logprobs is not None:
                    if merged is None:
                        self._deliver_logprobs(job, text, now, output.logprobs)
                        continue
                    if merged_logprobs is None:
                        merged_logprobs = {}
                    if (lps := merged_logprobs.get(job)) is None:
                        merged_logprobs[job] = list(output.logprobs)
                    else:
                        lps += output.logprobs
            else:
                if merged is not None and (earlier := merged.pop(job, None)):
                    # What came before it, first.
                    lps = merged_logprobs.pop(job, None) if merged_logprobs else None
                    if lps is None:
                        self._deliver(job, "".join(earlier), now)
                    else:
                        self._deliver_logprobs(job, "".join(earlier), now, tuple(lps))
                    if job.state == "done":  # its delivery failed
                        continue
                try:
                    self._other(job, output, now)
                except Exception as exc:  # a bug costs its job, not the batch's other jobs
                    if job.state != "done":
                        self._sink_failed(job, exc)
                continue
            if merged is None:
                self._deliver(job, text, now)
            elif (parts := merged.get(job)) is None:
                merged[job] = [text]
            else:
                parts.append(text)
        gaps.sum += gap_sum
        if merged:
            for job, parts in merged.items():
                text = parts[0] if len(parts) == 1 else "".join(parts)
                if merged_logprobs and (lps := merged_logprobs.get(job)) is not None:
                    self._deliver_logprobs(job, text, now, tuple(lps))
                else:
                    self._deliver(job, text, now)

    def _deliver(self, job: Job, text: str, now: float, token_ids: tuple[int, ...] = ()) -> None:
        if job.parts:
            self.metrics.inter_token.observe(now - job.last_token_at)
        else:
            job.first_token_at = now
        job.last_token_at = now
        try:
            if token_ids:
                job.sink.on_delta(job, text, token_ids)
            elif job.on_text is not None:
                job.on_text(text)
            else:
                job.sink.on_delta(job, text)
        except Exception as exc:  # a bug costs its job, not the batch's other jobs
            self._sink_failed(job, exc)
            return
        job.parts.append(text)  # after it went out: the final text is what was sent

    def _deliver_logprobs(
        self,
        job: Job,
        text: str,
        now: float,
        logprobs: tuple[TokenLogprob, ...],
        token_ids: tuple[int, ...] = (),
    ) -> None:
        """:meth:`_deliver`'s twin for a request that asked for log probabilities (kept
        apart, so that one that did not pays nothing for them)."""
        if job.parts:
            self.metrics.inter_token.observe(now - job.last_token_at)
        else:
            job.first_token_at = now
        job.last_token_at = now
        try:
            job.sink.on_logprobs_delta(job, text, logprobs, token_ids)
        except Exception as exc:  # a bug costs its job, not the batch's other jobs
            self._sink_failed(job, exc)
            return
        job.parts.append(text)
        if job.logprobs is not None:
            job.logprobs += logprobs

    def _sink_failed(self, job: Job, exc: Exception) -> None:
        log.exception("scheduler: delivering %s failed", job.request_id, exc_info=exc)
        self._draining[job.request_id] = time.perf_counter()
        self.engine.abort(job.request_id)
        self._end(job, self._partial(job, "failed", EngineError("internal_error", repr(exc))))

    def _other(self, job: Job, output: Output, now: float) -> None:
        """Everything but text: tool-call deltas, prompt counts, the end; and text that
        carries its token ids (never merged: the ids go with their own text)."""
        if isinstance(output, TextDelta):
            job.output_tokens += output.tokens
            if output.logprobs is None:
                self._deliver(job, output.text, now, output.token_ids)
            else:
                self._deliver_logprobs(job, output.text, now, output.logprobs, output.token_ids)
            return
        if isinstance(output, ToolCallDelta):
            job.last_token_at = now
            job.output_tokens += output.tokens
            job.sink.on_tool_call_delta(job, output)
        elif isinstance(output, PromptTokens):
            job.last_token_at = now
            job.input_tokens, job.cached_tokens = output.input_tokens, output.cached_tokens
        elif isinstance(output, PromptLogprobs):
            job.last_token_at = now
            job.sink.on_prompt_logprobs(job, output)
        elif isinstance(output, Moved):
            job.moves += (now,)
            self.metrics.upstream_moves.inc()
        elif isinstance(output, Finished):
            if output.reason == "cancelled":  # the engine stopped it on its own
                error = EngineError("engine_error", "the engine stopped the generation")
                self._end(job, self._partial(job, "failed", error))
                return
            status: Status = "incomplete" if output.reason == "length" else "completed"
            outcome = Outcome(status, "".join(job.parts), output.usage)
            if job.logprobs is not None:
                outcome = replace(outcome, logprobs=tuple(job.logprobs))
            self._end(job, outcome)
        elif isinstance(output, EngineError):
            self._end(job, self._partial(job, "failed", output))

    def _confirmed(self, request_id: str) -> None:
        """The engine let go of an aborted request: its slot is free for the next job."""
        since = self._draining.pop(request_id, None)
        if since is None:
            return
        self.metrics.abort_latency.observe(time.perf_counter() - since)
        if not self._draining and self._all_confirmed is not None:
            self._all_confirmed.set()

    # -- watchdog ------------------------------------------------------------------

    async def _watchdog(self) -> None:
        timeout = self.generation_timeout
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.perf_counter()
            for job in [j for j in self._running.values() if now - j.last_token_at > timeout]:
                log.warning(
                    "scheduler: %s made no progress for %.1fs; failing it",
                    job.request_id,
                    timeout,
                )
                self.metrics.generation_timeouts.inc()
                self.engine.abort(job.request_id)
                error = EngineError(
                    "generation_timeout",
                    f"the engine produced nothing for {timeout:g}s; the response was stopped",
                )
                self._end(job, self._partial(job, "failed", error))
            # An engine that never confirms an abort must not hold a slot for good.
            for request_id in [r for r, t in self._draining.items() if now - t > timeout]:
                log.warning("scheduler: the engine never confirmed aborting %s", request_id)
                self._confirmed(request_id)

    # -- ending --------------------------------------------------------------------

    def _end(self, job: Job, outcome: Outcome) -> None:
        del self._running[job.request_id]
        self._running_by_session[job.session_key] -= 1
        self.tenants.running[job.tenant] -= 1
        if self.tenants.running[job.tenant] <= 0:
            del self.tenants.running[job.tenant]
        self._forget_if_idle(job.session_key)
        self._finish(job, outcome)
        if not self._closing:
            self._admit()
        self._update_gauges()

    def _partial(self, job: Job, status: Status, error: EngineError | None = None) -> Outcome:
        usage = Usage(job.input_tokens, job.output_tokens, job.cached_tokens)
        logprobs = tuple(job.logprobs) if job.logprobs is not None else None
        return Outcome(status, "".join(job.parts), usage, error, job.cancel_reason, logprobs)

    def _finish(self, job: Job, outcome: Outcome) -> None:
        job.state = "done"
        job.ended_at = now = time.perf_counter()
        m = self.metrics
        m.finished.labels(status=outcome.status).inc()
        m.output_tokens.inc(outcome.usage.output_tokens)
        m.tenant_output_tokens.labels(tenant=job.tenant).inc(outcome.usage.output_tokens)
        self.tenants.request_ended(job.tenant, outcome.usage.output_tokens, job.reserved_tokens)
        m.deltas.inc(len(job.parts))
        m.e2e.observe(now - job.submitted_at)
        job.sink.on_finish(job, outcome)

    def _update_gauges(self) -> None:
        self.metrics.running.set(self.running)
        self.metrics.queued.set(self._queued)
