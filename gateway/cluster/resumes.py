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

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from gateway.cluster import store_relay
from gateway.cluster import worker_relay as relay
from gateway.cluster.persistence import Persistence
from gateway.cluster.redis_store import RedisStore
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.observability import Record
from gateway.session_table import SessionTable
from gateway.transport.head_timers import refusal
from gateway.transport.wire import CLOSE_TIMEOUT, SocketWire
from sessions import codec, errors, snapshot
from sessions.core import Session
from sessions.dialects import RESPONSES, DialectContext
from sessions.errors import ResumeRefused, SessionRelayed
from sessions.realtime import codec as rt
from sessions.realtime.dialect import resumed_event

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
RESUME_TOKEN_HEADER = "x-resume-token"
LAST_SEQUENCE_HEADER = "x-last-sequence-number"


@dataclass(frozen=True, slots=True)
class Upgrade:
    """What a Responses upgrade's answer said: a fresh session's id and token, or the
    session it resumes (with the token presented and the last number processed)."""

    session_id: str
    token: str
    resume: Session | None = None
    last_sequence_number: int = -1
    in_store: bool = False  # a session another process holds or held
    tenant: str = ""  # the upgrading credential's: a resume finds that tenant's sessions only


class Resumes:
    """Finds the session a resume names and puts the new connection on it.

    Each way in returns the session the connection is now on, or raises
    :class:`~sessions.errors.ResumeRefused` (the code says why) or
    :class:`~sessions.errors.SessionRelayed` (another process served it)."""

    def __init__(
        self,
        config: GatewayConfig,
        table: SessionTable,
        metrics: Metrics,
        dialects: DialectContext,
        store: RedisStore | None = None,
        persistence: Persistence | None = None,
    ) -> None:
        self._config = config
        self._table = table
        self._metrics = metrics
        self._dialects = dialects
        self._store = store
        self._persistence = persistence
        # Responses upgrades, by connection, until their handler takes them: the fresh
        # session's id and token, or the session to resume (see name_upgrade).
        self._upgrades: weakref.WeakKeyDictionary[ServerConnection, Upgrade] = (
            weakref.WeakKeyDictionary()
        )

    def _count(self, outcome: str) -> None:
        self._metrics.resumes.labels(outcome=outcome).inc()

    # -- the Responses WebSocket's upgrade ----------------------------------------------

    @staticmethod
    def asks_resume(request: Request) -> bool:
        """Does this Responses upgrade ask to resume a session (which its tenant has)?"""
        return _resume_fields(request) is not None

    def refuse_upgrade(self, request: Request, tenant: str) -> Response | None:
        """A resume asked for that cannot be served: refused before the upgrade (the
        client then knows it lost the session, and starts a new one)."""
        asked = _resume_fields(request)
        if asked is None:
            return None
        try:
            self._resumable(asked, tenant)
        except ResumeRefused as refused:
            self._count(refused.code)
            status = 404 if refused.code == "session_not_found" else 409
            return refusal(status, refused.message)
        return None

    def name_upgrade(
        self,
        connection: ServerConnection,
        request: Request,
        response: Response,
        tenant: str = "",
    ) -> None:
        """Name the session of a Responses upgrade in its answer: a fresh one, or the one
        the request resumes (``tenant``'s alone)."""
        asked = _resume_fields(request)
        try:
            found = self._resumable(asked, tenant) if asked is not None else None
        except ResumeRefused:
            found = None
        if isinstance(found, Session) and asked is not None:
            upgrade = Upgrade(found.id, asked[1], found, int(asked[2]), tenant=tenant)
        elif found == "in_store" and asked is not None:
            upgrade = Upgrade(asked[0], asked[1], None, int(asked[2]), True, tenant)
        else:
            fresh_id = self._table.new_session_id()
            upgrade = Upgrade(fresh_id, secrets.token_urlsafe(24), tenant=tenant)
        self._upgrades[connection] = upgrade
        response.headers[SESSION_HEADER] = upgrade.session_id
        response.headers[RESUME_TOKEN_HEADER] = upgrade.token

    def take_upgrade(self, connection: ServerConnection) -> Upgrade | None:
        """What :meth:`name_upgrade` said for this connection (None: a Realtime one)."""
        return self._upgrades.pop(connection, None)

    async def responses_session(
        self, upgrade: Upgrade, ws: ServerConnection, wire: SocketWire, origin: Record | None
    ) -> Session:
        """The session a Responses upgrade named, on ``wire``: fresh or resumed (``origin``:
        the connection, for the access log)."""
        if upgrade.in_store:
            return await self._from_store(
                upgrade.session_id,
                upgrade.token,
                upgrade.last_sequence_number,
                ws,
                wire,
                None,
                upgrade.tenant,
                origin,
            )
        if upgrade.resume is None:
            dialect, framing = RESPONSES.make(self._dialects)
            session = self._table.open(
                dialect,
                framing,
                upgrade.session_id,
                upgrade.token,
                tenant=upgrade.tenant,
                origin=origin,
            )
            session.outbox.attach(wire)
            return session
        target = upgrade.resume
        last = upgrade.last_sequence_number
        code = target.resume(upgrade.token, last, wire, rotate=False, origin=origin)
        self._count(code or "resumed")
        if code is not None:  # it went away between the upgrade's answer and now
            raise ResumeRefused("session_not_found")
        self._table.set_detached(target, False)
        log.info("session %s resumed after event %d", target.id, upgrade.last_sequence_number)
        return target

    def _resumable(self, asked: tuple[str, str, str], tenant: str) -> Session | str:
        """The session a Responses resume names (checked against its token and last
        number), or ``"in_store"``: decided once the socket is open (it takes Redis)."""
        session_id, token, last = asked
        session = self._table.get(session_id)
        if self._config.resume_window <= 0:
            raise ResumeRefused("session_not_found")
        if not re.fullmatch(r"-1|\d{1,15}", last):
            raise ResumeRefused("resume_gap")
        if session is None and self._persistence is not None:
            return "in_store"
        if session is None or session.dialect.name != RESPONSES.name or session.tenant != tenant:
            raise ResumeRefused("session_not_found")
        code = session.can_resume(token, int(last))
        if code is not None:
            raise ResumeRefused(code)
        return session

    # -- the Realtime dialect's session.resume ------------------------------------------

    async def resume(
        self,
        event: rt.SessionResume,
        ws: ServerConnection,
        wire: SocketWire,
        fresh: Session,
        first: bool,
    ) -> Session:
        """Take over the session ``event`` names (here, or relayed to the process holding
        it), or tell the client why not and go on with ``fresh``."""
        if not first:
            await fresh.deliver(
                errors.ProtocolError(
                    "invalid_event",
                    "session.resume must be the first event on a new connection.",
                    event_id=event.event_id,
                )
            )
            return fresh
        try:
            return await self._resume(event, ws, wire, fresh)
        except ResumeRefused as refused:
            await fresh.deliver(ResumeRefused(refused.code, event_id=event.event_id))
            return fresh

    async def _resume(
        self, event: rt.SessionResume, ws: ServerConnection, wire: SocketWire, fresh: Session
    ) -> Session:
        c = self._config
        known = self._table.get(event.session_id) is not None
        if self._persistence is not None and c.resume_window > 0 and not known:
            return await self._from_store(
                event.session_id,
                event.resume_token,
                event.last_sequence_number,
                ws,
                wire,
                fresh,
                fresh.tenant,
                fresh.origin,
            )
        owner = relay.owner_of(event.session_id)
        if (
            c.worker_dir is not None
            and self._store is None  # with a store, the store relays (store_relay.py)
            and c.resume_window > 0
            and owner is not None
            and owner != relay.owner_tag(c.node, c.worker)
            and owner == relay.owner_tag(c.node, relay.worker_of(owner))  # this host's
        ):
            await self._relay_to_worker(c.worker_dir, owner, event, ws, wire, fresh)
        if event.session_id == fresh.id:  # the session this connection already has
            raise ResumeRefused("session_not_found")
        target = self.take_over(event, wire, fresh.tenant, fresh.origin)
        _discard(fresh, wire)
        return target

    async def _relay_to_worker(
        self,
        worker_dir: str,
        owner: str,
        event: rt.SessionResume,
        ws: ServerConnection,
        wire: SocketWire,
        fresh: Session,
    ) -> None:
        """Pipe this connection to the worker of this host that holds the session, until
        that ends (raises :class:`SessionRelayed`), or raise the worker's refusal."""
        opened = await relay.open_leg(worker_dir, relay.worker_of(owner), event, fresh.tenant)
        if opened is not None and opened[1].get("type") == "session.resumed":
            leg, answer = opened
            _discard(fresh, wire)
            await wire.write_later(codec.encode(answer))
            await relay.pipe(ws, wire, leg)
            # The owner's close code (1001, 4001...) must reach the client before this
            # handler returns and websockets closes with 1000 on its own.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT + 0.5):
                    await wire.closed()
            raise SessionRelayed
        if opened is not None:
            await opened[0].close()
        code = opened[1].get("error", {}).get("code") if opened is not None else None
        raise ResumeRefused(code if code in errors.RESUME_ERRORS else "session_not_found")

    def take_over(
        self,
        event: rt.SessionResume,
        wire: SocketWire,
        tenant: str,
        origin: Record | None = None,
    ) -> Session:
        """Attach ``wire`` to the session ``event`` names, if it is ``tenant``'s and its
        token and replay buffer allow; else raise :class:`ResumeRefused`."""
        target = self._table.get(event.session_id)
        if target is not None and target.tenant != tenant:
            target = None  # another tenant's: as if there were none
        code = (
            target.resume(event.resume_token, event.last_sequence_number, wire, origin=origin)
            if target is not None and self._config.resume_window > 0
            else "session_not_found"
        )
        self._count(code or "resumed")
        if code is not None or target is None:
            raise ResumeRefused(code or "session_not_found")
        self._table.set_detached(target, False)
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
        tenant: str,
        origin: Record | None,
    ) -> Session:
        """The session from the store on ``wire``: taken over (returned) or relayed to its
        owner (:class:`SessionRelayed`, once the relay has ended)."""
        persistence, store = self._persistence, self._store
        assert persistence is not None and store is not None
        try:
            loaded = await persistence.load(session_id, token, tenant)
        except ResumeRefused as refused:
            self._count(refused.code)
            raise
        if loaded.owner is not None and loaded.owner != store.process:
            if store_relay.gap(loaded, last):
                raise ResumeRefused("resume_gap")
            if fresh is not None:
                _discard(fresh, wire)
            greeting = None
            if loaded.state["dialect"] == "realtime":
                config = snapshot.config_from(loaded.state["config"])
                greeting = resumed_event(session_id, config, token)
            self._count("relayed")
            await store_relay.relay(ws, wire, store, loaded, last, greeting)
            raise SessionRelayed
        try:
            taken = await persistence.take_over(loaded, token, last, wire, origin)
        except ResumeRefused as refused:
            self._count(refused.code)
            raise
        self._count("resumed")
        if fresh is not None:
            _discard(fresh, wire)
        return taken


def _discard(fresh: Session, wire: SocketWire) -> None:
    """The session the connection started with goes, quietly: the socket belongs to
    the resumed one now."""
    fresh.outbox.detach(wire)
    fresh.close("disconnected")


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
