"""What the API layer reads of the server's state: a narrow view, never the server.

uvicorn hands its protocols ``(config, server_state)``; here the routes and the WebSocket
endpoint get a :class:`ServerState` (gateway/server.py's ``Gateway`` is one) and read
from it alone whether to take work, what ``/healthz`` says and what ``/metrics`` shows.
"""

from __future__ import annotations

from typing import Protocol


class ServerState(Protocol):
    started_at: float  # the process's start, in seconds since the epoch

    @property
    def engine_ready(self) -> bool:
        """The engine is up (loaded, or a replica answers)."""

    @property
    def draining(self) -> bool:
        """SIGTERM with a store: no new work; answers in flight finish, then move."""

    @property
    def stopping(self) -> bool:
        """Shutdown has begun: sessions are closing."""

    @property
    def ready(self) -> bool:
        """Taking new work: the engine is up and no drain or shutdown has begun."""

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``."""

    @property
    def port(self) -> int: ...

    def health(self) -> dict[str, object]:
        """``/healthz``'s body (less the URLs, which depend on the request's Host)."""

    def render_metrics(self) -> bytes:
        """``/metrics``: the Prometheus exposition of this process."""
