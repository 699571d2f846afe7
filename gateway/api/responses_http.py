"""The Responses API over HTTP: ``POST /v1/responses`` and the routes of a response.

Every ``POST`` gets a session of its own (the session core with the Responses dialect,
one response in it, events numbered from 0), so streaming, cancel, the replay buffer
and the response store are the WebSocket's. Its outbox writes to an
:class:`~gateway.transport.sse.SseWire` (``stream: true``), or to nothing while the handler
waits for the end (``stream: false``). A plain response lives as long as its request:
a client that disconnects aborts it in the engine within a step. A background one
(``background: true``) lives on without a connection; its session is kept
``--background-retention`` seconds after the end, so ``GET ...?stream=true&
starting_after=N`` replays what a dropped client missed, then goes on live.

With a Redis session store a background response is found on any instance: relayed
from the log while its owner lives, taken over by the instance a request reaches once it
is gone (gateway/api/background_responses.py keeps them).

Who owns what: each session's actor owns its response as on the WebSocket; the route
handlers only deliver commands and attach wires.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.api.admission import Admission
from gateway.api.background_responses import UNREAD, BackgroundResponses, Live
from gateway.api.http_api import SSE_HEADERS, HttpApi, send_error
from gateway.api.status import ServerState
from gateway.api.waiter import Waiter
from gateway.cluster.background import Remote, latest_response
from gateway.cluster.persistence import Persistence
from gateway.config import GatewayConfig
from gateway.observability import Record
from gateway.session_table import SessionTable
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.router import Router
from gateway.transport.sse import SseWire
from sessions import codec, errors
from sessions.conversation import Item
from sessions.core import Session
from sessions.response_store import ResponseStore, StoredResponse
from sessions.responses import codec as rp
from sessions.responses.dialect import ResponsesDialect, ResponsesFraming

log = logging.getLogger(__name__)

BACKGROUND_REPLAY_BYTES = 4 << 20  # a background response's events, for starting_after


class ResponsesHttp(HttpApi):
    """The routes (see the module docstring)."""

    def __init__(
        self,
        config: GatewayConfig,
        state: ServerState,
        table: SessionTable,
        admission: Admission,
        response_store: ResponseStore,
        persistence: Persistence | None = None,
    ) -> None:
        super().__init__(config, state, table, admission)
        self.response_store = response_store
        self._persistence = persistence
        self.background = BackgroundResponses(
            config.background_retention, persistence, response_store.ttl
        )

    def register(self, router: Router) -> None:
        limit = self._config.max_message_bytes
        router.add("POST", "/v1/responses", self.create, body_limit=limit)
        router.add("GET", "/v1/responses/{id}", self.retrieve)
        router.add("DELETE", "/v1/responses/{id}", self.delete)
        router.add("POST", "/v1/responses/{id}/cancel", self.cancel)
        router.add("GET", "/v1/responses/{id}/input_items", self.input_items)

    def close(self) -> None:
        """Shutdown: every retained background session goes now."""
        self.background.close()

    # -- POST /v1/responses ------------------------------------------------------------

    async def create(self, request: HttpRequest, reply: HttpReply) -> None:
        tenant = self.admitted(request, reply)
        if tenant is None:
            return
        try:
            body = await self._read_body(request, tenant)
        except errors.ProtocolError as err:
            send_error(reply, err)
            return
        waiter = Waiter()
        dialect = ResponsesDialect(self.response_store, waiter)
        if body.background and request.record is not None:
            request.record.background = True  # its answer outlives it: a line of its own
        session = self._table.open(
            dialect,
            ResponsesFraming(),
            replay_bytes=BACKGROUND_REPLAY_BYTES if body.background else 0,
            kept=body.background,  # a plain answer dies with its request: no one resumes it
            tenant=tenant,
            origin=request.record,
            # One-shot: the handler waits for the Response object; no event is read.
            unread=not body.stream and not body.background,
        )
        await session.deliver(rp.Create(body))
        try:
            started = await waiter.start
        except errors.ProtocolError as err:
            session.close("disconnected")
            send_error(reply, err)
            return
        if body.background:
            await self.background.keep(started["id"], session, dialect, waiter)
            if not body.stream:
                # No client reads it now: its events still go, numbered, into the replay
                # buffer, for a GET ...?stream=true&starting_after=N to pick up.
                session.outbox.attach(UNREAD)
        if body.stream:
            await self._stream(reply, session, -1, keep=body.background)
        elif body.background:
            reply.send_json(200, started)
        else:
            try:
                reply.send_json(200, await waiter.end)
            finally:
                session.close("disconnected")  # a no-op once it has ended

    async def _read_body(self, request: HttpRequest, tenant: str) -> rp.CreateBody:
        obj = codec.json_body(request.body)
        if "stream_id" in obj:
            raise errors.ProtocolError(
                "unknown_parameter",
                "'stream_id' names a lane of the Responses WebSocket; HTTP has none.",
                param="stream_id",
            )
        body = rp.read_create(obj)
        if body.background and not body.store:
            raise errors.ProtocolError(
                "invalid_value",
                "A background response must be stored: drop 'store: false'.",
                param="store",
            )
        wanted = body.previous_response_id
        if wanted is not None and await self._find(wanted, tenant) is None:
            raise errors.ProtocolError(
                "previous_response_not_found",
                f"Previous response with id '{wanted}' not found.",
                param="previous_response_id",
            )
        return body

    async def _stream(
        self,
        reply: HttpReply,
        session: Session,
        after: int,
        *,
        keep: bool,
        origin: Record | None = None,
    ) -> None:
        """SSE of ``session``'s events after number ``after``, until its terminal event
        (or the client goes: a plain response is then cancelled, a background one not).
        ``origin``: a GET picking a background response up (its answer says so)."""
        code = session.can_resume(session.resume_token, after)
        if code is not None:
            send_error(reply, _not_kept(code))
            return
        # The head goes first: attaching the wire writes what is pending at once (with
        # the head, in one write). A background response's events wait for the session
        # store, so that another instance can continue from any event its client read.
        hold = self._persistence.store.holds if keep and self._persistence is not None else None
        wire = SseWire(reply, hold=hold)
        with session.scheduler.write_batch:
            reply.start(200, SSE_HEADERS)
            session.resume(session.resume_token, after, wire, rotate=False, origin=origin)
        await self._follow(session, wire, keep=keep)

    async def _follow(self, session: Session, wire: SseWire, *, keep: bool) -> None:
        """Until ``wire``'s stream is over; then a background session's events go on
        into its replay buffer."""
        try:
            await wire.over.wait()
        finally:
            session.outbox.detach(wire)
            if not keep:
                # Ends it in the engine within a step if it still runs (client gone).
                session.close("disconnected")
            elif not session.ending:
                session.outbox.attach(UNREAD)  # the rest, kept for the next GET

    # -- the routes of one response ------------------------------------------------------

    async def retrieve(self, request: HttpRequest, reply: HttpReply) -> None:
        tenant = self.admitted(request, reply, engine=False)
        if tenant is None:
            return
        response_id = request.params["id"]
        if request.arg("stream") == "true":
            target = await self.background.find(response_id, tenant)
            if target is None:
                _not_found(reply, response_id, stream=True)
                return
            after = request.arg("starting_after", "-1") or "-1"
            if not after.lstrip("-").isdigit() or int(after) < -1:
                send_error(
                    reply,
                    errors.ProtocolError(
                        "invalid_value",
                        "'starting_after' must be an integer.",
                        param="starting_after",
                    ),
                )
                return
            if isinstance(target, Remote):
                await self._relay(reply, target, int(after))
            else:
                await self._stream(
                    reply, target.session, int(after), keep=True, origin=request.record
                )
            return
        live = self.background.get(response_id, tenant)
        body = live.waiter.body if live is not None else None
        stored = await self._find(response_id, tenant)
        if body is None and stored is not None:
            body = stored.body
        if body is None:
            # Running on another instance (or on none: then taken over here).
            target = await self.background.find(response_id, tenant)
            if isinstance(target, Remote):
                body = latest_response(target.loaded)
            elif target is not None:
                body = target.waiter.body
        if body is None:
            _not_found(reply, response_id)
            return
        reply.send_json(200, body)

    async def cancel(self, request: HttpRequest, reply: HttpReply) -> None:
        tenant = self.admitted(request, reply, engine=False)
        if tenant is None:
            return
        response_id = request.params["id"]
        live = self.background.get(response_id, tenant)
        stored = None if live is not None else await self._find(response_id, tenant)
        if live is None and stored is None:
            found = await self.background.cancel_elsewhere(response_id, tenant)
            if not isinstance(found, Live):
                if found is None:
                    _not_found(reply, response_id)
                else:
                    reply.send_json(200, found)  # cancelled by the instance that held it
                return
            live = found
        if live is None:
            if stored is None:
                _not_found(reply, response_id)
            elif not stored.body.get("background"):
                send_error(
                    reply,
                    errors.ProtocolError(
                        "invalid_value", "Only background responses can be cancelled."
                    ),
                )
            else:
                reply.send_json(200, stored.body)  # over already: as it ended
            return
        if not live.waiter.end.done():
            await live.session.deliver(rp.Cancel(response_id))
        reply.send_json(200, await asyncio.shield(live.waiter.end))

    async def delete(self, request: HttpRequest, reply: HttpReply) -> None:
        tenant = self.admitted(request, reply, engine=False)
        if tenant is None:
            return
        response_id = request.params["id"]
        live = self.background.get(response_id, tenant)
        stored = await self._find(response_id, tenant)
        # Running on another instance: cancelled there (or taken over here, and ended
        # below); another tenant's, or none: as if it did not exist.
        if (
            live is None
            and stored is None
            and await self.background.cancel_elsewhere(response_id, tenant) is None
        ):
            _not_found(reply, response_id)
            return
        self.response_store.delete(response_id, notify=True)
        await self.background.delete(response_id)  # in the store once answered
        reply.send_json(200, {"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: HttpRequest, reply: HttpReply) -> None:
        tenant = self.admitted(request, reply, engine=False)
        if tenant is None:
            return
        response_id = request.params["id"]
        stored = await self._find(response_id, tenant)
        if stored is None:
            _not_found(reply, response_id)
            return
        items = [_item_json(i) for i in stored.input_items]
        order = request.arg("order", "desc")
        if order not in ("asc", "desc"):
            send_error(
                reply,
                errors.ProtocolError("invalid_value", "'order' is asc or desc.", param="order"),
            )
            return
        if order == "desc":
            items.reverse()
        after = request.arg("after")
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        limit_text = request.arg("limit", "20") or "20"
        limit = int(limit_text) if limit_text.isdigit() else 0
        if not 1 <= limit <= 100:
            send_error(
                reply, errors.ProtocolError("invalid_value", "'limit' is 1 to 100.", param="limit")
            )
            return
        page = items[:limit]
        reply.send_json(
            200,
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            },
        )

    # -- internals -----------------------------------------------------------------------

    async def _find(self, response_id: str, tenant: str) -> StoredResponse | None:
        """``tenant``'s finished response: the store's (this process's, else the session
        store's), or a retained background one's. Another tenant's is not found."""
        stored = self.response_store.get(response_id, tenant)
        if stored is not None:
            return stored
        persistence = self._persistence
        if persistence is not None:
            await persistence.fetch_response(response_id)
            stored = self.response_store.get(response_id, tenant)
            if stored is not None:
                return stored
        live = self.background.get(response_id, tenant)
        return live.dialect.latest if live is not None else None

    async def _relay(self, reply: HttpReply, remote: Remote, after: int) -> None:
        """SSE of a response another process holds, from its log; if that process goes
        meanwhile, the response is taken over here and the same stream goes on."""
        if self.background.gap(remote, after):
            send_error(reply, _not_kept("resume_gap"))
            return
        reply.start(200, SSE_HEADERS)
        # Held for the store like a local stream: after a takeover the session writes here.
        assert self._persistence is not None
        wire = SseWire(reply, hold=self._persistence.store.holds)
        live = await self.background.relay(remote, after, wire)
        if live is not None:
            await self._follow(live.session, wire, keep=True)


def _not_kept(code: str) -> errors.ProtocolError:
    return errors.ProtocolError(
        code,
        "Those events are no longer kept: retrieve the response without stream.",
        param="starting_after",
    )


def _not_found(reply: HttpReply, response_id: str, *, stream: bool = False) -> None:
    message = (
        f"No background response '{response_id}' is kept to stream (unknown, not background, "
        "or past --background-retention); retrieve it without stream."
        if stream
        else f"Response with id '{response_id}' not found."
    )
    reply.send_json(404, codec.error_json(errors.ProtocolError("response_not_found", message)))


def _item_json(item: Item) -> codec.JSON:
    """An input item as ``GET .../input_items`` lists it (openai-python's ResponseItem)."""
    if item.kind == "function_call":
        return rp.function_call_json(
            item.id, item.call_id or "", item.name or "", item.text, "completed"
        )
    if item.kind == "function_call_output":
        return {
            "id": item.id,
            "type": "function_call_output",
            "call_id": item.call_id,
            "output": item.text,
            "status": "completed",
        }
    part = "output_text" if item.role == "assistant" else "input_text"
    content: dict[str, Any] = {"type": part, "text": item.text}
    if part == "output_text":
        content["annotations"] = []
    return {
        "id": item.id,
        "type": "message",
        "role": item.role,
        "status": "completed",
        "content": [content],
    }
