"""HTTP/1.1 on the WebSocket port: h11 parses every request but the common shape (see
gateway/transport/request_head.py, which reads and answers those without it); a
WebSocket upgrade goes on to websockets untouched.

Who owns what:

- :class:`HttpService` (one per gateway): the routes, the limits and timeouts, and the
  live plain-HTTP connections and their handler tasks (for shutdown). websockets'
  ``serve(create_connection=service.connection_factory)`` builds one
  :class:`HttpConnection` per accepted TCP connection; websockets keeps the listening
  socket, ``Server.close()`` and ``wait_closed()``.
- :class:`HttpConnection` (the transport's asyncio protocol until an upgrade): the h11
  state machine, one timer (handshake, body or keep-alive idle timeout), and the task
  of the request in progress. Requests are answered one at a time, in order (h11
  pauses on a pipelined request until the response before it has ended). A request
  of the common shape is read and answered without h11 (h11 sees none of it, and is
  at the start of a cycle for the next one); any other goes to h11 from its first byte.
- On ``GET`` with ``Upgrade: websocket`` to a WebSocket path, the connection builds the
  ``ServerConnection`` websockets would have built, hands it the transport
  (``transport.set_protocol``) and every byte of the request as received, and is out
  of the picture: the handshake, ``process_request``, subprotocol selection,
  ``open_timeout`` and every frame after it are websockets' own, at the cost they
  always had (nothing of this module stays on that path).
- :class:`HttpReply` (one per request): the response, written by the route's handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import h11
import orjson
from websockets.asyncio.server import Server, ServerConnection
from websockets.datastructures import Headers
from websockets.server import ServerProtocol

from gateway.observability import REQUEST_ID, Observability, Record, peer_address
from gateway.transport import request_head
from gateway.transport.coalesce import CoalescedWrites, WriteBatch
from gateway.transport.head_timers import Pending

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # request line and headers; beyond, 431
PIPELINE_BYTES = 64 * 1024  # read ahead while a request is handled; beyond, reading pauses
LINGER_SECONDS = 1.0  # after an error answer, how long the client's leftovers are read
CLOSE_SECONDS = 10.0  # a closing connection whose client reads nothing is dropped then
TEXT = "text/plain; charset=utf-8"


class ClientDisconnected(ConnectionError):
    """The client went away before the response was over."""


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """A whole request: its head, as h11 read it, and its body, within the route's limit."""

    method: str
    path: str  # without the query; percent-escapes left as they came
    query: Mapping[str, list[str]]
    headers: Headers  # case-insensitive, repeatable; non-ASCII bytes as ISO-8859-1
    body: bytes
    params: Mapping[str, str] = field(default_factory=dict)  # the route's {name}s, unquoted
    http_version: str = "1.1"
    # Its access log line and span (gateway/observability/): what its handler learns of it
    # (an answer, a tenant) goes there; the line is written as its response ends.
    record: Record | None = None

    def arg(self, name: str, default: str | None = None) -> str | None:
        """The first value of a query parameter."""
        values = self.query.get(name)
        return values[0] if values else default


