"""A hostile or unlucky world against a gateway process on the sim engine.

    python -m bench.adversarial [--quick] [--only NAME ...]

Each scenario starts a fresh ``python -m gateway --engine sim`` process of its own,
does what a bad client (or a bad day) does, and prints what it saw:

- ``fuzz``: malformed events (valid ones mutated at random, broken JSON, binary
  frames) on a few sessions. Every frame must get at most one ``error`` event, never
  ``internal_error``, and the session must keep answering.
- ``frames``: WebSocket frame violations over raw sockets (unmasked, reserved bits
  and opcodes, bad control frames, invalid UTF-8, a bad close code, an oversized
  message): the close code each gets (RFC 6455: 1002, 1007, 1009).
- ``handshakes``: malformed HTTP requests and credential headers: statuses; never 500.
- ``chaos``: sessions that create items, start in-conversation and out-of-band
  responses, cancel and drop at random. Invariants: every accepted ``response.create``
  ends in one ``response.done``, a refused one in one ``error``; nothing of a response
  after its ``response.done``; its deltas joined equal its final text.
- ``stuck``: clients that send ``response.create`` and never read: how many the
  gateway closes, how soon, and with which close code (``--stall-timeout 3``).
- ``halfopen``: TCP connections that send nothing, more than the default file limit:
  how long a new client then takes to get its ``session.created``.
- ``shutdown``: SIGTERM with streaming sessions and idle TCP connections open: time
  to exit.
- ``churn``: the gateway's resident memory over rounds of sessions coming and going.

Everything stays on the loopback interface and every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench.loadgen import raise_nofile
from bench.procs import free_port, rss_bytes, stop

MIB = 1 << 20
SIM = ["--engine", "sim", "--log-level", "WARNING"]


# -- the gateway process -------------------------------------------------------------


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as r:
            result: dict[str, Any] = json.loads(r.read())
            return result


def _default_file_limit() -> None:
    """The gateway starts as from a login shell (soft limit 1024), not with this
    process's raised limit: raising its own is part of what is measured."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))


@contextlib.contextmanager
def gateway(*flags: str) -> Iterator[Gateway]:
    port = free_port()
    argv = [sys.executable, "-m", "gateway", *SIM, "--port", str(port), *flags]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_default_file_limit
    )
    g = Gateway(proc, port)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not start") from None
                time.sleep(0.05)
        yield g
    finally:
        stop(proc)
        assert proc.stderr is not None
        errors = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
        tracebacks = errors.count("Traceback")
        if tracebacks:
            print(f"  !! the gateway logged {tracebacks} tracebacks:\n{errors[-3000:]}")
        noted = [line for line in errors.splitlines() if " WARNING " in line or " ERROR " in line]
        if noted:
            print(f"  the gateway logged {len(noted)} warnings or errors, first: {noted[0]}")


def report(name: str, **figures: Any) -> None:
    print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)


# -- fuzz ----------------------------------------------------------------------------------

VALID: list[dict[str, Any]] = [
    {"type": "session.update", "session": {"type": "realtime", "instructions": "Hi."}},
    {"type": "session.update", "session": {"temperature": 0.5, "max_output_tokens": 8}},
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "x"}],
        },
    },
    {"type": "conversation.item.delete", "item_id": "item_1"},
    {"type": "conversation.item.retrieve", "item_id": "item_1"},
    {"type": "response.create", "response": {"max_output_tokens": 4}},
    {"type": "response.create", "response": {"conversation": "none", "input": []}},
    {"type": "response.cancel"},
]
ODD_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    2**70,
    1e308,
    "",
    "x" * 5000,
    "\ud7ff\u0000",
    [],
    [None],
    {},
    {"a": {}},
    "inf",
    -0.0,
    [[[[[]]]]],
    "realtime",
]


