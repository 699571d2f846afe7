"""Every Python block of README.md runs as a newcomer runs it: pasted into a file, run with python.

The blocks talk to ``127.0.0.1:8765``, where ``make run`` serves; here that address is
rewritten to a gateway on the simulated engine (started as ``make run ARGS="--engine sim"``
would, on a free port), so the blocks run as printed, against a real gateway process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
ADDRESS = "127.0.0.1:8765"  # what make run serves, and what the blocks use
TIMEOUT = 60.0


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block."""
    text = README.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 2, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)
    ]


BLOCKS = python_blocks()


@contextmanager
def gateway(*flags: str) -> Iterator[list[str]]:
    """A gateway process on the sim engine; its stderr lines up to its ready line."""
    command = [sys.executable, "-m", "gateway", "--engine", "sim", "--port", "0", *flags]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    try:
        lines: list[str] = []
        while not lines or " ready in " not in lines[-1]:
            line = proc.stderr.readline()
            assert line, f"the gateway exited with {proc.wait()} before its ready line: {lines}"
            lines.append(line)
        yield lines
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)
        proc.stderr.close()


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """``host:port`` of a gateway process on the sim engine: answers long enough to cancel."""
    with gateway("--sim-step-ms", "2", "--sim-response-tokens", "200") as lines:
        found = re.search(r"chat page http://(127\.0\.0\.1:\d+)/", lines[-1])
        assert found, lines[-1]
        yield found.group(1)


def ran(line: int, command: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """What a README block printed, run as a newcomer runs it; it must succeed, print, and
    end its last line."""
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, f"README.md:{line} failed:\n{done.stderr}"
    assert done.stdout.strip(), f"README.md:{line} printed nothing"
    assert done.stdout.endswith("\n"), f"README.md:{line}: the last line is left open"
    return done.stdout


def test_readme_has_the_blocks_this_test_runs() -> None:
    assert len(BLOCKS) >= 2
    assert all(ADDRESS in code for _, code in BLOCKS), "a block talks to another address"


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_block_runs_as_a_file(line: int, code: str, address: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code.replace(ADDRESS, address), encoding="utf-8")
    stdout = ran(line, [sys.executable, str(script)], tmp_path)
    if "stream.cancel()" in code:
        # The cancel it shows happens, and the answer says so.
        assert "\ncancelled " in stdout, stdout


def curl_blocks() -> list[tuple[int, str]]:
    """(line number, command) of each ```sh block that is a curl command."""
    text = README.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 2, m.group(1))
        for m in re.finditer(r"^```sh\n(curl .*?)^```$", text, re.DOTALL | re.MULTILINE)
    ]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize(
    ("line", "command"), curl_blocks(), ids=[f"README.md:{n}" for n, _ in curl_blocks()]
)
def test_curl_block_streams_a_whole_answer(line: int, command: str, address: str) -> None:
    assert ADDRESS in command
    done = subprocess.run(
        ["bash", "-c", command.replace(ADDRESS, address)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, f"README.md:{line} failed:\n{done.stderr}"
    if "/v1/chat/completions" in command:
        assert '"object":"chat.completion.chunk"' in done.stdout
        assert '"finish_reason":"stop"' in done.stdout or '"finish_reason":"length"' in done.stdout
        assert done.stdout.rstrip().endswith("data: [DONE]")
        return
    assert "event: response.output_text.delta" in done.stdout
    assert "event: response.completed" in done.stdout or "event: response.incomplete" in done.stdout


def test_readme_has_a_curl_block() -> None:
    assert curl_blocks()


# --- the JavaScript block: openai-node over the gateway's own TLS ---------------------------

NODE_MODULES = Path(__file__).resolve().parent / "node" / "node_modules"


def js_blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```js block."""
    text = README.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 2, m.group(1))
        for m in re.finditer(r"^```js\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)
    ]


@pytest.fixture(scope="module")
def tls_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``host:port`` of a gateway started as ``make run ARGS="--tls-self-signed"`` would
    be (on the sim engine), and the certificate it printed."""
    with gateway("--tls-self-signed", str(tmp_path_factory.mktemp("tls"))) as lines:
        printed = [m for line in lines if (m := re.search(r"self-signed .* at (\S+) ", line))]
        assert printed, f"the certificate's path was not printed: {lines}"
        found = re.search(r"chat page https://(127\.0\.0\.1:\d+)/", lines[-1])
        assert found, lines[-1]
        yield found.group(1), Path(printed[0].group(1))


def test_readme_has_a_javascript_block() -> None:
    assert [code for _, code in js_blocks() if "OpenAIRealtimeWS" in code]


@pytest.mark.skipif(shutil.which("node") is None, reason="Node is not installed")
@pytest.mark.parametrize(
    ("line", "code"), js_blocks(), ids=[f"README.md:{n}" for n, _ in js_blocks()]
)
def test_js_block_runs_as_pasted(
    line: int, code: str, tls_gateway: tuple[str, Path], tmp_path: Path
) -> None:
    assert NODE_MODULES.exists(), "run `make test` (npm ci in tests/node)"
    address, cert = tls_gateway
    assert ADDRESS in code
    (tmp_path / "node_modules").symlink_to(NODE_MODULES)  # the README's `npm install openai ws`
    script = tmp_path / "chat.mjs"
    script.write_text(code.replace(ADDRESS, address), encoding="utf-8")
    ran(line, ["node", str(script)], tmp_path, {**os.environ, "NODE_EXTRA_CA_CERTS": str(cert)})
