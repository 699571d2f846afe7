"""Connections before they are WebSockets: the handshake limits, and plain HTTP requests.

websockets parses only ``GET`` requests (15 drops any other method without a reply,
17 answers 405). This module's connection class reads the request's method first: a
``GET`` goes on to websockets unchanged (the WebSocket handshake, and the GET routes
of gateway/server.py); any other method is read here (request line, headers, a
``Content-Length`` body), handed to the gateway's handler, answered and closed. This
is how ``POST /v1/realtime/client_secrets`` shares the WebSocket's port.

It also keeps every connection that has not yet sent a whole request, oldest first
(:class:`Pending`). Such a connection costs a file descriptor and a task and may
never send anything (a browser's preconnect, a load balancer's probe, an attack):
beyond ``--max-handshakes`` the oldest is dropped, and shutdown aborts them all at
once instead of waiting for each one's handshake timeout.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import InvalidHandshake
from websockets.http11 import Response
from websockets.protocol import Event

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # request line and headers of a plain request
MAX_BODY_BYTES = 64 * 1024
_METHOD_CHARS = 16  # the request line's first word is shorter than this
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


@dataclass(frozen=True, slots=True)
class PlainRequest:
    """An HTTP request that is not a GET: what the gateway's handler answers."""

    method: str
    path: str
    headers: Headers
    body: bytes


PlainHandler = Callable[[PlainRequest], Response]


class Pending:
    """Connections still in their opening handshake (no whole request yet), oldest first."""

    def __init__(self, limit: int, on_drop: Callable[[str], None] | None = None) -> None:
        self.limit = limit
        self.closed = False  # shutdown: a connection that arrives now is dropped at once
        self._on_drop = on_drop
        self._connections: dict[HandshakeConnection, None] = {}

    def __len__(self) -> int:
        return len(self._connections)

    def add(self, connection: HandshakeConnection) -> None:
        if self.closed:
            self._drop(connection, "shutdown")
            return
        self._connections[connection] = None
        while len(self._connections) > self.limit:
            # The oldest, not the newest: a real client sends its request within one
            # round trip, so the longest waiter is the likeliest to send nothing.
            self._drop(next(iter(self._connections)), "limit")

    def discard(self, connection: HandshakeConnection) -> None:
        self._connections.pop(connection, None)

    def close(self) -> None:
        """Shutdown: abort every connection still in its handshake, and any that comes."""
        self.closed = True
        for connection in list(self._connections):
            self._drop(connection, "shutdown")

    def _drop(self, connection: HandshakeConnection, reason: str) -> None:
        self.discard(connection)
        connection.dropped = True
        connection.transport.abort()
        if self._on_drop is not None:
            self._on_drop(reason)


def _plain_error(status: int, text: str) -> Response:
    body = text.encode() + b"\n"
    headers = Headers({"Content-Type": "text/plain; charset=utf-8"})
    headers["Content-Length"] = str(len(body))
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


