"""``python -m gateway`` / ``llm-gateway``: parse flags, run until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import importlib.util
import logging
import os
import re
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from websockets.exceptions import ConnectionClosed, InvalidHandshake

from gateway import engines
from gateway.api import auth
from gateway.cluster import redis_topology
from gateway.config import GatewayConfig
from gateway.engines.base import EngineError, EngineUnavailableError
from gateway.observability import access_log
from gateway.server import Gateway
from gateway.transport import tls

log = logging.getLogger("gateway")

PROG = "llm-gateway"
SERVED_APIS = "Realtime, Responses, Chat Completions, Completions"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOOPS = ("asyncio", "uvloop")
LOOP_ENV_VAR = "LLM_GATEWAY_LOOP"
"""The default for ``--loop`` where set (the test suite sets it, so that every gateway it
starts runs on the loop under test)."""


def default_loop() -> str:
    """``$LLM_GATEWAY_LOOP`` if set, else uvloop where it is installed (Linux, macOS)."""
    chosen = os.environ.get(LOOP_ENV_VAR, "").strip().lower()
    if chosen:
        return chosen
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes the event loop ``--loop`` names, whatever event loop policy is set."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if sys.platform == "win32":
        return asyncio.ProactorEventLoop
    return asyncio.SelectorEventLoop


def _number(
    kind: type[int] | type[float], low: float, high: float | None = None
) -> Callable[[str], Any]:
    """An argparse type that refuses values outside ``low``..``high`` with a clear message."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


count = _number(int, 1)
port_number = _number(int, 0, 65535)


class _HelpFormatter(argparse.HelpFormatter):
    """One line per flag where the terminal allows; each default shown once, and only a real one.

    A help that names its default itself (``default: the engine's``) is left alone, and so is
    a flag whose default is "nothing" (None, an empty list, off): adding a flag is one
    ``add_argument`` call with no default written twice.
    """

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, [], argparse.SUPPRESS)
        if "default:" in text or "(default)" in text or not shown or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        """``N`` for a number, else the last word of the name: ``--upstream-api-key KEY``."""
        return "N" if action.type in (int, float) else action.dest.rsplit("_", 1)[-1].upper()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not the whole usage: what is wrong and where to look."""
        self.exit(2, f"{PROG}: {message} (--help lists every flag)\n")


SESSION_STORE_ENV_VAR = "LLM_GATEWAY_SESSION_STORE"
"""The default for ``--session-store`` where set (so that a password need not be on the
command line)."""


def session_store_url(text: str) -> str:
    """``--session-store``: ``memory``, or a Redis, Sentinel or Cluster URL
    (gateway/cluster/redis_topology.py)."""
    text = text.strip()
    if text == "memory":
        return text
    try:
        redis_topology.parse(text)
    except redis_topology.StoreUrlError as exc:
        raise argparse.ArgumentTypeError(f"use memory, or {exc}") from None
    return text


def otlp_url(text: str) -> str:
    """``--otlp-traces-endpoint``: an ``http://`` or ``https://`` URL (OTLP/HTTP's whole
    traces URL, usually ending in ``/v1/traces``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError("expected a URL like http://127.0.0.1:4318/v1/traces")
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        raise argparse.ArgumentTypeError(
            "needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http: pip install them"
        )
    return text.strip()


