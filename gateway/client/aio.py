"""The asyncio client: one :class:`AsyncChat` per conversation, over one WebSocket at a time.

There is no background reader task. Whoever needs the next server event (an iterating
stream, a ``cancel()``, an ``update()``) takes the read lock, receives one event and
dispatches it to its owner (the active stream, or a request waiting for its answer), then
checks whether its own wait is over. So nothing is buffered behind the library's back,
the gateway feels the reader's pace (back-pressure), and no task outlives the chat.

When the connection drops (no close frame from the gateway), the reader that notices it
reconnects and resumes the session (gateway/client/reconnect.py) before it receives on: the
gateway replays what the dropped connection lost, so waits go on as if nothing happened.
Only the reader, holding the read lock, ever swaps the socket; a send that finds the
socket dead is left to be sent again after the resume (see ``Unconfirmed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping
from types import TracebackType
from typing import Any, Unpack

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close

from gateway.client import events
from gateway.client.errors import ClientError, ConnectionLost, GatewayError, GatewayTimeout
from gateway.client.events import JSON, ResponseOptions, SessionOptions
from gateway.client.reconnect import Dialer, reconnect
from gateway.client.reply import Reply, failure_of, reply_from_done
from gateway.client.resume import RESUME_TIMEOUT, Cursor, Unconfirmed, is_drop
from gateway.client.sockets import close_quietly, deadline, lost, open_socket, recv_json

logger = logging.getLogger("gateway.client")

DEFAULT_TIMEOUT = 120.0
"""Seconds to wait for any one server event (not for a whole answer) before giving up."""


class _Waiter:
    """A request waiting for its answer event, or for an ``error`` naming its ``event_id``."""

    def __init__(self, event_id: str, accept: Callable[[JSON], bool]) -> None:
        self.event_id = event_id
        self.accept = accept
        self.event: JSON | None = None
        self.error: GatewayError | None = None

    @property
    def done(self) -> bool:
        return self.event is not None or self.error is not None


class AsyncChat:
    """One conversation with the gateway over one WebSocket.

    Ask one question at a time: :meth:`ask` waits for a previous :meth:`ask`, and starting a
    new question cancels a previous :meth:`stream` that was left unfinished. For several
    conversations at once, open several chats (e.g. ``asyncio.gather`` over ``connect()``).
    """

    def __init__(self, ws: ClientConnection, created: JSON, dialer: Dialer) -> None:
        self._ws = ws
        self._dialer = dialer
        session = created.get("session")
        self.session: JSON = session if isinstance(session, dict) else {}  # the gateway's view
        self.timeout = dialer.timeout
        self._cursor = Cursor(created)
        self._connection = 0  # which connection ``_ws`` is: +1 per resume
        self._unconfirmed = Unconfirmed()
        self._resend: list[JSON] = []  # lost requests to send again, now that a fence told
        self._closing = False
        self._resume_failed = False
        self._ids = events.EventIds()
        self._read_lock = asyncio.Lock()
        self._turn_lock = asyncio.Lock()
        self._waiters: list[_Waiter] = []
        self._active: AsyncStream | None = None  # the answer asked for, until it ends
        self._starting: AsyncStream | None = None  # a question being sent, not yet answered
        # Cancels that may race with the answer's natural end: the gateway then answers
        # with an error that concerns nobody any more. Such an error comes right after the
        # answer's end, so remembering the last few cancels is enough (and stays bounded).
        self._cancel_ids: deque[str] = deque(maxlen=16)

    # -- opening and closing ---------------------------------------------------------

    @classmethod
    async def open(
        cls,
        url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (bounds each wait, not the call)
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT,
        **options: Unpack[SessionOptions],
    ) -> AsyncChat:
        """Connect, wait for ``session.created`` and apply ``options`` with ``session.update``."""
        dialer = Dialer(events.resolve_url(url), api_key, timeout, resume, resume_timeout)
        ws = await open_socket(dialer.url, api_key, timeout)
        try:
            try:
                first = await recv_json(ws, timeout)
            except ConnectionClosed as exc:
                raise lost(exc) from None
            if first.get("type") == "error":
                raise GatewayError.from_event(first)
            if first.get("type") != "session.created":
                raise ClientError(f"expected session.created first, got {first.get('type')!r}")
            chat = cls(ws, first, dialer)
            if options:
                await chat.update(**options)
        except BaseException:
            await ws.close()
            raise
        return chat

    async def close(self) -> None:
        """Close the WebSocket; the gateway stops whatever this chat still had running.

        (If the connection is down at that moment, the gateway lets the session go when
        its resume window ends.)
        """
        self._closing = True
        await self._ws.close()

    async def __aenter__(self) -> AsyncChat:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- the public calls -------------------------------------------------------------

    async def update(self, **options: Unpack[SessionOptions]) -> JSON:
        """Change session settings (instructions, sampling...); returns the updated session."""
        eid = self._ids.event()
        answer = await self._request(
            events.session_update(eid, options), lambda e: e.get("type") == "session.updated"
        )
        session = answer.get("session")
        if isinstance(session, dict):
            self.session = session
        return self.session

    async def ask(self, text: str, **options: Unpack[ResponseOptions]) -> Reply:
        """Send ``text`` as the user's next message and return the whole answer.

        Raises :class:`GatewayError` if the gateway refuses or the answer fails.
        """
        async with self._turn_lock:
            stream = AsyncStream(self, text, options)
            await stream._start_locked()
            async for _ in stream:
                pass
        assert stream.reply is not None  # a stream that ends without error has a reply
        return stream.reply

    def stream(self, text: str, **options: Unpack[ResponseOptions]) -> AsyncStream:
        """Like :meth:`ask` but iterate the answer: ``async for delta in chat.stream(text)``.

        Nothing is sent until iteration starts.
        """
        return AsyncStream(self, text, options)

    async def cancel(self) -> Reply | None:
        """Stop the answer in progress (or the question being sent), if any; returns its reply."""
        active = self._starting or self._active
        return await active.cancel() if active is not None else None

    @property
    def closed(self) -> bool:
        """True once the chat cannot be used any more: closed, or its connection lost for
        good. A dropped connection that the next call will resume does not count."""
        if self._closing or self._resume_failed:
            return True
        ws = self._ws
        return ws.close_code is not None and not self._may_resume(
            ws.protocol.close_rcvd, ws.protocol.close_sent
        )

    @property
    def session_id(self) -> str | None:
        """The gateway's id of this conversation (it stays the same across resumes)."""
        return self._cursor.session_id

    # -- turns ------------------------------------------------------------------------

    async def _begin_turn(self, stream: AsyncStream) -> None:
        """Add the user message, then ask for the answer. The caller holds the turn lock.

        ``stream.cancel()`` may run while this waits (another task): it then only waits for
        this to notice, at one of the checks below, and nothing more is sent for the stream.
        """
        self._starting = stream
        try:
            previous = self._active
            if previous is not None and not previous.finished:
                await previous.cancel()  # left unfinished by its reader: a new question wins
            if stream._cancelled:
                stream._finish_unsent()
                return
            await self._add_user_message(stream.text)
            if stream._cancelled:
                # The question stays in the conversation, unanswered; no response.create
                # went out, so there is nothing for the gateway to stop.
                stream._finish_unsent()
                return
            stream._response_event_id = event_id = self._ids.event()
            self._active = stream  # from here on, cancel() sends response.cancel
        finally:
            self._starting = None
        await self._send(
            events.response_create(event_id, stream.options),
            until=lambda: stream.response_id is None and not stream.finished,
        )

    async def _add_user_message(self, text: str) -> None:
        item_id = self._ids.item()

        def is_our_item(event: JSON) -> bool:
            item = event.get("item")
            return (
                event.get("type") == "conversation.item.done"
                and isinstance(item, dict)
                and item.get("id") == item_id
            )

        # Only our own item's done: the gateway also announces the answers' assistant items
        # with conversation.item.added/done, which must not be taken for this acknowledgement.
        await self._request(events.user_message(self._ids.event(), item_id, text), is_our_item)

    async def _send_cancel(
        self, response_id: str | None, until: Callable[[], bool] = lambda: False
    ) -> None:
        """Send ``response.cancel``; ``until()``: whether it still needs to reach the gateway
        (after a resume)."""
        eid = self._ids.event()
        self._cancel_ids.append(eid)
        await self._send(events.response_cancel(eid, response_id), until=until)

    # -- the event pump ---------------------------------------------------------------

    async def _request(self, event: JSON, accept: Callable[[JSON], bool]) -> JSON:
        """Send ``event`` and pump until an accepted answer or an error naming it arrives."""
        waiter = _Waiter(str(event["event_id"]), accept)
        self._waiters.append(waiter)
        try:
            await self._send(event, until=lambda: not waiter.done and waiter in self._waiters)
            await self._pump(lambda: waiter.done)
        finally:
            self._waiters.remove(waiter)
        if waiter.error is not None:
            raise waiter.error
        assert waiter.event is not None
        return waiter.event

    async def _pump(self, done: Callable[[], bool]) -> None:
        """Receive and dispatch events until ``done()``.

        Several tasks may pump at once (a reader and a canceller); the lock makes them take
        turns, and each re-checks ``done()`` after getting the lock, because the other may
        have received the very event it waited for.
        """
        while not done():
            async with self._read_lock:
                if done():
                    return
                self._dispatch(await self._receive())
                while self._resend:  # a fence was answered: these never reached the gateway
                    await self._send_frame(self._resend.pop(0))

    async def _receive(self) -> JSON:
        """The next new event of the session; resumes it first if the connection dropped.
        The caller holds the read lock."""
        while True:
            try:
                event = await recv_json(self._ws, self.timeout)
            except ConnectionClosed as exc:
                if not self._may_resume(exc.rcvd, exc.sent):
                    raise lost(exc) from None
                await self._resume()
                continue
            if self._cursor.accept(event):  # else a replayed event processed already
                return event

    async def _send(self, event: JSON, *, until: Callable[[], bool]) -> None:
        """Send a request; ``until()`` tells whether it still awaits its answer, which is
        how a resume knows whether it may have been lost with the connection."""
        self._unconfirmed.add(event, self._connection, until)
        await self._send_frame(event)

    async def _send_frame(self, event: JSON) -> None:
        ws = self._ws
        try:
            async with deadline(self.timeout, "sending to the gateway"):
                await ws.send(json.dumps(event))
        except ConnectionClosed as exc:
            if not self._may_resume(exc.rcvd, exc.sent):
                raise lost(exc) from None
            # The connection dropped: the next read resumes the session, and the fence
            # sent then tells whether this event must go again.

    # -- resuming ---------------------------------------------------------------------

    def _may_resume(self, rcvd: Close | None, sent: Close | None) -> bool:
        return (
            self._dialer.resume
            and not self._closing
            and not self._resume_failed
            and self._cursor.resumable
            and is_drop(rcvd, sent)
        )

    async def _resume(self) -> None:
        """Reconnect and take the session back, or raise :class:`ConnectionLost`.

        The caller holds the read lock: nobody reads meanwhile, and sends go to the dead
        socket, to be sent again if need be (see :class:`Unconfirmed`).
        """
        logger.info("connection lost; resuming session %s", self._cursor.session_id)
        try:
            ws, resumed = await reconnect(self._dialer, self._cursor, lambda: self._closing)
        except ConnectionLost:
            self._resume_failed = True
            raise
        if self._closing:  # close() ran meanwhile: it closed the old socket, not this one
            await close_quietly(ws)
            raise ConnectionLost("the chat was closed while its connection was being resumed")
        self._adopt(ws, resumed)
        logger.info("session %s resumed after event %d", self._cursor.session_id, self._cursor.last)
        if self._unconfirmed.any_before(self._connection):
            # Some request went out on a connection that dropped before its answer came.
            # The gateway answers this fence (an error: no such item) only after whatever
            # it received before, and the dispatcher then sends again what is still
            # unanswered (a response.create must not be sent twice).
            eid = self._ids.event()
            self._unconfirmed.fence(eid, self._connection)
            await self._send_frame(events.item_retrieve(eid, self._ids.item()))

    def _adopt(self, ws: ClientConnection, resumed: JSON) -> None:
        old, self._ws = self._ws, ws
        old.transport.abort()  # gone already; nothing of it may linger
        self._connection += 1
        self._cursor.resumed(resumed)
        session = resumed.get("session")
        if isinstance(session, dict):
            self.session = session

    def _dispatch(self, event: JSON) -> None:
        if event.get("type") == "error":
            self._dispatch_error(GatewayError.from_event(event))
            return
        active = self._active
        if active is not None and active._offer(event):
            return
        for waiter in self._waiters:
            if not waiter.done and waiter.accept(event):
                waiter.event = event
                return
        # Anything else (conversation.item.added, an older response's tail...) is informational.

    def _dispatch_error(self, err: GatewayError) -> None:
        lost = self._unconfirmed.fence_answered(err.event_id, self._connection)
        if lost is not None:
            self._resend.extend(lost)
            return
        if err.event_id is not None and err.event_id in self._cancel_ids:
            self._cancel_ids.remove(err.event_id)  # the answer had ended before the cancel
            return
        active = self._active if self._active is not None and not self._active.finished else None
        if active is not None and err.event_id == active._response_event_id:
            active._fail(err)  # the answer was refused (overloaded, already one running...)
            return
        pending = [w for w in self._waiters if not w.done]
        for waiter in pending:
            if waiter.event_id == err.event_id:
                waiter.error = err
                return
        if active is not None and active.response_id is not None and err.event_id is None:
            # A failure inside a running answer (the engine broke): the gateway reports it,
            # then still ends the answer with response.done (status failed), which the
            # stream waits for so that its reply keeps the text generated so far.
            logger.debug("error during response %s: %s", active.response_id, err)
            return
        # An error naming none of our requests: hand it to whoever waits so it is not lost.
        if active is not None:
            active._fail(err)
        elif pending:
            pending[0].error = err
        else:
            logger.warning("gateway error nobody waited for: %s", err)


