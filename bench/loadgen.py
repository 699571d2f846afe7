"""The load generator: worker processes, each an asyncio loop holding many sessions.

It never runs inside the process it measures. The parent (:func:`run_load`) starts
``workers`` processes, hands each a share of the sessions, waits until every share
has connected, then sends one "go" with a shared start time (``perf_counter`` is
CLOCK_MONOTONIC on Linux, the same clock in every process), so the measurement
window is the same in every worker and in the parent that samples the server's CPU.

Two targets speak the same turns: ``("ws", url)`` (the gateway, or the bare
websockets server, over the Realtime protocol) and ``("engine", params)`` (the
SimEngine in the worker process itself, driven directly (EngineDriver): the
bare-engine baseline, no network, no gateway).

Every loop is bounded: by the window, by ``max_turns`` per session, and by
``turn_timeout`` per turn; whatever is still open at the end is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import resource
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

import orjson

now = time.perf_counter

Mode = Literal["closed", "open", "idle"]


@dataclass(frozen=True)
class Workload:
    """What every session does. Times in seconds unless the name says otherwise."""

    sessions: int
    mode: Mode = "closed"
    warmup: float = 1.0  # from "go" to the start of the window (ramp-up, not measured)
    duration: float = 5.0  # the measurement window
    think: tuple[float, float] = (0.0, 0.04)  # uniform pause before each turn (closed loop)
    rate: float = 0.0  # open loop: arrivals per second, all workers together
    cancel_after: tuple[int, int] | None = None  # cancel after k delta frames, k uniform
    max_turns: int = 1000
    turn_timeout: float = 30.0
    drain: float = 10.0  # after the window, how long open turns may take to finish
    prompt: str = "Tell me about streaming gateways."


@dataclass
class Tally:
    """What one worker saw; merged across workers by the parent."""

    connected: int = 0
    connect_failed: int = 0
    turns: int = 0  # turns started inside the window (the ones with latency records)
    unfinished: int = 0  # turns still open when the drain ran out
    status: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    text_mismatch: int = 0
    dropped_arrivals: int = 0  # open loop: no free session at an arrival
    ttft: array[float] = field(default_factory=lambda: array("d"))
    tpot: array[float] = field(default_factory=lambda: array("d"))
    e2e: array[float] = field(default_factory=lambda: array("d"))
    gaps: array[float] = field(default_factory=lambda: array("d"))
    cancel_to_done: array[float] = field(default_factory=lambda: array("d"))
    # Arrivals inside the window, for rates.
    frames: int = 0
    delta_frames: int = 0
    chars: int = 0
    # Whole finished responses, for the tokens-per-character ratio.
    done_tokens: int = 0
    done_chars: int = 0
    cpu_s: float = 0.0  # this worker's own CPU over the window

    def merge(self, other: Tally) -> None:
        for name, mine in vars(self).items():
            theirs = getattr(other, name)
            if isinstance(mine, (Counter, array)):
                mine += theirs  # in place for Counter and array
            else:
                setattr(self, name, mine + theirs)

    @property
    def tokens_in_window(self) -> float:
        """Tokens delivered in the window: characters seen times tokens per character."""
        return self.chars * self.done_tokens / self.done_chars if self.done_chars else 0.0


@dataclass
class Window:
    go: float
    start: float
    end: float

    def __contains__(self, t: float) -> bool:
        return self.start <= t <= self.end


@dataclass
class _Turn:
    """One response as the client sees it."""

    started: float
    record: bool
    parts: list[str] = field(default_factory=list)
    first: float = 0.0
    last: float = 0.0
    cancel_at: float = 0.0
    final_text: str | None = None


def _finish_turn(tally: Tally, turn: _Turn, status: str, tokens: int, t: float) -> None:
    text = "".join(turn.parts)
    tally.done_tokens += tokens
    tally.done_chars += len(text)
    if not turn.record:
        return
    tally.status[status] += 1
    if turn.final_text is not None and turn.final_text != text:
        tally.text_mismatch += 1
    if turn.first:
        tally.ttft.append(turn.first - turn.started)
        if tokens > 1:
            tally.tpot.append((t - turn.first) / (tokens - 1))
    tally.e2e.append(t - turn.started)
    if turn.cancel_at:
        tally.cancel_to_done.append(t - turn.cancel_at)


# -- the two targets -----------------------------------------------------------------


class WsSession:
    """One Realtime session over a WebSocket: a user item, then a response, per turn."""

    def __init__(self, ws: Any, index: int) -> None:
        self.ws = ws
        self.index = index
        self.turns = 0

    @classmethod
    async def open(cls, url: str, index: int) -> WsSession:
        from websockets.asyncio.client import connect

        # Spread source addresses over 127.0.0.2-17 so thousands of sessions never
        # run out of ephemeral ports (each source address has its own port range).
        ws = await connect(
            url,
            compression=None,
            max_size=None,
            ping_interval=None,
            open_timeout=60,
            close_timeout=2,
            local_addr=(f"127.0.0.{2 + index % 16}", 0),
        )
        created = orjson.loads(await ws.recv())
        assert created["type"] == "session.created", created
        return cls(ws, index)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()

    async def turn(
        self, w: Workload, win: Window, tally: Tally, rng: random.Random, record: bool
    ) -> None:
        ws = self.ws
        self.turns += 1
        text = f"{w.prompt} (session {self.index}, turn {self.turns})"
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        }
        await ws.send(orjson.dumps({"type": "conversation.item.create", "item": item}).decode())
        turn = _Turn(now(), record)
        await ws.send('{"type":"response.create"}')
        cancel_k = rng.randint(*w.cancel_after) if w.cancel_after else 0
        created = False
        while True:
            frame = await ws.recv()
            t = now()
            inside = t in win
            tally.frames += inside
            event = orjson.loads(frame)
            kind = event["type"]
            if kind == "response.output_text.delta":
                delta = event["delta"]
                turn.parts.append(delta)
                if inside:
                    tally.delta_frames += 1
                    tally.chars += len(delta)
                if not turn.first:
                    turn.first = t
                elif record:
                    tally.gaps.append(t - turn.last)
                turn.last = t
                if cancel_k and len(turn.parts) == cancel_k:
                    turn.cancel_at = now()
                    await ws.send('{"type":"response.cancel"}')
            elif kind == "response.created":
                created = True
            elif kind == "response.output_text.done":
                turn.final_text = event["text"]
            elif kind == "response.done":
                response = event["response"]
                tokens = (response.get("usage") or {}).get("output_tokens", 0)
                _finish_turn(tally, turn, response["status"], tokens, t)
                return
            elif kind == "error":
                tally.errors[event["error"]["code"]] += 1
                if not created:  # refused (overloaded): no response will come
                    if record:
                        tally.status["refused"] += 1
                    return


class EngineSession:
    """The bare-engine baseline: the same turns straight into the engine (an EngineDriver)."""

    def __init__(self, engine: Any, index: int) -> None:
        from gateway.engines.base import Message

        self.engine = engine
        self.index = index
        self.turns = 0
        self.messages: list[Message] = []

    async def close(self) -> None:
        return None

    async def turn(
        self, w: Workload, win: Window, tally: Tally, rng: random.Random, record: bool
    ) -> None:
        from gateway.engines.base import Finished, GenerationRequest, Message, TextDelta

        self.turns += 1
        self.messages.append(
            Message("user", f"{w.prompt} (session {self.index}, turn {self.turns})")
        )
        request = GenerationRequest(
            f"r{self.index}-{self.turns}", tuple(self.messages), affinity_key=f"c{self.index}"
        )
        cancel_k = rng.randint(*w.cancel_after) if w.cancel_after else 0
        turn = _Turn(now(), record)
        stream = self.engine.stream(request)
        status, tokens = "cancelled", 0
        try:
            async for item in stream:
                t = now()
                if isinstance(item, Finished):
                    status = "completed" if item.reason == "stop" else "incomplete"
                    tokens = item.usage.output_tokens
                    break
                if not isinstance(item, TextDelta):
                    continue  # the prompt's token count
                turn.parts.append(item.text)
                if t in win:
                    tally.frames += 1
                    tally.delta_frames += 1
                    tally.chars += len(item.text)
                if not turn.first:
                    turn.first = t
                elif record:
                    tally.gaps.append(t - turn.last)
                turn.last = t
                if cancel_k and len(turn.parts) == cancel_k:
                    turn.cancel_at = now()
                    tokens = len(turn.parts)
                    break
        finally:
            await stream.aclose()  # what the gateway's cancel does to the engine
        text = "".join(turn.parts)
        self.messages.append(Message("assistant", text))
        turn.final_text = text
        _finish_turn(tally, turn, status, tokens, now())


# -- the worker process ----------------------------------------------------------------


def raise_nofile() -> None:
    """Allow as many open files as the hard limit: thousands of sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