def node_name(text: str) -> str:
    """``--node``: letters, digits and ``-``, so that session ids stay parseable."""
    if not re.fullmatch(r"[A-Za-z0-9-]{1,32}", text):
        raise argparse.ArgumentTypeError("use 1 to 32 letters, digits or '-'")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The flags, by group. Adding one is one ``GROUP.add_argument(...)`` line; its default
    is shown by the formatter (write ``default: ...`` in the help only when it is not a value)."""
    parser = _Parser(
        prog="python -m gateway",
        usage="%(prog)s [options]",
        description="Streaming LLM gateway: OpenAI's Realtime (WebSocket), Responses (WebSocket"
        " and HTTP), Chat Completions and Completions APIs, and a chat page, on one port over"
        " one shared engine. README.md explains every flag.",
        formatter_class=_HelpFormatter,
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument(
        "--port",
        type=port_number,
        default=8765,
        help="port to listen on; 0: any free",
    )
    server.add_argument(
        "--workers", type=count, default=1, metavar="N", help="processes sharing the port"
    )
    server.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        metavar="LEVEL",
        help="debug, info, warning or error",
    )
    server.add_argument(
        "--access-log",
        type=str.lower,
        choices=access_log.FORMATS,
        default="text",
        metavar="FORMAT",
        help="request log: text, json or off",
    )
    server.add_argument(
        "--otlp-traces-endpoint",
        type=otlp_url,
        metavar="URL",
        help="export traces to this OTLP/HTTP URL",
    )
    server.add_argument(
        "--node",
        type=node_name,
        metavar="NAME",
        help="host name in session ids, for routing",
    )
    server.add_argument(
        "--no-responses-websocket",
        action="store_true",
        help="no Responses WebSocket: upgrades get 426",
    )
    server.add_argument(
        "--no-coalesce", action="store_true", help="a frame per delta, no merging (benchmarks)"
    )
    server.add_argument(
        "--loop",
        type=str.lower,
        choices=LOOPS,
        default=default_loop(),
        metavar="NAME",
        help="asyncio, uvloop (default: uvloop if installed)",
    )
    # Set by --workers for each process it starts.
    server.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    server.add_argument("--worker-dir", help=argparse.SUPPRESS)  # their relay sockets

    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-running",
        type=count,
        metavar="N",
        help="responses at once (default: engine capacity)",
    )
    limits.add_argument(
        "--max-queued",
        type=_number(int, 0),
        default=256,
        metavar="N",
        help="responses waiting for a slot",
    )
    limits.add_argument(
        "--max-choices",
        type=_number(int, 1, 128),
        default=16,
        metavar="N",
        help="choices per completions request",
    )
    limits.add_argument(
        "--max-sessions",
        type=count,
        metavar="N",
        help="sessions, detached too (default: no limit)",
    )
    limits.add_argument(
        "--max-message-bytes",
        type=_number(int, 1024),
        default=1 << 20,
        metavar="N",
        help="largest client frame (default: 1 MiB)",
    )
    limits.add_argument(
        "--handshake-timeout",
        type=_number(float, 0.1),
        default=5.0,
        metavar="SECONDS",
        help="for a new connection's request",
    )
    limits.add_argument(
        "--keepalive-timeout",
        type=_number(float, 0.1),
        default=5.0,
        metavar="SECONDS",
        help="for an idle HTTP connection",
    )
    limits.add_argument(
        "--max-handshakes",
        type=count,
        default=1024,
        metavar="N",
        help="unfinished handshakes kept",
    )
    limits.add_argument(
        "--max-parallel-per-session",
        type=count,
        default=4,
        metavar="N",
        help="out-of-band responses per session",
    )
    limits.add_argument(
        "--generation-timeout",
        type=_number(float, 0),
        default=300.0,
        metavar="SECONDS",
        help="fail a stalled answer; 0: off",
    )
    limits.add_argument(
        "--resume-window",
        type=_number(float, 0),
        default=30.0,
        metavar="SECONDS",
        help="keep dropped sessions; 0: off",
    )
    limits.add_argument(
        "--replay-bytes",
        type=_number(int, 1024),
        default=256 << 10,
        metavar="N",
        help="kept per session for resume (default: 256 KiB)",
    )
    limits.add_argument(
        "--replay-total-bytes",
        type=_number(int, 1024),
        default=256 << 20,
        metavar="N",
        help="kept for all sessions (default: 256 MiB)",
    )
    limits.add_argument(
        "--session-store",
        default=os.environ.get(SESSION_STORE_ENV_VAR, "memory"),
        metavar="URL",
        type=session_store_url,
        help="memory (default), redis[+sentinel|+cluster]://",
    )
    limits.add_argument(
        "--session-lease",
        type=_number(float, 0.3),
        default=3.0,
        metavar="N",
        help="a session's lease, seconds",
    )
    limits.add_argument(
        "--drain-timeout",
        type=_number(float, 0),
        default=30.0,
        metavar="N",
        help="SIGTERM grace, with a store",
    )
    limits.add_argument(
        "--response-store-bytes",
        type=_number(int, 0),
        default=64 << 20,
        metavar="N",
        help="stored responses, per tenant (default: 64 MiB)",
    )
    limits.add_argument(
        "--response-store-ttl",
        type=_number(float, 0),
        default=3600.0,
        metavar="SECONDS",
        help="stored responses' lifetime",
    )
    limits.add_argument(
        "--background-retention",
        type=_number(float, 0),
        default=600.0,
        metavar="N",
        help="keep ended background answers",
    )
    limits.add_argument(
        "--responses-max-age",
        type=_number(float, 0),
        default=3600.0,
        metavar="N",
        help="Responses WS age; 0: none",
    )
    limits.add_argument(
        "--stall-timeout",
        type=_number(float, 0.01),
        default=30.0,
        metavar="SECONDS",
        help="close stalled clients after",
    )

    security = parser.add_argument_group("security")
    security.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allowed Origin, repeatable (default: any)",
    )
    security.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"key, repeatable; or ${auth.ENV_VAR}",
    )
    security.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="file of keys clients may send, one a line",
    )
    security.add_argument(
        "--client-secret-ttl",
        type=_number(int, auth.MIN_SECRET_TTL),
        default=auth.DEFAULT_SECRET_TTL,
        metavar="SECONDS",
        help="max life of a client secret",
    )
    security.add_argument(
        "--client-secret-key",
        metavar="FILE",
        help="signs sha256: lines' secrets (default: random)",
    )
    security.add_argument("--tls-cert", metavar="FILE", help="PEM certificate: serve https, wss")
    security.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    security.add_argument(
        "--tls-key-password-file", metavar="FILE", help="password of an encrypted --tls-key"
    )
    security.add_argument(
        "--tls-self-signed",
        nargs="?",
        const="",
        metavar="DIR",
        help="TLS with a localhost certificate made here",
    )
    security.add_argument(
        "--client-secret-url",
        metavar="PATH",
        help="where the chat page POSTs for a client secret",
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--engine",
        default=engines.DEFAULT_ENGINE,
        choices=sorted(engines.ENGINES),
        metavar="NAME",
        help="llamacpp (default), sim, trtllm, upstream",
    )
    engine.add_argument(
        "--model",
        metavar="MODEL",
        help="model to serve (default: the engine's own)",
    )
    engine.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a model name to serve (repeatable)",
    )
    engine.add_argument(
        "--hosted-tools",
        choices=("ignore", "refuse"),
        default="ignore",
        metavar="MODE",
        help="drop or refuse hosted tools",
    )
    engine.add_argument(
        "--instructions",
        metavar="TEXT",
        help="new sessions' instructions (default: engine's)",
    )
    engines.add_arguments(parser)
    return parser


def tls_from_args(args: argparse.Namespace) -> tls.TlsFiles | None:
    """The TLS files the flags name, checked now (one clear line, before any worker
    starts), or None for plain http:// and ws://."""
    if args.tls_self_signed is not None:
        if args.tls_cert or args.tls_key or args.tls_key_password_file:
            raise tls.TlsError(
                "--tls-self-signed makes its own certificate: drop --tls-cert/--tls-key"
            )
        directory = Path(args.tls_self_signed) if args.tls_self_signed else tls.default_dir()
        files = tls.self_signed(directory)
        if args.worker_index is None:  # its workers would only repeat it
            log.info(
                "TLS: a self-signed certificate for %s at %s (trust it: in a browser, import "
                "it as an authority; Node: NODE_EXTRA_CA_CERTS=FILE; Python: SSL_CERT_FILE=FILE)",
                ", ".join(tls.SELF_SIGNED_NAMES),
                files.cert,
            )
        return files
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_key_password_file:
            raise tls.TlsError("--tls-key-password-file needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise tls.TlsError("--tls-cert and --tls-key go together: give both")
    password = Path(args.tls_key_password_file) if args.tls_key_password_file else None
    files = tls.TlsFiles(Path(args.tls_cert), Path(args.tls_key), password)
    tls.server_context(files)  # raises TlsError, with which file and why
    return files


def _checked_key_file(path: str | None) -> str | None:
    """The key file, read once here so that a bad line stops the start with one line
    (the gateway reads it again at start and on SIGHUP)."""
    if path is not None:
        auth.read_key_file(path)
    return path


def _checked_client_secret_key(path: str | None) -> str | None:
    if path is not None:
        auth.read_client_secret_key(path)
    return path


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        tls=tls_from_args(args),
        max_running=args.max_running,
        max_queued=args.max_queued,
        max_choices=args.max_choices,
        max_sessions=args.max_sessions,
        max_message_bytes=args.max_message_bytes,
        allowed_origins=tuple(args.allowed_origin),
        api_keys=auth.read_api_keys(args.api_key),
        api_key_file=_checked_key_file(args.api_key_file),
        client_secret_ttl=args.client_secret_ttl,
        client_secret_key_path=_checked_client_secret_key(args.client_secret_key),
        client_secret_url=args.client_secret_url,
        handshake_timeout=args.handshake_timeout,
        max_handshakes=args.max_handshakes,
        keepalive_timeout=args.keepalive_timeout,
        max_parallel_per_session=args.max_parallel_per_session,
        stall_timeout=args.stall_timeout,
        generation_timeout=args.generation_timeout,
        resume_window=args.resume_window,
        replay_buffer_bytes=args.replay_bytes,
        replay_buffer_total_bytes=args.replay_total_bytes,
        response_store_bytes=args.response_store_bytes,
        response_store_ttl=args.response_store_ttl,
        responses_max_age=args.responses_max_age,
        access_log=args.access_log,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        served_model_names=tuple(args.served_model_name),
        hosted_tools=args.hosted_tools,
        background_retention=args.background_retention,
        session_store=args.session_store,
        drain_timeout=args.drain_timeout,
        session_lease=args.session_lease,
        coalesce=not args.no_coalesce,
        responses_websocket=not args.no_responses_websocket,
        instructions=args.instructions,
        worker=str(args.worker_index or 0),
        worker_dir=args.worker_dir,
        node=args.node,
        reuse_port=args.worker_index is not None,
    )