def mutate(rng: random.Random) -> str | bytes:
    """One malformed frame: a valid event changed at random, or something worse."""
    kind = rng.random()
    if kind < 0.05:
        return rng.randbytes(rng.randint(1, 64))  # a binary frame
    if kind < 0.12:
        text = json.dumps(rng.choice(VALID))
        return text[: rng.randint(0, len(text) - 1)]  # broken JSON
    if kind < 0.15:
        return json.dumps(rng.choice(ODD_VALUES))  # JSON, but not an object
    event = json.loads(json.dumps(rng.choice(VALID)))
    target, path = event, []
    while isinstance(target, dict) and target and rng.random() < 0.6:
        key = rng.choice(list(target))
        if not isinstance(target[key], dict | list) or not target[key]:
            break
        path.append(key)
        target = target[key] if isinstance(target[key], dict) else target[key][0]
    if isinstance(target, dict):
        action = rng.random()
        if action < 0.3 and target:
            del target[rng.choice(list(target))]
        elif action < 0.5:
            target[rng.choice(["bogus", "audio", "tools", "voice", "event_id"])] = rng.choice(
                ODD_VALUES
            )
        else:
            key = rng.choice(list(target) or ["type"])
            target[key] = rng.choice(ODD_VALUES)
    return json.dumps(event)


async def _probe(ws: ClientConnection, n: int) -> list[dict[str, Any]]:
    """Events until the error that answers probe ``n`` (a retrieve of a missing item),
    and until every response that started meanwhile is done."""
    await ws.send(
        json.dumps(
            {"type": "conversation.item.retrieve", "item_id": "none", "event_id": f"probe{n}"}
        )
    )
    events, open_responses, probed = [], set(), False
    while not probed or open_responses:
        async with asyncio.timeout(10):
            event = json.loads(await ws.recv())
        events.append(event)
        if event["type"] == "response.created":
            open_responses.add(event["response"]["id"])
        elif event["type"] == "response.done":
            open_responses.discard(event["response"]["id"])
        elif event["type"] == "error" and event["error"].get("event_id") == f"probe{n}":
            probed = True
    return events


async def fuzz(frames: int, sessions: int) -> None:
    rng = random.Random(16)
    tally: Counter[str] = Counter()
    with gateway("--sim-step-ms", "1", "--sim-response-tokens", "4") as g:

        async def one(share: int, seed: int) -> None:
            r = random.Random(seed)
            async with connect(g.url, max_size=None) as ws:
                await ws.recv()  # session.created
                for n in range(share):
                    frame = mutate(r)
                    await ws.send(frame)
                    events = await _probe(ws, n)
                    errors = [e for e in events if e["type"] == "error"][:-1]  # not the probe's
                    tally["frames"] += 1
                    tally[
                        "answered with one error" if len(errors) == 1 else f"{len(errors)} errors"
                    ] += 1
                    tally["internal_error"] += sum(
                        e["error"]["code"] == "internal_error" for e in errors
                    )

        share = frames // sessions
        started = time.perf_counter()
        await asyncio.gather(*(one(share, rng.randrange(1 << 30)) for _ in range(sessions)))
        alive = g.health()["status"] == "ok"
    report(
        "fuzz",
        frames=tally.pop("frames"),
        outcome=dict(tally),
        sessions_alive=sessions,
        server_alive=alive,
        seconds=round(time.perf_counter() - started, 1),
    )


# -- frames --------------------------------------------------------------------------------


def _frame(
    opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True, rsv: int = 0
) -> bytes:
    head = bytes([(0x80 if fin else 0) | rsv | opcode])
    length = len(payload)
    mask_bit = 0x80 if mask else 0
    if length < 126:
        head += bytes([mask_bit | length])
    elif length < 1 << 16:
        head += bytes([mask_bit | 126]) + struct.pack(">H", length)
    else:
        head += bytes([mask_bit | 127]) + struct.pack(">Q", length)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


