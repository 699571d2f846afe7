"""One gateway process: it builds the parts, starts them, drains and stops them.

Everything else is a part this module hands the narrow things it uses: the session table
(gateway/session_table.py), the API (gateway/api/: the WebSocket endpoint, the HTTP routes,
admission), the cluster layer (gateway/cluster/: resumes, relays, persistence, the Redis
store), the transport (gateway/transport/: HTTP/1.1, TLS, the socket wire) and the
scheduler with its engine. :class:`Gateway` is the :class:`~gateway.api.status.ServerState`
the API reads; no part holds the Gateway itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
import time
from collections.abc import ValuesView
from typing import cast

from websockets.asyncio.server import Server, ServerConnection, serve, unix_serve

from gateway.api import auth, routes
from gateway.api.admission import Admission
from gateway.api.chat_http import ChatCompletionsHttp
from gateway.api.completions_http import CompletionsHttp
from gateway.api.embeddings_http import EmbeddingsHttp
from gateway.api.responses_http import ResponsesHttp
from gateway.api.websocket import WebSocketEndpoint, select_subprotocol
from gateway.cluster import worker_relay
from gateway.cluster.persistence import Persistence, process_id
from gateway.cluster.redis_store import RedisStore
from gateway.cluster.resumes import Resumes
from gateway.cluster.store_relay import Inbound
from gateway.config import GatewayConfig
from gateway.engines.base import Engine, EngineError
from gateway.metrics import Metrics
from gateway.observability import Observability
from gateway.scheduler import Scheduler
from gateway.session_table import SessionTable
from gateway.tenants import KeyEntry
from gateway.transport import tls
from gateway.transport.coalesce import WriteBatch
from gateway.transport.head_timers import Pending
from gateway.transport.http1 import HttpService
from gateway.transport.router import Router
from gateway.transport.wire import CLOSE_TIMEOUT
from sessions.core import Session, SessionConfig
from sessions.dialects import DialectContext
from sessions.response_store import ResponseStore

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn
REVOKED_CLOSE_CODE = 4003  # a session whose key a SIGHUP removed (docs/deployment.md)


class Gateway:
    """One gateway process: the server, the scheduler and the shared engine."""

    def __init__(self, engine: Engine, config: GatewayConfig, metrics: Metrics | None = None):
        self.engine = engine
        self.config = config
        self.metrics = metrics or Metrics(config.worker)
        self.metrics.set_engine(engine.name)
        # The access log, the spans and the latency histograms (gateway/observability/).
        self.observability = Observability(
            config.access_log,
            metrics=self.metrics,
            otlp_traces_endpoint=config.otlp_traces_endpoint,
            provider_name=engine.name,
            worker=config.worker,
            untraced_routes=routes.UNTRACED_ROUTES,
        )
        # What one batch of work writes to a socket leaves in one write (coalesce.py).
        self.write_batch = WriteBatch()
        self.scheduler = Scheduler(
            engine,
            max_running=engine.capacity if config.max_running is None else config.max_running,
            max_queued=config.max_queued,
            metrics=self.metrics,
            generation_timeout=config.generation_timeout,
            merge_deltas=config.coalesce,
            write_batch=self.write_batch,
        )
        self.table = SessionTable(
            config,
            self.scheduler,
            self.metrics,
            worker_relay.owner_tag(config.node, config.worker),
            self._describe_sessions(),
            self.observability,
        )
        self.response_store = ResponseStore(config.response_store_bytes, config.response_store_ttl)
        dialects = DialectContext(self.response_store, config.max_parallel_per_session)
        # Without --client-secret-key: this process's own, kept across SIGHUPs.
        self._random_client_secret_key = secrets.token_bytes(32)
        self.admission = Admission(self._credentials(), config.allowed_origins)
        self.scheduler.tenants.limits = self.admission.credentials.limits
        self.observability.tenant_of = self.admission.tenant_of_http
        self.pending = Pending(config.max_handshakes, on_drop=self._handshake_dropped)
        self.store: RedisStore | None = None
        self.persistence: Persistence | None = None
        if config.session_store != "memory":
            self.store = RedisStore(
                config.session_store,
                process_id(config.node),
                resume_window=config.resume_window,
                lease_seconds=config.session_lease,
                metrics=self.metrics,
                write_batch=self.write_batch,
            )
            self.persistence = Persistence(
                self.store,
                self.table,
                self.response_store,
                self.metrics,
                dialects,
                config.resume_window,
            )
        resumes = Resumes(config, self.table, self.metrics, dialects, self.store, self.persistence)
        self.websocket = WebSocketEndpoint(
            config,
            self,
            self.table,
            self.admission,
            resumes,
            self.metrics,
            dialects,
            self.store,
            self.persistence,
            self.write_batch,
            self.observability,
        )
        self.responses_http = ResponsesHttp(
            config, self, self.table, self.admission, self.response_store, self.persistence
        )
        self.chat_http = ChatCompletionsHttp(config, self, self.table, self.admission)
        self.completions_http = CompletionsHttp(config, self, self.table, self.admission)
        self.embeddings_http = EmbeddingsHttp(config, self, self.table, self.admission)
        self._server: Server | None = None
        # The live TLS context of the listening socket; SIGHUP loads new files into it.
        self._tls: ssl.SSLContext | None = None
        self.http: HttpService | None = None
        self._stopping = False
        self._engine_task: asyncio.Task[None] | None = None
        self._relay_server: Server | None = None  # --workers: resumes other workers relay
        self._inbound: Inbound | None = None  # frames relays forward to our sessions
        self._draining = False  # SIGTERM with a store: no new work, answers finish
        self.started_at = time.time()
        # Set when the engine fails for good (Engine._fail); the CLI then stops and exits.
        self.engine_failed = asyncio.Event()
        engine.on_failure = lambda _reason: self.engine_failed.set()

    @property
    def sessions(self) -> ValuesView[Session]:
        """Every session: connected, or detached and waiting for a resume."""
        return self.table.sessions

    # -- the ServerState the API reads (gateway/api/status.py) --------------------------

    @property
    def engine_ready(self) -> bool:
        return self.engine.ready

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def ready(self) -> bool:
        """Taking new work: the engine is up and no drain or shutdown has begun."""
        return self.engine.ready and not self._draining and not self._stopping

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``; the WebSocket's is the same with ``ws``."""
        return "https" if self._tls is not None else "http"

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = next(iter(self._server.sockets)).getsockname()[1]
        return port

    def health(self) -> dict[str, object]:
        return {
            "status": "ok",
            "ready": self.ready,  # what /readyz answers, beside which worker says it
            "engine": self.engine.name,
            "model": self.model,
            "engine_details": self.engine.describe(),
            "worker": self.config.worker,
            "sessions": len(self.table),
            "responses": {"running": self.scheduler.running, "queued": self.scheduler.queued},
            "store": self.store.describe() if self.store is not None else {"kind": "memory"},
            "tls": tls.describe(self.config.tls) if self._tls and self.config.tls else None,
        }

    def render_metrics(self) -> bytes:
        m = self.metrics
        frames, delta_frames, sent = self.table.traffic()
        m.frames.set(frames)
        m.delta_frames.set(delta_frames)
        m.bytes_out.set(sent)
        m.trace_spans_dropped.set(self.observability.spans_dropped)
        return m.render()

    def _routes(self) -> Router:
        """Every plain HTTP route (a test's subclass adds its own)."""
        return routes.router(
            self.config,
            self,
            self.table,
            self.admission,
            self.responses_http,
            self.chat_http,
            self.completions_http,
            self.embeddings_http,
        )

    def _handshake_dropped(self, reason: str) -> None:
        self.metrics.handshakes_dropped.labels(reason=reason).inc()

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Listen at once; load the engine in the background (``/readyz`` says when)."""
        self.http = HttpService(
            self._routes(),
            websocket_paths=routes.WEBSOCKET_PATHS,
            pending=self.pending,
            handshake_timeout=self.config.handshake_timeout,
            keepalive_timeout=self.config.keepalive_timeout,
            logger=log,
            write_batch=self.write_batch,
            observability=self.observability,
        )
        if self.config.tls is not None:
            self._tls = tls.server_context(self.config.tls)
        # websockets keeps the listening socket; every connection starts as the HTTP
        # service's (gateway/transport/http1.py), which hands WebSocket upgrades back to websockets.
        self._server = await serve(
            self.websocket.handle,
            self.config.host,
            self.config.port,
            process_request=self.websocket.process_request,
            process_response=self.websocket.process_response,
            select_subprotocol=select_subprotocol,
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
            path = worker_relay.socket_path(self.config.worker_dir, self.config.worker)
            path.unlink(missing_ok=True)
            self._relay_server = await unix_serve(
                self.websocket.handle_relayed,
                str(path),
                max_size=self.config.max_message_bytes,
                compression=None,
                close_timeout=CLOSE_TIMEOUT,
            )
        if self.store is not None:
            await self.store.start()
            self._inbound = Inbound(self.store, self.table.get, self.config.resume_window)
            self._inbound.start()
        loop = asyncio.get_running_loop()
        self._engine_task = loop.create_task(self._start_engine())
        self.websocket.start()

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
        self.table.defaults = self._describe_sessions()
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
        return self.table.defaults.model

    async def wait_ready(self) -> None:
        assert self._engine_task is not None
        await asyncio.shield(self._engine_task)

    def _credentials(self) -> auth.Credentials:
        """The keys of the flags and the variable, then --api-key-file's as it is now (and
        --client-secret-key's key)."""
        keys: list[str | KeyEntry] = []  # the file first: a key there keeps its name, limits
        if self.config.api_key_file is not None:
            keys += auth.read_key_file(self.config.api_key_file)
        keys += self.config.api_keys
        path = self.config.client_secret_key_path
        return auth.Credentials(
            keys,
            max_secret_ttl=self.config.client_secret_ttl,
            client_secret_key=(
                auth.read_client_secret_key(path) if path else self._random_client_secret_key
            ),
        )

    def reload(self) -> None:
        """SIGHUP: the TLS files and the key file, read again."""
        self.reload_tls()
        self.reload_keys()

    def reload_keys(self) -> None:
        """New keys work at once; a removed key's tenant (when no key is left for it) loses
        its sessions (closed with 4003, their answers aborted in the engine) and its client
        secrets; a malformed file keeps the old keys, and the log says which line."""
        if self.config.api_key_file is None:
            return
        try:
            fresh = self._credentials()
        except auth.KeyConfigError as exc:
            log.error("SIGHUP: kept the old keys: %s", exc)
            return
        old = self.admission.credentials
        self.admission.credentials = fresh
        self.scheduler.tenants.limits = fresh.limits
        gone = {e.tenant for e in old.entries} - {e.tenant for e in fresh.entries}
        for session in list(self.table.sessions):
            if session.tenant in gone:
                session.close("disconnected", REVOKED_CLOSE_CODE, "the API key was revoked")
        log.info(
            "SIGHUP: %d keys from %s (%d tenants removed)",
            len(fresh.entries),
            self.config.api_key_file,
            len(gone),
        )

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
        self.table.close_all("server_shutdown", 1001, "server shutting down")
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
        await self.table.wait_ended(grace)
        if self._relay_server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._relay_server.wait_closed()
        await self.scheduler.close()
        self.websocket.close()
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
        await self.observability.close()
        self._server = None
