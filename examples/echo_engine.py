"""A whole engine in one file: it answers with the last user message, a word per step.

What a new engine needs (gateway/engines/base.py): ``capacity``; ``submit`` and ``abort``,
which never block; and every step's outputs for all its requests, put into
``self.outputs`` as one batch, each request ending with one ``Finished`` (or an
``EngineError``). Engines whose API is one async iterator per request subclass
``StreamingEngine`` and write ``stream()`` instead (see gateway/engines/upstream.py).

Serve it with the gateway (docs/design.md shows how; tests/test_design.py does it).
"""

from __future__ import annotations

import asyncio
import contextlib

from gateway.engines.base import Engine, Finished, GenerationRequest, StepOutput, Usage


class EchoEngine(Engine):
    name = "echo"

    def __init__(self, step_s: float = 0.01) -> None:
        super().__init__()
        self.step_s = step_s
        self._words: dict[str, list[str]] = {}  # what each running request has left to say
        self._done: dict[str, int] = {}  # words said so far
        self._aborted: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def capacity(self) -> int:
        return 64

    async def start(self) -> None:
        await super().start()  # binds self.outputs to the loop, marks the engine ready
        self._task = asyncio.get_running_loop().create_task(self._steps())

    async def close(self) -> None:
        await super().close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, request: GenerationRequest) -> None:
        said = next((m.text for m in reversed(request.messages) if m.role == "user"), "")
        words = [f" {w}" for w in said.split()] or [" ..."]
        words[0] = words[0].lstrip()
        self._words[request.request_id] = words
        self._done[request.request_id] = 0

    def abort(self, request_id: str) -> None:
        if request_id in self._words:
            self._aborted.add(request_id)  # the next step ends it, as cancelled

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            batch: list[StepOutput] = []
            for rid, words in list(self._words.items()):
                if words and rid not in self._aborted:
                    batch.append((rid, words.pop(0)))  # a plain str: one token of text
                    self._done[rid] += 1
                if not words or rid in self._aborted:
                    reason = "cancelled" if rid in self._aborted else "stop"
                    batch.append((rid, Finished(reason, Usage(1, self._done.pop(rid)))))
                    del self._words[rid]
                    self._aborted.discard(rid)
            if batch:
                self.outputs.put_step(batch)  # the whole step: one wake-up of the scheduler
