from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.engines.sim import SimEngine
from tests.harness import RunningGateway, running_gateway


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    """A gateway on a fast simulated engine (2 ms steps, 16-token answers)."""
    async with running_gateway(SimEngine(step_ms=2, response_tokens=16)) as running:
        yield running
