"""Completions from clients a user already has, unmodified: LlamaIndex's ``OpenAILike`` with
its defaults, LiteLLM's ``text_completion``, the ``llm`` CLI with a ``completion: true``
model, and curl. The Python clients need openai<3, so they run in an environment of their
own (``.venv-clients``, from tests/clients/requirements.txt), driven as subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.engines.sim import SimEngine
from tests.support.harness import RunningGateway, running_gateway
from tests.test_chat_completions import sse_chunks
from tests.test_sdk import run_program

ROOT = Path(__file__).resolve().parent.parent
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
PROGRAM = ROOT / "tests" / "clients" / "completion_clients.py"
KEY, MODEL = "key-completions", "local"

needs_clients = pytest.mark.skipif(
    not CLIENTS_PYTHON.exists(), reason="no .venv-clients: run `make install` first"
)


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    engine = SimEngine(step_ms=1, response_tokens=12)
    async with running_gateway(engine, api_keys=(KEY,), served_model_names=(MODEL,)) as running:
        yield running
        await running.wait_idle()
        assert not running.gateway.sessions, "a completions session outlived its request"


# LiteLLM fetches a model price list from the internet as it is imported, unless told not to.
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}


async def clients(scenario: str, gw: RunningGateway) -> dict[str, object]:
    return await run_program(
        str(CLIENTS_PYTHON), str(PROGRAM), scenario, f"{gw.http_url}/v1", KEY, MODEL, env=OFFLINE
    )


@pytest.fixture
def once(selected_loop: str) -> None:
    """The client programs take seconds each just to import (LiteLLM about five), and what
    they send is the same bytes whichever loop serves them: they run on uvloop's pass
    alone; the route itself is tested on both loops (tests/test_completions.py)."""
    if selected_loop != "uvloop":
        pytest.skip("the completion clients run on the uvloop pass only")


@needs_clients
@pytest.mark.usefixtures("once")
async def test_llamaindex_openailike_completes_and_chats_through_completions(
    gw: RunningGateway,
) -> None:
    result = await clients("llamaindex", gw)
    assert result["is_chat_model"] is False  # its default: /v1/completions for both
    assert result["complete"] and result["stream"] == result["complete"]
    assert isinstance(result["chunks"], int) and result["chunks"] > 1
    assert result["chat"] and result["chat_role"] == "assistant"


@needs_clients
@pytest.mark.usefixtures("once")
async def test_litellm_text_completion_whole_and_streamed(gw: RunningGateway) -> None:
    result = await clients("litellm", gw)
    assert result["text"] and result["stream"] == result["text"]
    assert result["finish"] == "length"  # max_tokens 8 of a 12-token answer
    usage = result["usage"]
    assert isinstance(usage, dict) and usage["completion_tokens"] == 8


@needs_clients
@pytest.mark.usefixtures("once")
async def test_the_llm_cli_with_a_completion_model(gw: RunningGateway, tmp_path: Path) -> None:
    models = [
        {
            "model_id": "gateway",
            "model_name": MODEL,
            "api_base": f"{gw.http_url}/v1",
            "api_key_name": "gateway",
            "completion": True,
        }
    ]
    (tmp_path / "extra-openai-models.yaml").write_text(json.dumps(models))  # YAML is JSON's
    (tmp_path / "keys.json").write_text(json.dumps({"gateway": KEY}))
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path)}
    llm = str(CLIENTS_PYTHON.parent / "llm")
    proc = await asyncio.create_subprocess_exec(
        llm, "-m", "gateway", "-o", "max_tokens", "8", "The capital of France is",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    # What it printed is the answer's first 8 tokens, streamed: the sim's answer to that
    # prompt, as the route gives it.
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as http:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
        reply = await http.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        )
    assert out.decode().strip() == reply.json()["choices"][0]["text"].strip()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_streams_completion_chunks_then_done(gw: RunningGateway) -> None:
    body = {"model": MODEL, "prompt": ["Hello", "Bye"], "n": 2, "max_tokens": 4, "stream": True}
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-N", f"{gw.http_url}/v1/completions",
        "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
        "-d", orjson.dumps(body).decode(),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await curl.communicate()
    assert curl.returncode == 0
    chunks = sse_chunks(out.decode())
    assert {c["object"] for c in chunks} == {"text_completion"}
    ends = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(ends) == [0, 1, 2, 3]
