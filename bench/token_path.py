"""One token's trip through the gateway's own code, in one process, with no socket: the
scheduler's fan-out of one engine output, the session, the outbox and the Chat Completions
chunk template, to a wire that drops the frame. Prints nanoseconds per token (the best of
``--repeat`` runs of ``--tokens`` each).

``python bench/token_path.py [--logprobs N]``: run as a script, so that bench/logprobs.py
can run it against another commit's sources (``PYTHONPATH`` at that tree: only what both
trees have is used when ``--logprobs`` is left out). With ``--logprobs N`` each output is a
``TextDelta`` carrying its token's log probability and ``N`` alternatives, as an engine
reports them for a request that asked; without, a plain ``str``, the common case.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson

from gateway.engines.sim import SimEngine
from gateway.scheduler import Scheduler
from gateway.transport.wire import NullWire
from sessions.chat import codec as cc
from sessions.core import Session
from sessions.dialects import CHAT
from sessions.outbox import Outbox


def output(logprobs: int | None) -> Any:
    if logprobs is None:
        return " token"
    from gateway.engines.base import TextDelta, TokenLogprob

    top = tuple(TokenLogprob(f" w{k}", -1.0 - k, f" w{k}".encode()) for k in range(logprobs))
    return TextDelta(" token", logprobs=(TokenLogprob(" token", -0.5, b" token", top),))


async def measure(tokens: int, repeat: int, logprobs: int | None) -> float:
    engine = SimEngine(step_ms=1000)  # never started: the outputs below stand for its steps
    scheduler = Scheduler(engine, max_running=8, max_queued=8)
    # Made by its kind, which every tree this runs on has (their framings' classes differ).
    dialect, framing = CHAT.make(None)  # type: ignore[arg-type]  # the chat kind takes none
    session = Session(scheduler, Outbox(framing, replay_bytes=0), dialect)
    session.outbox.attach(NullWire())  # the socket's cost is not measured here
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    if logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": logprobs}
    session.dialect.handle(cc.decode(orjson.dumps(body)))
    batch = [(session.responses[0].id, output(logprobs))]
    fan_out = scheduler._fan_out
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter_ns()
        for _ in range(tokens):
            fan_out(batch)
        best = min(best, (time.perf_counter_ns() - began) / tokens)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{asyncio.run(measure(args.tokens, args.repeat, args.logprobs)):.0f}")


if __name__ == "__main__":
    main()
