"""Background responses (``background: true`` over HTTP) with a Redis session store: found,
streamed, retrieved and cancelled on any instance, and taken over when their gateway died.

A background response is a session of its own (gateway/api/responses_http.py), saved like
any other with a store: its state, its event log, its owner's lease. What this adds is the
way from a response id to that session: ``llmgw:b:{response id}`` holds the session's id
and resume token, written before the create is answered (so that a request sent at once
to another instance finds it) and kept as long as a stored response. An instance asked
about a background response it does not hold looks it up there (:meth:`Background.find`):

- its owner is alive: ``GET ...?stream=true`` is served from the log (the events after
  ``starting_after``, then the log's tail: :func:`relay_events`), a retrieve answers the
  latest Response object in the log (:func:`latest_response`), a cancel goes to the
  owner over its channel (:meth:`Background.cancel`);
- its owner is gone (killed, or drained): the instance takes the session over
  (``Persistence.take_over``) and the answer goes on on its engine from the text sent.

Nothing takes a background response over unless some request for it arrives: a client
polling it, streaming it or cancelling it is what moves it (docs/deployment.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import orjson
from redis.exceptions import RedisError

from gateway.cluster import store_relay
from gateway.cluster.persistence import Persistence
from gateway.cluster.redis_store import channel
from gateway.cluster.store_reads import Loaded
from gateway.transport.sse import TERMINAL_TYPES, SseWire
from sessions.errors import ResumeRefused

log = logging.getLogger(__name__)

OWNER_CHECK_SECONDS = 0.5  # how often a relayed stream asks whether the owner still lives
PUBLISH_TRIES = 20  # a cancel sent to an owner that has not subscribed (yet, again)


@dataclass(frozen=True, slots=True)
class Remote:
    """A background response another process holds, or held: its session as stored."""

    response_id: str
    token: str
    loaded: Loaded

    @property
    def session_id(self) -> str:
        session_id: str = self.loaded.state["id"]
        return session_id

    @property
    def top(self) -> int:
        """The number of the last event in the log (-1: none)."""
        return self.loaded.frames[-1][0] if self.loaded.frames else -1


def latest_response(loaded: Loaded) -> dict[str, object] | None:
    """The latest Response object among the log's events (each ``response.*`` lifecycle
    event carries the response as it was then)."""
    for _, frame in reversed(loaded.frames):
        if b'"response":{' in frame:
            event = orjson.loads(frame)
            body = event.get("response")
            if isinstance(body, dict):
                return body
    return None


def ended(loaded: Loaded) -> bool:
    """Whether the log holds the response's terminal event."""
    return any(_terminal(frame) for _, frame in loaded.frames[-3:])


def _terminal(frame: bytes) -> bool:
    return any(b'"type":"%b"' % t in frame for t in TERMINAL_TYPES)


class Background:
    """One gateway's background responses in the store (see the module docstring)."""

    def __init__(self, persistence: Persistence, ttl: float) -> None:
        self.persistence = persistence
        self.store = persistence.store
        self._ttl = ttl

    async def keep(self, response_id: str, session_id: str, token: str) -> None:
        """Record the response's session, and wait until Redis has it."""
        data = orjson.dumps({"session": session_id, "token": token})
        self.store.responses.put_background(response_id, data, self._ttl)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):  # a store that is down: the create goes on
                await self.store.flush()

    async def forget(self, response_id: str) -> None:
        """Delete the record, and wait until Redis has it gone (with what was queued
        before it: the stored response's delete)."""
        self.store.responses.delete_background(response_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):  # a store that is down: the delete goes on
                await self.store.flush()

    async def find(self, response_id: str, tenant: str) -> Remote | None:
        """``tenant``'s background response ``response_id`` from the store, if it has one."""
        try:
            data = await self.store.reads.background(response_id)
        except (RedisError, OSError):
            return None
        if data is None:
            return None
        ref = orjson.loads(data)
        try:
            loaded = await self.persistence.load(ref["session"], ref["token"], tenant)
        except ResumeRefused:
            return None  # gone since, or another tenant's: as if there were none
        return Remote(response_id, ref["token"], loaded)

    def owner_alive(self, remote: Remote) -> bool:
        owner = remote.loaded.owner
        return owner is not None and owner != self.store.process

    async def relay_events(self, remote: Remote, after: int, wire: SseWire) -> int | None:
        """Write the events after ``after`` to ``wire`` from the log, then its tail, while
        the owner lives. None once the terminal event went out (or the client left);
        else the number of the last event written (the owner is gone, or the log has a
        gap): the caller takes the session over and goes on from there."""
        written = after
        for seq, frame in remote.loaded.frames:
            if seq > after:
                await wire.write_later(frame)
                written = seq
        if wire.over.is_set():
            return None

        async def write(frame: bytes) -> None:
            nonlocal written
            await wire.write_later(frame)
            written += 1

        tail = asyncio.create_task(
            store_relay.tail_log(self.store, remote.session_id, remote.top, write)
        )
        over = asyncio.create_task(wire.over.wait())
        try:
            while not tail.done() and not over.done():
                await asyncio.wait([tail, over], timeout=OWNER_CHECK_SECONDS)
                if not over.done() and not await self._owner_there(remote):
                    break
        finally:
            for task in (tail, over):
                task.cancel()
            for task in (tail, over):
                with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                    await task
        return None if wire.over.is_set() else written

    async def cancel(self, remote: Remote) -> dict[str, object] | None:
        """Have the owner cancel the response; the Response object as it ended (None: the
        owner went away first, and the caller takes the session over)."""
        frame = orjson.dumps({"type": "response.cancel", "response_id": remote.response_id})
        message = orjson.dumps(
            {"session": remote.session_id, "kind": "frame", "frame": frame.decode()}
        )
        owner = remote.loaded.owner or ""
        for _ in range(PUBLISH_TRIES):
            with contextlib.suppress(RedisError, OSError):
                if await self.store.topology.publish(channel(owner), message):
                    break
            await asyncio.sleep(0.05)
        while True:  # until the terminal event is in the log, or the owner is gone
            fresh = await self.find(remote.response_id, remote.loaded.state.get("tenant", ""))
            if fresh is None:
                return None
            if ended(fresh.loaded):
                return latest_response(fresh.loaded)
            if not self.owner_alive(fresh):
                return None
            await asyncio.sleep(0.05)

    async def _owner_there(self, remote: Remote) -> bool:
        try:
            owner = await self.store.reads.owner(remote.session_id)
        except (RedisError, OSError):
            return True  # Redis is away: the tail reads on once it is back
        return owner is not None and owner == remote.loaded.owner