class HandshakeConnection(ServerConnection):
    """A server connection that answers non-GET requests itself and reports to
    :class:`Pending` until its request has arrived. Use :meth:`bound`."""

    pending: ClassVar[Pending]
    handle_plain: ClassVar[staticmethod[[PlainRequest], Response]]

    @classmethod
    def bound(cls, pending: Pending, handle_plain: PlainHandler) -> type[ServerConnection]:
        """A subclass for one gateway (``serve(create_connection=...)`` takes a class)."""
        attributes = {"pending": pending, "handle_plain": staticmethod(handle_plain)}
        return cast(type[ServerConnection], type("GatewayConnection", (cls,), attributes))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mode: Literal["sniff", "websocket", "plain", "answered"] = "sniff"
        self._head = bytearray()
        self.dropped = False  # by Pending: too many handshakes, or shutdown

    async def handshake(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().handshake(*args, **kwargs)
        except InvalidHandshake:
            # websockets 15 raises "no valid HTTP request" (and logs it as an error)
            # for a connection this class answered or dropped itself: not a failure.
            if self._mode != "answered" and not self.dropped:
                raise

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.pending.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pending.discard(self)
        super().connection_lost(exc)

    def process_event(self, event: Event) -> None:
        if self.request is None:  # the first event is the whole request
            self.pending.discard(self)
        super().process_event(event)

    def data_received(self, data: bytes) -> None:
        if self._mode == "websocket":
            super().data_received(data)
            return
        if self._mode == "answered":
            return  # the rest of a request already answered (and closing)
        self._head += data
        if self._mode == "sniff":
            space = self._head.find(b" ", 0, _METHOD_CHARS)
            if space < 0 and len(self._head) < _METHOD_CHARS:
                return  # the method is not all here yet
            if space < 0 or self._head[:space] == b"GET":
                # websockets' own parser takes it from here (and refuses garbage).
                self._mode = "websocket"
                head, self._head = bytes(self._head), bytearray()
                super().data_received(head)
                return
            self._mode = "plain"
        self._read_plain()

    def _read_plain(self) -> None:
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD_BYTES:
                self._answer("POST", _plain_error(431, "The request's headers are too large."))
            return
        if end > MAX_HEAD_BYTES:
            self._answer("POST", _plain_error(431, "The request's headers are too large."))
            return
        request_or_error = _parse_head(bytes(self._head[:end]))
        if isinstance(request_or_error, Response):
            self._answer("POST", request_or_error)
            return
        method, path, headers = request_or_error
        length = _content_length(headers)
        if isinstance(length, Response):
            self._answer(method, length)
            return
        body = self._head[end + 4 :]
        if len(body) < length:
            return  # more to come; the handshake timeout bounds the wait
        request = PlainRequest(method, path, headers, bytes(body[:length]))
        try:
            response = self.handle_plain(request)
        except Exception:
            log.exception("failed to answer %s %s", method, path)
            response = _plain_error(500, "The gateway failed to answer; its log says why.")
        self._answer(method, response)

    def _answer(self, method: str, response: Response) -> None:
        """Send ``response`` (no body to a HEAD) and close: one request per connection."""
        self._mode = "answered"
        self.pending.discard(self)
        headers = response.headers  # Headers: assigning a name adds one more value
        if "Connection" not in headers:
            headers["Connection"] = "close"
        if "Content-Length" not in headers:
            headers["Content-Length"] = str(len(response.body))
        if method == "HEAD":
            response = Response(response.status_code, response.reason_phrase, response.headers)
        self.transport.write(response.serialize())
        self.transport.close()


def _parse_head(head: bytes) -> tuple[str, str, Headers] | Response:
    request_line, *lines = head.split(b"\r\n")
    parts = request_line.split(b" ")
    if (
        len(parts) != 3
        or not _TOKEN.fullmatch(parts[0])
        or parts[2]
        not in (
            b"HTTP/1.1",
            b"HTTP/1.0",
        )
    ):
        return _plain_error(400, "Malformed HTTP request line.")
    if not parts[1].isascii():
        return _plain_error(400, "The request's path must be ASCII.")
    headers = Headers()
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            return _plain_error(400, "Malformed HTTP header line.")
        # Non-ASCII bytes survive as surrogates; whoever reads a header decides.
        headers[name.decode()] = value.strip(b" \t").decode("ascii", "surrogateescape")
    return parts[0].decode(), parts[1].decode(), headers


def _content_length(headers: Headers) -> int | Response:
    if "Transfer-Encoding" in headers:
        return _plain_error(411, "Send the body with a Content-Length, not chunked.")
    values = headers.get_all("Content-Length")
    if not values:
        return 0
    if len(values) > 1 or not values[0].isdigit():
        return _plain_error(400, "Malformed Content-Length.")
    length = int(values[0])
    if length > MAX_BODY_BYTES:
        return _plain_error(413, f"The body is larger than {MAX_BODY_BYTES} bytes.")
    return length
