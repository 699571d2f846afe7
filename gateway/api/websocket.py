"""The WebSocket endpoint: the upgrade's checks, then one connection's frames to its session.

gateway/transport/http1.py reads every request on the port and hands an upgrade to one
of ``WEBSOCKET_PATHS`` on to websockets, which calls :meth:`WebSocketEndpoint.process_request`
(the handshake's checks: gateway/api/admission.py, and gateway/cluster/resumes.py for a
Responses resume) and then :meth:`WebSocketEndpoint.handle` with the open connection. The
path picks the dialect: ``/v1/realtime`` or ``/v1/responses``.

Per connection two tasks run: this module's reader (frames -> the dialect's decoder ->
the session's inbox) and the session actor (sessions/core.py), which may outlive the
connection (a dropped one waits for a resume). The session's outbox is the one path to
the socket: it writes through a :class:`~gateway.transport.wire.SocketWire`, straight
from the caller's stack while the socket has room, and through a writer task of its own
only while the socket pushes back, so a slow client blocks nothing but its own outbox.

Who owns what: the endpoint owns the set of wires attached to sessions (for the stall
watch and ``--max-sessions``) and the stall watch's task; sessions are the table's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import urllib.parse
import weakref
from collections.abc import Sequence

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from gateway.api.admission import Admission, Entry
from gateway.api.auth import ANONYMOUS
from gateway.api.routes import RESPONSES_PATH
from gateway.api.status import ServerState
from gateway.cluster import worker_relay
from gateway.cluster.persistence import Persistence
from gateway.cluster.redis_store import RedisStore
from gateway.cluster.resumes import Resumes
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.observability import REQUEST_ID, Observability, Record, peer_address
from gateway.session_table import SessionTable
from gateway.tenants import retry_after_header
from gateway.transport.coalesce import WriteBatch
from gateway.transport.head_timers import refusal
from gateway.transport.wire import (
    NullWire,
    SocketWire,
    cap_kernel_send_buffer,
    close_socket,
    forget_handshake,
)
from sessions import codec, errors
from sessions.core import Session
from sessions.dialects import REALTIME, DialectContext
from sessions.realtime import codec as rt
from sessions.responses import codec as rp

log = logging.getLogger(__name__)


class WebSocketEndpoint:
    def __init__(
        self,
        config: GatewayConfig,
        state: ServerState,
        table: SessionTable,
        admission: Admission,
        resumes: Resumes,
        metrics: Metrics,
        dialects: DialectContext,
        store: RedisStore | None = None,
        persistence: Persistence | None = None,
        write_batch: WriteBatch | None = None,
        observability: Observability | None = None,
    ) -> None:
        self._config = config
        self._observability = observability or Observability("off")
        self._write_batch = write_batch
        self._state = state
        self._table = table
        self._admission = admission
        self._resumes = resumes
        self._metrics = metrics
        self._dialects = dialects
        self._store = store
        # What a socket's frames wait for: the store's flushes.
        self._hold = store.holds if store is not None else None
        self._persistence = persistence
        self._wires: set[SocketWire] = set()  # attached to a session's outbox
        # Each handshake's tenant, from process_request to handle() (gone with it).
        self._tenants: weakref.WeakKeyDictionary[ServerConnection, str] = (
            weakref.WeakKeyDictionary()
        )
        # Each upgrade's access log record, from process_request to the connection's end.
        self._origins: weakref.WeakKeyDictionary[ServerConnection, Record] = (
            weakref.WeakKeyDictionary()
        )
        self._stall_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._stall_task = asyncio.get_running_loop().create_task(
            self._watch_stalls(), name="stall-watch"
        )

    def close(self) -> None:
        if self._stall_task is not None:
            self._stall_task.cancel()

    def _full(self) -> bool:
        limit = self._config.max_sessions
        return limit is not None and len(self._wires) + self._table.detached >= limit

    # -- the handshake (websockets calls these for upgrades only) -----------------------

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        self._origin(connection, request)
        try:
            refused = self._refuse_handshake(connection, request)
        except Exception:
            # Logged here: websockets would log it only at DEBUG (see __main__).
            log.exception("failed to answer GET %s", request.path)
            return refusal(500, "The gateway failed to answer; its log says why.")
        if refused is not None:
            self._metrics.connections_refused.labels(status=str(refused.status_code)).inc()
        return refused

    def _refuse_handshake(self, connection: ServerConnection, request: Request) -> Response | None:
        refused = self._admission.refuse(request.headers, Entry.WEBSOCKET)
        if refused is not None:
            return refusal(refused.status, refused.message, refused.headers)
        # Read once, while the credential is known to be good: the connection is this
        # tenant's even if a SIGHUP removes its key before handle() runs.
        tenant = self._admission.tenant(request.headers, Entry.WEBSOCKET)
        self._tenants[connection] = tenant
        over = self._table.scheduler.tenants.refuse_session(tenant)
        resuming = is_responses_upgrade(request) and self._resumes.asks_resume(request)
        if over is not None and not resuming:
            self._metrics.tenant_refused.labels(tenant=tenant, reason="session").inc()
            wait = retry_after_header(over.retry_after)
            return refusal(429, f"rate_limit_exceeded: {over.message}", {"Retry-After": wait})
        if self._full():
            limit = self._config.max_sessions
            return refusal(503, f"Too many sessions (limit {limit}); retry later.")
        if self._state.draining:
            return refusal(503, "This gateway is draining for a restart; connect to another.")
        if not self._state.engine_ready:
            return refusal(
                503, "The engine is not ready (loading, or no replica is up); retry shortly."
            )
        if is_responses_upgrade(request):
            if not self._config.responses_websocket:
                return refusal(
                    426,
                    "The Responses WebSocket mode is off on this gateway "
                    "(--no-responses-websocket): POST /v1/responses instead.",
                )
            return self._resumes.refuse_upgrade(request, tenant)
        return None

    def _origin(self, connection: ServerConnection, request: Request) -> Record:
        origin = self._origins.get(connection)
        if origin is None:
            path = request.path.partition("?")[0]  # never the query: a resume token's place
            client = peer_address(connection.remote_address)
            origin = self._observability.connection(path, request.headers, client)
            self._origins[connection] = origin
        return origin

    def process_response(
        self, connection: ServerConnection, request: Request, response: Response
    ) -> Response | None:
        origin = self._origin(connection, request)
        response.headers[REQUEST_ID] = origin.request_id or ""
        if response.status_code != 101:
            self._origins.pop(connection, None)
            self._observability.upgrade_refused(origin, response.status_code, request.headers)
            self._tenants.pop(connection, None)
        elif is_responses_upgrade(request):
            tenant = self._tenants.get(connection, ANONYMOUS)
            self._resumes.name_upgrade(connection, request, response, tenant)
        return None

    # -- connections ----------------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        origin = self._origins.pop(ws, None)
        tenant = self._tenants.pop(ws, ANONYMOUS)
        session: Session | None = None
        try:
            session = await self._handle(ws, origin, tenant)
        finally:
            if origin is not None:
                session_id = session.id if session is not None else None
                self._observability.connection_closed(origin, ws.close_code, session_id, tenant)

    async def _handle(
        self, ws: ServerConnection, origin: Record | None, tenant: str
    ) -> Session | None:
        """The connection's life; the session it ended with (None: none, or relayed)."""
        if self._state.stopping:  # the handshake finished after shutdown began
            await close_socket(ws, 1001, "server shutting down")
            return None
        if self._full():
            # Handshakes that raced past the HTTP check: refuse at the WebSocket level.
            self._metrics.connections_refused.labels(status="1013").inc()
            await close_socket(ws, 1013, "too many sessions")
            return None
        cap_kernel_send_buffer(ws)
        upgrade = self._resumes.take_upgrade(ws)
        forget_handshake(ws)
        if upgrade is None and self._table.scheduler.tenants.refuse_session(tenant) is not None:
            # Handshakes that raced past the check in process_request.
            self._metrics.tenant_refused.labels(tenant=tenant, reason="session").inc()
            await close_socket(ws, 1013, "rate_limit_exceeded: the key's max_sessions")
            return None
        wire = SocketWire(ws, self._hold, self._write_batch)
        self._wires.add(wire)
        api = "realtime" if upgrade is None else "responses"
        self._metrics.websocket_connections.labels(api=api).inc()
        session: Session | None
        if upgrade is None:
            dialect, framing = REALTIME.make(self._dialects)
            session = self._table.open(dialect, framing, tenant=tenant, origin=origin)
            session.outbox.attach(wire)
            self._check_url_model(ws, session)
        else:
            try:
                session = await self._resumes.responses_session(upgrade, ws, wire, origin)
            except errors.ResumeRefused as refused:
                self._wires.discard(wire)
                await close_socket(ws, 4004, refused.code)
                return None
            except errors.SessionRelayed:
                self._wires.discard(wire)
                return None
        max_age = self._config.responses_max_age
        expiry = None
        if upgrade is not None and max_age > 0:
            expiry = asyncio.get_running_loop().call_later(
                max_age, session.call_soon, session.dialect.expire
            )
        ended: Session | None = session
        try:
            ended = await self._read(ws, wire, session)
        finally:
            if expiry is not None:
                expiry.cancel()
            self._wires.discard(wire)
            if ended is not None:
                await self._let_go(ws, wire, ended)
        return ended

    def _check_url_model(self, ws: ServerConnection, session: Session) -> None:
        """A Realtime URL's ``?model=`` outside ``--served-model-name``: an error event after
        ``session.created``, the session going on with the served model (OpenAI's clients
        always name one there)."""
        path = ws.request.path if ws.request is not None else ""
        if not session.limits.served_models or "?" not in path:
            return  # any model name is served, or none is named
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        try:
            for name in query.get("model", [])[:1]:
                codec.check_model(name, session.limits.served_models)
        except errors.ProtocolError as err:
            session.call_soon(functools.partial(session.dialect.error, err))

    async def handle_relayed(self, ws: ServerConnection) -> None:
        """A resume another worker received for a session of ours
        (gateway/cluster/worker_relay.py): the first event is that ``session.resume``;
        after it, as any connection."""
        if self._state.stopping:
            await close_socket(ws, 1001, "server shutting down")
            return
        wire = SocketWire(ws, self._hold, self._write_batch)
        self._wires.add(wire)
        session: Session | None = None
        try:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                async with asyncio.timeout(worker_relay.CONNECT_TIMEOUT):
                    event = rt.decode(await ws.recv())
                if isinstance(event, rt.SessionResume):
                    # The relaying worker names the tenant of its client's credential.
                    request = ws.request
                    tenant = (
                        request.headers.get(worker_relay.TENANT_HEADER, "")
                        if request is not None
                        else ""
                    )
                    try:
                        session = self._resumes.take_over(event, wire, tenant)
                    except errors.ResumeRefused as refused:  # the other worker tells why
                        await ws.send(codec.encode(codec.error_event(refused)), text=True)
            if session is None:
                return
            session = await self._read(ws, wire, session, first=False)
        except errors.ProtocolError:
            return
        finally:
            self._wires.discard(wire)
            if session is not None:
                await self._let_go(ws, wire, session)

    async def _read(
        self, ws: ServerConnection, wire: SocketWire, session: Session, *, first: bool = True
    ) -> Session | None:
        """Client frames -> the session's inbox, until the connection ends; returns the
        session the connection ended with (another one after a ``session.resume``), or
        None if the connection was relayed to another process and that has ended."""
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                try:
                    event: object = session.dialect.decode(frame)
                except errors.ProtocolError as err:
                    event = err
                if isinstance(event, rt.SessionResume):
                    try:
                        session = await self._resumes.resume(event, ws, wire, session, first)
                    except errors.SessionRelayed:
                        return None
                else:
                    if isinstance(event, rp.Create) and self._persistence is not None:
                        # The dialect finds what it continues in this process's cache.
                        wanted = event.body.previous_response_id
                        if wanted is not None:
                            await self._persistence.fetch_response(wanted)
                    await session.deliver(event)
                first = False
        return session

    async def _let_go(self, ws: ServerConnection, wire: SocketWire, session: Session) -> None:
        """The connection is over. A client that closed it (a close frame: a closed tab)
        ends its session at once; one that vanished without a close frame (a network
        drop, a proxy recycling its sockets) leaves the session detached for
        ``--resume-window`` seconds, for a resume on a new connection."""
        current = session.outbox.wire
        # None: this socket was the session's (the outbox let go of it, e.g. overflow).
        if current is wire or current is None:
            session.outbox.detach(wire)
            window = self._config.resume_window
            keep = (
                window > 0
                and not self._state.stopping
                and not session.ending
                and ws.protocol.close_rcvd is None
            )
            if keep:
                session.detach(window)
                self._table.set_detached(session, True)
                if self._store is not None:
                    # Numbered and logged meanwhile: a resume may come to another process.
                    session.outbox.attach(NullWire())
            else:
                session.close("disconnected")
        # else: resumed on another connection meanwhile; nothing here is ours to end.
        # websockets closes the socket when this handler returns: first let a close the
        # outbox started (1001 at shutdown, 1008, 4001) reach the client.
        if wire.closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5 if ws.close_code is not None else 2.5):
                    await wire.closed()

    async def _watch_stalls(self) -> None:
        """Close connections whose client stopped reading: see :meth:`SocketWire.check_stall`.

        One task for all connections, a few checks per stall timeout: nothing per frame.
        """
        stall = self._config.stall_timeout
        while True:
            await asyncio.sleep(max(0.05, stall / 4))
            now = time.monotonic()
            for wire in list(self._wires):
                if wire.check_stall(now, stall):
                    log.info("closing a connection that read nothing for %.1fs", stall)
                    self._metrics.stalled.inc()


def is_responses_upgrade(request: Request) -> bool:
    return request.path.partition("?")[0].rstrip("/") == RESPONSES_PATH


def select_subprotocol(
    connection: object,  # websockets passes the HttpConnection it was built with
    subprotocols: Sequence[Subprotocol],
) -> Subprotocol | None:
    # Browsers offer "realtime" plus the key as a second subprotocol; never echo the key.
    return Subprotocol("realtime") if "realtime" in subprotocols else None