class AsyncStream:
    """One answer as it is generated: ``async for delta in stream`` yields the new text.

    After the loop, :attr:`reply` holds the final :class:`Reply`. :meth:`cancel` stops the
    answer on the gateway; no delta is yielded after it is called. A stream left unfinished
    (``break``) goes on until the next question cancels it, or use ``async with`` to
    cancel it on leaving the block.
    """

    def __init__(self, chat: AsyncChat, text: str, options: Mapping[str, Any]) -> None:
        self.text = text
        self.options = options
        self._chat = chat
        self._started = False
        self._response_event_id: str | None = None
        self.response_id: str | None = None
        self._pending: deque[str] = deque()  # received, not yet yielded
        self._parts: list[str] = []  # every delta received, yielded or not
        self._final_text: str | None = None
        self._cancelled = False
        self._t0 = 0.0
        self._ttft: float | None = None
        self._reply: Reply | None = None
        self._error: BaseException | None = None
        self._error_raised = False
        self._finished = False
        self._ended = asyncio.Event()

    @property
    def reply(self) -> Reply | None:
        """The final reply once the answer ended (also after :meth:`cancel`), else ``None``."""
        return self._reply

    @property
    def finished(self) -> bool:
        return self._finished

    def __aiter__(self) -> AsyncStream:
        return self

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """``async with chat.stream(text) as s``: leaving the block early cancels the answer."""
        if self._started and not self._finished:
            with contextlib.suppress(ClientError):
                await self.cancel()

    async def __anext__(self) -> str:
        await self._start()
        try:
            await self._chat._pump(lambda: bool(self._pending) or self._finished)
        except ClientError as exc:
            await self._abandon(exc)
            raise
        if self._pending:
            return self._pending.popleft()
        if self._error is not None and not self._error_raised:
            self._error_raised = True
            raise self._error
        raise StopAsyncIteration

    async def cancel(self) -> Reply | None:
        """Stop this answer on the gateway and wait for its end; returns the final reply.

        Safe to call from another task while one iterates, and after the end (no-op).
        A stream that never started is simply never sent (returns ``None``).
        """
        self._cancelled = True
        self._pending.clear()
        if not self._started:
            self._started = True
            self._finish_unsent()
            return None
        if self._finished:
            return self._reply
        if self._response_event_id is None:
            # Another task is still sending the question: it sees ``_cancelled`` before
            # sending response.create and ends the stream. Pumping here instead could block
            # in recv() after the last event this turn will ever get.
            await self._ended.wait()
            return self._reply
        await self._chat._send_cancel(self.response_id, until=lambda: not self._finished)
        await self._chat._pump(lambda: self._finished)
        return self._reply

    # -- lifecycle (called by the chat) -------------------------------------------------

    async def _start(self) -> None:
        if self._started:
            return
        async with self._chat._turn_lock:
            await self._start_locked()

    async def _start_locked(self) -> None:
        if self._started:
            return
        self._started = True
        self._t0 = time.monotonic()
        try:
            await self._chat._begin_turn(self)
        except BaseException as exc:
            # Interrupted after response.create may have gone out: stay unfinished, so that
            # cancel() (or the next question) stops the answer the gateway may be running.
            if self._chat._active is not self or not isinstance(exc, asyncio.CancelledError):
                self._fail(exc)
                self._error_raised = True  # raised right here, not again by the iterator
            raise

    def _offer(self, event: JSON) -> bool:
        """Take ``event`` if it belongs to this answer; returns whether it did."""
        kind = str(event.get("type", ""))
        if self._finished or not kind.startswith("response."):
            return False
        rid = events.response_id_of(event)
        if kind == "response.created" and self.response_id is None:
            self.response_id = rid
            return True
        if rid is None or rid != self.response_id:
            return False  # an older answer's tail
        if kind == "response.output_text.delta":
            self._on_delta(str(event.get("delta", "")))
        elif kind == "response.output_text.done" and isinstance(event.get("text"), str):
            self._final_text = event["text"]
        elif kind == "response.done":
            self._on_done(event)
        return True

    def _on_delta(self, delta: str) -> None:
        if self._ttft is None and delta:
            self._ttft = time.monotonic() - self._t0
        self._parts.append(delta)
        if not self._cancelled:
            self._pending.append(delta)

    def _on_done(self, done: JSON) -> None:
        text = self._final_text if self._final_text is not None else "".join(self._parts)
        self._reply = reply_from_done(done, text, self._ttft, time.monotonic() - self._t0)
        failure = failure_of(done)
        if failure is not None:
            self._error = GatewayError(*failure, reply=self._reply)
        self._end()

    def _fail(self, err: BaseException) -> None:
        self._error = err
        self._end()

    def _finish_unsent(self) -> None:
        self._reply = Reply("", "cancelled", None, None, None, reason="client_cancelled")
        self._end()

    def _end(self) -> None:
        self._finished = True
        self._ended.set()
        if self._chat._active is self:
            self._chat._active = None

    async def _abandon(self, exc: ClientError) -> None:
        """The wait broke (timeout, lost connection): end the stream, and try to stop the answer."""
        if self._finished:
            return
        self._fail(exc)
        self._error_raised = True  # the caller raises ``exc`` itself
        if isinstance(exc, GatewayTimeout):
            with contextlib.suppress(ClientError):
                await self._chat._send_cancel(self.response_id)


