"""One engine's requests as async iterators, without a scheduler or a session.

For engine tests, the bare-engine benchmark and scripts that want an engine
alone: ``async with EngineDriver(engine) as driver`` then
``async for event in driver.stream(request)``. A task drains the engine's
output channel and routes each output to its request's iterator. Leaving an
iterator early (break, cancel, error) aborts the request in the engine and
waits for the engine to confirm, so when the iterator is closed the engine no
longer holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from types import TracebackType

from gateway.engines.base import (
    Engine,
    EngineError,
    Finished,
    GenerationRequest,
    Output,
    StreamEvent,
    TextDelta,
)

_CLOSED = EngineError("engine_closed", "the engine driver was closed")


class EngineDriver:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[Output]] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EngineDriver:
        self._task = asyncio.get_running_loop().create_task(self._route(), name="engine-driver")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # Nothing more will be routed: wake any stream still waiting for its engine.
        for queue in self._queues.values():
            queue.put_nowait(_CLOSED)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[StreamEvent, None]:
        """Deltas then one :class:`Finished`; raises the request's :class:`EngineError`."""
        rid = request.request_id
        queue: asyncio.Queue[Output] = asyncio.Queue()
        self._queues[rid] = queue
        ended = False
        try:
            self.engine.submit(request)
            while True:
                output = await queue.get()
                if output is _CLOSED:
                    ended = True
                    raise EngineError("engine_closed", "the engine driver was closed")
                if isinstance(output, EngineError):
                    ended = True
                    raise output
                if isinstance(output, Finished):
                    ended = True
                    yield output
                    return
                yield TextDelta(output) if isinstance(output, str) else output
        finally:
            if not ended:
                await self._abort(rid, queue)
            del self._queues[rid]

    async def _abort(self, rid: str, queue: asyncio.Queue[Output]) -> None:
        """Abort ``rid`` and wait for the engine's terminal output, even if cancelled
        meanwhile (the cancel is passed on once the engine has let go)."""
        self.engine.abort(rid)
        cancelled = False
        while True:
            try:
                output = await queue.get()
                if output is _CLOSED or isinstance(output, Finished | EngineError):
                    break
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    async def _route(self) -> None:
        while True:
            for rid, output in await self.engine.outputs.get():
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(output)
