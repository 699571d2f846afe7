"""Where background responses (``background: true`` over HTTP) are kept, by response id.

Each is a session of its own (gateway/api/responses_http.py opens it), kept while it
runs and ``--background-retention`` seconds after it ended, so that ``GET ...?stream=true
&starting_after=N`` replays what a dropped client missed. With a Redis session store
those of other instances are found too (gateway/cluster/background.py): a
:class:`~gateway.cluster.background.Remote` while their owner lives (relayed from the
log), taken over by this process once it is gone (then kept here as any other).

The routes ask :class:`BackgroundResponses` for a response and attach wires; each
session's actor owns its response, as on the WebSocket.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.api.waiter import Waiter
from gateway.cluster import store_relay
from gateway.cluster.background import Background, Remote, ended, latest_response
from gateway.cluster.persistence import Persistence
from gateway.transport.sse import SseWire
from sessions import codec
from sessions.core import Session
from sessions.errors import ResumeRefused
from sessions.responses.dialect import ResponsesDialect

log = logging.getLogger(__name__)


class Live:
    """A background response's session here, while it runs and for the retention after."""

    __slots__ = ("dialect", "expiry", "session", "waiter")

    def __init__(self, session: Session, dialect: ResponsesDialect, waiter: Waiter) -> None:
        self.session = session
        self.dialect = dialect
        self.waiter = waiter
        self.expiry: asyncio.TimerHandle | None = None


class _Unread:
    """The wire of a background response no client is reading: what the session sends
    goes into its replay buffer (the outbox keeps every sent event there), nowhere else."""

    def writable(self) -> bool:
        return True

    def write(self, frame: bytes) -> None:
        """Dropped here: the outbox has kept it for a replay."""

    async def write_later(self, frame: bytes) -> None:
        """Never called: this wire is always writable."""

    def close(self, code: int, reason: str) -> None:
        """Nothing to close."""


UNREAD = _Unread()


class BackgroundResponses:
    """This process's background responses, and with a store everyone's (see the module
    docstring)."""

    def __init__(self, retention: float, persistence: Persistence | None, ttl: float) -> None:
        self._retention = retention
        self._persistence = persistence
        self._store = Background(persistence, ttl) if persistence is not None else None
        self._here: dict[str, Live] = {}

    def get(self, response_id: str, tenant: str) -> Live | None:
        """``tenant``'s background response ``response_id``, if this process keeps it."""
        live = self._here.get(response_id)
        return live if live is not None and live.session.tenant == tenant else None

    async def keep(
        self, response_id: str, session: Session, dialect: ResponsesDialect, waiter: Waiter
    ) -> None:
        """Keep a new one here, and in the store (once Redis has it, another instance
        finds it)."""
        self._keep_here(response_id, session, dialect, waiter)
        if self._store is not None:
            await self._store.keep(response_id, session.id, session.resume_token)

    async def delete(self, response_id: str) -> None:
        """Forget ``response_id`` here and in the store; returns once the store has it
        gone (a request sent at once to another instance no longer finds it)."""
        live = self._here.pop(response_id, None)
        if live is not None:
            self._forget(live)
        if self._store is not None:
            await self._store.forget(response_id)

    def close(self) -> None:
        """Shutdown: every retained session goes now (running ones end with the gateway)."""
        for live in list(self._here.values()):
            self._forget(live)

    async def find(self, response_id: str, tenant: str) -> Live | Remote | None:
        """``tenant``'s background response: this process's; else the store's, a
        :class:`Remote` while its owner lives, taken over here once it is gone."""
        live = self.get(response_id, tenant)
        if live is not None or self._store is None:
            return live
        for _ in range(3):  # another instance may take it over just before this one
            remote = await self._store.find(response_id, tenant)
            if remote is None or self._store.owner_alive(remote):
                return remote
            live = await self._take_over(remote)
            if live is not None:
                return live
        return None

    async def relay(self, remote: Remote, after: int, wire: SseWire) -> Live | None:
        """Write the events after ``after`` of a response another process holds, from its
        log, to ``wire``. If that process goes meanwhile the response is taken over here:
        it is returned, resumed on ``wire`` after the last event written, for the caller
        to follow. None once the stream is over (or the response is gone)."""
        assert self._store is not None
        last = await self._store.relay_events(remote, after, wire)
        if last is None:
            return None
        target = await self.find(remote.response_id, remote.loaded.state.get("tenant", ""))
        if isinstance(target, Remote):  # another instance took it over: relay from it
            await self._store.relay_events(target, last, wire)
            return None
        if target is None or target.session.can_resume(target.session.resume_token, last):
            return None  # gone: the stream ends without its terminal event, as a drop would
        target.session.resume(target.session.resume_token, last, wire, rotate=False)
        return target

    @staticmethod
    def gap(remote: Remote, after: int) -> bool:
        """Whether the log no longer holds the events after ``after``."""
        return store_relay.gap(remote.loaded, after)

    async def cancel_elsewhere(self, response_id: str, tenant: str) -> Live | codec.JSON | None:
        """Cancel a background response another process holds: the Response object as it
        ended; or, once this process took it over, the :class:`Live` to cancel here.
        None: there is none."""
        target = await self.find(response_id, tenant)
        if not isinstance(target, Remote):
            return target
        assert self._store is not None
        body = await self._store.cancel(target)
        if body is not None:
            return body
        live = await self.find(response_id, tenant)  # its owner went first
        return None if isinstance(live, Remote) else live

    async def _take_over(self, remote: Remote) -> Live | None:
        """Make the response's session this process's; its answer goes on here."""
        assert self._persistence is not None
        local = self.get(remote.response_id, remote.loaded.state.get("tenant", ""))
        if local is not None:
            return local  # taken over by another request to this process meanwhile
        try:
            session = await self._persistence.take_over(
                remote.loaded, remote.token, remote.top, UNREAD
            )
        except ResumeRefused as refused:
            log.info("background %s: not taken over (%s)", remote.response_id, refused.code)
            return None
        dialect = session.dialect
        assert isinstance(dialect, ResponsesDialect)
        waiter = Waiter()
        if (body := latest_response(remote.loaded)) is not None:
            if ended(remote.loaded):
                waiter.ended(body)
            waiter.started(body)
        dialect.observer = waiter
        return self._keep_here(remote.response_id, session, dialect, waiter)

    def _keep_here(
        self, response_id: str, session: Session, dialect: ResponsesDialect, waiter: Waiter
    ) -> Live:
        live = Live(session, dialect, waiter)
        self._here[response_id] = live

        def retain(_: object) -> None:
            loop = asyncio.get_running_loop()
            live.expiry = loop.call_later(self._retention, self._expire, response_id)

        waiter.end.add_done_callback(retain)
        return live

    def _expire(self, response_id: str) -> None:
        live = self._here.pop(response_id, None)
        if live is not None:
            self._forget(live)

    def _forget(self, live: Live) -> None:
        if live.expiry is not None:
            live.expiry.cancel()
        live.session.close("disconnected")
        for response_id, other in list(self._here.items()):
            if other is live:
                del self._here[response_id]
