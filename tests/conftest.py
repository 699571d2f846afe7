"""The event loop every test runs on: ``pytest --loop asyncio|uvloop``.

The choice (default: ``$LLM_GATEWAY_LOOP``, else the gateway's own default) sets the
event loop policy for the whole session, so pytest-asyncio's loops and every
``asyncio.run`` in a helper thread use it, and exports ``$LLM_GATEWAY_LOOP`` so that
every ``python -m gateway`` a test starts runs on the same loop. ``make test`` runs
the suite once per loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from gateway.__main__ import LOOP_ENV_VAR, LOOPS, default_loop
from gateway.engines.sim import SimEngine
from tests.support.harness import RunningGateway, running_gateway


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--loop",
        choices=LOOPS,
        default=None,
        help=f"event loop for every test and gateway subprocess (default: ${LOOP_ENV_VAR}, "
        "else uvloop if installed)",
    )


def pytest_configure(config: pytest.Config) -> None:
    loop = config.getoption("--loop") or default_loop()
    if loop not in LOOPS:
        raise pytest.UsageError(f"{LOOP_ENV_VAR}={loop}: expected asyncio or uvloop")
    os.environ[LOOP_ENV_VAR] = loop  # inherited by every gateway subprocess
    if loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    config.stash[_LOOP] = loop


def pytest_report_header(config: pytest.Config) -> str:
    return f"event loop: {config.stash[_LOOP]}"


_LOOP = pytest.StashKey[str]()


@pytest.fixture
def selected_loop(request: pytest.FixtureRequest) -> str:
    """The loop this session runs on (``asyncio`` or ``uvloop``)."""
    return request.config.stash[_LOOP]


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    """A gateway on a fast simulated engine (2 ms steps, 16-token answers)."""
    async with running_gateway(SimEngine(step_ms=2, response_tokens=16)) as running:
        yield running
