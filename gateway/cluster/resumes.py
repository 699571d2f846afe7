"""Resumes: a new connection that continues a session instead of starting one.

A Realtime client asks with a ``session.resume`` event, first on its new socket; a
Responses client with the upgrade's headers (or query, for openai-node), answered in the
upgrade's response (docs/protocol.md, "Resuming"). Either way the session is found here,
relayed to the worker that holds it (--workers, gateway/cluster/worker_relay.py), relayed
through the store to the process that holds it (gateway/cluster/store_relay.py), or taken
over from the store when its owner is gone (gateway/cluster/persistence.py); or the client
is told why not and its connection goes on with a fresh session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import urllib.parse
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from gateway.api.routes import RESPONSES_PATH
from gateway.cluster import store_relay
from gateway.cluster import worker_relay as relay
from gateway.transport.head_timers import refusal
from gateway.transport.wire import CLOSE_TIMEOUT, SocketWire
from sessions import codec, errors, snapshot
from sessions.core import Session
from sessions.realtime import codec as rt
from sessions.realtime.dialect import resumed_event
from sessions.responses.dialect import ResponsesDialect, ResponsesFraming

if TYPE_CHECKING:
    from gateway.server import Gateway

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
RESUME_TOKEN_HEADER = "x-resume-token"
LAST_SEQUENCE_HEADER = "x-last-sequence-number"

RESUME_ERRORS: dict[str, str] = {
    "session_busy": "Another gateway is taking this session over right now; retry the resume.",
    "session_not_found": "No session with that id and resume token can be resumed here "
    "(unknown, ended, or its resume window is over); this connection goes on as a new session.",
    "resume_gap": "Some events after last_sequence_number are no longer kept, so the session "
    "cannot be resumed without losing them; this connection goes on as a new session.",
}


@dataclass(frozen=True, slots=True)
class Upgrade:
    """What a Responses upgrade's answer said: a fresh session's id and token, or the
    session it resumes (with the token presented and the last number processed)."""

    session_id: str
    token: str
    resume: Session | None = None
    last_sequence_number: int = -1
    in_store: bool = False  # a session another process holds or held


class Resumes:
    """Finds the session a resume names and puts the new connection on it."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        # Responses upgrades, by connection, until their handler takes them: the fresh
        # session's id and token, or the session to resume (see name_upgrade).
        self._upgrades: weakref.WeakKeyDictionary[ServerConnection, Upgrade] = (
            weakref.WeakKeyDictionary()
        )

    # -- the Responses WebSocket's upgrade ----------------------------------------------

    def refuse_upgrade(self, request: Request) -> Response | None:
        """A resume asked for that cannot be served: refused before the upgrade (the
        client then knows it lost the session, and starts a new one)."""
        asked = _resume_fields(request)
        if asked is None:
            return None
        code = self._resumable(asked)
        if isinstance(code, str) and code != "in_store":
            self.gateway.metrics.resumes.labels(outcome=code).inc()
            return refusal(404 if code == "session_not_found" else 409, RESUME_ERRORS[code])
        return None

    def name_upgrade(
        self, connection: ServerConnection, request: Request, response: Response
    ) -> None:
        """Name the session of a Responses upgrade in its answer: a fresh one, or the one
        the request resumes."""
        asked = _resume_fields(request)
        found = self._resumable(asked) if asked is not None else None
        if isinstance(found, tuple):
            upgrade = Upgrade(found[0].id, found[1], found[0], found[2])
        elif found == "in_store" and asked is not None:
            upgrade = Upgrade(asked[0], asked[1], None, int(asked[2]), in_store=True)
        else:
            upgrade = Upgrade(self.gateway.new_session_id(), secrets.token_urlsafe(24))
        self._upgrades[connection] = upgrade
        response.headers[SESSION_HEADER] = upgrade.session_id
        response.headers[RESUME_TOKEN_HEADER] = upgrade.token

    def take_upgrade(self, connection: ServerConnection) -> Upgrade | None:
        """What :meth:`name_upgrade` said for this connection (None: a Realtime one)."""
        return self._upgrades.pop(connection, None)

    async def responses_session(
        self, upgrade: Upgrade, ws: ServerConnection, wire: SocketWire
    ) -> Session | str | None:
        """The session a Responses upgrade named, on ``wire``: fresh or resumed; else the
        reason to close with, or None once a relay to its owner has ended."""
        if upgrade.in_store:
            return await self._from_store(
                upgrade.session_id, upgrade.token, upgrade.last_sequence_number, ws, wire, None
            )
        gw = self.gateway
        if upgrade.resume is None:
            session = gw.open_session(
                ResponsesDialect(gw.response_store),
                ResponsesFraming(),
                upgrade.session_id,
                upgrade.token,
            )
            session.outbox.attach(wire)
            return session
        target = upgrade.resume
        code = target.resume(upgrade.token, upgrade.last_sequence_number, wire, rotate=False)
        gw.metrics.resumes.labels(outcome=code or "resumed").inc()
        if code is not None:  # it went away between the upgrade's answer and now
            return "session_not_found"
        gw.set_detached(target, False)
        log.info("session %s resumed after event %d", target.id, upgrade.last_sequence_number)
        return target

    def _resumable(self, asked: tuple[str, str, str]) -> str | tuple[Session, str, int]:
        """The session a resume names, its token and last number; else why not."""
        session_id, token, last = asked
        gw = self.gateway
        session = gw.session(session_id)
        if gw.config.resume_window <= 0:
            return "session_not_found"
        if not re.fullmatch(r"-1|\d{1,15}", last):
            return "resume_gap"
        if session is None and gw.persistence is not None:
            return "in_store"  # decided once the socket is open (it takes Redis)
        if session is None or not isinstance(session.dialect, ResponsesDialect):
            return "session_not_found"
        code = session.can_resume(token, int(last))
        return code if code is not None else (session, token, int(last))

    # -- the Realtime dialect's session.resume ------------------------------------------

    async def resume(
        self,
        event: rt.SessionResume,
        ws: ServerConnection,
        wire: SocketWire,
        fresh: Session,
        first: bool,
    ) -> Session | None:
        """Take over the session ``event`` names (here, or relayed to the worker holding
        it: then None once that relay has ended), or tell why not and go on with ``fresh``."""
        if not first:
            await fresh.deliver(
                errors.ProtocolError(
                    "invalid_event",
                    "session.resume must be the first event on a new connection.",
                    event_id=event.event_id,
                )
            )
            return fresh
        gw = self.gateway
        c = gw.config
        known = gw.session(event.session_id) is not None
        if gw.persistence is not None and c.resume_window > 0 and not known:
            found = await self._from_store(
                event.session_id, event.resume_token, event.last_sequence_number, ws, wire, fresh
            )
            if isinstance(found, str):
                return await _refuse(event, fresh, found)
            return found
        owner = relay.owner_of(event.session_id)
        if (
            c.worker_dir is not None
            and gw.store is None  # with a store, the store relays (gateway/cluster/store_relay.py)
            and c.resume_window > 0
            and owner is not None
            and owner != relay.owner_tag(c.node, c.worker)
            and owner == relay.owner_tag(c.node, relay.worker_of(owner))  # this host's
        ):
            opened = await relay.open_leg(c.worker_dir, relay.worker_of(owner), event)
            if opened is not None and opened[1].get("type") == "session.resumed":
                leg, answer = opened
                _discard(fresh, wire)
                await wire.write_later(codec.encode(answer))
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
            return await _refuse(event, fresh, code or "session_not_found")
        if event.session_id == fresh.id:  # the session this connection already has
            return await _refuse(event, fresh, "session_not_found")
        target = self.take_over(event, wire)
        if isinstance(target, str):
            return await _refuse(event, fresh, target)
        _discard(fresh, wire)
        return target

    def take_over(self, event: rt.SessionResume, wire: SocketWire) -> Session | str:
        """Attach ``wire`` to the session ``event`` names, if its token and replay buffer
        allow; else the error code that says why not."""
        gw = self.gateway
        target = gw.session(event.session_id)
        code = (
            target.resume(event.resume_token, event.last_sequence_number, wire)
            if target is not None and gw.config.resume_window > 0
            else "session_not_found"
        )
        gw.metrics.resumes.labels(outcome=code or "resumed").inc()
        if code is not None or target is None:
            return code or "session_not_found"
        gw.set_detached(target, False)
        log.info("session %s resumed after event %d", target.id, event.last_sequence_number)
        return target

    # -- a session another process holds or held ----------------------------------------

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
        gw = self.gateway
        persistence, store = gw.persistence, gw.store
        assert persistence is not None and store is not None
        loaded = await persistence.load(session_id, token)
        if isinstance(loaded, str):
            gw.metrics.resumes.labels(outcome=loaded).inc()
            return loaded
        if loaded.owner is not None and loaded.owner != store.process:
            if store_relay.gap(loaded, last):
                return "resume_gap"
            if fresh is not None:
                _discard(fresh, wire)
            greeting = None
            if loaded.state["dialect"] == "realtime":
                config = snapshot.config_from(loaded.state["config"])
                greeting = resumed_event(session_id, config, token)
            gw.metrics.resumes.labels(outcome="relayed").inc()
            await store_relay.relay(ws, wire, store, loaded, last, greeting)
            return None
        taken = await persistence.take_over(loaded, token, last, wire)
        gw.metrics.resumes.labels(outcome=taken if isinstance(taken, str) else "resumed").inc()
        if isinstance(taken, Session) and fresh is not None:
            _discard(fresh, wire)
        return taken


async def _refuse(event: rt.SessionResume, fresh: Session, code: str) -> Session:
    error = errors.ProtocolError(code, RESUME_ERRORS[code], event_id=event.event_id)
    await fresh.deliver(error)
    return fresh


def _discard(fresh: Session, wire: SocketWire) -> None:
    """The session the connection started with goes, quietly: the socket belongs to
    the resumed one now."""
    fresh.outbox.detach(wire)
    fresh.close("disconnected")


def is_responses_upgrade(request: Request) -> bool:
    return request.path.partition("?")[0].rstrip("/") == RESPONSES_PATH


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