class Connect:
    """What :func:`connect` returns: ``async with`` it, or ``await`` it (then close the chat)."""

    def __init__(
        self,
        url: str | None,
        api_key: str | None,
        timeout: float | None,
        resume: bool,
        resume_timeout: float,
        options: SessionOptions,
    ) -> None:
        self._url = url
        self._api_key = api_key
        self._timeout = timeout
        self._resume = resume
        self._resume_timeout = resume_timeout
        self._options = options
        self._chat: AsyncChat | None = None

    def __await__(self) -> Generator[Any, None, AsyncChat]:
        return AsyncChat.open(
            self._url,
            api_key=self._api_key,
            timeout=self._timeout,
            resume=self._resume,
            resume_timeout=self._resume_timeout,
            **self._options,
        ).__await__()

    async def __aenter__(self) -> AsyncChat:
        self._chat = await self
        return self._chat

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._chat is not None:
            await self._chat.close()


def connect(
    url: str | None = None,
    *,
    api_key: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    resume: bool = True,
    resume_timeout: float = RESUME_TIMEOUT,
    **options: Unpack[SessionOptions],
) -> Connect:
    """Open a conversation: ``async with connect(url, instructions=...) as chat``.

    ``url`` defaults to ``$GATEWAY_URL``, then ``ws://127.0.0.1:8765/v1/realtime``.
    ``timeout`` bounds every wait for the gateway (seconds; ``None``: wait forever).
    ``resume``: when the connection drops, reconnect and resume the session, trying for
    up to ``resume_timeout`` seconds, so that calls go on unaware (``False``: raise
    :class:`ConnectionLost` at once).
    ``options`` (instructions, max_output_tokens, temperature, top_p, seed, stop,
    frequency_penalty, presence_penalty) are sent
    with ``session.update`` and apply to every answer.
    """
    return Connect(url, api_key, timeout, resume, resume_timeout, options)