Target = tuple[str, Any]  # ("ws", url) or ("engine", SimEngine keyword arguments)


async def _open_sessions(
    target: Target, indices: list[int], tally: Tally
) -> tuple[list[Any], Callable[[], Awaitable[None]]]:
    kind, arg = target
    if kind == "engine":
        from gateway.engines.driver import EngineDriver
        from gateway.engines.sim import SimEngine

        engine = SimEngine(**arg)
        await engine.start()
        driver = await EngineDriver(engine).__aenter__()
        tally.connected = len(indices)

        async def close() -> None:
            await driver.__aexit__(None, None, None)
            await engine.close()

        return [EngineSession(driver, i) for i in indices], close

    gate = asyncio.Semaphore(64)  # handshakes in flight per worker

    async def one(i: int) -> WsSession | None:
        async with gate:
            try:
                return await WsSession.open(arg, i)
            except Exception:
                return None

    opened = await asyncio.gather(*(one(i) for i in indices))
    sessions = [s for s in opened if s is not None]
    tally.connected = len(sessions)
    tally.connect_failed = len(indices) - len(sessions)

    async def nothing() -> None:
        return None

    return sessions, nothing


async def _guarded_turn(
    session: Any, w: Workload, win: Window, tally: Tally, rng: random.Random
) -> None:
    record = now() in win
    if record:
        tally.turns += 1
    try:
        async with asyncio.timeout(w.turn_timeout):
            await session.turn(w, win, tally, rng, record)
    except TimeoutError:
        if record:
            tally.status["timeout"] += 1
    except Exception as exc:  # a dropped connection: counted, never fatal to the run
        if record:
            tally.errors[type(exc).__name__] += 1