def ready_line(gateway: Gateway, seconds: float) -> str:
    """What a person needs once the model is up: where to go, and what answers there."""
    host = _url_host(gateway.config.host)
    base = f"{host}:{gateway.port}"
    worker = f", worker {gateway.config.worker}" if gateway.config.reuse_port else ""
    page, ws = gateway.scheme, gateway.scheme.replace("http", "ws")
    return (
        f"ready in {seconds:.1f} s: chat page {page}://{base}/ · WebSocket {ws}://{base}/v1/realtime"
        f" · model {gateway.model} ({gateway.engine.name} engine{worker})"
        f" · OpenAI API {page}://{base}/v1: {SERVED_APIS}"
    )


def _url_host(host: str) -> str:
    """The host as a browser can reach it: a wildcard address means this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


async def serve(gateway: Gateway) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    if gateway.config.tls is not None or gateway.config.api_key_file is not None:
        # Else SIGHUP keeps its default: it ends the process.
        loop.add_signal_handler(signal.SIGHUP, gateway.reload)
    try:
        await _serve(gateway, stop)
    finally:
        # uvloop, unlike asyncio, leaves its handlers installed when the loop closes:
        # Ctrl-C would then be swallowed for the rest of the process (main() in a notebook).
        for sig in (*signals, signal.SIGHUP):
            loop.remove_signal_handler(sig)


async def _serve(gateway: Gateway, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    began = time.perf_counter()
    try:
        await gateway.start()
    except OSError as exc:
        cfg = gateway.config
        raise CannotListen(describe_os_error(exc, cfg.host, cfg.port)) from exc
    # Listening already (/healthz and /readyz answer, the page says "loading"), but not
    # ready: the ready line comes only once the engine has loaded its model.
    log.info("loading the %s engine (%s event loop)…", gateway.engine.name, _loop_name(loop))
    ready = loop.create_task(gateway.wait_ready())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        if (failure := ready.exception()) is not None:
            stopping.cancel()
            await gateway.stop()
            raise failure
        log.info("%s", ready_line(gateway, time.perf_counter() - began))
        # What exists now (modules, classes, the engine, the gateway's parts) lives as
        # long as the process: out of the cyclic collector's way, so that its full
        # passes walk only what requests and sessions made since.
        gc.freeze()
    failed = loop.create_task(gateway.engine_failed.wait())
    await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    failed.cancel()
    log.info("shutting down")
    await gateway.shutdown()
    if gateway.engine.failure is not None:
        # A fatal engine error: exit non-zero so that a supervisor starts a fresh gateway
        # (trtllm-serve does the same); the live answers have already failed.
        raise EngineUnavailableError(
            f"engine {gateway.engine.name} failed ({gateway.engine.failure}); "
            "exiting so that a supervisor can restart the gateway"
        )
    log.info("stopped")


def _loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def run_workers(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start ``--workers`` copies of this command on one port; forward SIGTERM/SIGINT
    (and SIGHUP, with which each reloads its TLS certificate and key file)."""
    port = args.port or _free_port(args.host)
    base = [a for a in argv if not a.startswith("--workers")]
    if "--workers" in argv:  # the value was a separate word
        index = list(argv).index("--workers")
        base = list(argv[:index]) + list(argv[index + 2 :])
    # The workers' relay sockets (a resume reaching the wrong worker is relayed to the
    # right one: gateway/cluster/worker_relay.py), in a directory only this user can open.
    # Each worker runs on the loop this process chose (the last --loop wins), whatever
    # its own environment would default to.
    with tempfile.TemporaryDirectory(prefix="llm-gateway-") as worker_dir:
        command = [sys.executable, "-m", "gateway", *base, "--port", str(port)]
        command += ["--loop", args.loop, "--worker-dir", worker_dir]
        if args.client_secret_key is None:
            # One random key for all the workers: each accepts the client secrets the
            # others mint for a sha256: line.
            shared = Path(worker_dir) / "client-secret-key"
            shared.write_text(secrets.token_urlsafe(32))
            command += ["--client-secret-key", str(shared)]
        children = [
            subprocess.Popen([*command, "--worker-index", str(i)]) for i in range(args.workers)
        ]
        log.info("started %d workers on port %d", len(children), port)

        def forward(signum: int, _frame: object) -> None:
            for child in children:
                if child.poll() is None:
                    child.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGHUP, forward)
        codes = [child.wait() for child in children]
    return max(codes, key=abs)


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


