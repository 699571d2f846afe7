"""vLLM's shape: the FastAPI app of bench/baselines/fastapi_server.py with what vLLM's
OpenAI server puts between its engine and each response's generator: a queue per
request, fed by a producer task (vLLM's ``AsyncLLM`` output handler pushing each step's
outputs to per-request collectors, which the route's generator awaits).

Flat out (``--step-ms 0``) the producer puts one token per loop turn (one engine step
each, as the sim gives the gateway), and the generator awaits the queue for every
token; with ``--step-ms`` above 0 it puts a step's tokens per step of the shared clock.
The routes, the events and the objects are the minimal app's: what this adds is the
hand-off, which is what "what vLLM costs" means here. It is not "FastAPI": that
baseline is the minimal app.

Run: ``python -m bench.baselines.vllm_shape_server --port 8805 --step-ms 0 --response-tokens 300``
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from bench.baselines.fastapi_server import Answers, TokenSource, arguments, build_app, run


def queued(answers: Answers) -> TokenSource:
    """What a route awaits: a queue of its own, filled by a producer task."""

    async def source(tokens: list[str]) -> AsyncIterator[list[str]]:
        queue: asyncio.Queue[list[str] | None] = asyncio.Queue()

        async def produce() -> None:
            if answers.step_s <= 0:
                for token in tokens:  # a token per engine step, a step per loop turn
                    queue.put_nowait([token])
                    await asyncio.sleep(0)
            else:
                async for batch in answers.paced(tokens):
                    queue.put_nowait(batch)
            queue.put_nowait(None)

        producer = asyncio.get_running_loop().create_task(produce())
        try:
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            producer.cancel()

    return source


def main() -> None:
    args = arguments(__doc__.splitlines()[0], 8805)
    answers = Answers(args.step_ms, args.response_tokens)
    run(build_app(answers, queued(answers)), args)


if __name__ == "__main__":
    main()
