"""API keys from flags, a file or the environment, and the client secrets they mint (issue 16)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AuthenticationError, BadRequestError
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as sync_connect

from gateway import tenants
from gateway.api import auth
from gateway.engines.sim import SimEngine
from tests.support.harness import RawClient, RunningGateway, running_gateway
from tests.test_workers import free_port, wait_until_serving

SECRETS = "/v1/realtime/client_secrets"


def subprotocol(credential: str) -> dict[str, Any]:
    return {"subprotocols": ["realtime", f"openai-insecure-api-key.{credential}"]}


# -- keys ---------------------------------------------------------------------


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nfile-key-1\n\n  file-key-2  \nflag-key\n")
    keys = auth.read_api_keys(["flag-key"], str(key_file), {auth.ENV_VAR: "env-key-1, env-key-2"})
    assert [k.key for k in keys] == [
        "flag-key",
        "file-key-1",
        "file-key-2",
        "env-key-1",
        "env-key-2",
    ]
    assert auth.read_api_keys([], None, {}) == ()


def test_a_key_file_line_names_its_tenant_and_limits_and_may_hold_only_a_hash(
    tmp_path: Path,
) -> None:
    digest = hashlib.sha256(b"bobs-key").hexdigest()
    key_file = tmp_path / "keys"
    key_file.write_text(
        "alices-key name=alice max_sessions=2 requests_per_minute=60 weight=3\n"
        f"sha256:{digest} name=bob tokens_per_minute=1000 max_running=1\n"
        "carols-key\n"
    )
    alice, bob, carol = auth.read_key_file(str(key_file))
    assert (alice.tenant, alice.limits.max_sessions, alice.limits.weight) == ("alice", 2, 3)
    assert alice.limits.requests_per_minute == 60 and alice.key == "alices-key"
    assert (bob.tenant, bob.key, bob.limits.tokens_per_minute) == ("bob", None, 1000)
    assert carol.tenant.startswith("key-") and "carols-key" not in carol.tenant
    assert carol.limits == tenants.NO_LIMITS
    credentials = auth.Credentials([alice, bob, carol])
    assert credentials.tenant_of("bobs-key") == "bob"  # by its hash alone
    assert credentials.tenant_of("alices-key") == "alice"
    assert credentials.tenant_of(credentials.mint(bob).value) == "bob"
    assert credentials.limits["bob"].max_running == 1


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("k max_sessions=two", "max_sessions= takes a whole number"),
        ("k weight=0", "weight"),
        ("k colour=blue", "unknown field 'colour'"),
        ("k name", "is not word=VALUE"),
        ("sha256:abc", "64 hex digits"),
        ("k name=a/b", "name= takes"),
    ],
)
def test_a_malformed_key_file_line_is_one_error_naming_the_line(
    tmp_path: Path, line: str, complaint: str
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# keys\ngood-key\n{line}\n")
    with pytest.raises(auth.KeyConfigError, match="line 3: .*" + complaint):
        auth.read_key_file(str(key_file))


@pytest.mark.parametrize(
    ("flags", "content", "env", "complaint"),
    [
        ([], None, {auth.ENV_VAR: "has space"}, auth.ENV_VAR),
        (["ké"], None, {}, "--api-key"),
        (["ek_abc"], None, {}, "must not start with"),
        ([], "", {}, "no key in it"),
        ([], "missing", {}, "No such file"),
    ],
)
def test_a_key_that_cannot_work_is_refused_with_its_source(
    tmp_path: Path, flags: list[str], content: str | None, env: dict[str, str], complaint: str
) -> None:
    key_file = tmp_path / "keys"
    if content not in (None, "missing"):
        key_file.write_text(content)
    path = str(key_file) if content is not None else None
    with pytest.raises(auth.KeyConfigError, match=complaint):
        auth.read_api_keys(flags, path, env)


# -- secrets ---------------------------------------------------------------------


def test_a_secret_opens_sessions_until_it_expires_and_cannot_be_forged() -> None:
    now = [1_000_000.0]
    credentials = auth.Credentials(["old-key", "new-key"], clock=lambda: now[0])
    old, new = credentials.entries
    secret = credentials.mint(old, 60)
    assert secret.value.startswith("ek_") and secret.expires_at == 1_000_060
    assert credentials.admits(secret.value) and credentials.admits("new-key")
    assert not credentials.admits("wrong-key") and not credentials.admits("ek_")
    forged = secret.value[:-4] + ("AAAA" if not secret.value.endswith("AAAA") else "BBBB")
    assert not credentials.admits(forged)
    assert credentials.mint(new, 7200).expires_at == 1_000_600  # capped: max 600 s
    now[0] += 60
    assert not credentials.admits(secret.value)  # expired


def test_every_worker_with_the_same_keys_accepts_a_secret_and_a_removed_key_revokes() -> None:
    signer = auth.Credentials(["k1", "k2"])
    minted = signer.mint(signer.entries[0])
    assert auth.Credentials(["k2", "k1"]).admits(minted.value)  # another worker
    assert not auth.Credentials(["k2"]).admits(minted.value)  # k1 rotated out
    assert not auth.Credentials(["k1-other"]).admits(minted.value)


def test_a_hash_lines_secrets_cannot_be_minted_by_whoever_reads_the_key_file() -> None:
    """A ``sha256:`` line's client secrets are signed with a key the gateway holds: what
    the file says (the hash) is not enough to forge one."""
    digest = hashlib.sha256(b"bobs-key").digest()
    bob = tenants.KeyEntry(digest, "bob")
    credentials = auth.Credentials([bob])
    assert credentials.tenant_of(credentials.mint(bob).value) == "bob"
    # Every signing key a reader of the file could derive from the line: the hash as hex
    # (what gateways derived theirs from), and as raw bytes.
    for known in (digest.hex().encode(), digest):
        signing = hashlib.pbkdf2_hmac("sha256", known, b"llm-gateway client secrets v1", 100_000)
        key_id = hashlib.sha256(b"key id" + signing).digest()[:4]
        payload = struct.pack(">B4sI8s", 1, key_id, int(time.time()) + 600, b"\0" * 8)
        mac = hmac.digest(signing, payload, "sha256")[:16]
        forged = "ek_" + base64.urlsafe_b64encode(payload + mac).decode().rstrip("=")
        assert credentials.tenant_of(forged) is None
    # Gateways given one --client-secret-key accept each other's; another does not.
    shared = b"k" * 32
    one = auth.Credentials([bob], client_secret_key=shared)
    minted = one.mint(bob).value
    assert auth.Credentials([bob], client_secret_key=shared).tenant_of(minted) == "bob"
    assert auth.Credentials([bob], client_secret_key=b"x" * 32).tenant_of(minted) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"[]", None),
        (b"{", None),
        (b'{"expires_after": {"anchor": "created_at", "seconds": 5}}', "expires_after.seconds"),
        (b'{"expires_after": {"anchor": "now", "seconds": 60}}', "expires_after.anchor"),
        (b'{"expires_after": 60}', "expires_after"),
        (b'{"session": {"type": "realtime", "instructions": "Be evil."}}', "session.instructions"),
        (b'{"session": {"type": "transcription"}}', "session.type"),
        (b'{"other": 1}', "other"),
    ],
)
def test_a_mint_request_is_validated_like_the_hosted_api(body: bytes, param: str | None) -> None:
    with pytest.raises(auth.SecretRequestError) as refused:
        auth.parse_secret_request(body)
    assert refused.value.param == param


def test_a_mint_request_names_the_lifetime_or_takes_the_default() -> None:
    assert auth.parse_secret_request(b"") is None
    assert auth.parse_secret_request(b'{"session": {"type": "realtime", "model": "m"}}') is None
    body = b'{"expires_after": {"anchor": "created_at", "seconds": 120}}'
    assert auth.parse_secret_request(body) == 120


# -- the endpoint, over real HTTP ---------------------------------------------------


async def mint(gw: RunningGateway, key: str | None, body: Any = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with httpx.AsyncClient(base_url=gw.http_url) as http:
        return await http.post(SECRETS, headers=headers, json=body)


async def test_an_api_key_mints_a_secret_that_opens_sessions_and_nothing_else() -> None:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=4), api_keys=("sk-1",)) as gw:
        answer = await mint(gw, "sk-1", {"expires_after": {"anchor": "created_at", "seconds": 60}})
        assert answer.status_code == 200, answer.text
        created = answer.json()
        assert created["value"].startswith("ek_")
        assert 55 <= created["expires_at"] - time.time() <= 61
        assert created["session"]["type"] == "realtime"
        secret = created["value"]

        async with RawClient.connect(gw.ws_url, **subprotocol(secret)) as c:  # as a browser
            assert (await c.respond()).status == "completed"
        bearer = {"additional_headers": {"Authorization": f"Bearer {secret}"}}
        async with RawClient.connect(gw.ws_url, **bearer) as c:
            assert c.events[0]["type"] == "session.created"

        refused = await mint(gw, secret)  # a secret mints nothing
        assert refused.status_code == 401
        assert "cannot mint" in refused.json()["error"]["message"]
        assert (await mint(gw, None)).status_code == 401
        assert (await mint(gw, "sk-wrong")).status_code == 401
        bad = await mint(gw, "sk-1", {"expires_after": {"seconds": 1}})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "expires_after.seconds"
        async with httpx.AsyncClient(base_url=gw.http_url) as http:
            assert (await http.get(SECRETS)).status_code == 405


async def test_an_expired_or_forged_secret_gets_401() -> None:
    async with running_gateway(SimEngine(step_ms=0), api_keys=("sk-1",)) as gw:
        secret = (await mint(gw, "sk-1")).json()["value"]
        for credential in (secret[:-3] + "abc", "ek_nonsense", secret + "x"):
            with pytest.raises(InvalidStatus) as refused:
                await RawClient.connect(gw.ws_url, **subprotocol(credential)).__aenter__()
            assert refused.value.response.status_code == 401
        later = auth.Credentials(("sk-1",), clock=lambda: time.time() + 601)
        gw.gateway.admission.credentials = later  # the clock of a gateway ten minutes on
        with pytest.raises(InvalidStatus) as refused:
            await RawClient.connect(gw.ws_url, **subprotocol(secret)).__aenter__()
        assert refused.value.response.status_code == 401


async def test_the_openai_sdk_mints_a_secret_and_connects_with_it() -> None:
    async with running_gateway(SimEngine(step_ms=1, response_tokens=6), api_keys=("sk-1",)) as gw:
        backend = gw.openai("sk-1")
        created = await backend.realtime.client_secrets.create(
            expires_after={"anchor": "created_at", "seconds": 120},
            session={"type": "realtime", "model": "sim"},
        )
        assert created.value.startswith("ek_") and created.session.type == "realtime"
        with pytest.raises(BadRequestError):
            await backend.realtime.client_secrets.create(
                session={"type": "realtime", "instructions": "x"}
            )

        browser = gw.openai(created.value)
        async with browser.realtime.connect(model="sim") as conn:
            await conn.response.create()
            async for event in conn:
                if event.type == "response.done":
                    assert event.response.status == "completed"
                    break
        with pytest.raises(AuthenticationError):
            await browser.realtime.client_secrets.create()


# -- the command line ---------------------------------------------------------------


def test_a_bad_key_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--engine", "sim", "--api-key-file", missing],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--api-key-file" in done.stderr


def test_workers_keyed_from_the_environment_accept_each_others_secrets(tmp_path: Path) -> None:
    """And those of a key file's ``sha256:`` line, signed with the key the parent made."""
    port = free_port()
    base = f"127.0.0.1:{port}"
    env = {**os.environ, auth.ENV_VAR: "sk-env"}
    keys = tmp_path / "keys"
    keys.write_text(f"sha256:{hashlib.sha256(b'sk-file').hexdigest()}\n")
    argv = [sys.executable, "-m", "gateway", "--engine", "sim", "--workers", "2"]
    process = subprocess.Popen(
        [*argv, "--port", str(port), "--api-key-file", str(keys)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait_until_serving(process, base)
        with pytest.raises(InvalidStatus) as refused, sync_connect(f"ws://{base}/v1/realtime"):
            pass
        assert refused.value.response.status_code == 401
        # Each request on a new connection: the kernel spreads them over both workers, so
        # among 12 secrets used on 12 connections, some are minted by one and used on the other.
        for i in range(12):
            key = ("sk-env", "sk-file")[i % 2]
            answer = httpx.post(
                f"http://{base}{SECRETS}", headers={"Authorization": f"Bearer {key}"}
            )
            secret = answer.json()["value"]
            with sync_connect(f"ws://{base}/v1/realtime", **subprotocol(secret)) as ws:
                assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
        assert process.stderr is not None
        process.stderr.close()


async def test_no_key_configured_means_open_and_minting_still_works() -> None:
    async with running_gateway(SimEngine(step_ms=0)) as gw:
        answer = await mint(gw, None)
        assert answer.status_code == 200
        async with RawClient.connect(gw.ws_url, **subprotocol(answer.json()["value"])):
            pass


async def test_the_backend_in_docs_browser_md_mints_secrets_that_open_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = (Path(__file__).parent.parent / "docs" / "browser.md").read_text()
    section = text.split("## Client secrets", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv(auth.ENV_VAR, "sk-docs")
    async with running_gateway(SimEngine(step_ms=0), api_keys=("sk-docs",)) as gw:
        namespace: dict[str, Any] = {"__name__": "backend"}
        exec(snippet.replace("http://127.0.0.1:8765", gw.http_url), namespace)
        backend = ThreadingHTTPServer(("127.0.0.1", 0), namespace["Backend"])
        threading.Thread(target=backend.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{backend.server_port}/app/realtime-secret"
            async with httpx.AsyncClient() as http:
                answer = (await http.post(url)).json()
        finally:
            backend.shutdown()
            backend.server_close()
        assert set(answer) == {"value", "expires_at"}
        async with RawClient.connect(gw.ws_url, **subprotocol(answer["value"])) as c:
            assert c.events[0]["type"] == "session.created"