class CannotListen(Exception):
    """The port cannot be opened; the message says why and which flag fixes it."""


def describe_os_error(exc: OSError, host: str, port: int) -> str:
    """One line for a socket that cannot be opened: the cause, and the flag that fixes it."""
    if isinstance(exc, socket.gaierror):
        return f"--host {host}: cannot resolve this address ({exc.strerror})"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another gateway?): "
            "stop it, or choose another with --port (0: any free port)"
        )
    if exc.errno == errno.EACCES:
        return f"no permission to listen on port {port}: choose one above 1023 with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def not_a_client_fault(record: logging.LogRecord) -> bool:
    """Hide websockets' "opening handshake failed" when the client caused it (garbage,
    a closed or timed-out connection); keep it when something in the server broke."""
    if record.getMessage() != "opening handshake failed" or not record.exc_info:
        return True
    client_faults = InvalidHandshake | ConnectionClosed | EOFError | OSError | TimeoutError
    return not isinstance(record.exc_info[1], client_faults)


# What a log line must not hold, whatever logs it (websockets at DEBUG logs every request
# header): a credential in Authorization (to the end of the value: a key may hold '&'),
# the key subprotocol, a client secret anywhere, a resume token in a header, a query or
# an event.
_SECRETS = re.compile(
    r"(?i)(authorization:\s*bearer\s+|x-resume-token:\s*)\S+"
    r"|(openai-insecure-api-key\.)[^\s,\"']+"
    r"|(resume_token=)[^\s&\"']+"
    r"|(\"resume_token\":\s*\")[^\"]+"
    r"|\bek_[A-Za-z0-9_-]{16,}"
)