async def _closed_loop(session: Any, w: Workload, win: Window, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, min(w.warmup, 1.0)))  # spread the first turns
    for _ in range(w.max_turns):
        await asyncio.sleep(rng.uniform(*w.think))
        if now() >= win.end:
            return
        await _guarded_turn(session, w, win, tally, rng)


async def _open_loop(
    sessions: list[Any], w: Workload, win: Window, tally: Tally, share: float, seed: int
) -> None:
    """Poisson arrivals at ``share`` of the total rate; each takes a free session."""
    rng = random.Random(seed)
    free = list(sessions)
    running: set[asyncio.Task[None]] = set()

    async def serve(session: Any) -> None:
        try:
            await _guarded_turn(session, w, win, tally, rng)
        finally:
            free.append(session)

    next_at = now()
    while True:
        next_at += rng.expovariate(share)
        if next_at >= win.end:
            break
        await asyncio.sleep(max(0.0, next_at - now()))
        if not free:
            tally.dropped_arrivals += now() in win
            continue
        task = asyncio.get_running_loop().create_task(serve(free.pop()))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.wait(running)


async def _worker(conn: Connection, target: Target, w: Workload, indices: list[int]) -> None:
    tally = Tally()
    sessions, close_target = await _open_sessions(target, indices, tally)
    conn.send(("ready", tally.connected, tally.connect_failed))
    message = await asyncio.to_thread(conn.recv)
    if w.mode == "idle":
        for s in sessions:
            await s.close()
        conn.send(("result", tally))
        return
    go = message[1]
    win = Window(go, go + w.warmup, go + w.warmup + w.duration)
    await asyncio.sleep(max(0.0, go - now()))
    seed = indices[0] if indices else 0
    if w.mode == "closed":
        work = [_closed_loop(s, w, win, tally, seed + k) for k, s in enumerate(sessions)]
    else:
        share = w.rate * len(indices) / w.sessions
        work = [_open_loop(sessions, w, win, tally, share, seed)]
    tasks = [asyncio.ensure_future(c) for c in work]
    cpu = _CpuWindow(win)
    cpu_task = asyncio.ensure_future(cpu.run())
    _, pending = await asyncio.wait(tasks, timeout=win.end + w.drain - now())
    for task in pending:
        task.cancel()
    tally.unfinished = len(pending)
    await asyncio.gather(*pending, return_exceptions=True)
    await cpu_task
    tally.cpu_s = cpu.seconds
    await asyncio.gather(*(s.close() for s in sessions))
    await close_target()
    conn.send(("result", tally))


