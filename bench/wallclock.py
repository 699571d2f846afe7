"""The gateway with a sim engine whose steps keep wall-clock time, like a GPU's.

The shipped SimEngine sleeps ``step`` *after* each step on the gateway's own event
loop, so when the gateway is busy the engine slows down with it and hands out one
token per stream per loop turn: the outbox never has two deltas to merge. A real
engine (TensorRT-LLM, llama.cpp) generates on its own threads whatever the event
loop is doing; when the loop falls behind, several tokens per stream are waiting
by the time it looks. This variant models that: steps are due on a fixed clock,
and a late loop runs every missed step at once (up to ``_MAX_CATCH_UP``).

Run exactly like ``python -m gateway --engine sim ...`` (same flags), in a
process of its own: ``python -m bench.wallclock --sim-step-ms 5 --port 8765``.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from bench.loadgen import raise_nofile
from gateway.__main__ import build_parser, config_from_args, serve
from gateway.engines.sim import SimEngine
from gateway.server import Gateway

_MAX_CATCH_UP = 50  # steps run back to back when the loop was away this long


class WallClockSimEngine(SimEngine):
    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if not self._streams:
                self._wake.clear()
                await self._wake.wait()
                due = loop.time()
            late = loop.time() - due
            steps = 1 + min(_MAX_CATCH_UP, int(late / self.step_s)) if self.step_s > 0 else 1
            for _ in range(steps):
                self._step()
            due += steps * self.step_s
            await asyncio.sleep(max(0.0, due - loop.time()))


def main() -> int:
    args = build_parser().parse_args()
    if args.engine != "sim":
        print("bench.wallclock runs the sim engine only", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level)
    raise_nofile()
    engine = WallClockSimEngine(
        step_ms=args.sim_step_ms,
        max_batch=args.sim_max_batch,
        response_tokens=args.sim_response_tokens,
    )
    asyncio.run(serve(Gateway(engine, config_from_args(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