VIOLATIONS: dict[str, Callable[[], bytes]] = {
    "unmasked frame": lambda: _frame(1, b'{"type": "response.cancel"}', mask=False),
    "reserved bit": lambda: _frame(1, b"{}", rsv=0x40),
    "reserved opcode": lambda: _frame(3, b"{}"),
    "ping over 125 bytes": lambda: _frame(9, b"x" * 200),
    "fragmented ping": lambda: _frame(9, b"x", fin=False),
    "continuation first": lambda: _frame(0, b"{}"),
    "text inside a fragmented message": lambda: _frame(1, b"{", fin=False) + _frame(1, b"}"),
    "invalid UTF-8": lambda: _frame(1, b'{"type": "\xff\xfe"}'),
    "close code 999": lambda: _frame(8, struct.pack(">H", 999)),
    "close reason not UTF-8": lambda: _frame(8, struct.pack(">H", 1000) + b"\xff"),
    "message over --max-message-bytes": lambda: _frame(1, b"x" * (1 << 20 + 1)),
}


def _handshake_bytes(path: str = "/v1/realtime", extra: Sequence[str] = ()) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [
        f"GET {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


async def _read_close_code(reader: asyncio.StreamReader) -> int | None:
    """Read frames until a close frame (its code) or the end of the stream (None)."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        async with asyncio.timeout(10):
            while True:
                b1, b2 = await reader.readexactly(2)
                length = b2 & 0x7F
                if length == 126:
                    (length,) = struct.unpack(">H", await reader.readexactly(2))
                elif length == 127:
                    (length,) = struct.unpack(">Q", await reader.readexactly(8))
                payload = await reader.readexactly(length)
                if b1 & 0x0F == 8:
                    return struct.unpack(">H", payload[:2])[0] if len(payload) >= 2 else 1005
    return None


async def _open_raw(
    port: int, request: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head


async def frames(repeats: int) -> None:
    codes: dict[str, Counter[int | None]] = {}
    with gateway() as g:
        for name, build in VIOLATIONS.items():
            codes[name] = Counter()
            for _ in range(repeats):
                reader, writer, head = await _open_raw(g.port, _handshake_bytes())
                assert b" 101 " in head.split(b"\r\n")[0], head
                writer.write(build())
                codes[name][await _read_close_code(reader)] += 1
                writer.close()
        alive = g.health()["status"] == "ok"
    total = sum(sum(c.values()) for c in codes.values())
    summary = {name: dict(c) for name, c in codes.items()}
    report("frames", violations=total, close_codes=summary, server_alive=alive)


# -- handshakes --------------------------------------------------------------------------


def bad_handshakes(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    while True:
        yield "garbage", rng.randbytes(rng.randint(1, 300)) + b"\r\n\r\n"
        yield (
            "no key",
            b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\n\r\n",
        )
        yield "version 12", _handshake_bytes().replace(b"Version: 13", b"Version: 12")
        yield "Authorization twice", _handshake_bytes(extra=["Authorization: Bearer a"] * 2)
        yield "Origin twice", _handshake_bytes(extra=["Origin: https://a.example"] * 2)
        yield "non-ASCII Origin", _handshake_bytes(extra=["Origin: https://\udcc3\udca4.example"])
        yield "non-ASCII key", _handshake_bytes(extra=["Authorization: Bearer \udcc3\udca4"])
        yield (
            "non-ASCII subprotocol",
            _handshake_bytes(
                extra=["Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.\udcc3\udca4"]
            ),
        )
        yield "wrong key", _handshake_bytes(extra=["Authorization: Bearer wrong"])
        yield "huge header", _handshake_bytes(extra=["X-Pad: " + "a" * 9000])
        yield "too many headers", _handshake_bytes(extra=[f"X-{i}: y" for i in range(300)])
        yield (
            "POST garbage",
            b"POST /v1/realtime/client_secrets HTTP/1.1\r\nContent-Length: 5\r\n\r\n{{{{{",
        )
        yield "HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


async def handshakes(count: int) -> None:
    statuses: dict[str, Counter[str]] = {}
    rng = random.Random(7)
    with gateway("--api-key", "adversarial-key") as g:
        for name, request in itertools.islice(bad_handshakes(rng), count):
            reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
            writer.write(request)
            try:
                async with asyncio.timeout(10):
                    line = await reader.readline()
                status = line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else "closed"
            except (TimeoutError, ConnectionError):
                status = "closed"
            statuses.setdefault(name, Counter())[status] += 1
            writer.close()
        alive = g.health()["status"] == "ok"
    every = Counter[str]()
    for c in statuses.values():
        every.update(c)
    summary = {name: dict(c) for name, c in statuses.items()}
    report(
        "handshakes",
        sent=count,
        statuses=dict(every),
        http_500=every["500"],
        by_kind=summary,
        server_alive=alive,
    )


# -- chaos ---------------------------------------------------------------------------------


@dataclass
class ChaosTally:
    sessions: int = 0
    dropped: int = 0
    creates: int = 0
    accepted: int = 0
    refused: int = 0
    violations: list[str] = field(default_factory=list)


def check_invariants(
    events: list[dict[str, Any]], creates: set[str], complete: bool, t: ChaosTally
) -> None:
    started: dict[str, int] = {}
    done: dict[str, int] = {}
    deltas: dict[str, list[str]] = {}
    final: dict[str, str] = {}
    refused = 0
    for i, e in enumerate(events):
        rid = e.get("response_id") or (e.get("response") or {}).get("id")
        if e["type"] == "error":
            code = e["error"]["code"]
            if code == "internal_error":
                t.violations.append(f"internal_error: {e}")
            if e["error"].get("event_id") in creates:
                refused += 1
            continue
        if rid is None:
            continue
        if rid in done:
            t.violations.append(f"{e['type']} after response.done of {rid}")
        if e["type"] == "response.created":
            started[rid] = i
        elif e["type"] == "response.output_text.delta":
            deltas.setdefault(rid, []).append(e["delta"])
        elif e["type"] == "response.output_text.done":
            final[rid] = e["text"]
        elif e["type"] == "response.done":
            done[rid] = i
            if rid not in started:
                t.violations.append(f"response.done without response.created: {rid}")
    for rid, text in final.items():
        if "".join(deltas.get(rid, [])) != text:
            t.violations.append(f"deltas joined differ from the final text of {rid}")
    t.accepted += len(started)
    t.refused += refused
    if complete:
        if set(started) - set(done):
            t.violations.append(f"no response.done for {set(started) - set(done)}")
        if len(started) + refused != len(creates):
            t.violations.append(
                f"{len(creates)} response.create, {len(started)} accepted + {refused} refused"
            )


async def chaos(count: int, concurrency: int) -> None:
    t = ChaosTally()
    rng = random.Random(1000)
    flags = [
        "--sim-step-ms",
        "5",
        "--sim-response-tokens",
        "20",
        "--max-running",
        "32",
        "--max-queued",
        "16",
        # Dropped sessions wait for a resume this long, then everything must be gone.
        "--resume-window",
        "1",
    ]
    with gateway(*flags) as g:
        gate = asyncio.Semaphore(concurrency)

        async def one(seed: int) -> None:
            r = random.Random(seed)
            events: list[dict[str, Any]] = []
            creates: set[str] = set()
            async with gate, connect(g.url, max_size=None) as ws:
                t.sessions += 1

                async def read() -> None:
                    with contextlib.suppress(ConnectionClosed):
                        async for frame in ws:
                            events.append(json.loads(frame))

                reader = asyncio.create_task(read())
                dropped = False
                for step in range(r.randint(1, 30)):
                    action = r.random()
                    if action < 0.3:
                        await ws.send(json.dumps(VALID[2]))
                    elif action < 0.55:
                        creates.add(eid := f"c{step}")
                        await ws.send(json.dumps({"type": "response.create", "event_id": eid}))
                    elif action < 0.7:
                        creates.add(eid := f"c{step}")
                        body = {
                            "conversation": "none",
                            "input": [],
                            "max_output_tokens": r.randint(1, 40),
                        }
                        await ws.send(
                            json.dumps(
                                {"type": "response.create", "event_id": eid, "response": body}
                            )
                        )
                    elif action < 0.85:
                        await ws.send(json.dumps({"type": "response.cancel"}))
                    elif action < 0.97:
                        await asyncio.sleep(r.random() * 0.05)
                    else:
                        ws.transport.abort()  # the network drops it
                        dropped = True
                        break
                if not dropped:  # wait until every response has ended, then leave
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        created = sum(e["type"] == "response.created" for e in events)
                        finished = sum(e["type"] == "response.done" for e in events)
                        answered = sum(
                            e["type"] == "error" and e["error"].get("event_id") in creates
                            for e in events
                        )
                        if created == finished and created + answered == len(creates):
                            break
                        await asyncio.sleep(0.02)
                    await ws.close()
                await reader
            t.dropped += dropped
            t.creates += len(creates)
            check_invariants(events, creates, not dropped, t)

        started = time.perf_counter()
        await asyncio.gather(*(one(rng.randrange(1 << 30)) for _ in range(count)))
        detached = _metric(g, "gateway_sessions_detached")
        await asyncio.sleep(1.5)  # past the resume window
        left = g.health()
    report(
        "chaos",
        sessions=t.sessions,
        dropped_by_client=t.dropped,
        response_creates=t.creates,
        accepted=t.accepted,
        refused_with_error=t.refused,
        violations=len(t.violations),
        detached_for_resume=int(detached),
        left_after_the_window=f"{left['sessions']} sessions, {left['responses']}",
        seconds=round(time.perf_counter() - started, 1),
    )
    for v in t.violations[:10]:
        print("  violation:", v)


# -- stuck readers ----------------------------------------------------------------------------


async def stuck(clients: int, observe: float) -> None:
    flags = ["--sim-response-tokens", "4000", "--sim-step-ms", "5", "--stall-timeout", "3"]
    with gateway(*flags) as g:
        socks = []
        for _ in range(clients):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", g.port))
            sock.sendall(_handshake_bytes())
            sock.sendall(_frame(1, b'{"type": "response.create"}'))
            socks.append(sock)
        started = time.monotonic()
        closes: list[float] = []
        while time.monotonic() - started < observe and len(closes) < clients:
            await asyncio.sleep(0.25)
            # Closed for not reading (their sessions then wait for a resume, detached).
            stalled = int(_metric(g, "gateway_stalled_connections_total"))
            closes += [time.monotonic() - started] * max(0, stalled - len(closes))
        codes: Counter[int | None] = Counter()
        for sock in socks:  # read what reached each client, to its close frame if any
            sock.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=sock)
            await reader.readuntil(b"\r\n\r\n")
            codes[await _read_close_code(reader)] += 1
            writer.close()
    report(
        "stuck",
        clients=clients,
        closed=f"{len(closes)} within {observe:.0f} s",
        first_close_s=round(min(closes), 1) if closes else None,
        last_close_s=round(max(closes), 1) if closes else None,
        close_frames_read_afterwards=dict(codes),
    )


# -- half-open connections -------------------------------------------------------------------


async def halfopen(idle: int) -> None:
    with gateway() as g:
        held = []
        for _ in range(idle):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", g.port))
            held.append(sock)
        await asyncio.sleep(0.5)
        started = time.perf_counter()
        async with connect(g.url, open_timeout=60) as ws:
            await ws.recv()
        waited = time.perf_counter() - started
        open_ = set(held)
        while open_ and time.perf_counter() - started < 60:
            await asyncio.sleep(0.5)
            for sock in list(open_):
                try:
                    sock.recv(1)  # b"" or a reset: the gateway closed it
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                open_.discard(sock)
        all_closed = time.perf_counter() - started
        for sock in held:
            sock.close()
        dropped = _metric(g, "gateway_handshakes_dropped_total")
    report(
        "halfopen",
        idle_connections=idle,
        new_client_connected_in_s=round(waited, 3),
        idle_closed_by_the_gateway=f"{idle - len(open_)} within {all_closed:.1f} s",
        dropped_over_the_cap=dropped,
    )


def _metric(g: Gateway, name: str) -> float:
    """A counter's total over its labels (0 where the gateway has no such counter)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{g.port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(
        float(line.split()[-1]) for line in lines if line.startswith((name + "{", name + " "))
    )


