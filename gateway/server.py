"""The network edge: one port for the Realtime WebSocket and a few HTTP routes.

gateway/http1.py reads every request on the port (h11) and answers the routes of
:meth:`Gateway._routes`; a WebSocket upgrade to one of ``WEBSOCKET_PATHS`` goes on to
websockets, which calls :meth:`Gateway._process_request` (the handshake's checks) and
then :meth:`Gateway._handle` with the open connection.

Per connection two tasks run: this module's reader (frames -> decoded events
-> the session's inbox) and the session actor (sessions/core.py, with its dialect), which may
outlive the connection (a dropped one waits for ``session.resume``). The
session's outbox (sessions/outbox.py) is the one path to the socket: it writes
through a :class:`~gateway.wire.SocketWire`, straight from the caller's stack
while the socket has room, and through a writer task of its own only while the
socket pushes back, so a slow client blocks nothing but its own outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import ssl
import time
import urllib.parse
import weakref
from collections.abc import Sequence, ValuesView
from dataclasses import dataclass
from typing import cast

from websockets.asyncio.server import Server, ServerConnection, serve, unix_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from gateway import auth, protocol, relay, responses_protocol, static, store_relay, tls
from gateway.config import GatewayConfig
from gateway.engines.base import Engine, EngineError
from gateway.handshake import Pending, refusal
from gateway.http1 import HttpReply, HttpRequest, HttpService
from gateway.metrics import Metrics
from gateway.persistence import Persistence, process_id
from gateway.responses_http import ResponsesHttp
from gateway.router import Router
from gateway.scheduler import Scheduler
from gateway.session_store import RedisStore
from gateway.store_relay import Inbound
from gateway.wire import (
    CLOSE_TIMEOUT,
    NullWire,
    SocketWire,
    cap_kernel_send_buffer,
    close_socket,
    forget_handshake,
)
from sessions import snapshot
from sessions.core import Dialect, Session, SessionConfig, SessionLimits
from sessions.outbox import Framing, Outbox, ReplayBudget
from sessions.realtime import RealtimeDialect, RealtimeFraming, resumed_event
from sessions.response_store import ResponseStore
from sessions.responses import ResponsesDialect, ResponsesFraming

log = logging.getLogger(__name__)

# Where a GET with "Upgrade: websocket" becomes a WebSocket (each also with a trailing
# slash); anywhere else it is answered 404. The handshake rules (_refuse_handshake) and
# the session (_handle) are the same on every one; the path picks the dialect.
REALTIME_PATH = "/v1/realtime"
RESPONSES_PATH = "/v1/responses"
WEBSOCKET_PATHS = (REALTIME_PATH, RESPONSES_PATH)
# The Responses WebSocket's resume (docs/protocol.md, "Resuming"): the upgrade's response
# names the session and its token; a new upgrade that sends them back, with the last
# sequence_number the client processed, continues that session.
SESSION_HEADER = "x-session-id"
RESUME_TOKEN_HEADER = "x-resume-token"
LAST_SEQUENCE_HEADER = "x-last-sequence-number"
CLIENT_SECRETS_PATHS = ("/v1/realtime/client_secrets", "/v1/realtime/client_secrets/")
PAGE_CONFIG_PATH = "/page-config.json"
KEY_SUBPROTOCOL = "openai-insecure-api-key."
# Headers that carry credentials: each at most once, and ASCII (a key is ASCII, and a
# browser sends an Origin in its ASCII serialization).
_SINGLE_HEADERS = ("Origin", "Authorization")
_ASCII_HEADERS = ("Origin", "Authorization", "Sec-WebSocket-Protocol")
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
        self.credentials = auth.Credentials(
            config.api_keys, max_secret_ttl=config.client_secret_ttl
        )
        self.pending = Pending(config.max_handshakes, on_drop=self._handshake_dropped)
        self._session_defaults = self._describe_sessions()
        self.response_store = ResponseStore(config.response_store_bytes, config.response_store_ttl)
        # Responses upgrades, by connection, until their handler takes them: the fresh
        # session's id and token, or the session to resume (see _process_response).
        self._upgrades: weakref.WeakKeyDictionary[ServerConnection, _Upgrade] = (
            weakref.WeakKeyDictionary()
        )
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
        # service's (gateway/http1.py), which hands WebSocket upgrades back to websockets.
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
            self._inbound = Inbound(self.store, self._sessions_by_id.get, self.config.resume_window)
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

    def _render_metrics(self) -> bytes:
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
        """Every plain HTTP route (gateway/router.py says how to add one)."""
        router = Router(self._not_found)
        router.add("GET", "/healthz", self._healthz)
        router.add("GET", "/readyz", self._readyz)
        router.add("GET", "/metrics", self._metrics)
        router.add("GET", PAGE_CONFIG_PATH, self._page_config)
        router.add("GET", "/", self._page)
        router.add("GET", "/static/{name}", self._page)
        for path in WEBSOCKET_PATHS:  # a GET that is no upgrade (an upgrade never gets here)
            router.add("GET", path, self._websocket_only)
            router.add("GET", path + "/", self._websocket_only)
        for path in CLIENT_SECRETS_PATHS:
            router.add("POST", path, self._mint_client_secret)
            router.add("*", path, self._mint_with_post)
        self.responses_http.register(router)
        return router

    async def _healthz(self, request: HttpRequest, reply: HttpReply) -> None:
        # Where this client reaches each endpoint, in the scheme this port speaks.
        host = request.headers.get("Host") or f"{self.config.host}:{self.port}"
        ws = "wss" if self._tls is not None else "ws"
        urls = {
            "page": f"{self.scheme}://{host}/",
            "realtime": f"{ws}://{host}{REALTIME_PATH}",
            "responses": f"{ws}://{host}{RESPONSES_PATH}",
            "http": f"{self.scheme}://{host}/v1",
        }
        reply.send_json(200, {**self.health(), "urls": urls})

    async def _readyz(self, request: HttpRequest, reply: HttpReply) -> None:
        ready = self.engine.ready and not self._draining
        reply.send_json(200 if ready else 503, {"ready": ready})

    async def _metrics(self, request: HttpRequest, reply: HttpReply) -> None:
        reply.send(200, self._render_metrics(), "text/plain; version=0.0.4; charset=utf-8")

    async def _page_config(self, request: HttpRequest, reply: HttpReply) -> None:
        reply.send_json(200, {"client_secret_url": self.config.client_secret_url})

    async def _page(self, request: HttpRequest, reply: HttpReply) -> None:
        found = static.page(request.params.get("name", "index.html"))
        if found is None:
            await self._not_found(request, reply)
            return
        body, content_type = found
        reply.send(200, body, content_type, static.PAGE_HEADERS)

    async def _websocket_only(self, request: HttpRequest, reply: HttpReply) -> None:
        name = "Realtime" if request.path.rstrip("/") == REALTIME_PATH else "Responses"
        reply.send_text(
            426,
            f"This is the {name} WebSocket endpoint: connect with a WebSocket client.",
            {"Upgrade": "websocket"},
        )

    async def _not_found(self, request: HttpRequest, reply: HttpReply) -> None:
        if request.method in ("GET", "HEAD"):
            reply.send_text(
                404, f"Not found: {request.path}. The WebSocket is at {WEBSOCKET_PATHS[0]}."
            )
        else:
            reply.send_text(405, f"{request.method} is not served here.", {"Allow": "GET, HEAD"})

    async def _mint_with_post(self, request: HttpRequest, reply: HttpReply) -> None:
        _api_error(reply, 405, "Mint a client secret with POST.", "method_not_allowed")

    async def _mint_client_secret(self, request: HttpRequest, reply: HttpReply) -> None:
        """``POST /v1/realtime/client_secrets``: the hosted Realtime API's shape."""
        malformed = _malformed_credentials(request.headers)
        if malformed is not None:
            _api_error(reply, 400, malformed, "invalid_header")
            return
        origin = request.headers.get("Origin")
        allowed = self.config.allowed_origins
        if allowed and origin is not None and origin not in allowed:
            _api_error(reply, 403, f"Origin {origin} is not allowed.", "origin_not_allowed")
            return
        offered = _bearer(request.headers)
        api_key = self.credentials.is_api_key(offered)
        if self.credentials.required and api_key is None:
            message = (
                "A client secret cannot mint client secrets: use an API key."
                if offered.startswith(auth.SECRET_PREFIX)
                else "Missing or wrong API key: send 'Authorization: Bearer KEY'."
            )
            _api_error(reply, 401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return
        try:
            ttl = auth.parse_secret_request(request.body)
        except auth.SecretRequestError as err:
            _api_error(reply, 400, err.message, err.code, param=err.param)
            return
        secret = self.credentials.mint(api_key, ttl)
        defaults = self._session_defaults
        session = {
            "object": "realtime.session",
            "type": "realtime",
            "model": defaults.model,
            "instructions": defaults.instructions,
            "output_modalities": ["text"],
        }
        reply.send_json(
            200, {"value": secret.value, "expires_at": secret.expires_at, "session": session}
        )

    # -- the WebSocket handshake (websockets calls these for upgrades only) -------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        try:
            refused = self._refuse_handshake(request.headers)
        except Exception:
            # Logged here: websockets would log it only at DEBUG (see __main__).
            log.exception("failed to answer GET %s", request.path)
            return refusal(500, "The gateway failed to answer; its log says why.")
        if refused is None and request.path.partition("?")[0].rstrip("/") == RESPONSES_PATH:
            refused = self._check_resume_headers(request)
        if refused is not None:
            self.metrics.connections_refused.labels(status=str(refused.status_code)).inc()
        return refused

    def _refuse_handshake(self, headers: Headers) -> Response | None:
        malformed = _malformed_credentials(headers)
        if malformed is not None:
            return refusal(400, malformed)
        origin = headers.get("Origin")
        allowed = self.config.allowed_origins
        if allowed and origin is not None and origin not in allowed:
            return refusal(403, f"Origin {origin} is not allowed.")
        if self.credentials.required and not self._authorized(headers):
            return refusal(
                401,
                "Missing, wrong or expired credential: send 'Authorization: Bearer KEY' or the "
                "subprotocol 'openai-insecure-api-key.KEY', where KEY is an API key or a "
                "client secret (ek_...) that has not expired.",
                {"WWW-Authenticate": "Bearer"},
            )
        limit = self.config.max_sessions
        if limit is not None and len(self._wires) + len(self._detached) >= limit:
            return refusal(503, f"Too many sessions (limit {limit}); retry later.")
        if self._draining:
            return refusal(503, "This gateway is draining for a restart; connect to another.")
        if not self.engine.ready:
            return refusal(
                503, "The engine is not ready (loading, or no replica is up); retry shortly."
            )
        return None

    def _authorized(self, headers: Headers) -> bool:
        """Does the Bearer header or a key subprotocol hold a key or a live client secret?"""
        offered = [_bearer(headers)]
        for header in headers.get_all("Sec-WebSocket-Protocol"):
            offered += [
                p.strip()[len(KEY_SUBPROTOCOL) :]
                for p in header.split(",")
                if p.strip().startswith(KEY_SUBPROTOCOL)
            ]
        return any(self.credentials.admits(o) for o in offered if o)

    def _handshake_dropped(self, reason: str) -> None:
        self.metrics.handshakes_dropped.labels(reason=reason).inc()

    # -- the Responses WebSocket's session headers --------------------------------

    def _check_resume_headers(self, request: Request) -> Response | None:
        """A resume asked for that cannot be served: refused before the upgrade (the
        client then knows it lost the session, and starts a new one)."""
        asked = _resume_fields(request)
        if asked is None:
            return None
        code = self._resumable(asked)
        if isinstance(code, str) and code != "in_store":
            self.metrics.resumes.labels(outcome=code).inc()
            return refusal(404 if code == "session_not_found" else 409, _RESUME_ERRORS[code])
        return None

    def _resumable(self, asked: tuple[str, str, str]) -> str | tuple[Session, str, int]:
        """The session a resume names, its token and last number; else why not."""
        session_id, token, last = asked
        session = self._sessions_by_id.get(session_id)
        if self.config.resume_window <= 0:
            return "session_not_found"
        if not re.fullmatch(r"-1|\d{1,15}", last):
            return "resume_gap"
        if session is None and self.persistence is not None:
            return "in_store"  # decided once the socket is open (it takes Redis)
        if session is None or not isinstance(session.dialect, ResponsesDialect):
            return "session_not_found"
        code = session.can_resume(token, int(last))
        return code if code is not None else (session, token, int(last))

    def _process_response(
        self, connection: ServerConnection, request: Request, response: Response
    ) -> Response | None:
        """Name the session of a Responses upgrade in its answer: a fresh one, or the one
        the request resumes."""
        if (
            response.status_code != 101
            or request.path.partition("?")[0].rstrip("/") != RESPONSES_PATH
        ):
            return None
        asked = _resume_fields(request)
        found = self._resumable(asked) if asked is not None else None
        if isinstance(found, tuple):
            upgrade = _Upgrade(found[0].id, found[1], found[0], found[2])
        elif found == "in_store" and asked is not None:
            upgrade = _Upgrade(asked[0], asked[1], None, int(asked[2]), in_store=True)
        else:
            upgrade = _Upgrade(self._new_session_id(), secrets.token_urlsafe(24))
        self._upgrades[connection] = upgrade
        response.headers[SESSION_HEADER] = upgrade.session_id
        response.headers[RESUME_TOKEN_HEADER] = upgrade.token
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
        upgrade = self._upgrades.pop(ws, None)
        forget_handshake(ws)
        wire = SocketWire(ws, self.store)
        self._wires.add(wire)
        session: Session | None
        if upgrade is None:
            session = self._open_session(RealtimeDialect(), RealtimeFraming())
            session.outbox.attach(wire)
        elif upgrade.in_store:
            found = await self._from_store(
                upgrade.session_id, upgrade.token, upgrade.last_sequence_number, ws, wire, None
            )
            if not isinstance(found, Session):
                self._wires.discard(wire)
                if found is not None:
                    await close_socket(ws, 4004, found)
                return
            session = found
        else:
            session = self._responses_session(upgrade, wire)
            if session is None:
                self._wires.discard(wire)
                await close_socket(ws, 4004, "session_not_found")
                return
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

    def _responses_session(self, upgrade: _Upgrade, wire: SocketWire) -> Session | None:
        """The session a Responses upgrade named: fresh, or resumed (None: it went away
        between the upgrade's answer and now)."""
        if upgrade.resume is None:
            session = self._open_session(
                ResponsesDialect(self.response_store),
                ResponsesFraming(),
                upgrade.session_id,
                upgrade.token,
            )
            session.outbox.attach(wire)
            return session
        target = upgrade.resume
        code = target.resume(upgrade.token, upgrade.last_sequence_number, wire, rotate=False)
        self.metrics.resumes.labels(outcome=code or "resumed").inc()
        if code is not None:
            return None
        self._set_detached(target, False)
        log.info("session %s resumed after event %d", target.id, upgrade.last_sequence_number)
        return target

    @staticmethod
    def _expire(session: Session) -> None:
        dialect = session.dialect
        if isinstance(dialect, ResponsesDialect):
            session.call_soon(dialect.expire)

    async def _handle_relayed(self, ws: ServerConnection) -> None:
        """A resume another worker received for a session of ours (gateway/relay.py): the
        first event is that ``session.resume``; after it, as any connection."""
        if self._stopping:
            await close_socket(ws, 1001, "server shutting down")
            return
        wire = SocketWire(ws, self.store)
        self._wires.add(wire)
        session: Session | None = None
        try:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                async with asyncio.timeout(relay.CONNECT_TIMEOUT):
                    event = protocol.decode(await ws.recv())
                if isinstance(event, protocol.SessionResume):
                    taken = self._take_over(event, wire)
                    if isinstance(taken, str):  # the other worker tells its client why
                        refusal = protocol.ProtocolError(taken, _RESUME_ERRORS[taken])
                        await ws.send(protocol.encode(protocol.error_event(refusal)), text=True)
                    else:
                        session = taken
            if session is None:
                return
            session = await self._read(ws, wire, session, first=False)
        except protocol.ProtocolError:
            return
        finally:
            self._wires.discard(wire)
            if session is not None:
                await self._let_go(ws, wire, session)

    def _new_session_id(self) -> str:
        # The worker that holds a session is in its id: a resume landing on another
        # worker is relayed there (gateway/relay.py).
        c = self.config
        return protocol.new_id(f"sess_{relay.owner_tag(c.node, c.worker)}")

    def _open_session(
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
            session_id=session_id or self._new_session_id(),
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

    def open_http_session(self, dialect: Dialect, framing: Framing, replay_bytes: int) -> Session:
        """A session for one HTTP request's response (gateway/responses_http.py)."""
        return self._open_session(dialect, framing, replay_bytes=replay_bytes)

    def refuse_http(
        self, headers: Headers, *, need_engine: bool = True
    ) -> tuple[int, protocol.ProtocolError, dict[str, str] | None] | None:
        """Why an API request over plain HTTP may not be served (the WebSocket handshake's
        rules, as JSON errors): (status, error, headers), or None."""

        def no(
            status: int, code: str, message: str, extra: dict[str, str] | None = None
        ) -> tuple[int, protocol.ProtocolError, dict[str, str] | None]:
            kind = "invalid_request_error" if status < 500 else "server_error"
            return status, protocol.ProtocolError(code, message, error_type=kind), extra

        malformed = _malformed_credentials(headers)
        if malformed is not None:
            return no(400, "invalid_header", malformed)
        origin = headers.get("Origin")
        allowed = self.config.allowed_origins
        if allowed and origin is not None and origin not in allowed:
            return no(403, "origin_not_allowed", f"Origin {origin} is not allowed.")
        if self.credentials.required and not self.credentials.admits(_bearer(headers)):
            message = "Missing, wrong or expired key: send 'Authorization: Bearer KEY'."
            return no(401, "invalid_api_key", message, {"WWW-Authenticate": "Bearer"})
        if need_engine and (self._stopping or self._draining or not self.engine.ready):
            message = "The engine is not ready (loading, stopping, or no replica is up)."
            return no(503, "engine_unavailable", message + " Retry shortly.", {"Retry-After": "1"})
        return None

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
            self._set_detached(session, False)

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
                self._set_detached(session, True)
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
            else protocol.decode
        )
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                try:
                    event: object = decode(frame)
                except protocol.ProtocolError as err:
                    event = err
                if isinstance(event, protocol.SessionResume):
                    resumed = await self._resume(event, ws, wire, session, first)
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

    async def _resume(
        self,
        event: protocol.SessionResume,
        ws: ServerConnection,
        wire: SocketWire,
        fresh: Session,
        first: bool,
    ) -> Session | None:
        """Take over the session ``event`` names (here, or relayed to the worker holding
        it: then None once that relay has ended), or tell why not and go on with ``fresh``."""
        if not first:
            await fresh.deliver(
                protocol.ProtocolError(
                    "invalid_event",
                    "session.resume must be the first event on a new connection.",
                    event_id=event.event_id,
                )
            )
            return fresh
        c = self.config
        if (
            self.persistence is not None
            and c.resume_window > 0
            and event.session_id not in self._sessions_by_id
        ):
            return await self._resume_from_store(event, ws, wire, fresh)
        owner = relay.owner_of(event.session_id)
        if (
            c.worker_dir is not None
            and self.store is None  # with a store, the store relays (gateway/store_relay.py)
            and c.resume_window > 0
            and owner is not None
            and owner != relay.owner_tag(c.node, c.worker)
            and owner == relay.owner_tag(c.node, relay.worker_of(owner))  # this host's
        ):
            opened = await relay.open_leg(c.worker_dir, relay.worker_of(owner), event)
            if opened is not None and opened[1].get("type") == "session.resumed":
                leg, answer = opened
                self._discard_fresh(fresh, wire)
                await wire.write_later(protocol.encode(answer))
                await relay.pipe(ws, wire, leg)
                # The owner's close code (1001, 4001...) must reach the client before
                # this handler returns and websockets closes with 1000 on its own.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CLOSE_TIMEOUT + 0.5):
                        await wire.closed()
                return None
            if opened is not None:
                await opened[0].close()
            code = opened[1].get("error", {}).get("code") if opened is not None else None
            return await self._refuse_resume(event, fresh, code or "session_not_found")
        if event.session_id == fresh.id:  # the session this connection already has
            return await self._refuse_resume(event, fresh, "session_not_found")
        target = self._take_over(event, wire)
        if isinstance(target, str):
            return await self._refuse_resume(event, fresh, target)
        self._discard_fresh(fresh, wire)
        return target

    async def _resume_from_store(
        self,
        event: protocol.SessionResume,
        ws: ServerConnection,
        wire: SocketWire,
        fresh: Session,
    ) -> Session | None:
        """A Realtime resume of a session another process holds (or held): relayed while
        its owner lives, else taken over (gateway/persistence.py)."""
        found = await self._from_store(
            event.session_id, event.resume_token, event.last_sequence_number, ws, wire, fresh
        )
        if isinstance(found, str):
            return await self._refuse_resume(event, fresh, found)
        return found

    async def _from_store(
        self,
        session_id: str,
        token: str,
        last: int,
        ws: ServerConnection,
        wire: SocketWire,
        fresh: Session | None,
    ) -> Session | str | None:
        """The session from the store on ``wire``: taken over (returned), relayed (None,
        once the relay has ended) or an error code."""
        persistence, store = self.persistence, self.store
        assert persistence is not None and store is not None
        loaded = await persistence.load(session_id, token)
        if isinstance(loaded, str):
            self.metrics.resumes.labels(outcome=loaded).inc()
            return loaded
        if loaded.owner is not None and loaded.owner != store.process:
            if store_relay.gap(loaded, last):
                return "resume_gap"
            if fresh is not None:
                self._discard_fresh(fresh, wire)
            greeting = None
            if loaded.state["dialect"] == "realtime":
                config = snapshot.config_from(loaded.state["config"])
                greeting = resumed_event(session_id, config, token)
            self.metrics.resumes.labels(outcome="relayed").inc()
            await store_relay.relay(ws, wire, store, loaded, last, greeting)
            return None
        taken = await persistence.take_over(loaded, token, last, wire)
        self.metrics.resumes.labels(outcome=taken if isinstance(taken, str) else "resumed").inc()
        if isinstance(taken, Session) and fresh is not None:
            self._discard_fresh(fresh, wire)
        return taken

    def _take_over(self, event: protocol.SessionResume, wire: SocketWire) -> Session | str:
        """Attach ``wire`` to the session ``event`` names, if its token and replay buffer
        allow; else the error code that says why not."""
        target = self._sessions_by_id.get(event.session_id)
        code = (
            target.resume(event.resume_token, event.last_sequence_number, wire)
            if target is not None and self.config.resume_window > 0
            else "session_not_found"
        )
        self.metrics.resumes.labels(outcome=code or "resumed").inc()
        if code is not None or target is None:
            return code or "session_not_found"
        self._set_detached(target, False)
        log.info("session %s resumed after event %d", target.id, event.last_sequence_number)
        return target

    async def _refuse_resume(
        self, event: protocol.SessionResume, fresh: Session, code: str
    ) -> Session:
        error = protocol.ProtocolError(code, _RESUME_ERRORS[code], event_id=event.event_id)
        await fresh.deliver(error)
        return fresh

    def _discard_fresh(self, fresh: Session, wire: SocketWire) -> None:
        """The session the connection started with goes, quietly: the socket belongs to
        the resumed one now."""
        fresh.outbox.detach(wire)
        fresh.close("disconnected")

    def _set_detached(self, session: Session, detached: bool) -> None:
        if detached:
            self._detached.add(session)
        else:
            self._detached.discard(session)
        self.metrics.detached.set(len(self._detached))


@dataclass(frozen=True, slots=True)
class _Upgrade:
    """What a Responses upgrade's answer said: a fresh session's id and token, or the
    session it resumes (with the token presented and the last number processed)."""

    session_id: str
    token: str
    resume: Session | None = None
    last_sequence_number: int = -1
    in_store: bool = False  # a session another process holds or held


_RESUME_ERRORS: dict[str, str] = {
    "session_busy": "Another gateway is taking this session over right now; retry the resume.",
    "session_not_found": "No session with that id and resume token can be resumed here "
    "(unknown, ended, or its resume window is over); this connection goes on as a new session.",
    "resume_gap": "Some events after last_sequence_number are no longer kept, so the session "
    "cannot be resumed without losing them; this connection goes on as a new session.",
}


def _resume_fields(request: Request) -> tuple[str, str, str] | None:
    """(session id, resume token, last sequence number) of a Responses resume: from the
    headers (openai-python's reconnect hook sets headers) or else the query (openai-node's
    sets only query parameters); None if the request asks for no resume."""
    headers = request.headers
    if SESSION_HEADER in headers:
        return (
            headers.get(SESSION_HEADER, ""),
            headers.get(RESUME_TOKEN_HEADER, ""),
            headers.get(LAST_SEQUENCE_HEADER, "-1").strip(),
        )
    query = urllib.parse.parse_qs(request.path.partition("?")[2])
    if "resume_token" not in query:
        return None
    return (
        query.get("session_id", [""])[0],
        query["resume_token"][0],
        query.get("last_sequence_number", ["-1"])[0].strip(),
    )


def _malformed_credentials(headers: Headers) -> str | None:
    """Why the credential headers cannot be read (sent twice, not ASCII), or None."""
    for name in _SINGLE_HEADERS:
        if len(headers.get_all(name)) > 1:
            return f"Send the {name} header once."
    for name in _ASCII_HEADERS:
        if not all(value.isascii() for value in headers.get_all(name)):
            return f"The {name} header must be ASCII."
    return None


def _bearer(headers: Headers) -> str:
    """The token of ``Authorization: Bearer TOKEN`` ("" if there is none)."""
    scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _api_error(
    reply: HttpReply,
    status: int,
    message: str,
    code: str,
    extra: dict[str, str] | None = None,
    *,
    param: str | None = None,
) -> None:
    """An error in the OpenAI REST API's shape, which the SDK turns into its exceptions."""
    error_type = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": error_type, "code": code, "param": param}}
    reply.send_json(status, body, extra)


def _select_subprotocol(
    connection: object,  # websockets passes the HttpConnection it was built with
    subprotocols: Sequence[Subprotocol],
) -> Subprotocol | None:
    # Browsers offer "realtime" plus the key as a second subprotocol; never echo the key.
    return Subprotocol("realtime") if "realtime" in subprotocols else None
