"""``python -m gateway`` / ``llm-gateway``: parse flags, run until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake

from gateway import auth, engines
from gateway.config import GatewayConfig
from gateway.engines.base import EngineError
from gateway.server import Gateway

log = logging.getLogger("gateway")


def _number(kind: type[int] | type[float], low: float) -> Callable[[str], Any]:
    """An argparse type that refuses values below ``low`` with a clear message."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


count = _number(int, 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="Streaming LLM gateway: the OpenAI Realtime text protocol over WebSocket.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=int, default=8765, help="port for WebSocket and HTTP (0: any free port)")
    add("--engine", default=engines.DEFAULT_ENGINE, choices=sorted(engines.ENGINES))
    add("--model", default=None, help="model for the engine (default: the engine's own)")
    add(
        "--max-running",
        type=count,
        default=None,
        help="responses run at once (default: engine capacity)",
    )
    add(
        "--max-queued",
        type=_number(int, 0),
        default=256,
        help="responses waiting; beyond: 'overloaded'",
    )
    add("--max-sessions", type=count, default=None, help="connections at once; beyond: HTTP 503")
    add(
        "--max-message-bytes",
        type=_number(int, 1024),
        default=1 << 20,
        help="largest client frame; beyond: 1009",
    )
    add("--allowed-origin", action="append", default=[], help="browser Origin allowed (repeatable)")
    add(
        "--api-key",
        action="append",
        default=[],
        help=f"require this key (repeatable; better: --api-key-file or ${auth.ENV_VAR})",
    )
    add("--api-key-file", default=None, help="require the keys in this file (one a line)")
    add(
        "--client-secret-ttl",
        type=_number(int, auth.MIN_SECRET_TTL),
        default=auth.DEFAULT_SECRET_TTL,
        help="seconds a client secret lives at most (POST /v1/realtime/client_secrets)",
    )
    add(
        "--client-secret-url",
        default=None,
        help="path on the page's origin where the chat page POSTs for a client secret",
    )
    add(
        "--handshake-timeout",
        type=_number(float, 0.1),
        default=5.0,
        help="seconds a new connection has to send its whole HTTP request",
    )
    add(
        "--max-handshakes",
        type=count,
        default=1024,
        help="connections still in their handshake; beyond, the oldest is dropped",
    )
    add(
        "--max-parallel-per-session",
        type=count,
        default=4,
        help="out-of-band responses per session",
    )
    add(
        "--stall-timeout",
        type=_number(float, 0.01),
        default=30.0,
        help="close clients that read nothing this long",
    )
    add("--instructions", default=None, help="default instructions (default: the engine's)")
    add("--no-coalesce", action="store_true", help="send every delta as its own frame (benchmarks)")
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add(
        "--workers", type=count, default=1, help="gateway processes sharing the port (SO_REUSEPORT)"
    )
    add("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set by --workers
    engines.add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        max_running=args.max_running,
        max_queued=args.max_queued,
        max_sessions=args.max_sessions,
        max_message_bytes=args.max_message_bytes,
        allowed_origins=tuple(args.allowed_origin),
        api_keys=auth.read_api_keys(args.api_key, args.api_key_file),
        client_secret_ttl=args.client_secret_ttl,
        client_secret_url=args.client_secret_url,
        handshake_timeout=args.handshake_timeout,
        max_handshakes=args.max_handshakes,
        max_parallel_per_session=args.max_parallel_per_session,
        stall_timeout=args.stall_timeout,
        coalesce=not args.no_coalesce,
        instructions=args.instructions,
        worker=str(args.worker_index or 0),
        reuse_port=args.worker_index is not None,
    )


async def serve(gateway: Gateway) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await gateway.start()
    cfg = gateway.config
    log.info(
        "listening on ws://%s:%d/v1/realtime (engine %s)",
        cfg.host,
        gateway.port,
        gateway.engine.name,
    )
    ready = loop.create_task(gateway.wait_ready())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        stopping.cancel()
        await gateway.stop()
        raise ready.exception()  # type: ignore[misc]
    await stopping
    log.info("shutting down")
    await gateway.stop()
    log.info("stopped")


def run_workers(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start ``--workers`` copies of this command on one port; forward SIGTERM/SIGINT."""
    port = args.port or _free_port(args.host)
    base = [a for a in argv if not a.startswith("--workers")]
    if "--workers" in argv:  # the value was a separate word
        index = list(argv).index("--workers")
        base = list(argv[:index]) + list(argv[index + 2 :])
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "gateway", *base, "--port", str(port), "--worker-index", str(i)]
        )
        for i in range(args.workers)
    ]
    log.info("started %d workers on port %d", len(children), port)

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    return max(codes, key=abs)


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def not_a_client_fault(record: logging.LogRecord) -> bool:
    """Hide websockets' "opening handshake failed" when the client caused it (garbage,
    a closed or timed-out connection); keep it when something in the server broke."""
    if record.getMessage() != "opening handshake failed" or not record.exc_info:
        return True
    client_faults = InvalidHandshake | ConnectionClosed | EOFError | OSError | TimeoutError
    return not isinstance(record.exc_info[1], client_faults)


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
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "DEBUG":
        # One line per connection and per HTTP GET is noise, and so is a traceback
        # for every malformed request a scanner sends; a failure of our own is not.
        websockets_log = logging.getLogger("websockets.server")
        websockets_log.setLevel(logging.WARNING)
        websockets_log.addFilter(not_a_client_fault)
    try:
        config = config_from_args(args)  # reads the keys: fails here, before any worker
    except auth.KeyConfigError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return 2
    raise_open_file_limit()
    if args.workers > 1 and args.worker_index is None:
        return run_workers(args, argv)
    try:
        engine = engines.from_args(args)
        asyncio.run(serve(Gateway(engine, config)))
    except EngineError as exc:
        print(f"llm-gateway: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