# -- shutdown --------------------------------------------------------------------------------


async def shutdown(streaming: int, idle: int) -> None:
    with gateway("--sim-response-tokens", "100000", "--sim-step-ms", "20") as g:
        done = 0

        async def stream(ws: ClientConnection) -> None:  # a client that reads, as they do
            nonlocal done
            with contextlib.suppress(ConnectionClosed):
                async for frame in ws:
                    done += json.loads(frame)["type"] == "response.done"

        readers = []
        for _ in range(streaming):
            ws = await connect(g.url, max_size=None)
            await ws.recv()
            await ws.send(json.dumps({"type": "response.create"}))
            readers.append(asyncio.create_task(stream(ws)))
        held = [await asyncio.open_connection("127.0.0.1", g.port) for _ in range(idle)]
        await asyncio.sleep(0.5)
        g.proc.send_signal(signal.SIGTERM)
        started = time.perf_counter()
        await asyncio.to_thread(g.proc.wait, 30)
        took = time.perf_counter() - started
        await asyncio.gather(*readers)
        for _, writer in held:
            writer.close()
    report(
        "shutdown",
        streaming_sessions=streaming,
        idle_tcp=idle,
        exit_code=g.proc.returncode,
        seconds=round(took, 2),
        response_done=done,
    )


# -- churn -----------------------------------------------------------------------------------


