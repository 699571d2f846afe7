"""What an HTTP request waits on while its session answers: the start of its answer (or a
refusal) and its end. It is the observer the Responses, Chat Completions and Completions
dialects tell (:class:`~sessions.responses.dialect.ResponseObserver`,
:class:`~sessions.choices.RequestObserver`)."""

from __future__ import annotations

import asyncio

from sessions import codec, errors


class Waiter:
    """The HTTP side of one answer: its start, its end, and the latest body."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.start: asyncio.Future[codec.JSON] = loop.create_future()
        self.end: asyncio.Future[codec.JSON] = loop.create_future()
        self.body: codec.JSON | None = None  # the latest Response object

    def started(self, body: codec.JSON) -> None:
        self.body = body
        if not self.start.done():
            self.start.set_result(body)

    def ended(self, body: codec.JSON) -> None:
        self.body = body
        if not self.end.done():
            self.end.set_result(body)

    def refused(self, err: errors.ProtocolError) -> None:
        if not self.start.done():
            self.start.set_exception(err)
