"""The network edge: one port for the WebSockets and the HTTP routes, and the sessions.

gateway/transport/http1.py reads every request on the port (h11) and answers the routes of
gateway/api/routes.py; a WebSocket upgrade to one of ``WEBSOCKET_PATHS`` goes on to
websockets, which calls :meth:`Gateway._process_request` (the handshake's checks:
gateway/api/admission.py, and gateway/cluster/resumes.py for a Responses resume) and then
:meth:`Gateway._handle` with the open connection.

Per connection two tasks run: this module's reader (frames -> decoded events
-> the session's inbox) and the session actor (sessions/core.py, with its dialect), which may
outlive the connection (a dropped one waits for a resume). The
session's outbox (sessions/outbox.py) is the one path to the socket: it writes
through a :class:`~gateway.transport.wire.SocketWire`, straight from the caller's stack
while the socket has room, and through a writer task of its own only while the
socket pushes back, so a slow client blocks nothing but its own outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Sequence, ValuesView
from typing import cast

from websockets.asyncio.server import Server, ServerConnection, serve, unix_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from gateway.api import auth, routes
from gateway.api.admission import Admission, Entry, Refusal
from gateway.api.responses_http import ResponsesHttp
from gateway.api.routes import WEBSOCKET_PATHS
from gateway.cluster import worker_relay as relay
from gateway.cluster.persistence import Persistence, process_id
from gateway.cluster.redis_store import RedisStore
from gateway.cluster.resumes import RESUME_ERRORS, Resumes, is_responses_upgrade
from gateway.cluster.store_relay import Inbound
from gateway.config import GatewayConfig
from gateway.engines.base import Engine, EngineError
from gateway.metrics import Metrics
from gateway.scheduler import Scheduler
from gateway.transport import tls
from gateway.transport.head_timers import Pending, refusal
from gateway.transport.http1 import HttpService
from gateway.transport.router import Router
from gateway.transport.wire import (
    CLOSE_TIMEOUT,
    NullWire,
    SocketWire,
    cap_kernel_send_buffer,
    close_socket,
    forget_handshake,
)
from sessions import codec, errors
from sessions.core import Dialect, Session, SessionConfig, SessionLimits
from sessions.outbox import Framing, Outbox, ReplayBudget
from sessions.realtime import codec as rt
from sessions.realtime.dialect import RealtimeDialect, RealtimeFraming
from sessions.response_store import ResponseStore
from sessions.responses import codec as responses_protocol
from sessions.responses.dialect import ResponsesDialect

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn


class Gateway:
    """One gateway process: the server, the scheduler and the shared engine."""

    def __init__(self, engine: Engine, config: GatewayConfig, metrics: Metrics | None = None):
        self.engine = engine
        self.config = config
        self.metrics = metrics or Metrics(config.worker)
        self.metrics.set_engine(engine.name)
        self.scheduler = Scheduler(
            engine,
            max_running=engine.capacity if config.max_running is None else config.max_running,
            max_queued=config.max_queued,
            metrics=self.metrics,
            generation_timeout=config.generation_timeout,
            merge_deltas=config.coalesce,
        )
        self._sessions_by_id: dict[str, Session] = {}  # connected or detached
        self._session_tasks: set[asyncio.Task[None]] = set()
        self._detached: set[Session] = set()
        self._ended_traffic = (0, 0, 0)  # frames, delta frames, bytes of ended sessions
        self._replay_budget = ReplayBudget(config.replay_buffer_total_bytes)
        self._server: Server | None = None
        # The live TLS context of the listening socket; SIGHUP loads new files into it.
        self._tls: ssl.SSLContext | None = None
        self.http: HttpService | None = None
        self._stopping = False
        self._engine_task: asyncio.Task[None] | None = None
        self._stall_task: asyncio.Task[None] | None = None
        self._relay_server: Server | None = None  # --workers: resumes other workers relay
        self._wires: set[SocketWire] = set()  # attached to a session's outbox
        self._limits = SessionLimits(max_parallel_out_of_band=config.max_parallel_per_session)
        self.admission = Admission(
            auth.Credentials(config.api_keys, max_secret_ttl=config.client_secret_ttl),
            config.allowed_origins,
        )
        self.pending = Pending(config.max_handshakes, on_drop=self._handshake_dropped)
        self._session_defaults = self._describe_sessions()
        self.response_store = ResponseStore(config.response_store_bytes, config.response_store_ttl)
        self.resumes = Resumes(self)
        self.responses_http = ResponsesHttp(self)
        self.store: RedisStore | None = None
        self.persistence: Persistence | None = None
        if config.session_store != "memory":
            self.store = RedisStore(
                config.session_store,
                process_id(config.node),
                resume_window=config.resume_window,
                metrics=self.metrics,
            )
            self.persistence = Persistence(self, self.store)
        self._inbound: Inbound | None = None  # frames relays forward to our sessions
        self._draining = False  # SIGTERM with a store: no new work, answers finish
        self._handed_over = False  # the drain gave every session back to the store
        self.started_at = time.time()
        # Set when the engine fails for good (Engine._fail); the CLI then stops and exits.
        self.engine_failed = asyncio.Event()
        engine.on_failure = lambda _reason: self.engine_failed.set()

    @property
    def sessions(self) -> ValuesView[Session]:
        """Every session: connected, or detached and waiting for a resume."""
        return self._sessions_by_id.values()

    def session(self, session_id: str) -> Session | None:
        return self._sessions_by_id.get(session_id)

    @property
    def ready(self) -> bool:
        """Taking new work: the engine is up and no drain or shutdown has begun."""
        return self.engine.ready and not self._draining and not self._stopping

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Listen at once; load the engine in the background (``/readyz`` says when)."""
        self.http = HttpService(
            self._routes(),
            websocket_paths=WEBSOCKET_PATHS,
            pending=self.pending,
            handshake_timeout=self.config.handshake_timeout,
            keepalive_timeout=self.config.keepalive_timeout,
            logger=log,
        )
        if self.config.tls is not None:
            self._tls = tls.server_context(self.config.tls)
        # websockets keeps the listening socket; every connection starts as the HTTP
        # service's (gateway/transport/http1.py), which hands WebSocket upgrades back to websockets.
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            process_response=self._process_response,
            select_subprotocol=_select_subprotocol,
            max_size=self.config.max_message_bytes,
            compression=None,  # small JSON frames: deflate costs more CPU than it saves
            open_timeout=self.config.handshake_timeout,
            close_timeout=CLOSE_TIMEOUT,
            # "a wrapper or a subclass" of ServerConnection, says serve(): a wrapper.
            create_connection=cast(type[ServerConnection], self.http.connection_factory),
            reuse_port=self.config.reuse_port or None,
            # asyncio's default (100) overflows in a burst of connects: the kernel then
            # drops their handshakes' last ACK and each waits for a SYN-ACK resend (1 s+).
            backlog=LISTEN_BACKLOG,
            ssl=self._tls,
            # A client that never finishes its TLS handshake holds no more than a plain
            # one that never finishes its HTTP request.
            ssl_handshake_timeout=self.config.handshake_timeout if self._tls else None,
        )
        if self.config.worker_dir is not None:
            path = relay.socket_path(self.config.worker_dir, self.config.worker)
            path.unlink(missing_ok=True)
            self._relay_server = await unix_serve(
                self._handle_relayed,
                str(path),
                max_size=self.config.max_message_bytes,
                compression=None,
                close_timeout=CLOSE_TIMEOUT,
            )
        if self.store is not None:
            await self.store.start()
            self._inbound = Inbound(self.store, self.session, self.config.resume_window)
            self._inbound.start()
        loop = asyncio.get_running_loop()
        self._engine_task = loop.create_task(self._start_engine())
        self._stall_task = loop.create_task(self._watch_stalls(), name="stall-watch")

    async def _start_engine(self) -> None:
        started = time.perf_counter()
        try:
            await self.engine.start()
        except EngineError:
            raise  # its message says what is wrong and what to do: the caller shows it
        except Exception:
            log.exception("engine %s failed to start", self.engine.name)
            raise
        # Some engines learn their capacity and model name only as they start.
        if self.config.max_running is None:
            self.scheduler.max_running = self.engine.capacity
        self._session_defaults = self._describe_sessions()
        log.debug(  # the CLI's ready line says it for people
            "engine %s ready in %.2fs %s",
            self.engine.name,
            time.perf_counter() - started,
            self.engine.describe(),
        )

    def _describe_sessions(self) -> SessionConfig:
        engine, instructions = self.engine, self.config.instructions
        return SessionConfig(
            model=str(engine.describe().get("model", engine.name)),
            instructions=engine.default_instructions if instructions is None else instructions,
            temperature=engine.default_sampling.temperature,
            top_p=engine.default_sampling.top_p,
            frequency_penalty=engine.default_sampling.frequency_penalty,
            presence_penalty=engine.default_sampling.presence_penalty,
        )

    @property
    def session_defaults(self) -> SessionConfig:
        """What a new session starts with: the engine's and the command line's defaults."""
        return self._session_defaults

    @property
    def model(self) -> str:
        """The model sessions are told they talk to (the engine's, once it has started)."""
        return self._session_defaults.model

    async def wait_ready(self) -> None:
        assert self._engine_task is not None
        await asyncio.shield(self._engine_task)

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``; the WebSocket's is the same with ``ws``."""
        return "https" if self._tls is not None else "http"

    def reload_tls(self) -> None:
        """SIGHUP: new connections get the certificate and key now in the files; on an
        error the old ones stay and the log says why."""
        if self._tls is None or self.config.tls is None:
            return
        try:
            tls.reload(self._tls, self.config.tls)
        except tls.TlsError as exc:
            log.error("SIGHUP: kept the old TLS certificate: %s", exc)
            return
        log.info("SIGHUP: TLS certificate reloaded from %s", self.config.tls.cert)

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = next(iter(self._server.sockets)).getsockname()[1]
        return port

    async def shutdown(self) -> None:
        """SIGTERM: with a store, :meth:`drain` first; then :meth:`stop`."""
        if self.persistence is not None:
            await self.drain(self.config.drain_timeout)
        await self.stop()

    async def drain(self, seconds: float) -> None:
        """Take no new work (``/readyz`` 503, upgrades and requests refused), let the
        answers in flight go on for up to ``seconds`` while their clients read,
        then hand every session to the store and close its socket with 1012 (service
        restart): the client resumes on another process, which takes the session over
        (and continues an answer still in flight)."""
        self._draining = True
        log.info("draining: %d answers in flight, up to %.0fs", self.scheduler.running, seconds)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                # Polled: a few checks a second for a state no event marks.
                while self.scheduler.running or self.scheduler.queued:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        persistence, store = self.persistence, self.store
        if persistence is None or store is None:
            return
        sessions = list(self.sessions)
        persistence.hand_over(sessions)
        self._handed_over = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await store.flush()

    async def stop(self) -> None:
        """Stop accepting, end every response with ``response.done``, close with 1001."""
        server = self._server
        if server is None:
            return
        self._stopping = True
        self.scheduler.drain()  # nothing new starts while the sessions wind down
        self.responses_http.close()
        server.close(close_connections=False)
        if self._relay_server is not None:
            self._relay_server.close(close_connections=False)
        # A connection that has sent no request yet would hold wait_closed() until its
        # handshake timeout: nothing it could still ask for will be served.
        self.pending.close()
        http = self.http
        assert http is not None
        http.close()  # idle keep-alive connections close; busy ones after their answer
        for session in list(self.sessions):
            session.close("server_shutdown", 1001, "server shutting down")
        grace = self.config.shutdown_grace
        try:
            async with asyncio.timeout(grace):
                await server.wait_closed()
                await http.wait_closed()
        except TimeoutError:
            log.warning("connections still open after %.1fs; aborting them", grace)
            for connection in list(server.connections):
                connection.transport.abort()
            http.abort()  # a streaming answer's handler is cancelled
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await server.wait_closed()
                    await http.wait_closed()
        # Detached sessions have no connection to wait for: wait for them to end.
        if self._session_tasks:
            await asyncio.wait(set(self._session_tasks), timeout=grace)
        if self._relay_server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._relay_server.wait_closed()
        await self.scheduler.close()
        if self._stall_task is not None:
            self._stall_task.cancel()
        if self._engine_task is not None and not self._engine_task.done():
            self._engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            if self._engine_task is not None:
                await self._engine_task
        await self.engine.close()
        if self._inbound is not None:
            await self._inbound.close()
        if self.store is not None:
            await self.store.close()
        self._server = None

    # -- HTTP ------------------------------------------------------------------

    def health(self) -> dict[str, object]:
        return {
            "status": "ok",
            "engine": self.engine.name,
            "model": self.model,
            "engine_details": self.engine.describe(),
            "worker": self.config.worker,
            "sessions": len(self.sessions),
            "responses": {"running": self.scheduler.running, "queued": self.scheduler.queued},
            "store": self.store.describe() if self.store is not None else {"kind": "memory"},
            "tls": tls.describe(self.config.tls) if self._tls and self.config.tls else None,
        }

    def render_metrics(self) -> bytes:
        # Frames and bytes are counted per session (a few additions on the hot path, no
        # call); the gateway's totals are summed here, at scrape time.
        frames, delta_frames, sent = self._ended_traffic
        for session in self.sessions:
            stats = session.outbox.stats
            frames += stats.frames_out
            delta_frames += stats.delta_frames_out
            sent += stats.bytes_out
        m = self.metrics
        m.frames.set(frames)
        m.delta_frames.set(delta_frames)
        m.bytes_out.set(sent)
        return m.render()

    def _routes(self) -> Router:
        return routes.router(self)

    # -- the WebSocket handshake (websockets calls these for upgrades only) -------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        try:
            refused = self._refuse_handshake(request)
        except Exception:
            # Logged here: websockets would log it only at DEBUG (see __main__).
            log.exception("failed to answer GET %s", request.path)
            return refusal(500, "The gateway failed to answer; its log says why.")
        if refused is not None:
            self.metrics.connections_refused.labels(status=str(refused.status_code)).inc()
        return refused

    def _refuse_handshake(self, request: Request) -> Response | None:
        refused = self.admission.refuse(request.headers, Entry.WEBSOCKET)
        if refused is not None:
            return refusal(refused.status, refused.message, refused.headers)
        limit = self.config.max_sessions
        if limit is not None and len(self._wires) + len(self._detached) >= limit:
            return refusal(503, f"Too many sessions (limit {limit}); retry later.")
        if self._draining:
            return refusal(503, "This gateway is draining for a restart; connect to another.")
        if not self.engine.ready:
            return refusal(
                503, "The engine is not ready (loading, or no replica is up); retry shortly."
            )
        if is_responses_upgrade(request):
            return self.resumes.refuse_upgrade(request)
        return None

    def _handshake_dropped(self, reason: str) -> None:
        self.metrics.handshakes_dropped.labels(reason=reason).inc()

    def _process_response(
        self, connection: ServerConnection, request: Request, response: Response
    ) -> Response | None:
        if response.status_code == 101 and is_responses_upgrade(request):
            self.resumes.name_upgrade(connection, request, response)
        return None

    # -- WebSocket ---------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if self._stopping:  # the handshake finished after shutdown began
            await close_socket(ws, 1001, "server shutting down")
            return
        limit = self.config.max_sessions
        if limit is not None and len(self._wires) + len(self._detached) >= limit:
            # Handshakes that raced past the HTTP check: refuse at the WebSocket level.
            self.metrics.connections_refused.labels(status="1013").inc()
            await close_socket(ws, 1013, "too many sessions")
            return
        cap_kernel_send_buffer(ws)
        upgrade = self.resumes.take_upgrade(ws)
        forget_handshake(ws)
        wire = SocketWire(ws, self.store)
        self._wires.add(wire)
        session: Session | None
        if upgrade is None:
            session = self.open_session(RealtimeDialect(), RealtimeFraming())
            session.outbox.attach(wire)
        else:
            found = await self.resumes.responses_session(upgrade, ws, wire)
            if not isinstance(found, Session):
                self._wires.discard(wire)
                if found is not None:
                    await close_socket(ws, 4004, found)
                return  # None: relayed to its owner, and that has ended
            session = found
        max_age = self.config.responses_max_age
        expiry = None
        if upgrade is not None and max_age > 0:
            expiry = asyncio.get_running_loop().call_later(max_age, self._expire, session)
        try:
            session = await self._read(ws, wire, session)
        finally:
            if expiry is not None:
                expiry.cancel()
            self._wires.discard(wire)
            if session is not None:
                await self._let_go(ws, wire, session)

    @staticmethod
    def _expire(session: Session) -> None:
        dialect = session.dialect
        if isinstance(dialect, ResponsesDialect):
            session.call_soon(dialect.expire)

    async def _handle_relayed(self, ws: ServerConnection) -> None:
        """A resume another worker received for a session of ours
        (gateway/cluster/worker_relay.py): the first event is that ``session.resume``;
        after it, as any connection."""
        if self._stopping:
            await close_socket(ws, 1001, "server shutting down")
            return
        wire = SocketWire(ws, self.store)
        self._wires.add(wire)
        session: Session | None = None
        try:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                async with asyncio.timeout(relay.CONNECT_TIMEOUT):
                    event = rt.decode(await ws.recv())
                if isinstance(event, rt.SessionResume):
                    taken = self.resumes.take_over(event, wire)
                    if isinstance(taken, str):  # the other worker tells its client why
                        error = errors.ProtocolError(taken, RESUME_ERRORS[taken])
                        await ws.send(codec.encode(codec.error_event(error)), text=True)
                    else:
                        session = taken
            if session is None:
                return
            session = await self._read(ws, wire, session, first=False)
        except errors.ProtocolError:
            return
        finally:
            self._wires.discard(wire)
            if session is not None:
                await self._let_go(ws, wire, session)

    def new_session_id(self) -> str:
        # The worker that holds a session is in its id: a resume landing on another
        # worker is relayed there (gateway/cluster/worker_relay.py).
        c = self.config
        return codec.new_id(f"sess_{relay.owner_tag(c.node, c.worker)}")

    def open_session(
        self,
        dialect: Dialect,
        framing: Framing,
        session_id: str | None = None,
        resume_token: str | None = None,
        replay_bytes: int | None = None,
    ) -> Session:
        """A new session and the task that runs it, until it ends (which may be long after
        its first connection: see :meth:`_let_go`)."""
        outbox = self.new_outbox(framing, replay_bytes)
        session = Session(
            self.scheduler,
            outbox,
            dialect,
            config=self._session_defaults,
            limits=self._limits,
            metrics=self.metrics,
            session_id=session_id or self.new_session_id(),
            resume_token=resume_token,
        )
        self.register(session)
        return session

    @property
    def session_limits(self) -> SessionLimits:
        return self._limits

    def new_outbox(self, framing: Framing, replay_bytes: int | None = None) -> Outbox:
        c = self.config
        if replay_bytes is None:
            replay_bytes = c.replay_buffer_bytes if c.resume_window > 0 else 0
        return Outbox(
            framing,
            coalesce=c.coalesce,
            replay_bytes=replay_bytes,
            replay_budget=self._replay_budget,
        )

    def register(self, session: Session) -> None:
        """``session`` is this process's from now on: counted, run, saved (with a store)."""
        self._sessions_by_id[session.id] = session
        self.metrics.sessions.inc()
        self.metrics.sessions_total.inc()
        if self.persistence is not None:
            self.persistence.adopt(session)
        task = asyncio.get_running_loop().create_task(self._live(session), name=session.id)
        self._session_tasks.add(task)
        task.add_done_callback(self._session_tasks.discard)

    def refuse_http(self, headers: Headers, *, need_engine: bool = True) -> Refusal | None:
        """Why an API request over plain HTTP may not be served (the WebSocket handshake's
        rules, as JSON errors), or None."""
        refused = self.admission.refuse(headers, Entry.HTTP)
        if refused is None and need_engine and not self.ready:
            message = "The engine is not ready (loading, stopping, or no replica is up)."
            refused = Refusal(
                503, "engine_unavailable", message + " Retry shortly.", {"Retry-After": "1"}
            )
        return refused

    async def _live(self, session: Session) -> None:
        try:
            await session.run()
        except Exception:
            log.exception("session %s ended with an error", session.id)
        finally:
            del self._sessions_by_id[session.id]
            if self.persistence is not None:
                self.persistence.ended(session, handed_over=self._handed_over)
            session.outbox.release()
            stats, (frames, deltas, sent) = session.outbox.stats, self._ended_traffic
            self._ended_traffic = (
                frames + stats.frames_out,
                deltas + stats.delta_frames_out,
                sent + stats.bytes_out,
            )
            self.metrics.sessions.dec()
            self.set_detached(session, False)

    async def _let_go(self, ws: ServerConnection, wire: SocketWire, session: Session) -> None:
        """The connection is over. A client that closed it (a close frame: a closed tab)
        ends its session at once; one that vanished without a close frame (a network
        drop, a proxy recycling its sockets) leaves the session detached for
        ``--resume-window`` seconds, for ``session.resume`` on a new connection."""
        current = session.outbox.wire
        # None: this socket was the session's (the outbox let go of it, e.g. overflow).
        if current is wire or current is None:
            session.outbox.detach(wire)
            keep = (
                self.config.resume_window > 0
                and not self._stopping
                and not session.ending
                and ws.protocol.close_rcvd is None
            )
            if keep:
                session.detach(self.config.resume_window)
                self.set_detached(session, True)
                if self.store is not None:
                    # Numbered and logged meanwhile: a resume may come to another process.
                    session.outbox.attach(NullWire())
            else:
                session.close("disconnected")
        # else: resumed on another connection meanwhile; nothing here is ours to end.
        # websockets closes the socket when this handler returns: first let a close the
        # outbox started (1001 at shutdown, 1008, 4001) reach the client.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5 if ws.close_code is not None else 2.5):
                await wire.closed()

    async def _watch_stalls(self) -> None:
        """Close connections whose client stopped reading: see :meth:`SocketWire.check_stall`.

        One task for all connections, a few checks per stall timeout: nothing per frame.
        """
        stall = self.config.stall_timeout
        while True:
            await asyncio.sleep(max(0.05, stall / 4))
            now = time.monotonic()
            for wire in list(self._wires):
                if wire.check_stall(now, stall):
                    log.info("closing a connection that read nothing for %.1fs", stall)
                    self.metrics.stalled.inc()

    async def _read(
        self, ws: ServerConnection, wire: SocketWire, session: Session, *, first: bool = True
    ) -> Session | None:
        """Client frames -> the session's inbox, until the connection ends; returns the
        session the connection ended with (another one after a ``session.resume``), or
        None if the connection was relayed to another worker and that has ended."""
        decode = (
            responses_protocol.decode
            if isinstance(session.dialect, ResponsesDialect)
            else rt.decode
        )
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                try:
                    event: object = decode(frame)
                except errors.ProtocolError as err:
                    event = err
                if isinstance(event, rt.SessionResume):
                    resumed = await self.resumes.resume(event, ws, wire, session, first)
                    if resumed is None:
                        return None
                    session = resumed
                else:
                    if isinstance(event, responses_protocol.Create) and self.persistence:
                        # The dialect finds what it continues in this process's cache.
                        wanted = event.body.previous_response_id
                        if wanted is not None:
                            await self.persistence.fetch_response(wanted)
                    await session.deliver(event)
                first = False
        return session

    def set_detached(self, session: Session, detached: bool) -> None:
        if detached:
            self._detached.add(session)
        else:
            self._detached.discard(session)
        self.metrics.detached.set(len(self._detached))


def _select_subprotocol(
    connection: object,  # websockets passes the HttpConnection it was built with
    subprotocols: Sequence[Subprotocol],
) -> Subprotocol | None:
    # Browsers offer "realtime" plus the key as a second subprotocol; never echo the key.
    return Subprotocol("realtime") if "realtime" in subprotocols else None
