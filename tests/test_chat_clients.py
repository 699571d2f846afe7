"""Chat Completions from clients a user already has, unmodified: openai-node, LangChain's
``ChatOpenAI`` (in .venv-sdk) and curl ``-N``. Each program prints what it saw as JSON
(tests/node/chat_completions.mjs, tests/sdk/langchain_chat.py)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from gateway.engines.sim import TOOL_ANSWER_PREFIX, SimEngine
from tests.support.harness import RunningGateway, running_gateway
from tests.test_sdk import run_program, run_sdk

NODE_PROGRAM = Path(__file__).resolve().parent / "node" / "chat_completions.mjs"
KEY = "key-chat"


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    engine = SimEngine(step_ms=1, response_tokens=12)
    async with running_gateway(engine, api_keys=(KEY,), served_model_names=("local",)) as running:
        yield running
        await running.wait_idle()
        assert not running.gateway.sessions, "a chat session outlived its request"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node is not installed")
async def test_openai_node_lists_models_and_streams_with_usage(gw: RunningGateway) -> None:
    result = await run_program("node", str(NODE_PROGRAM), "stream", f"{gw.http_url}/v1", KEY)
    assert result["models"] == ["local"]
    assert result["whole"] and result["whole_finish"] == "stop"
    assert result["text"] == result["whole"]  # the sim engine answers a prompt the same way
    assert result["finish"] == "stop"
    assert result["usage"]["completion_tokens"] == 12
    assert result["usage"]["total_tokens"] == (
        result["usage"]["prompt_tokens"] + result["usage"]["completion_tokens"]
    )


@pytest.mark.skipif(shutil.which("node") is None, reason="Node is not installed")
async def test_openai_node_runs_a_tool_loop(gw: RunningGateway) -> None:
    result = await run_program("node", str(NODE_PROGRAM), "tools", f"{gw.http_url}/v1", KEY)
    assert result["calls"] == ["get_weather"] and result["finish"] == "tool_calls"
    assert result["answer"] == TOOL_ANSWER_PREFIX + "Sunny, 21 degrees"


async def test_langchain_invokes_and_streams_with_usage(gw: RunningGateway) -> None:
    result = await run_sdk("langchain_chat.py", "stream", f"{gw.http_url}/v1", KEY, "local")
    assert result["invoke"] and result["invoke_finish"] == "stop"
    # The answer comes in pieces: the role chunk, its text in one or more chunks (a
    # gateway behind the engine's steps merges a step's tokens into one delta, losslessly)
    # and the usage chunk. How many text chunks depends on the machine's load, not on
    # LangChain: the count is not the check, the text and its usage are.
    assert result["chunks"] >= 3 and result["text"] and result["finish"] == "stop"
    assert result["usage"]["output_tokens"] == 12
    assert result["usage"]["total_tokens"] == (
        result["usage"]["input_tokens"] + result["usage"]["output_tokens"]
    )


async def test_langchain_bind_tools_round_trip(gw: RunningGateway) -> None:
    result = await run_sdk("langchain_chat.py", "tools", f"{gw.http_url}/v1", KEY, "local")
    assert [c["name"] for c in result["calls"]] == ["get_weather"]
    assert result["answer"] == TOOL_ANSWER_PREFIX + "Sunny, 21 degrees"
    assert result["streamed_calls"] == ["get_weather"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_streams_chunks_then_done(gw: RunningGateway) -> None:
    body = {
        "model": "local",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Hello"}],
    }
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-N", f"{gw.http_url}/v1/chat/completions",
        "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
        "-d", orjson.dumps(body).decode(),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await curl.communicate()
    assert curl.returncode == 0
    lines = out.decode().split("\n\n")
    assert lines[-2:] == ["data: [DONE]", ""]
    chunks = [orjson.loads(line.removeprefix("data: ")) for line in lines[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert {c["model"] for c in chunks} == {"local"}
    # Without the key: OpenAI's 401 error object.
    refused = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-w", "\n%{http_code}", f"{gw.http_url}/v1/chat/completions",
        "-H", "Content-Type: application/json", "-d", orjson.dumps(body).decode(),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await refused.communicate()
    text, status = out.decode().rsplit("\n", 1)
    assert status == "401" and orjson.loads(text)["error"]["code"] == "invalid_api_key"
