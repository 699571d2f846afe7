"""The upstream engine's HTTP/1.1 client: a keep-alive pool per replica, on the event
loop's own transports.

What the hop to a replica needs, and nothing more: send a request (a JSON ``POST``, a
health ``GET``), read its answer whole or as it streams (a chunked body of server-sent
events, split into lines), keep connections alive and reuse them, open each within a
connect timeout, give up on a stream that sends nothing for a read timeout, and close
the connection of a stream that is left before its end (what the gateway's cancel is to
a replica: its client went away, so it stops generating).

Why not httpx: at one request per answer and one chunk per token, httpx's layers
(httpcore's pool checking every pooled socket's readability on each request, anyio's
streams, the text decoders) cost the gateway more than its whole answer path
(docs/performance.md, "The upstream hop"). Here a connection is an
:class:`asyncio.Protocol` that parses what arrives in ``data_received``: the response
head, then the body's framing (Content-Length, chunked, or until the close), handing
the body's bytes to the one reader waiting for them.

Errors are :class:`HttpError`'s kinds, named for what httpx would raise, so that the
engine's retry rules read the same: a reused connection the server closed before
answering is a :class:`RemoteProtocolError` (safe to send again), a connection that
broke mid-answer a :class:`ReadError`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
MAX_IDLE = 256  # connections kept per pool
# A body's bytes received but not yet read; beyond, the connection stops reading until
# its reader catches up (a replica cannot make the gateway hold more than this).
MAX_UNREAD = 1024 * 1024
_HEX = frozenset(b"0123456789abcdefABCDEF")


class HttpError(Exception):
    """The request could not be made or its answer not read."""


class ConnectError(HttpError):
    """No connection: refused, unreachable, or not within the connect timeout."""


class ReadTimeout(HttpError):
    """Nothing arrived for the read timeout."""


class RemoteProtocolError(HttpError):
    """The server closed the connection without answering, or answered what is not HTTP."""


class ReadError(HttpError):
    """The connection broke (or the pool closed it) before the answer's end."""


class WriteError(HttpError):
    """The request could not be written (the connection was gone)."""


