"""Sans-I/O half of resuming a session after a dropped connection.

The gateway numbers every event of a session (``sequence_number``) and keeps the recent
ones; a new connection that sends ``session.resume`` with the session's id, its resume
token and the last number the client processed gets every later event again, then the
live ones (docs/protocol.md). What the client must remember for that, and which of its
own requests may never have reached the gateway, lives here, testable with dicts alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from websockets.frames import Close

from gateway.client.errors import ClientError
from gateway.client.events import JSON

RESUME_TIMEOUT = 20.0
"""Seconds to keep trying to reconnect and resume (the gateway keeps a dropped session for
its ``--resume-window``, 30 s by default, counted from when it notices the drop)."""

_KEEPALIVE_TIMEOUT = 1011  # what websockets sends when its pings go unanswered
_SERVICE_RESTART = 1012  # a gateway with a session store restarting (docs/deployment.md)


def is_drop(rcvd: Close | None, sent: Close | None) -> bool:
    """Whether a closed connection was lost rather than closed on purpose.

    A close frame from the gateway (1001 shutdown, 1008, 4001 taken over...) is its
    decision and is final. No close frame means the network went away: a reset, or
    keepalive pings that went unanswered (websockets then sends 1011 itself, which a dead
    network does not deliver). Any other close the client started (a frame too big...)
    would happen again on a resumed connection. 1012 (service restart) is a gateway with
    a session store that handed its sessions over as it stops: resume, on another one.
    """
    if rcvd is not None:
        return rcvd.code == _SERVICE_RESTART
    return sent is None or sent.code == _KEEPALIVE_TIMEOUT


def backoff(
    first: float = 0.05, cap: float = 1.0, rng: Callable[[], float] = random.random
) -> Iterator[float]:
    """Delays between reconnection attempts: short at first (most drops are brief), then
    capped, so that a gateway back within its window is found within ``cap`` seconds.
    Each is between half and all of its step, so that the clients a gateway lost at once
    do not all come back in the same instant."""
    delay = first
    while True:
        yield delay * (0.5 + rng() / 2)
        delay = min(cap, delay * 2)


def resume_url(url: str, session_id: str) -> str:
    """``url`` with ``session_id=<id>`` in its query: a load balancer can route the resume to
    the host that holds the session (the gateway itself ignores the query)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "session_id"]
    query.append(("session_id", session_id))
    return urlunsplit(parts._replace(query=urlencode(query)))


class Cursor:
    """The session being resumed, its current resume token, and the last event processed."""

    def __init__(self, created: JSON) -> None:
        session = created.get("session")
        sid = session.get("id") if isinstance(session, dict) else None
        token = created.get("resume_token")
        self.session_id = sid if isinstance(sid, str) else None
        self._token = token if isinstance(token, str) else None  # a secret: never log it
        self.last = 0
        self.accept(created)

    @property
    def resumable(self) -> bool:
        """False against a gateway that offers no resume (no token in ``session.created``)."""
        return self.session_id is not None and self._token is not None

    def accept(self, event: JSON) -> bool:
        """Whether ``event`` is new; a replayed one the client already processed is not.

        Raises :class:`ClientError` if events are missing: text would be lost silently.
        """
        seq = event.get("sequence_number")
        if not isinstance(seq, int) or isinstance(seq, bool):
            return True  # not numbered (session.resumed, or a gateway without resume)
        if seq <= self.last:
            return False
        if self.last and seq != self.last + 1:
            raise ClientError(
                f"events {self.last + 1} to {seq - 1} of the session never arrived "
                f"(got {event.get('type')!r} numbered {seq})"
            )
        self.last = seq
        return True

    def resume_event(self) -> JSON:
        return {
            "type": "session.resume",
            "session_id": self.session_id,
            "resume_token": self._token,
            "last_sequence_number": self.last,
        }

    def resumed(self, event: JSON) -> None:
        """``session.resumed`` came: the token it carries replaces the spent one."""
        token = event.get("resume_token")
        if isinstance(token, str):
            self._token = token


@dataclass(slots=True)
class _Sent:
    event: JSON
    connection: int  # which connection (0 the first, +1 per resume) carried it last
    pending: Callable[[], bool]  # until the gateway's answer (or its error) arrived


class Unconfirmed:
    """Requests sent but not yet answered, and the fences that tell which of them were lost.

    A request written just before the network went away may or may not have reached the
    gateway, and one of them (``response.create``) must not be sent twice. So after a
    resume the client sends a fence, a request whose answer the gateway emits only after
    it handled everything it had received before: once the fence is answered, a request
    from an older connection that is still unanswered was lost, and is sent again.
    """

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._fences: dict[str, int] = {}  # fence event_id -> the connection it went on

    def add(self, event: JSON, connection: int, pending: Callable[[], bool]) -> None:
        self._prune()
        self._sent[str(event["event_id"])] = _Sent(event, connection, pending)

    def any_before(self, connection: int) -> bool:
        """Whether a request sent on an older connection is still unanswered."""
        self._prune()
        return any(s.connection < connection for s in self._sent.values())

    def fence(self, event_id: str, connection: int) -> None:
        self._fences[event_id] = connection

    def fence_answered(self, event_id: str | None, connection: int) -> list[JSON] | None:
        """The requests to send again on ``connection`` if ``event_id`` names a fence (whose
        answer, an error, is then for nobody else), else ``None``.

        A fence's answer stands for every request that went on an older connection than
        the fence; an older fence still unanswered is now moot.
        """
        fenced = self._fences.pop(event_id, None) if event_id is not None else None
        if fenced is None:
            return None
        self._fences = {e: c for e, c in self._fences.items() if c > fenced}
        self._prune()
        lost = [s for s in self._sent.values() if s.connection < fenced]
        for sent in lost:
            sent.connection = connection
        return [s.event for s in lost]

    def _prune(self) -> None:
        for event_id in [e for e, s in self._sent.items() if not s.pending()]:
            del self._sent[event_id]