class _CpuWindow:
    """This process's CPU seconds between the window's start and end."""

    def __init__(self, win: Window) -> None:
        self.win = win
        self.seconds = 0.0

    async def run(self) -> None:
        await asyncio.sleep(max(0.0, self.win.start - now()))
        t0 = sum(os.times()[:2])
        await asyncio.sleep(max(0.0, self.win.end - now()))
        self.seconds = sum(os.times()[:2]) - t0


def _worker_entry(
    conn: Connection, target: Target, w: Workload, indices: list[int], loop: str
) -> None:
    from gateway.__main__ import loop_factory

    raise_nofile()
    try:
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            runner.run(_worker(conn, target, w, indices))
    finally:
        conn.close()


# -- the parent side ------------------------------------------------------------------


@dataclass
class LoadResult:
    tally: Tally
    window: Window
    server_cpu_s: float | None  # the measured server process's CPU over the window
    extra: dict[str, Any] = field(default_factory=dict)


def run_load(
    target: Target,
    w: Workload,
    *,
    workers: int,
    server_pid: int | None = None,
    also_sample: Sequence[int] = (),
    on_ready: Callable[[], dict[str, Any]] | None = None,
    ready_timeout: float = 120.0,
    loop: str = "asyncio",
) -> LoadResult:
    """Run ``w`` against ``target`` from ``workers`` processes; merge what they saw.

    ``on_ready`` runs once every session is connected (before "go"); what it returns
    lands in ``extra``. For an idle workload that is the measurement itself. The
    workers run on the event loop ``loop`` names (the bare engine baseline runs in
    them). ``also_sample``: more processes whose CPU over the window goes into
    ``extra["cpu_s"]`` (an upstream server behind the gateway); the whole machine's
    busy CPU over the window goes into ``extra["machine_busy_s"]``, so that work
    that is not the benchmark's shows.
    """
    from bench.procs import cpu_seconds, machine_busy_seconds

    ctx = mp.get_context("spawn")
    shares = [list(range(k, w.sessions, workers)) for k in range(workers)]
    pipes, procs = [], []
    for share in shares:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_entry, args=(child, target, w, share, loop), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        for p in pipes:
            if not p.poll(ready_timeout):
                raise RuntimeError("a load worker did not connect its sessions in time")
            p.recv()
        extra = on_ready() if on_ready is not None else {}
        go = now() + 0.2
        win = Window(go, go + w.warmup, go + w.warmup + w.duration)
        for p in pipes:
            p.send(("go", go))
        server_cpu = None
        if w.mode != "idle":
            sampled = [server_pid, *also_sample] if server_pid is not None else []
            time.sleep(max(0.0, win.start - now()))
            cpu0 = [cpu_seconds(pid) for pid in sampled]
            busy0 = machine_busy_seconds()
            time.sleep(max(0.0, win.end - now()))
            cpu = [cpu_seconds(pid) - c for pid, c in zip(sampled, cpu0, strict=True)]
            extra["machine_busy_s"] = machine_busy_seconds() - busy0
            extra["cpu_s"] = dict(zip(sampled, cpu, strict=True))
            server_cpu = cpu[0] if cpu else None
        tally = Tally()
        limit = w.warmup + w.duration + w.drain + 30
        for p in pipes:
            if not p.poll(limit):
                raise RuntimeError("a load worker did not report in time")
            tally.merge(p.recv()[1])
        return LoadResult(tally, win, server_cpu, extra)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