async def churn(rounds: int, seconds: float, loops: int) -> None:
    with gateway("--sim-step-ms", "2", "--sim-response-tokens", "16") as g:
        rss = [rss_bytes(g.proc.pid) / MIB]
        opened = 0
        for _ in range(rounds):
            deadline = time.monotonic() + seconds

            async def loop(deadline: float) -> None:
                nonlocal opened
                while time.monotonic() < deadline:
                    async with connect(g.url) as ws:
                        await ws.recv()
                        await ws.send(json.dumps(VALID[2]))
                        await ws.send(json.dumps({"type": "response.create"}))
                        async for frame in ws:
                            if json.loads(frame)["type"] == "response.done":
                                break
                    opened += 1

            await asyncio.gather(*(loop(deadline) for _ in range(loops)))
            rss.append(rss_bytes(g.proc.pid) / MIB)
    report("churn", sessions=opened, rss_mib=" -> ".join(f"{r:.0f}" for r in rss))


SCENARIOS = ["fuzz", "frames", "handshakes", "chaos", "stuck", "halfopen", "shutdown", "churn"]


async def run(names: Sequence[str], quick: bool) -> None:
    scale = 0.1 if quick else 1.0
    plan: dict[str, Callable[[], Any]] = {
        "fuzz": lambda: fuzz(int(16_000 * scale), 16),
        "frames": lambda: frames(max(1, int(5 * scale))),
        "handshakes": lambda: handshakes(int(2_000 * scale)),
        "chaos": lambda: chaos(int(1_000 * scale), 100),
        "stuck": lambda: stuck(int(100 * scale) or 1, 45 if not quick else 10),
        "halfopen": lambda: halfopen(int(2_100 * scale)),
        "shutdown": lambda: shutdown(int(200 * scale), 10),
        "churn": lambda: churn(3 if not quick else 1, 20 * scale, 32),
    }
    for name in names:
        await plan[name]()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.adversarial")
    parser.add_argument("--quick", action="store_true", help="a tenth of the load (a smoke run)")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    args = parser.parse_args()
    raise_nofile()  # this process holds thousands of sockets too
    asyncio.run(run(args.only, args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
