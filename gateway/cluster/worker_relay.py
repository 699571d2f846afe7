"""``--workers N``: a resume that lands on another worker is relayed to the one holding it.

The kernel spreads connections over the workers (SO_REUSEPORT) by their addresses, so a
reconnecting client reaches any of them. A session lives in one worker's memory; its id
names that worker (``sess_<worker>_...``). Every worker also listens on a Unix socket in
a directory only this user can open, which the parent process creates for its workers
(``--worker-dir``). The worker that receives ``session.resume`` for another worker's
session opens a WebSocket to that worker there, passes the event on, and if the answer is
``session.resumed`` it becomes a pipe: client frames to the owner, the owner's frames
(numbered by the owner's outbox) to the client. The inner connection's handshake carries
the tenant of the client's credential (``x-llmgw-tenant``: only this user can reach
that socket), and the owner resumes only a session of that tenant. Closes cross the pipe
as they came: a
client's close frame closes the inner connection with one (the session ends), a client
that vanished aborts it (the session stays detached for its window), and a close by the
owner (1001 at shutdown, 4001 when taken over) reaches the client with its code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Protocol

import orjson
from websockets.asyncio.client import ClientConnection, unix_connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from sessions import codec
from sessions.realtime import codec as rt

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
TENANT_HEADER = "x-llmgw-tenant"  # on the inner connection: whose credential asked


class ClientSide(Protocol):
    """The client's socket end, as the relaying worker writes to it (a ``SocketWire``)."""

    def writable(self) -> bool: ...

    def write(self, frame: bytes) -> None: ...

    async def write_later(self, frame: bytes) -> None: ...

    def close(self, code: int, reason: str) -> None: ...


def socket_path(worker_dir: str, worker: str) -> Path:
    return Path(worker_dir) / f"worker-{worker}.sock"


def owner_tag(node: str | None, worker: str) -> str:
    """What a session id says about where the session lives: ``<node>.<worker>`` with
    ``--node`` (a load balancer in front of several hosts routes a resume by the node),
    else the worker alone."""
    return f"{node}.{worker}" if node else worker


def owner_of(session_id: str) -> str | None:
    """The owner tag a session id carries (``sess_<tag>_<random>``), if it carries one."""
    parts = session_id.split("_")
    return parts[1] if len(parts) == 3 and parts[0] == "sess" else None


def worker_of(tag: str) -> str:
    return tag.rpartition(".")[2]


async def open_leg(
    worker_dir: str, worker: str, event: rt.SessionResume, tenant: str
) -> tuple[ClientConnection, codec.JSON] | None:
    """Ask ``worker`` to resume for ``tenant``; the inner connection and its answer, or
    None when that worker cannot be reached (it is gone: the session went with it)."""
    path = socket_path(worker_dir, worker)
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            # No size limit inside: the owner's frames were not limited either (a long
            # answer's response.done can be bigger than what a client may send).
            leg = await unix_connect(
                str(path),
                uri="ws://worker/v1/realtime",
                compression=None,
                max_size=None,
                additional_headers={TENANT_HEADER: tenant},
            )
            await leg.send(_resume_frame(event))
            answer: codec.JSON = orjson.loads(await leg.recv())
    except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed, orjson.JSONDecodeError):
        log.info("relay: worker %s cannot be reached at %s", worker, path)
        return None
    return leg, answer


def _resume_frame(event: rt.SessionResume) -> str:
    return orjson.dumps(
        {
            "type": "session.resume",
            "event_id": event.event_id,
            "session_id": event.session_id,
            "resume_token": event.resume_token,
            "last_sequence_number": event.last_sequence_number,
        }
    ).decode()


async def pipe(client: ServerConnection, wire: ClientSide, leg: ClientConnection) -> None:
    """Relay both ways until one side ends; then end the other as described above."""
    loop = asyncio.get_running_loop()
    upstream = loop.create_task(_to_owner(client, leg))
    downstream = loop.create_task(_to_client(leg, wire))
    try:
        await asyncio.wait((upstream, downstream), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (upstream, downstream):
            task.cancel()
        await asyncio.gather(upstream, downstream, return_exceptions=True)
    if downstream.done() and not downstream.cancelled() and leg.close_code is not None:
        # The owner closed: the client gets its code (or the client went meanwhile).
        rcvd = leg.protocol.close_rcvd
        if rcvd is not None:
            wire.close(rcvd.code, rcvd.reason)
        return
    if client.protocol.close_rcvd is not None:
        await leg.close()  # the client closed: so does the session
    else:
        leg.transport.abort()  # the client vanished: the session waits for another resume


async def _to_owner(client: ServerConnection, leg: ClientConnection) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for frame in client:
            await leg.send(frame)


async def _to_client(leg: ClientConnection, wire: ClientSide) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for frame in leg:
            data = frame.encode() if isinstance(frame, str) else frame
            if wire.writable():
                wire.write(data)
            else:
                await wire.write_later(data)