class Response:
    """An answer whose head has come; its body is read with :meth:`read` or
    :meth:`lines`, and :meth:`aclose` gives the connection back (or closes it)."""

    __slots__ = ("_connection", "headers", "status_code")

    def __init__(self, connection: _Connection, status: int, headers: dict[str, str]) -> None:
        self._connection = connection
        self.status_code = status
        self.headers = headers  # names in lower case; repeated ones joined with ", "

    async def read(self) -> bytes:
        """The whole body (and the connection back to its pool)."""
        parts = []
        connection = self._connection
        while (piece := await connection.body()) is not None:
            parts.append(piece)
        await self.aclose()
        return b"".join(parts)

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive (``\\n`` or ``\\r\\n`` ended; UTF-8), without
        their line ends: what server-sent events are read from."""
        connection = self._connection
        pending = b""
        while (piece := await connection.body()) is not None:
            if pending:
                piece = pending + piece
            *whole, pending = piece.split(b"\n")
            for line in whole:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", "replace")

    async def aclose(self) -> None:
        """Done with it: a connection whose answer was read to its end (and that stays
        open) goes back to the pool; any other is closed, which tells a streaming
        server its client went away."""
        self._connection.finish()


class Pool:
    """Connections to one server (``base_url``: ``http://`` or ``https://``, host, port)."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        max_idle: int = MAX_IDLE,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        netloc = parts.netloc.rpartition("@")[2]  # no credentials in the Host header
        fixed = {"Host": netloc, **(headers or {})}
        self._fixed = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in fixed.items())
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._closed = False

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        io_timeout: float | None = None,
    ) -> Response:
        """Send a request and wait for its answer's head. ``io_timeout``: this request's
        connect and read timeouts, in place of the pool's."""
        if self._closed:
            raise ReadError("the connection pool is closed")
        connection = None
        while self._idle:
            candidate = self._idle.pop()
            if candidate.usable:
                connection = candidate
                break
        if connection is None:
            connection = await self._connect(io_timeout or self.connect_timeout)
        head = b"%s %s%s HTTP/1.1\r\n%b" % (
            method.encode(),
            self._prefix.encode(),
            path.encode(),
            self._fixed,
        )
        if headers:
            head += b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items())
        if body or method in ("POST", "PUT", "PATCH"):
            head += b"Content-Length: %d\r\n" % len(body)
        read_timeout = io_timeout or self.read_timeout
        return await connection.send(head + b"\r\n" + body, read_timeout, method)

    async def _connect(self, limit: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(limit):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(self),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise ConnectError(f"no connection within {limit:g}s") from None
        except OSError as exc:
            raise ConnectError(str(exc) or type(exc).__name__) from exc
        self._open.add(protocol)
        return protocol

    def _release(self, connection: _Connection) -> None:
        """A connection whose answer is over: kept for the next request, or closed."""
        if self._closed or len(self._idle) >= self._max_idle or not connection.usable:
            connection.close()
        else:
            self._idle.append(connection)

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    async def close(self) -> None:
        """Close every connection, idle or busy (a stream being read fails at once)."""
        self._closed = True
        self._idle.clear()
        for connection in list(self._open):
            connection.abort(ReadError("the connection pool was closed"))


class _Connection(asyncio.Protocol):
    """One connection: the answer to the request sent on it, parsed as it arrives."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._error: HttpError | None = None  # what ended it (a read raises it)
        self._lost = False
        self._busy = False  # a request is out on it, its answer not over
        self._served = 0  # answers read on it (a reused one may be found closed)
        self._received = False  # a byte of the current answer came
        self._method = "GET"
        # The answer being read: its head, then its body's framing.
        self._status = 0
        self._headers: dict[str, str] | None = None
        self._framing = ""  # "length", "chunked" or "close"
        self._left = 0  # of a Content-Length body, or of the current chunk
        self._chunk_state = "size"  # chunked: "size", "data", "crlf" or "trailer"
        self._pieces: list[bytes] = []
        self._unread = 0  # bytes in _pieces
        self._paused = False  # reading paused: _unread is over MAX_UNREAD
        self._ended = False  # the body is whole
        self._keep = True  # the connection may serve another request
        self._timeout = 0.0
        self._last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def usable(self) -> bool:
        transport = self._transport
        return not self._lost and transport is not None and not transport.is_closing()

    # -- asyncio callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy:  # nothing was asked: a server talking out of turn
            self.abort(RemoteProtocolError("data from the server between answers"))
            return
        self._received = True
        self._last_data = self._loop.time()
        self._buffer += data
        try:
            self._parse()
        except HttpError as exc:
            self.abort(exc)
            return
        if self._unread > MAX_UNREAD and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        return False  # a half-closed connection is a closed one

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._cancel_timer()
        self._pool._forget(self)
        if self._busy and self._error is None:
            if self._framing == "close" and self._headers is not None:
                self._ended = True  # a body that ends with the connection
            elif not self._received and self._served:
                self._error = RemoteProtocolError(
                    "the server closed a kept-alive connection without answering"
                )
            elif self._headers is None:
                self._error = RemoteProtocolError("the server disconnected without answering")
            else:
                self._error = ReadError("the connection closed before the answer's end")
        self._wake()

    # -- a request and its answer ----------------------------------------------------

    async def send(self, data: bytes, read_timeout: float, method: str) -> Response:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise WriteError("the connection is closed")
        self._busy, self._received, self._method = True, False, method
        self._status, self._headers, self._framing = 0, None, ""
        self._pieces, self._unread, self._ended, self._keep = [], 0, False, True
        self._buffer.clear()
        self._timeout = read_timeout
        self._last_data = self._loop.time()
        self._timer = self._loop.call_at(self._last_data + read_timeout, self._expire)
        transport.write(data)
        try:
            while self._headers is None:
                await self._wait()
        except BaseException:
            self.finish()  # no answer to read (cancelled, or broken): closed, never pooled
            raise
        return Response(self, self._status, self._headers)

    async def body(self) -> bytes | None:
        """The body's next bytes (all that came so far), None at its end."""
        while True:
            pieces = self._pieces
            if pieces:
                self._pieces, self._unread = [], 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._transport.resume_reading()
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if self._ended:
                return None
            await self._wait()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None and not self._pieces and not self._ended:
            raise self._error

    def finish(self) -> None:
        """The reader is done: back to the pool if the answer was read whole and the
        connection stays open; else closed."""
        self._cancel_timer()
        busy, self._busy = self._busy, False
        if not busy:
            return
        if self._ended and self._keep and not self._lost and not self._buffer and not self._paused:
            self._served += 1
            self._pool._release(self)
        else:
            self.close()

    def close(self) -> None:
        self._pool._forget(self)
        if self._transport is not None:
            self._transport.close()

    def abort(self, error: HttpError) -> None:
        if self._error is None:
            self._error = error
        self._pool._forget(self)
        if self._transport is not None:
            self._transport.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the read timeout: one timer per request, moved on only when it fires ---------

    def _expire(self) -> None:
        self._timer = None
        due = self._last_data + self._timeout
        if self._loop.time() < due:  # data came meanwhile: wait the rest
            self._timer = self._loop.call_at(due, self._expire)
            return
        self.abort(ReadTimeout(f"nothing arrived for {self._timeout:g}s"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- parsing ---------------------------------------------------------------------

    def _parse(self) -> None:
        if self._headers is None and not self._parse_head():
            return
        buffer = self._buffer
        if self._framing == "chunked":
            self._parse_chunks()
        elif self._framing == "length":
            if buffer:
                take = min(self._left, len(buffer))
                self._pieces.append(bytes(buffer[:take]))
                self._unread += take
                del buffer[:take]
                self._left -= take
            if not self._left:
                self._ended = True
                if buffer:
                    raise RemoteProtocolError("more than the Content-Length")
        elif buffer:  # until the close
            self._pieces.append(bytes(buffer))
            self._unread += len(buffer)
            buffer.clear()

    def _parse_head(self) -> bool:
        buffer = self._buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise RemoteProtocolError("an answer head over 64 KiB")
                return False
            lines = bytes(buffer[:end]).split(b"\r\n")
            del buffer[: end + 4]
            version, _, rest = lines[0].partition(b" ")
            code = rest[:3]
            if not version.startswith(b"HTTP/1.") or not code.isdigit():
                raise RemoteProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            status = int(code)
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue): the real one follows
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, colon, value = line.partition(b":")
                if not colon or not name or name != name.strip():
                    raise RemoteProtocolError(f"a malformed header line: {line[:80]!r}")
                key = name.decode("latin-1").lower()
                text = value.strip().decode("latin-1")
                headers[key] = f"{headers[key]}, {text}" if key in headers else text
            break
        self._status = status
        connection = headers.get("connection", "").lower()
        self._keep = version == b"HTTP/1.1" and "close" not in connection
        if self._method == "HEAD" or status in (204, 304):
            self._framing, self._ended = "length", True
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing = "chunked"
        elif (length := headers.get("content-length")) is not None:
            if not (length.isascii() and length.isdigit()):
                raise RemoteProtocolError(f"a bad Content-Length: {length[:20]!r}")
            self._framing, self._left = "length", int(length)
            self._ended = self._left == 0
        else:
            self._framing, self._keep = "close", False
        self._headers = headers
        return True

    def _parse_chunks(self) -> None:
        buffer, pieces = self._buffer, self._pieces
        while buffer:
            state = self._chunk_state
            if state == "data":
                take = min(self._left, len(buffer))
                pieces.append(bytes(buffer[:take]))
                self._unread += take
                del buffer[:take]
                self._left -= take
                if self._left:
                    return
                self._chunk_state = "crlf"
            elif state == "crlf":
                if len(buffer) < 2:
                    return
                if buffer[:2] != b"\r\n":
                    raise RemoteProtocolError("a chunk not followed by CRLF")
                del buffer[:2]
                self._chunk_state = "size"
            else:  # "size" or "trailer": a line
                eol = buffer.find(b"\r\n")
                if eol < 0:
                    if len(buffer) > MAX_HEAD_BYTES:
                        raise RemoteProtocolError("a chunk header over 64 KiB")
                    return
                line = bytes(buffer[:eol])
                del buffer[: eol + 2]
                if state == "trailer":
                    if not line:  # the empty line after the last chunk's trailers
                        self._chunk_state = "size"
                        self._ended = True
                        if buffer:
                            raise RemoteProtocolError("data after the chunked body")
                        return
                    continue
                size_text = line.split(b";", 1)[0].strip(b" \t")
                # Hex digits only: int() would also take a sign, "0x" and underscores.
                if not size_text or len(size_text) > 16 or not _HEX.issuperset(size_text):
                    raise RemoteProtocolError(f"a bad chunk size: {line[:20]!r}")
                size = int(size_text, 16)
                if size:
                    self._left, self._chunk_state = size, "data"
                else:
                    self._chunk_state = "trailer"
