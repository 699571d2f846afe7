"""One HTTP request answered by a session of its own: what ``POST /v1/chat/completions``
and ``POST /v1/completions`` share.

The request's dialect (sessions/chat/, sessions/completions/) gets the decoded body as its
one command; the handler waits for the answer's start (or its refusal: an OpenAI error
object with its status), then streams it as Server-Sent Events (``data: CHUNK`` each,
``data: [DONE]`` last) through an :class:`~gateway.transport.sse.SseWire`, or waits for
the one object. A client that disconnects, streaming or not, ends every choice of its
answer in the engine within a step: the handler's task is cancelled, and its ``finally``
closes the session. The session is never kept (no client can resume it).
"""

from __future__ import annotations

from gateway.api.http_api import SSE_HEADERS, send_error
from gateway.api.waiter import Waiter
from gateway.session_table import SessionTable
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.sse import Messages, SseWire
from sessions import errors
from sessions.core import Dialect
from sessions.outbox import Framing


async def answer(
    table: SessionTable,
    request: HttpRequest,
    reply: HttpReply,
    tenant: str,
    command: object,
    dialect: tuple[Dialect, Framing],
    waiter: Waiter,
    stream: Messages | None,
) -> None:
    """Answer ``command`` in a new session of ``dialect`` (whose observer is ``waiter``):
    as a stream whose messages ``stream`` frames, or (None) as one JSON object."""
    session = table.open(
        *dialect,
        replay_bytes=0,
        kept=False,
        tenant=tenant,
        origin=request.record,
        unread=stream is None,  # the handler waits for the one object: no event is read
    )
    try:
        await session.deliver(command)
        try:
            await waiter.start
        except errors.ProtocolError as err:
            send_error(reply, err)
            return
        if stream is not None:
            # The head goes first: attaching the wire writes what is pending at once
            # (with the head, in one write).
            wire = SseWire(reply, stream)
            with session.scheduler.write_batch:
                reply.start(200, SSE_HEADERS)
                session.outbox.attach(wire)
            await wire.over.wait()
            return
        body = await waiter.end
        error = body.get("error")
        if error is not None:
            failed = errors.ProtocolError(
                error["code"], error["message"], param=error["param"], error_type=error["type"]
            )
            send_error(reply, failed)
        else:
            reply.send_json(200, body)
    finally:
        # Ends the answer in the engine within a step if it still runs (client gone).
        session.close("disconnected")