Handler = Callable[[HttpRequest, "HttpReply"], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Target:
    """What answers a request: the handler, its path parameters, its body limit."""

    handler: Handler
    params: Mapping[str, str]
    body_limit: int
    pattern: str = ""  # the route's pattern, for the access log ("": no route matched)


class Routes(Protocol):
    def resolve(self, method: str, path: str, *, websocket: bool = False) -> Target: ...


class HttpReply:
    """The response to one request, written by its handler.

    ``send`` answers in one call; a stream is ``start``, then ``write`` as often as
    needed (it never waits: while ``writable`` is false the bytes queue in the
    transport, and ``await drain()`` waits for room), then ``end``. A body without a
    Content-Length goes chunked (HTTP/1.1) or until the close (HTTP/1.0). To a HEAD
    request the same headers go out and no body.

    When the client goes away before the response is over, ``disconnected`` is set,
    ``drain`` raises :class:`ClientDisconnected`, ``write`` does nothing, and the
    handler's task is cancelled: a handler cleans up in ``finally``; work that must
    outlive the client belongs to a task someone else owns.
    """

    __slots__ = (
        "_connection",
        "_direct",
        "_gone",
        "_head_only",
        "_left",
        "_over",
        "_request_id",
        "_streaming",
        "closes",
        "disconnected",
        "ended",
        "error_body",
        "status",
    )

    def __init__(
        self,
        connection: HttpConnection,
        *,
        head_only: bool,
        request_id: str = "",
        direct: bool | None = None,
    ) -> None:
        self._connection = connection
        self._head_only = head_only
        self._request_id = request_id  # its x-request-id header
        # Written without h11 (a request read without it, request_head.py): whether the
        # request keeps the connection alive; None: h11 writes this response.
        self._direct = direct
        self._left = 0  # what a direct response's Content-Length still owes
        self.closes = False  # a direct response said Connection: close
        self.error_body: bytes | None = None  # an error's body, for the access log
        self._over = False  # the handler has returned: this reply may write no more
        # A chunked body (h11 chose chunked framing) under way to a client still there:
        # a write is a chunk, at once (the per-token path: plain flags, no Event).
        self._streaming = False
        self._gone = False  # the client went away (``disconnected`` is set)
        self.status: int | None = None
        self.ended = False
        self.disconnected = asyncio.Event()

    @property
    def started(self) -> bool:
        return self.status is not None

    @property
    def writable(self) -> bool:
        """Room in the transport: ``write`` will not just queue behind a slow client."""
        return not self._gone and not self._connection.paused

    def start(self, status: int, headers: Iterable[tuple[str, str]] = ()) -> None:
        """Send the status line and headers now (a stream's client sees it has begun)."""
        self._write(self._head(status, headers))

    def write(self, data: bytes) -> None:
        if self._streaming and data:
            # A stream writes once per event (per token, over SSE): the chunk framing
            # h11 would make, without the trip through its state machine (it checks
            # nothing about chunks, and frames the last one at end()).
            self._connection.transport_write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        if not data or self._head_only or self._gone:
            return
        if self._direct is not None:
            self._left -= len(data)
            if self._left < 0:
                raise h11.LocalProtocolError("Too much data for declared Content-Length")
            self._write(data)
            return
        self._write(self._connection.emit(h11.Data(data=data)))

    def write_framed(self, prefix: bytes, data: bytes, suffix: bytes) -> None:
        """``write(prefix + data + suffix)``, framed in one go: a stream's per-token path
        (an SSE event's lines around a frame, and the chunk around them)."""
        if self._streaming:
            size = len(prefix) + len(data) + len(suffix)
            self._connection.transport_write(b"%x\r\n%b%b%b\r\n" % (size, prefix, data, suffix))
            return
        self.write(prefix + data + suffix)

    async def drain(self) -> None:
        """Until the transport has room again (at once if it has)."""
        await self._connection.drained()
        if self.disconnected.is_set():
            raise ClientDisconnected

    def end(self) -> None:
        if self._gone:
            return
        if self._direct is not None:
            if self._streaming:
                self._write(b"0\r\n\r\n")
            elif self._left:
                raise h11.LocalProtocolError("Too little data for declared Content-Length")
            self._streaming = False
            self.ended = True
            return
        self._streaming = False
        self._write(self._connection.emit(h11.EndOfMessage()))
        self.ended = True

    def gone(self) -> None:
        """The client went away (the connection says so)."""
        self._gone, self._streaming = True, False
        self.disconnected.set()

    def over(self) -> None:
        """The handler returned: no more writes."""
        self._over, self._streaming = True, False

    def send(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = TEXT,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """The whole response in one write: status, headers, ``body``, end."""
        fields = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        fields += (headers or {}).items()
        if status >= 400:
            self.error_body = body  # its code and param go to the access log
        data = self._head(status, fields)
        if self._direct is not None:
            self._left = 0
            self._write(data + body)
            self.ended = True
            return
        if body and not self._head_only:
            data += self._connection.emit(h11.Data(data=body))
        self._write(data + self._connection.emit(h11.EndOfMessage()))
        self.ended = True

    def send_text(self, status: int, text: str, headers: Mapping[str, str] | None = None) -> None:
        self.send(status, text.encode() + b"\n", TEXT, headers)

    def send_json(
        self, status: int, payload: object, headers: Mapping[str, str] | None = None
    ) -> None:
        self.send(status, orjson.dumps(payload), "application/json", headers)

    def _head(self, status: int, headers: Iterable[tuple[str, str]]) -> bytes:
        if self._over:
            raise RuntimeError("this request's handler has returned")
        fields = list(headers)
        if self._request_id:
            fields.append((REQUEST_ID, self._request_id))
        if self._connection.closing:  # shutdown: this is the connection's last response
            fields.append(("Connection", "close"))
        if self._direct is not None:
            data, chunked, self.closes = request_head.response_head(
                status, _reason(status), fields, keep_alive=self._direct
            )
            if not chunked:
                self._left = next((int(v) for n, v in fields if n.lower() == "content-length"), 0)
        else:
            data = self._connection.emit(
                h11.Response(status_code=status, headers=fields, reason=_reason(status))
            )
            chunked = b"transfer-encoding: chunked" in data.lower()
        self.status = status
        self._streaming = chunked and not self._head_only and not self._gone
        return data

    def _write(self, data: bytes) -> None:
        if self._over:
            raise RuntimeError("this request's handler has returned")
        if not self._gone:
            self._connection.transport_write(data)


_Sendable = h11.InformationalResponse | h11.Response | h11.Data | h11.EndOfMessage
State = Literal["head", "body", "handling", "idle", "linger", "closed"]


class HttpConnection(asyncio.Protocol):
    """One TCP connection, until it closes or becomes a WebSocket. Built by
    :meth:`HttpService.connection_factory`."""

    def __init__(
        self,
        service: HttpService,
        protocol: ServerProtocol,
        websocket: Callable[[], ServerConnection],
    ) -> None:
        self._service = service
        # websockets' select_subprotocol closure asserts that the connection it was
        # built with (this object) carries this sans-I/O protocol.
        self.protocol = protocol
        self._websocket = websocket
        self._loop = asyncio.get_running_loop()
        # Made when a request needs it: a WebSocket upgrade, or a connection whose requests
        # all have the common shape, never does.
        self._h11_connection: h11.Connection | None = None
        self._transport: asyncio.Transport | None = None
        self._writes: CoalescedWrites | None = None
        self._state: State = "head"
        self._first = True  # in Pending until the first request head is whole
        # The current request's bytes as received, until its head is whole: what a
        # WebSocket handshake hands on to websockets.
        self._raw: bytearray | None = bytearray()
        # h11 has seen nothing of the current request: it may be read without it
        # (request_head.py); once it has, h11 reads the request to its end.
        self._fresh = True
        self._direct: request_head.RequestHead | None = None  # read so, its body coming
        self._leftover = bytearray()  # what came after a direct request (pipelined)
        self._host_added = False  # this request's head was parsed again with an empty Host
        self._timer: asyncio.TimerHandle | None = None
        self._request: h11.Request | None = None
        self._headers = Headers()
        self._target: Target | None = None
        self._body = bytearray()
        self._read_ahead = 0
        self._reading_paused = False
        self.paused = False  # the transport's write buffer is above its high-water mark
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._reply: HttpReply | None = None
        self._task: asyncio.Task[None] | None = None
        self._client = ""  # the peer's host:port, for the access log
        self._head_at = 0.0  # when the current request's head was whole

    @property
    def closing(self) -> bool:
        return self._service.closing

    @property
    def _h11(self) -> h11.Connection:
        if self._h11_connection is None:
            self._h11_connection = h11.Connection(
                h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES
            )
        return self._h11_connection

    # -- asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._client = peer_address(transport.get_extra_info("peername"))
        self._writes = CoalescedWrites(self._transport, self._service.write_batch)
        self._service.connections.add(self)
        self._arm(self._service.handshake_timeout)
        self._service.pending.add(self)  # may abort this one at once (limit, shutdown)

    def data_received(self, data: bytes) -> None:
        if self._state in ("linger", "closed"):
            return  # what a client still sends after its error answer
        if self._raw is not None:
            self._raw += data
            if self._state == "idle":  # the next request has begun
                self._state = "head"
                self._arm(self._service.handshake_timeout)
            elif self._first and self._upgrade_at_once(self._raw):
                return
            if self._fresh:
                self._read_head()
                return
        elif self._state == "body":
            self._arm(self._service.handshake_timeout)  # a body must keep coming
            if self._direct is not None:
                self._leftover += data
                self._direct_body()
                return
        elif self._state == "handling":
            self._read_ahead += len(data)
            if self._read_ahead > PIPELINE_BYTES and not self._reading_paused:
                # Bounded read-ahead; while paused, a disconnect shows only on a write.
                self._reading_paused = True
                self._require_transport().pause_reading()
            if self._fresh:  # a direct request is handled: this is the next one's
                self._leftover += data
                return
        self._h11.receive_data(data)
        self._advance()

    def eof_received(self) -> bool:
        # A half-close counts as the client leaving (as uvicorn and Node do): the
        # transport closes, and connection_lost ends whatever is in progress.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = "closed"
        self._cancel_timer()
        self._service.pending.discard(self)
        self._service.connections.discard(self)
        self._wake_drainers()
        reply, task = self._reply, self._task
        if reply is not None and not reply.disconnected.is_set():
            reply.gone()
        if task is not None and not task.done():
            task.cancel()  # the handler's own task: nothing of it outlives the client

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_drainers()

    # -- for Pending, HttpService and HttpReply ----------------------------------------

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def shutdown(self) -> None:
        """Shutdown: an idle connection closes now, one in a request after its response;
        one still sending a request head or body is dropped."""
        if self._state == "idle":
            self._close()
        elif self._state in ("head", "body"):
            self.abort()

    def emit(self, event: _Sendable) -> bytes:
        return self._h11.send(event)

    def transport_write(self, data: bytes) -> None:
        """Write ``data`` (held till the end of the batch of work this runs in, if any:
        gateway/transport/coalesce.py)."""
        if self._writes is not None and self._state != "closed":
            self._writes.write(data)

    async def drained(self) -> None:
        # Woken by resume_writing or connection_lost (which a close is sure to reach:
        # see _close).
        if not self.paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        try:
            await waiter
        finally:
            self._drain_waiters.remove(waiter)

    # -- the request cycle ---------------------------------------------------------------

    def _read_head(self) -> None:
        """The current request's bytes so far are in ``_raw``, and h11 has seen none of
        them: read it without h11 if it has the common shape, else hand h11 all of it."""
        raw = self._raw
        assert raw is not None
        # Where the head ends as h11 finds it (a bare LF ends a line too, which only h11
        # reads): waiting for a CRLF CRLF that never comes would hang such a client.
        found = _HEAD_END.search(raw)
        if found is None and len(raw) <= MAX_HEAD_BYTES:
            return  # the rest of the head is coming (the head timer runs)
        end = found.start() - 1 if found is not None else -1
        if raw[end : end + 4] != b"\r\n\r\n" or end > MAX_HEAD_BYTES - 4:
            end = -1
        head = request_head.parse(raw, end) if end >= 0 else None
        target = None
        if head is not None:
            path = head.target.partition("?")[0]
            target = self._service.routes.resolve(head.method, path)
            if head.length > target.body_limit:
                target = None  # h11's path refuses it (413), as any too large
        if head is None or target is None:
            self._fresh = False
            self._h11.receive_data(bytes(raw))
            self._advance()
            return
        self._raw = None
        self._head_at = time.perf_counter()
        self._cancel_timer()
        if self._first:
            self._first = False
            self._service.pending.discard(self)
        self._direct, self._target, self._headers = head, target, head.headers
        self._leftover = raw
        del raw[: end + 4]
        self._state = "body"
        self._arm(self._service.handshake_timeout)
        self._direct_body()

    def _direct_body(self) -> None:
        """A direct request's body is in ``_leftover`` so far: handle it once it is whole."""
        head, buffered = self._direct, self._leftover
        assert head is not None
        if len(buffered) < head.length:
            return
        body = bytes(buffered[: head.length])
        del buffered[: head.length]  # the next request's beginning, if pipelined
        self._direct = None
        self._dispatch(head.method, head.target, head.headers, body, "1.1", head.keep_alive)

    def _advance(self) -> None:
        """Act on every event h11 can parse now."""
        while self._state in ("head", "body", "idle"):
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                if not self._tolerate_missing_host():
                    self._refuse(exc.error_status_hint, _protocol_error_text(exc))
                    return
                continue
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._on_head(event)
            elif isinstance(event, h11.Data):
                self._on_body(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._on_end()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()

    def _tolerate_missing_host(self) -> bool:
        """h11 refuses an HTTP/1.1 request without Host (RFC 9112 says a server must);
        websockets and this gateway before h11 served it, and hand-written probes omit
        it. Parse the head again with an empty Host (websockets still gets the bytes
        as sent)."""
        raw = self._raw
        if raw is None or self._host_added or not _lacks_host(raw):
            return False
        self._host_added = True
        line_end = raw.index(b"\n") + 1
        self._h11_connection = None  # a fresh one
        self._h11.receive_data(bytes(raw[:line_end]) + b"Host: \r\n" + bytes(raw[line_end:]))
        return True

    def _upgrade_at_once(self, raw: bytearray) -> bool:
        """A connection's first request, whole, a WebSocket upgrade of a WebSocket path:
        straight to websockets, which parses (and validates) it anyway. Parsing it with
        h11 first would be a second parse of every handshake."""
        end = raw.find(b"\r\n\r\n")
        if end < 0 or end + 4 > MAX_HEAD_BYTES or not raw.startswith(b"GET "):
            return False
        target, _, version = raw[4 : raw.find(b"\r\n")].rpartition(b" ")
        path = target.partition(b"?")[0].decode("ascii", "replace")
        if version != b"HTTP/1.1" or not self._service.is_websocket_path(path):
            return False
        if not _UPGRADE_WEBSOCKET.search(raw, 0, end + 2):
            return False
        self._raw = None
        self._cancel_timer()
        self._first = False
        self._service.pending.discard(self)
        self._hand_off(bytes(raw))
        return True

    def _on_head(self, event: h11.Request) -> None:
        raw, self._raw = self._raw, None
        assert raw is not None
        self._head_at = time.perf_counter()
        self._cancel_timer()
        if self._first:
            self._first = False
            self._service.pending.discard(self)
        end = _HEAD_END.search(raw)
        if end is None or end.end() > MAX_HEAD_BYTES:
            # h11 caps a head only while it is incomplete: not one that came in one read.
            self._refuse(431, "The request's headers are too large.")
            return
        if event.http_version not in (b"1.0", b"1.1"):
            self._refuse(505, "Only HTTP/1.0 and HTTP/1.1 are served here.")
            return
        method = event.method.decode("ascii")
        path = event.target.decode("ascii").partition("?")[0]
        headers = _headers(event)
        upgrade = method == "GET" and any(
            "websocket" in value.lower() for value in headers.get_all("Upgrade")
        )
        if upgrade and self._service.is_websocket_path(path):
            self._hand_off(bytes(raw))
            return
        target = self._service.routes.resolve(method, path, websocket=upgrade)
        self._request, self._target, self._headers = event, target, headers
        if _declared_length(event) > target.body_limit:
            self._refuse(413, f"The body is larger than {target.body_limit} bytes.")
            return
        if self._h11.they_are_waiting_for_100_continue:
            self.transport_write(
                self.emit(
                    h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                )
            )
        self._body = bytearray()
        self._state = "body"
        self._arm(self._service.handshake_timeout)

    def _on_body(self, data: bytes | bytearray) -> None:
        assert self._target is not None
        self._body += data
        if len(self._body) > self._target.body_limit:
            self._refuse(413, f"The body is larger than {self._target.body_limit} bytes.")

    def _on_end(self) -> None:
        event = self._request
        assert event is not None
        body, self._body = bytes(self._body), bytearray()
        version = event.http_version.decode("ascii")
        method, target = event.method.decode("ascii"), event.target.decode("ascii")
        self._dispatch(method, target, self._headers, body, version, None)

    def _dispatch(
        self,
        method: str,
        target_text: str,
        headers: Headers,
        body: bytes,
        http_version: str,
        direct: bool | None,
    ) -> None:
        """A whole request: its handler's task starts. ``direct``: read without h11 (and
        whether it keeps the connection alive), None: h11's."""
        target = self._target
        assert target is not None
        self._cancel_timer()
        self._state = "handling"
        self._read_ahead = 0
        path, _, query = target_text.partition("?")
        record = self._service.observability.http_request(
            method, path, target.pattern, headers, self._client, self._head_at
        )
        request = HttpRequest(
            method=method,
            path=path,
            query=urllib.parse.parse_qs(query, keep_blank_values=True) if query else {},
            headers=headers,
            body=body,
            params=target.params,
            http_version=http_version,
            record=record,
        )
        reply = HttpReply(
            self, head_only=method == "HEAD", request_id=record.request_id or "", direct=direct
        )
        self._reply = reply
        self._fresh = direct is not None  # the next request's bytes are ours, not h11's
        self._task = self._loop.create_task(self._serve(target.handler, request, reply))
        self._service.track(self._task)

    async def _serve(self, handler: Handler, request: HttpRequest, reply: HttpReply) -> None:
        try:
            await handler(request, reply)
            if not reply.started:
                raise RuntimeError("the handler returned without answering")
            if not reply.ended:
                reply.end()
        except asyncio.CancelledError:
            if not reply.disconnected.is_set():
                raise  # cancelled by someone else: not ours to swallow
        except Exception:
            if reply.disconnected.is_set():
                return  # ClientDisconnected, or whatever a write to a gone client raised
            self._service.logger.exception("failed to answer %s %s", request.method, request.path)
            if not reply.started:
                with contextlib.suppress(h11.LocalProtocolError):
                    reply.send_text(500, "The gateway failed to answer; its log says why.")
            elif not reply.ended:  # half a response went out: the client must see it cut short
                self._close()
        finally:
            reply.over()
            self._reply = self._task = None
            if request.record is not None:
                observability = self._service.observability
                observability.http_answered(
                    request.record, reply.status, reply.error_body, request.headers
                )
            self._next_cycle(reply)

    def _next_cycle(self, reply: HttpReply) -> None:
        """The response is over: read the next request, or close."""
        if self._state != "handling":
            return  # closed, or closing
        if self._fresh:  # a direct request: h11 is still at the start of its cycle
            if self.closing or reply.closes or not reply.ended:
                self._close()  # Connection: close, shutdown, or a response cut short
                return
            pipelined, self._leftover = bytes(self._leftover), bytearray()
        else:
            h = self._h11
            if self.closing or h.our_state is not h11.DONE or h.their_state is not h11.DONE:
                self._close()  # Connection: close, HTTP/1.0, shutdown, or a response cut short
                return
            h.start_next_cycle()
            pipelined = h.trailing_data[0]
            self._fresh = not pipelined  # h11 holds those bytes: it reads that request
        self._request = self._target = None
        self._raw = bytearray(pipelined)
        self._host_added = False
        self._state = "head" if pipelined else "idle"
        self._arm(self._service.handshake_timeout if pipelined else self._service.keepalive_timeout)
        if self._reading_paused:
            self._reading_paused = False
            self._require_transport().resume_reading()
        if not pipelined:
            return
        if self._fresh:
            self._read_head()
        else:
            self._advance()

    def _hand_off(self, raw: bytes) -> None:
        """Make this connection websockets': a ServerConnection as ``serve()`` builds it,
        on this transport, fed the request as it came."""
        transport = self._require_transport()
        self._state = "closed"
        self._cancel_timer()
        self._service.connections.discard(self)
        websocket = self._websocket()
        transport.set_protocol(websocket)
        websocket.connection_made(transport)  # starts websockets' handshake task
        if self.paused:  # the transport paused for this protocol: tell the new one
            websocket.pause_writing()
        if self._reading_paused:
            transport.resume_reading()
        websocket.data_received(raw)
        # websockets' select_subprotocol closure keeps this object (for the assert on
        # ``protocol``) as long as the WebSocket lives: let go of all else it holds (the
        # h11 state machine, buffers, headers), which would cost every idle session ~2 KiB.
        vars(self).clear()
        self.protocol = websocket.protocol
        self._state = "closed"  # what the caller's loop (_advance) reads next

    def _refuse(self, status: int, text: str) -> None:
        """Answer a request that cannot be served (malformed, too large) and close,
        reading what the client still sends for a moment: closing with unread data
        would reset the connection and could destroy the answer before it is read."""
        body = text.encode() + b"\n"
        record = self._refused_record()
        fields = [
            ("Content-Type", TEXT),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            (REQUEST_ID, record.request_id or ""),
        ]
        try:
            data = self.emit(
                h11.Response(status_code=status, headers=fields, reason=_reason(status))
            )
            data += self.emit(h11.Data(data=body)) + self.emit(h11.EndOfMessage())
        except h11.LocalProtocolError:  # a response is already under way
            self.abort()
            return
        self._service.observability.http_answered(record, status, None, self._headers)
        self._service.pending.discard(self)
        transport = self._require_transport()
        transport.write(data)
        self._state = "linger"
        if transport.can_write_eof():
            transport.write_eof()
            self._arm(LINGER_SECONDS)
        else:
            self._close()

    def _refused_record(self) -> Record:
        """The access log record of a request refused before its handler (its head or body
        too large, malformed): what is known of it."""
        request, target = self._request, self._target
        if request is None:
            return self._service.observability.http_request("", "", "", Headers(), self._client)
        method = request.method.decode("ascii", "replace")
        path = request.target.decode("ascii", "replace").partition("?")[0]
        pattern = target.pattern if target is not None else ""
        observability = self._service.observability
        return observability.http_request(method, path, pattern, self._headers, self._client)

    def _close(self) -> None:
        """Close once what was written has gone out; drop the connection if it cannot."""
        if self._state != "closed" and self._transport is not None:
            if self._writes is not None:
                self._writes.flush()  # what a batch still holds goes before the close
            self._state = "closed"
            self._transport.close()
            self._arm(CLOSE_SECONDS)

    # -- timers ------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(seconds, self._expire)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._state == "idle":
            # A request may be on its way as this closes: clients retry a request sent
            # on a reused connection that closed before answering (RFC 9112, 9.3.1).
            self._close()
        else:  # a head or body that stopped coming, a linger or a close that is over
            self.abort()

    def _wake_drainers(self) -> None:
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _require_transport(self) -> asyncio.Transport:
        assert self._transport is not None
        return self._transport


class HttpService:
    """The HTTP side of the gateway's port: routes, limits, timeouts, and its
    connections and handler tasks (shutdown: :meth:`close`, :meth:`wait_closed`,
    :meth:`abort`)."""

    def __init__(
        self,
        routes: Routes,
        *,
        websocket_paths: Sequence[str],
        pending: Pending,
        handshake_timeout: float,
        keepalive_timeout: float,
        logger: logging.Logger = log,
        write_batch: WriteBatch | None = None,
        observability: Observability | None = None,
    ) -> None:
        self.routes = routes
        # Every request's access log line, span and request id, whatever its route.
        self.observability = observability or Observability("off")
        self.write_batch = write_batch  # the process's (see coalesce.py); None: no batching
        self._websocket_paths = frozenset(websocket_paths) | {p + "/" for p in websocket_paths}
        self.pending = pending
        self.handshake_timeout = handshake_timeout
        self.keepalive_timeout = keepalive_timeout
        self.logger = logger  # handler failures are logged here
        self.closing = False
        self.connections: set[HttpConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def is_websocket_path(self, path: str) -> bool:
        """Each WebSocket path, also with a trailing slash."""
        return path in self._websocket_paths

    def connection_factory(
        self, protocol: ServerProtocol, server: Server, **settings: Any
    ) -> HttpConnection:
        """For ``serve(create_connection=...)``: websockets calls it with the sans-I/O
        protocol and the settings of the ServerConnection it would build; that
        connection is built only if the client asks for a WebSocket."""
        return HttpConnection(
            self, protocol, lambda: ServerConnection(protocol, server, **settings)
        )

    @property
    def in_progress(self) -> int:
        """Requests whose handler is running."""
        return len(self._tasks)

    def track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Serve no new request: idle connections close now, busy ones after their
        current response (which says ``Connection: close``)."""
        self.closing = True
        for connection in list(self.connections):
            connection.shutdown()

    def abort(self) -> None:
        for connection in list(self.connections):
            connection.abort()

    async def wait_closed(self) -> None:
        """Until every request in progress has been answered (or its client is gone)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))


def _headers(event: h11.Request) -> Headers:
    headers = Headers()
    for name, value in event.headers.raw_items():
        # As websockets' own parser does: obs-text kept as ISO-8859-1, opaque and
        # reversible (h11 has refused control characters already).
        headers[name.decode("ascii")] = value.decode("iso-8859-1")
    return headers


def _declared_length(event: h11.Request) -> int:
    """The Content-Length h11 frames the body by (none when it is chunked)."""
    lengths = [int(v) for n, v in event.headers if n == b"content-length"]
    chunked = any(n == b"transfer-encoding" for n, _ in event.headers)
    return lengths[0] if lengths and not chunked else 0


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


# An Upgrade header naming websocket (any case; h11 would have found it the same way).
_UPGRADE_WEBSOCKET = re.compile(rb"\n[Uu][Pp][Gg][Rr][Aa][Dd][Ee][ \t]*:[^\r\n]*(?i:websocket)")
_HOST_LINE = re.compile(rb"\n[Hh][Oo][Ss][Tt][ \t]*:")
_HEAD_END = re.compile(rb"\n\r?\n")


def _lacks_host(raw: bytes | bytearray) -> bool:
    """Is this a whole HTTP/1.1 request head without a Host header?"""
    end = _HEAD_END.search(raw)
    line_end = raw.find(b"\n")
    if end is None or line_end < 0:
        return False
    return raw[:line_end].rstrip(b"\r").endswith(b" HTTP/1.1") and not _HOST_LINE.search(
        raw, 0, end.start() + 1
    )


def _protocol_error_text(exc: h11.RemoteProtocolError) -> str:
    if exc.error_status_hint == 431:
        return "The request's headers are too large."
    return f"Malformed HTTP request: {exc}."
