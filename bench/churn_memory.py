"""Memory of a gateway process while sessions come and go (issue 16, defect 6).

    python -m bench.churn_memory [--rounds 4] [--seconds 30] [--clients 8] [-- GATEWAY FLAGS]

Starts ``python -m gateway`` (the llama.cpp engine with the bundled model unless flags
after ``--`` say otherwise) in a process of its own. Each round, ``--clients`` loops
each open a session, ask two short questions that no other session asks (so no two
conversations share a prefix), and close it, again and again for ``--seconds``. More
clients than llama.cpp has slots means slots change hands all the time, which is what
fills llama.cpp's host-RAM prompt cache when it is on. The resident memory of the
gateway process is printed after loading and after each round: bounded memory stays
flat after the first round or two.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time

import gateway.client
from bench.procs import rss_bytes, server_process

MIB = 1 << 20


async def churn(url: str, clients: int, seconds: float, counter: itertools.count[int]) -> int:
    """Sessions opened and closed by ``clients`` loops within ``seconds``."""
    deadline = time.monotonic() + seconds
    done = 0

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            n = next(counter)
            async with gateway.client.connect(url, max_output_tokens=24) as chat:
                await chat.ask(f"Visitor {n} asks: name a colour and the number {n}.")
                await chat.ask(f"Now a fruit for visitor {n}.")
            done += 1

    await asyncio.gather(*(loop() for _ in range(clients)))
    return done


async def measure(pid: int, url: str, rounds: int, seconds: float, clients: int) -> None:
    counter = itertools.count(1)
    print(f"loaded: {rss_bytes(pid) / MIB:.0f} MiB", flush=True)
    for round_ in range(1, rounds + 1):
        sessions = await churn(url, clients, seconds, counter)
        print(
            f"round {round_}: {sessions} sessions in {seconds:.0f} s, "
            f"RSS {rss_bytes(pid) / MIB:.0f} MiB",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    ours, gateway_flags = _split(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.churn_memory")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args(ours)
    command = [sys.executable, "-m", "gateway", "--log-level", "WARNING", *gateway_flags]
    print("gateway:", " ".join(command[1:]), flush=True)
    with server_process(command, timeout=120) as server:
        asyncio.run(measure(server.pid, server.ws_url, args.rounds, args.seconds, args.clients))
    return 0


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """This script's flags, and the gateway's (after ``--``)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


if __name__ == "__main__":
    sys.exit(main())
