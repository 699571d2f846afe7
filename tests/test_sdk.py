"""The official ``openai`` SDK's realtime client and the OpenAI Agents SDK, unmodified,
against the gateway.

Both pin ``websockets<16``/``<17`` while the gateway is tested with the newest
``websockets`` its pyproject allows, so they run in a virtual environment of their own
(``.venv-sdk``, made by ``make install``/``make test`` from tests/sdk/requirements.txt):
each test starts a gateway here and runs a program from tests/sdk/ there, which prints
what it saw as JSON; the assertions are here.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import websockets

from gateway.engines.sim import TOOL_ANSWER_PREFIX, SimEngine
from tests.support.harness import running_gateway
from tests.support.scripted_engine import ScriptedEngine, text_then_two_calls

ROOT = Path(__file__).resolve().parent.parent
SDK_PYTHON = ROOT / ".venv-sdk" / "bin" / "python"


async def run_program(
    *command: str, env: dict[str, str] | None = None, timeout: float = 60
) -> dict[str, Any]:
    """Run a client program (an SDK's, under Python or Node); its last line of output,
    parsed. ``env`` is added to this process's environment."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-4000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def run_sdk(program: str, *args: str, timeout: float = 60) -> dict[str, Any]:
    """Run tests/sdk/PROGRAM in the SDK environment; its last line of output, parsed."""
    assert SDK_PYTHON.exists(), "no .venv-sdk: run `make install` (or `make test`) first"
    return await run_program(
        str(SDK_PYTHON), str(ROOT / "tests" / "sdk" / program), *args, timeout=timeout
    )


async def realtime_client(engine: Any, scenario: str) -> dict[str, Any]:
    async with running_gateway(engine, api_keys=("k",)) as gw:
        return await run_sdk("realtime_client.py", scenario, f"{gw.http_url}/v1", "k")


def test_the_gateway_is_tested_with_websockets_17() -> None:
    assert int(websockets.__version__.split(".")[0]) >= 17, websockets.__version__
    assert sys.prefix != str(ROOT / ".venv-sdk")


async def test_sdk_multi_turn_and_cancel() -> None:
    out = await realtime_client(SimEngine(step_ms=5, response_tokens=24), "multi_turn_and_cancel")
    assert (out["created"], out["updated"]) == ("session.created", "session.updated")
    first = out["first"]
    assert first["status"] == "completed" and first["deltas"] == first["stored"] != ""
    second = out["second"]
    assert second["input_tokens"] > first["input_tokens"] + second["output_tokens"]
    assert out["cancelled"] == {"status": "cancelled", "reason": "client_cancelled"}
    assert out["audio"] == {"type": "error", "code": "unsupported_modality"}


async def test_sdk_tool_call_and_output_round_trip() -> None:
    out = await realtime_client(SimEngine(step_ms=2), "tool_round_trip")
    assert out["call"] == {"type": "function_call", "name": "get_weather", "status": "completed"}
    assert json.loads(out["arguments"]) == {"city": "Use get_weather for Paris."}
    assert len(out["deltas"]) >= 2 and "".join(out["deltas"]) == out["arguments"]
    types = out["types"][out["types"].index("response.created") :]
    assert types[:4] == [
        "response.created",
        "rate_limits.updated",
        "response.output_item.added",
        "conversation.item.added",
    ]
    assert out["answer"] == f"{TOOL_ANSWER_PREFIX}Sunny, 21 °C"
    assert out["answer_status"] == "completed"


async def test_sdk_several_calls_in_one_response() -> None:
    out = await realtime_client(ScriptedEngine(text_then_two_calls()), "several_calls")
    assert out["text"] == "Let me check both."
    assert out["output"] == [
        ["message", None, None],
        ["function_call", "get_weather", '{"city": "Paris"}'],
        ["function_call", "get_time", '{"zone": "CET"}'],
    ]


async def test_sdk_tool_choice_variants() -> None:
    out = await realtime_client(SimEngine(step_ms=2), "tool_choices")
    assert out["called"] == {
        '"auto"': [],  # the message names no tool
        '"required"': ["get_weather"],
        '"none"': [],
        '{"type": "function", "name": "get_time"}': ["get_time"],
    }


async def test_sdk_bad_tools_get_errors_with_param() -> None:
    out = await realtime_client(SimEngine(step_ms=2), "bad_tools")
    assert out["errors"] == [
        ["error", "invalid_value", "session.tools[0].name"],
        ["error", "unsupported_tool_type", "session.tools[0].type"],
    ]
    assert out["then"] == "session.updated"


async def test_agents_sdk_realtime_agent_runs_its_tool() -> None:
    async with running_gateway(SimEngine(step_ms=2), api_keys=("k",)) as gw:
        out = await run_sdk("agent.py", gw.ws_url, "k")
    assert out["errors"] == []  # every server event passed the SDK's validation
    question = "What is the weather today? Please use get_weather."
    assert out["calls"] == [question]  # the model called the tool with the sim's arguments
    assert out["tool_outputs"] == ["Sunny and 21 degrees (asked: 1)"]
    # The tool's result reached the model: its next answer quotes it.
    assert out["answers"][-1] == f"{TOOL_ANSWER_PREFIX}Sunny and 21 degrees (asked: 1)"
