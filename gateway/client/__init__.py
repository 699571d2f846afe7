"""Python client for the gateway: synchronous, asynchronous and streaming, over WebSocket.

Asynchronous (scripts with ``asyncio.run``, services, notebook cells with top-level await)::

    async with gateway.client.connect(url, instructions="Be brief.") as chat:
        reply = await chat.ask("What is a GPU?")
        async for delta in chat.stream("And a TPU?"):
            print(delta, end="", flush=True)

Synchronous (plain scripts, and notebook cells too: it runs its own loop on a thread)::

    with gateway.client.connect_sync(url) as chat:
        print(chat.ask("What is a GPU?").text)
        for delta in chat.stream("And a TPU?"):
            print(delta, end="", flush=True)

A connection that drops mid-answer (no close frame from the gateway) is resumed on a new
one within the gateway's resume window: the answer goes on with no text lost or repeated,
and :class:`ConnectionLost` is raised only if that fails (``resume=False`` turns it off).

``python -m gateway.client [URL]`` is a terminal chat built on the synchronous client.
"""

from gateway.client.aio import DEFAULT_TIMEOUT, AsyncChat, AsyncStream, Connect, connect
from gateway.client.errors import (
    ClientError,
    ConnectionLost,
    GatewayError,
    GatewayTimeout,
    GatewayUnavailable,
    HandshakeRefused,
)
from gateway.client.events import DEFAULT_URL, ResponseOptions, SessionOptions, resolve_url
from gateway.client.reply import Reply, Usage
from gateway.client.resume import RESUME_TIMEOUT
from gateway.client.sync import SyncChat, SyncStream, connect_sync

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_URL",
    "RESUME_TIMEOUT",
    "AsyncChat",
    "AsyncStream",
    "ClientError",
    "Connect",
    "ConnectionLost",
    "GatewayError",
    "GatewayTimeout",
    "GatewayUnavailable",
    "HandshakeRefused",
    "Reply",
    "ResponseOptions",
    "SessionOptions",
    "SyncChat",
    "SyncStream",
    "Usage",
    "connect",
    "connect_sync",
    "resolve_url",
]
