"""openai-python's Responses clients, the Agents SDK and openai-node's ``ResponsesWS``,
unmodified, against the gateway's Responses API (tests/sdk/, tests/node/).

The Python programs run in ``.venv-sdk`` and the Node one under Node with the packages
of tests/node (both set up by ``make test``); each prints what it saw as JSON, checked
here. Every event they received was validated against the SDK's own types in strict
mode, and an invalid one is listed under ``invalid``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from gateway.engines.sim import TOOL_ANSWER_PREFIX, SimEngine
from tests.support.harness import running_gateway
from tests.support.scripted_engine import ToolLoopEngine
from tests.test_sdk import run_program, run_sdk

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "tests" / "node"


async def sdk(scenario: str, engine: Any = None, program: str = "responses_client.py") -> Any:
    engine = engine or SimEngine(step_ms=1, response_tokens=12)
    async with running_gateway(engine, api_keys=("k",)) as gw:
        result = await run_sdk(program, scenario, f"{gw.http_url}/v1", "k")
        await gw.wait_idle()
    assert result.get("invalid", []) == [], result["invalid"]
    return result


def assert_whole(turn: dict[str, Any], *, alone: bool = True) -> None:
    assert turn["status"] == "completed", turn
    assert turn["deltas"] == turn["text"] != ""
    # Numbers count the connection's events: a response alone on it gets a run of them.
    assert turn["contiguous"] or not alone


@pytest.mark.parametrize("scenario", ["ws_async", "ws_sync"])
async def test_responses_connect_chains_two_turns(scenario: str) -> None:
    result = await sdk(scenario)
    first, second = result["turns"]
    assert_whole(first)
    assert_whole(second)
    assert second["previous_response_id"] == first["id"]


async def test_responses_connect_runs_two_lanes_at_once() -> None:
    result = await sdk("ws_lanes", SimEngine(step_ms=5, response_tokens=20))
    for turn in result["lanes"].values():
        assert_whole(turn, alone=False)
    assert result["lane_switches"] > 2  # interleaved, not one lane after the other


async def test_responses_connect_calls_a_tool_and_answers_its_output() -> None:
    first, second = (await sdk("ws_tools"))["turns"]
    assert [c["name"] for c in first["calls"]] == ["get_weather"]
    assert second["text"] == TOOL_ANSWER_PREFIX + "Sunny, 21 degrees"


async def test_responses_connect_resumes_through_its_reconnect_hook() -> None:
    result = await sdk("ws_reconnect", SimEngine(step_ms=10, response_tokens=150))
    assert result["hooks"], "the socket never dropped mid-answer"
    assert result["hooks"][0]["close_code"] == 1006
    assert len(set(result["sessions"])) == 1  # the same session on the new socket
    turn = result["turn"]
    assert_whole(turn)
    assert turn["duplicates"] == 0


async def test_the_agents_sdk_runs_a_tool_loop_over_the_websocket() -> None:
    result = await sdk("ws", ToolLoopEngine(), program="responses_agent.py")
    assert [c["name"] for c in result["calls"]] == ["get_weather", "get_time"]
    assert result["model_calls"] == 3
    assert "Sunny" in result["final_output"] and "10:30" in result["final_output"]


@pytest.mark.skipif(shutil.which("node") is None, reason="Node is not installed")
@pytest.mark.parametrize("scenario", ["stream", "chain", "tools"])
async def test_openai_node_responses_ws(scenario: str) -> None:
    assert (NODE_DIR / "node_modules" / "openai").exists(), "run `make test` (npm ci)"
    async with running_gateway(SimEngine(step_ms=1, response_tokens=12), api_keys=("k",)) as gw:
        node = str(NODE_DIR / "responses_ws.mjs")
        result = await run_program("node", node, scenario, f"{gw.http_url}/v1", "k")
    assert result["errors"] == [], result
    for turn in result["turns"]:
        assert turn["status"] == "completed" and turn["deltas"] == turn["text"], result
        assert turn["contiguous"], result
    if scenario == "chain":
        assert result["turns"][1]["previous_response_id"] == result["turns"][0]["id"]
    if scenario == "tools":
        assert result["turns"][1]["text"] == TOOL_ANSWER_PREFIX + "Sunny"
