"""The exceptions the client raises: one base class, and a type per way a call can fail.

Every failure a caller can act on differently gets its own type: the gateway said no
(:class:`GatewayError`, with the protocol's error ``code`` to match on), the connection
went away (:class:`ConnectionLost`), nothing could be reached (:class:`GatewayUnavailable`),
or the gateway went quiet for longer than ``timeout`` (:class:`GatewayTimeout`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.client.reply import Reply


class ClientError(Exception):
    """Base class of everything :mod:`gateway.client` raises on purpose."""


class GatewayError(ClientError):
    """The gateway refused a request or an answer failed: an ``error`` event, or a failed response.

    ``code`` is what a program matches on (``overloaded``, ``invalid_value``,
    ``conversation_already_has_active_response``...); ``param`` names the offending field
    when there is one. For a failed answer, ``reply`` holds what was generated before it broke.
    """

    def __init__(
        self,
        code: str,
        message: str,
        param: str | None = None,
        *,
        event_id: str | None = None,
        reply: Reply | None = None,
    ) -> None:
        super().__init__(code, message, param)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.reply = reply

    def __str__(self) -> str:
        where = f" (param: {self.param})" if self.param else ""
        return f"{self.code}: {self.message}{where}"

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> GatewayError:
        """Build from a server ``error`` event, tolerating missing fields."""
        error = event.get("error")
        body: Mapping[str, Any] = error if isinstance(error, Mapping) else {}
        return cls(
            str(body.get("code") or body.get("type") or "error"),
            str(body.get("message") or "the gateway reported an error"),
            body.get("param") if isinstance(body.get("param"), str) else None,
            event_id=body.get("event_id") if isinstance(body.get("event_id"), str) else None,
        )


class HandshakeRefused(GatewayError):
    """The gateway answered the WebSocket handshake with an HTTP error (a wrong key: 401).

    ``status`` is the HTTP status; ``code`` is the body's error code when it sent one,
    else ``unauthorized`` (401/403) or ``http_<status>``.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(code, message)
        self.status = status


class ConnectionLost(ClientError, ConnectionError):
    """The connection ended for good while the client still expected events (or before a send).

    A connection that dropped (no close frame) is first resumed; this is raised only when
    that failed: ``resume_error`` is then the gateway's refusal (``session_not_found``,
    ``resume_gap``), or ``None`` if no connection could be made in time (the cause is
    chained). A close the gateway chose has its close ``code`` and ``reason`` (1001: the
    gateway shut down; 4001: another connection took the session over).
    """

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        reason: str = "",
        resume_error: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.resume_error = resume_error


class GatewayUnavailable(ClientError, ConnectionError):
    """No WebSocket could be opened: nothing listens at the address, or it is not a gateway."""


class GatewayTimeout(ClientError, TimeoutError):
    """The gateway sent nothing for ``timeout`` seconds while the client waited for it."""
