"""Settings of one gateway process, as the command line gives them."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tenants import KeyEntry
from gateway.transport.tls import TlsFiles


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    tls: TlsFiles | None = None  # None: plain http:// and ws:// (gateway/transport/tls.py)
    max_running: int | None = None  # None: the engine's own capacity
    max_queued: int = 256
    max_sessions: int | None = None
    max_message_bytes: int = 1 << 20
    allowed_origins: tuple[str, ...] = ()
    # Keys, plain or as read from --api-key-file (gateway/api/auth.py); none: the gateway
    # is open to anyone who reaches it.
    api_keys: tuple[str | KeyEntry, ...] = ()
    api_key_file: str | None = None  # read again on SIGHUP
    client_secret_ttl: int = 600  # seconds: default and longest lifetime of a client secret
    # Signs a sha256: line's client secrets (read again on SIGHUP); None: a random one.
    client_secret_key_path: str | None = None
    client_secret_url: str | None = None  # where the chat page gets a client secret
    handshake_timeout: float = 5.0  # seconds from TCP connect to a whole HTTP request
    max_handshakes: int = 1024  # connections still in their handshake; beyond, the oldest goes
    keepalive_timeout: float = 5.0  # seconds an idle plain-HTTP keep-alive connection stays open
    max_parallel_per_session: int = 4
    stall_timeout: float = 30.0
    generation_timeout: float = 300.0  # seconds without progress before a response fails; 0: off
    resume_window: float = 30.0  # seconds a dropped session waits for session.resume; 0: off
    replay_buffer_bytes: int = 256 << 10  # sent events kept per session, for a resume
    replay_buffer_total_bytes: int = 256 << 20  # ...and for all sessions together
    instructions: str | None = None  # None: the engine's default (a small model needs one)
    coalesce: bool = True
    shutdown_grace: float = 3.0  # seconds to flush response.done before closing sockets
    worker: str = "0"
    node: str | None = None  # this host's name in session ids, for a load balancer's routing
    worker_dir: str | None = None  # with --workers: where the workers' relay sockets are
    reuse_port: bool = False
    session_store: str = "memory"  # or a Redis, Sentinel or Cluster URL (cluster/redis_topology.py)
    drain_timeout: float = 30.0  # with a store: seconds answers may finish at SIGTERM
    session_lease: float = 3.0  # with a store: a session's lease (a dead owner's wait)
    response_store_bytes: int = 64 << 20  # stored Responses responses (store: true), per tenant
    response_store_ttl: float = 3600.0  # seconds a stored response can be continued
    background_retention: float = 600.0  # seconds a background response's events are kept
    served_model_names: tuple[str, ...] = ()  # --served-model-name; none: any name
    max_choices: int = 16  # --max-choices: answers one (Chat) Completions request may ask for
    responses_websocket: bool = True  # --no-responses-websocket: its upgrade answers 426
    hosted_tools: str = "ignore"  # --hosted-tools: "ignore" or "refuse" (OpenAI's own tools)
    responses_max_age: float = 3600.0  # seconds a Responses WebSocket may stay open; 0: no limit
    access_log: str = "text"  # --access-log: text, json or off (gateway/observability/)
    otlp_traces_endpoint: str | None = None  # --otlp-traces-endpoint: OTLP/HTTP; None: no traces
