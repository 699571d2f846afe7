"""What one access log line and one span say: a request or an answer, from its start to its
end, filled in by whoever sees each part of it and written once, when it is over.

A :class:`Record` is made where a request begins (the HTTP layer, the WebSocket upgrade, the
session core for an answer on a socket) and is open until every part that holds it has
let go (:meth:`Record.hold`): an HTTP request that carries an answer (``POST
/v1/chat/completions``) is held by the HTTP exchange and by the answer, and its line is
written when the later of the two ends, whichever that is (a client that disconnects
ends the exchange before its answer has stopped). Nothing here runs per token.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any, Literal

from gateway.observability.trace_context import TraceContext

Kind = Literal["http", "answer", "connection", "refusal"]

# An answer's statuses, the worse higher: a request's line says the worst of its choices'.
_WORSE = {"completed": 1, "incomplete": 2, "cancelled": 3, "failed": 4}
MAX_CLIENT_REQUEST_ID = 512  # OpenAI's limit for X-Client-Request-Id
_CLIENT_ID = re.compile(r"[\x20-\x7e]{1,512}")  # printable ASCII: no line break, no control


def new_request_id() -> str:
    """An ``x-request-id``: ``req_`` and 128 random bits (OpenAI's shape)."""
    return "req_" + secrets.token_hex(16)


def peer_address(address: object) -> str:
    """``host:port`` of a socket's peer (as asyncio gives it: a tuple for IP)."""
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address or "")


def client_request_id(value: str | None) -> str | None:
    """A client's ``X-Client-Request-Id`` as the log keeps it: printable ASCII, at most 512
    characters; anything else is not kept (it would be the client writing our log)."""
    if value is None or _CLIENT_ID.fullmatch(value) is None:
        return None
    return value


class Record:
    """One request's or answer's figures (see the module docstring). Times are
    ``time.perf_counter()`` seconds; ``wall`` is the start in seconds since the epoch."""

    __slots__ = (
        "_holds",
        "background",
        "cached_tokens",
        "cancel_reason",
        "client",
        "client_event_id",
        "client_request_id",
        "close_code",
        "connection_id",
        "ended",
        "error_code",
        "error_param",
        "error_type",
        "event",
        "finish_reasons",
        "first_token_at",
        "handed_over",
        "input_tokens",
        "kind",
        "link",
        "method",
        "model",
        "moves",
        "notes",
        "operation",
        "output_tokens",
        "own",
        "parent",
        "path",
        "request_attributes",
        "request_id",
        "response_id",
        "response_status",
        "resumes",
        "route",
        "session_id",
        "slot_at",
        "span",
        "started",
        "status",
        "submitted_at",
        "takeover",
        "tenant",
        "traced",
        "wall",
    )

    def __init__(
        self,
        kind: Kind,
        *,
        route: str,
        client: str = "",
        request_id: str | None = None,
        method: str = "",
        path: str = "",
        event: str = "",
        started: float | None = None,
        parent: TraceContext | None = None,
    ) -> None:
        self.kind: Kind = kind
        self.started = time.perf_counter() if started is None else started
        self.wall = time.time() - (time.perf_counter() - self.started)
        self.ended = 0.0
        self._holds = 1
        self.route = route  # the route's pattern, or the socket's path
        self.method = method
        self.path = path  # never the query: a resume token may travel there
        self.event = event  # on a socket: the client event (response.create, error...)
        self.client = client
        self.request_id = request_id
        self.client_request_id: str | None = None
        self.connection_id: str | None = None
        self.client_event_id: str | None = None
        self.session_id: str | None = None
        self.status: int | str | None = None
        self.tenant: str | None = None
        self.model: str | None = None
        self.operation: str | None = None  # gen_ai.operation.name, for an answer
        # The answer's sampling as gen_ai.request.* attributes (numbers, strings, lists).
        self.request_attributes: dict[str, Any] = {}
        self.response_id: str | None = None
        self.response_status: str | None = None  # an HTTP request's answer's status
        self.finish_reasons: tuple[str, ...] = ()
        self.input_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.output_tokens: int | None = None
        self.submitted_at = 0.0  # the answer asked for a slot
        self.slot_at = 0.0  # ...and got one
        self.first_token_at = 0.0
        self.error_code: str | None = None
        self.error_param: str | None = None
        self.error_type: str | None = None
        self.cancel_reason: str | None = None
        self.close_code: int | None = None
        self.resumes = 0
        self.moves = 0
        self.takeover = False
        self.handed_over = False
        self.background = False
        # (name, perf_counter time, attributes): the span's events (cancel, resume...).
        self.notes: list[tuple[str, float, dict[str, str | int]]] = []
        self.parent = parent  # the client's trace context
        self.link: TraceContext | None = None  # the span it continues (a takeover's)
        self.own: TraceContext | None = None  # its own span's context, when traced
        self.traced = False  # a span is (or is to be) written for it
        self.span: object = None  # the tracer's open span, while it is open

    # -- holding ---------------------------------------------------------------------

    def hold(self) -> None:
        """One more part (an answer) keeps the record open."""
        self._holds += 1

    def release(self) -> bool:
        """A part let go; True when it was the last (the record is over now)."""
        self._holds -= 1
        if self._holds == 0:
            self.ended = time.perf_counter()
            return True
        return False

    @property
    def open(self) -> bool:
        return self._holds > 0

    # -- what parts report ------------------------------------------------------------

    def note(self, name: str, **attributes: str | int) -> None:
        """Something that happened to it now (a cancel, a resume, a move): a span event,
        and a field of its log line."""
        self.notes.append((name, time.perf_counter(), attributes))

    def answered(self, status: str) -> None:
        """Its answer ended with ``status`` (completed, incomplete, cancelled, failed): the
        line's status on a socket, ``response_status`` beside an HTTP request's own. Of
        several answers (a request's choices), the worst is kept."""
        if self.kind == "http":
            if _WORSE.get(status, 0) >= _WORSE.get(self.response_status or "", 0):
                self.response_status = status
        else:
            self.status = status

    def refused(self, code: str, param: str | None, error_type: str | None = None) -> None:
        """Why it was refused (the first reason given wins)."""
        if self.error_code is None:
            self.error_code, self.error_param, self.error_type = code, param, error_type

    # -- derived figures --------------------------------------------------------------

    @property
    def duration(self) -> float:
        return max(0.0, (self.ended or time.perf_counter()) - self.started)

    @property
    def slot_wait(self) -> float | None:
        """Seconds its answer waited for an engine slot (None: it never had one)."""
        if not self.slot_at or not self.submitted_at:
            return None
        return max(0.0, self.slot_at - self.submitted_at)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from asking for a slot to the first token (None: no token came)."""
        if not self.first_token_at or not self.submitted_at:
            return None
        return max(0.0, self.first_token_at - self.submitted_at)

    def wall_time(self, at: float) -> float:
        """A perf_counter time as seconds since the epoch."""
        return self.wall + (at - self.started)