def _redacted(match: re.Match[str]) -> str:
    kept = next((group for group in match.groups() if group), "ek_")
    return kept + "[redacted]"


# What each of _SECRETS's alternatives must contain (lower case): an ASCII line with none
# of them cannot match, and skips the expression (a line per request: the access log).
_SECRET_MARKS = (
    "authorization",
    "x-resume-token",
    "openai-insecure-api-key.",
    "resume_token",
    "ek_",
)


def redact_secrets(record: logging.LogRecord) -> bool:
    """A log filter: the record's message with every credential replaced by [redacted]."""
    try:
        message = record.getMessage()
    except Exception:  # a malformed log call: logging reports it, as without the filter
        return True
    if message.isascii():  # (?i) matches beyond ASCII as lower() does not: those lines, always
        lower = message.lower()
        if not any(mark in lower for mark in _SECRET_MARKS):
            return True
    redacted = _SECRETS.sub(_redacted, message)
    if redacted != message:
        record.msg, record.args = redacted, None
    return True


def raise_open_file_limit() -> None:
    """Every connection is a file descriptor, and the usual soft limit (1024) is far below
    what one process serves: raise it to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited or (hard != unlimited and soft >= hard):
        return
    target = hard if hard != unlimited else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit from %d: %s", soft, exc)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.loop not in LOOPS:  # a default from the environment: argparse checks only flags
        parser.error(f"{LOOP_ENV_VAR}={args.loop}: expected asyncio or uvloop")
    if args.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        parser.error("--loop uvloop: uvloop is not installed (pip install uvloop), use asyncio")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(redact_secrets)
    if args.access_log == "json":
        # One JSON object a line, with nothing before it, for a log shipper to parse.
        json_lines = logging.StreamHandler()
        json_lines.addFilter(redact_secrets)
        access = logging.getLogger(access_log.LOGGER)
        access.addHandler(json_lines)
        access.propagate = False
    if args.log_level != "DEBUG":
        # One line per connection and per HTTP GET is noise, and so is a traceback
        # for every malformed request a scanner sends; a failure of our own is not.
        websockets_log = logging.getLogger("websockets.server")
        websockets_log.setLevel(logging.WARNING)
        websockets_log.addFilter(not_a_client_fault)
    if args.workers > 1 and args.engine == "trtllm":
        print(
            f"{PROG}: --workers with --engine trtllm would load the model once per worker "
            "on one GPU (each copy claims most of its memory): run one worker, or run "
            "trtllm-serve replicas behind --engine upstream",
            file=sys.stderr,
        )
        return 2
    try:
        config = config_from_args(args)  # reads the keys: fails here, before any worker
    except (auth.KeyConfigError, tls.TlsError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    raise_open_file_limit()
    if args.workers > 1 and args.worker_index is None:
        return run_workers(args, argv)
    try:
        engine = engines.from_args(args)
        with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
            runner.run(serve(Gateway(engine, config)))
    except EngineError as exc:
        print(f"{PROG}: {exc.message}", file=sys.stderr)
        return 2
    except (CannotListen, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
