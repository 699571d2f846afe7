"""TLS on the gateway's own port (``--tls-cert``/``--tls-key``): the clients that only dial
``wss://`` (openai-node's ``OpenAIRealtimeWS`` and ``ResponsesWS``, a page served over
https) and the Python ones, each trusting a certificate made in the test; the command
line's one-line errors; a certificate replaced on SIGHUP; a plain-text client on the TLS
port; ``--tls-self-signed``."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from openai import AsyncOpenAI

from gateway.__main__ import main
from gateway.client import connect
from gateway.engines.sim import TOOL_ANSWER_PREFIX, SimEngine
from tests.support.harness import RawClient, running_gateway
from tests.support.tls_certs import Pki, make_pki
from tests.test_cli import gateway_process, read_until
from tests.test_sdk import SDK_PYTHON, run_program

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "tests" / "node"
needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="Node is not installed")
TLS_READY = (
    r"ready in [\d.]+ s: chat page (https://127\.0\.0\.1:(\d+)/) · "
    r"WebSocket wss://127\.0\.0\.1:\d+/v1/realtime"
)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "tls")


# --- openai-node: its clients dial wss:// whatever the base URL ---------------------------


@needs_node
@pytest.mark.parametrize("scenario", ["stream", "cancel", "tools"])
async def test_openai_node_realtime_client_over_tls(pki: Pki, scenario: str) -> None:
    assert (NODE_DIR / "node_modules" / "openai").exists(), "run `make test` (npm ci)"
    tokens = 4000 if scenario == "cancel" else 12
    engine = SimEngine(step_ms=2, response_tokens=tokens)
    async with running_gateway(engine, api_keys=("k",), tls=pki.files) as gw:
        result = await run_program(
            "node",
            str(NODE_DIR / "realtime_ws.mjs"),
            scenario,
            f"{gw.http_url}/v1",
            "k",
            env={"NODE_EXTRA_CA_CERTS": str(pki.ca)},
        )
    assert result["url"].startswith(gw.ws_url) and gw.ws_url.startswith("wss://")
    assert result["created"] == "session.created" and result["errors"] == []
    turns = result["turns"]
    if scenario == "stream":
        assert turns[0]["status"] == "completed"
        assert turns[0]["deltas"] == turns[0]["text"] != ""
    if scenario == "cancel":
        assert (turns[0]["status"], turns[0]["reason"]) == ("cancelled", "client_cancelled")
        assert len(turns[0]["deltas"]) < len(" ".join(["word"] * 100))  # stopped early
        # The next turn, cut by its own max_output_tokens: it streams whole after the cancel.
        assert (turns[1]["status"], turns[1]["reason"]) == ("incomplete", "max_output_tokens")
        assert turns[1]["deltas"] == turns[1]["text"] != ""
    if scenario == "tools":
        assert [c["name"] for c in turns[0]["calls"]] == ["get_weather"]
        assert turns[1]["text"] == TOOL_ANSWER_PREFIX + "Sunny"


@needs_node
@pytest.mark.parametrize("scenario", ["stream", "tools"])
async def test_openai_node_responses_client_over_tls(pki: Pki, scenario: str) -> None:
    engine = SimEngine(step_ms=1, response_tokens=12)
    async with running_gateway(engine, api_keys=("k",), tls=pki.files) as gw:
        result = await run_program(
            "node",
            str(NODE_DIR / "responses_ws.mjs"),
            scenario,
            f"{gw.http_url}/v1",
            "k",
            env={"NODE_EXTRA_CA_CERTS": str(pki.ca)},
        )
    assert result["errors"] == [], result
    for turn in result["turns"]:
        assert turn["status"] == "completed" and turn["deltas"] == turn["text"], result
    if scenario == "tools":
        assert result["turns"][1]["text"] == TOOL_ANSWER_PREFIX + "Sunny"


# --- Python: the SDKs and gateway.client -------------------------------------------------


async def test_openai_python_streams_a_response_over_https(pki: Pki) -> None:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=12), tls=pki.files) as gw:
        http = httpx.AsyncClient(verify=pki.client_context())
        client = AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="none", http_client=http)
        async with client:
            stream = await client.responses.create(model="sim", input="Hello!", stream=True)
            deltas, final = "", None
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas += event.delta
                if event.type == "response.completed":
                    final = event.response
    assert final is not None and final.output_text == deltas != ""


@pytest.mark.skipif(not SDK_PYTHON.exists(), reason="run `make test` (.venv-sdk)")
async def test_openai_python_realtime_client_over_wss(pki: Pki) -> None:
    engine = SimEngine(step_ms=5, response_tokens=24)
    async with running_gateway(engine, api_keys=("k",), tls=pki.files) as gw:
        out = await run_program(
            str(SDK_PYTHON),
            str(ROOT / "tests" / "sdk" / "realtime_client.py"),
            "multi_turn_and_cancel",
            f"{gw.http_url}/v1",  # https: the SDK dials wss://
            "k",
            env={"SSL_CERT_FILE": str(pki.ca)},
        )
    assert out["first"]["status"] == "completed" and out["first"]["deltas"] != ""
    assert out["cancelled"] == {"status": "cancelled", "reason": "client_cancelled"}


async def test_gateway_client_over_wss(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))  # what a user sets for a private authority
    async with running_gateway(SimEngine(step_ms=1, response_tokens=12), tls=pki.files) as gw:
        assert gw.ws_url.startswith("wss://")
        async with connect(gw.ws_url) as chat:
            first = await chat.ask("Hello!")
            second = await chat.ask("Again?")
    assert first.status == second.status == "completed" and first.text != ""


# --- the server: schemes, a wrong client, a new certificate ------------------------------


async def test_healthz_says_https_and_wss_and_when_the_certificate_ends(pki: Pki) -> None:
    async with (
        running_gateway(SimEngine(), tls=pki.files) as gw,
        httpx.AsyncClient(verify=pki.client_context()) as http,
    ):
        health = (await http.get(f"{gw.http_url}/healthz")).json()
    base = gw.http_url.removeprefix("https://")
    assert health["urls"]["page"] == f"https://{base}/"
    assert health["urls"]["realtime"] == f"wss://{base}/v1/realtime"
    assert health["urls"]["responses"] == f"wss://{base}/v1/responses"
    assert health["tls"]["names"] == ["localhost", "127.0.0.1"]
    cert = x509.load_pem_x509_certificate(pki.files.cert.read_bytes())
    assert health["tls"]["not_after"] == cert.not_valid_after_utc.isoformat()


async def test_a_plain_text_client_on_the_tls_port_is_closed_and_tls_goes_on(pki: Pki) -> None:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=4), tls=pki.files) as gw:
        port = gw.gateway.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(5):  # closed at once, not left hanging
            assert await reader.read() == b""
        writer.close()
        with pytest.raises(httpx.HTTPError):
            async with httpx.AsyncClient() as plain:
                await plain.get(f"http://127.0.0.1:{port}/healthz")
        # TLS clients are served as before.
        async with RawClient.connect(gw.ws_url, ssl=pki.client_context()) as client:
            await client.say("Still here?")
            turn = await client.respond()
        assert turn.status == "completed"


def served_certificate(port: int, pki: Pki) -> int:
    """The serial number of the certificate a new connection is shown."""
    with ssl.create_connection(("127.0.0.1", port), timeout=10) as raw:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # we only read which certificate it is
        with context.wrap_socket(raw, server_hostname="localhost") as tls_socket:
            der = tls_socket.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_loads_a_new_certificate_for_new_connections(tmp_path: Path, workers: int) -> None:
    first = make_pki(tmp_path)
    argv = ["--engine", "sim", "--tls-cert", str(first.files.cert), "--tls-key"]
    argv += [str(first.files.key), "--workers", str(workers)]
    with gateway_process(*argv) as proc:
        for _ in range(workers):
            _, ready = read_until(proc, TLS_READY)
        port = int(ready.group(2))
        assert served_certificate(port, first) == first.serial
        second = make_pki(tmp_path / "new")
        # A deployment's rotation: the new files where the old ones were, then SIGHUP.
        first.files.cert.write_bytes(second.files.cert.read_bytes())
        first.files.key.write_bytes(second.files.key.read_bytes())
        proc.send_signal(signal.SIGHUP)
        for _ in range(workers):
            read_until(proc, r"SIGHUP: TLS certificate reloaded")
        # Each new connection, on whichever worker, gets the new one.
        assert {served_certificate(port, second) for _ in range(8)} == {second.serial}
        # A broken file on the next SIGHUP: the server keeps the certificate it has.
        first.files.key.write_text("not a key")
        proc.send_signal(signal.SIGHUP)
        for _ in range(workers):
            read_until(proc, r"SIGHUP: kept the old TLS certificate: --tls-key .*not a PEM")
        assert served_certificate(port, second) == second.serial


# --- the command line ------------------------------------------------------------------


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["--engine", "sim", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llm-gateway: "), err
    return err.strip()


def test_a_missing_or_wrong_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_pki(tmp_path / "a")
    other = make_pki(tmp_path / "b")
    cert, key = str(good.files.cert), str(good.files.key)
    missing = str(tmp_path / "missing.pem")
    assert one_line_error(["--tls-cert", missing, "--tls-key", key], capsys).endswith(
        f"--tls-cert {missing}: no such file"
    )
    assert "--tls-cert and --tls-key go together" in one_line_error(["--tls-cert", cert], capsys)
    mismatched = ["--tls-cert", cert, "--tls-key", str(other.files.key)]
    assert "is not the key of --tls-cert" in one_line_error(mismatched, capsys)
    swapped = ["--tls-cert", key, "--tls-key", cert]
    assert f"--tls-cert {key}: not a PEM certificate" in one_line_error(swapped, capsys)
    both = ["--tls-self-signed", str(tmp_path), "--tls-cert", cert, "--tls-key", key]
    assert "--tls-self-signed makes its own certificate" in one_line_error(both, capsys)


def test_an_encrypted_key_needs_its_password_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pki = make_pki(tmp_path, password=b"s3cret")
    assert pki.files.password_file is not None
    base = ["--tls-cert", str(pki.files.cert), "--tls-key", str(pki.files.key)]
    assert "is encrypted: give --tls-key-password-file" in one_line_error(base, capsys)
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("nope\n")
    err = one_line_error([*base, "--tls-key-password-file", str(wrong)], capsys)
    assert err.endswith(f"--tls-key-password-file {wrong}: not the key's password")
    with gateway_process(
        "--engine", "sim", *base, "--tls-key-password-file", str(pki.files.password_file)
    ) as proc:
        _, ready = read_until(proc, TLS_READY)
        assert served_certificate(int(ready.group(2)), pki) == pki.serial


def test_tls_self_signed_makes_a_localhost_certificate_once(tmp_path: Path) -> None:
    folder = tmp_path / "dev-tls"
    with gateway_process("--engine", "sim", "--tls-self-signed", str(folder)) as proc:
        lines, ready = read_until(proc, TLS_READY)
        port = int(ready.group(2))
        assert any(f"at {folder / 'cert.pem'}" in line for line in lines), lines
        context = ssl.create_default_context(cafile=str(folder / "cert.pem"))
        for host in ("127.0.0.1", "localhost"):
            with httpx.Client(verify=context) as http:
                assert http.get(f"https://{host}:{port}/readyz").status_code == 200
    made = (folder / "cert.pem").read_bytes()
    assert (folder / "key.pem").stat().st_mode & 0o077 == 0  # the key is this user's only
    with gateway_process("--engine", "sim", "--tls-self-signed", str(folder)) as proc:
        read_until(proc, TLS_READY)
    assert (folder / "cert.pem").read_bytes() == made  # kept: trusted once, good next time


# --- the chat page over https ------------------------------------------------------------


@pytest.fixture
async def trusting_browser(pki: Pki) -> AsyncIterator[Any]:
    """Chromium that trusts exactly the test's certificate (by its public key)."""
    from playwright.async_api import async_playwright

    from tests.test_browser import _chromium_or_skip

    args = [f"--ignore-certificate-errors-spki-list={pki.spki_sha256}"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=_chromium_or_skip(), headless=True, args=args
        )
        try:
            yield browser
        finally:
            await browser.close()


async def test_the_chat_page_over_https_talks_over_wss(pki: Pki, trusting_browser: Any) -> None:
    from playwright.async_api import expect

    from tests.test_browser import Socket, answer, chat_page, send, status, wait_connected

    sockets: list[Socket] = []
    engine = SimEngine(step_ms=5, response_tokens=20)
    async with (
        running_gateway(engine, tls=pki.files) as gw,
        chat_page(trusting_browser, gw.http_url, sockets) as page,
    ):
        assert page.url.startswith("https://")
        await wait_connected(page)
        await send(page, "Hello over https!")
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        assert (await answer(page, 0).text_content() or "").strip() != ""
    assert [s.url.split("?")[0] for s in sockets] == [gw.ws_url]
    assert re.match(r"wss://", sockets[0].url)
