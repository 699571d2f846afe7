"""The errors of the session layer, and what each becomes on the wire.

::

    Exception
     +-- ProtocolError          a client event (or request body) the gateway refuses: one ``error``
     |    |                     event (an OpenAI error object over HTTP); the connection goes on
     |    +-- ResumeRefused     a resume that cannot be served: ``session_not_found``,
     |                          ``resume_gap`` ...; its code says which
     +-- SessionRelayed         not an error: a resume that another process serves (a worker or
     |                          the store's owner); the connection was handed on and has ended
     +-- KeyError
          +-- DuplicateItemId   an item id already in the conversation: the dialect answers
                                ``duplicate_item_id`` (or makes another id, if it chose it)

Every :class:`ProtocolError` carries a ``code`` a program can match (OpenAI's where OpenAI has
one), a ``message`` for people, and the ``param`` and ``event_id`` it is about.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """A client event the gateway refuses; becomes one ``error`` event, the connection stays."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        event_id: str | None = None,
        error_type: str = "invalid_request_error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.error_type = error_type
        self.retry_after = retry_after  # seconds, for HTTP's Retry-After (429, 503)


RESUME_ERRORS: dict[str, str] = {
    "session_busy": "Another gateway is taking this session over right now; retry the resume.",
    "session_not_found": "No session with that id and resume token can be resumed here "
    "(unknown, ended, or its resume window is over); this connection goes on as a new session.",
    "resume_gap": "Some events after last_sequence_number are no longer kept, so the session "
    "cannot be resumed without losing them; this connection goes on as a new session.",
}


class ResumeRefused(ProtocolError):
    """A resume the gateway refuses; ``code`` (a key of :data:`RESUME_ERRORS`) says why
    (docs/protocol.md, "Resuming")."""

    def __init__(self, code: str, *, event_id: str | None = None) -> None:
        super().__init__(code, RESUME_ERRORS[code], event_id=event_id)


class SessionRelayed(Exception):
    """The resume was relayed to the process that owns the session, and that relay has
    ended: nothing is left for this connection to do."""


class DuplicateItemId(KeyError):
    """An item with this id is already in the conversation (whoever made either id)."""
