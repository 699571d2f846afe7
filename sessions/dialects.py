"""The dialects by name: the one place outside a dialect's package that knows them all.

A session store records a session's dialect by name; the process that takes the session
over makes that dialect again from here (:func:`make`). What differs between dialects
across a resume or a takeover is said here too, so that the gateway's other layers ask a
:class:`DialectKind` instead of testing a dialect's class. The session core imports none
of this: it sees a dialect through the ``Dialect`` protocol alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sessions.chat.dialect import ChatDialect, chat_framing
from sessions.completions.dialect import CompletionsDialect, completion_framing
from sessions.core import Dialect
from sessions.outbox import Framing
from sessions.realtime.dialect import RealtimeDialect, RealtimeFraming
from sessions.response_store import ResponseStore
from sessions.responses.dialect import ResponsesDialect, ResponsesFraming


@dataclass(frozen=True, slots=True)
class DialectContext:
    """What a dialect made for a new or taken-over session may use."""

    response_store: ResponseStore
    max_parallel_out_of_band: int = 4  # Realtime: responses with conversation "none"


@dataclass(frozen=True, slots=True)
class DialectKind:
    name: str
    make: Callable[[DialectContext], tuple[Dialect, Framing]]
    # Realtime hands a resumed client a new token each time; a Responses client keeps the
    # token its upgrade's answer named, since openai-python's reconnect sends it again.
    rotates_resume_token: bool
    # The stored responses a snapshot's dialect state continues, to be fetched into this
    # process's cache before the session is restored here.
    continued_responses: Callable[[dict[str, Any]], list[str]]


def _no_responses(_state: dict[str, Any]) -> list[str]:
    return []


def _lanes_latest(state: dict[str, Any]) -> list[str]:
    return [latest for _, latest in state["lanes"] if latest]


REALTIME = DialectKind(
    "realtime",
    lambda c: (RealtimeDialect(c.max_parallel_out_of_band), RealtimeFraming()),
    rotates_resume_token=True,
    continued_responses=_no_responses,
)
RESPONSES = DialectKind(
    "responses",
    lambda c: (ResponsesDialect(c.response_store), ResponsesFraming()),
    rotates_resume_token=False,
    continued_responses=_lanes_latest,
)


def _chat(_context: DialectContext) -> tuple[Dialect, Framing]:
    framing = chat_framing()
    return ChatDialect(framing), framing


def _completions(_context: DialectContext) -> tuple[Dialect, Framing]:
    framing = completion_framing()
    return CompletionsDialect(framing), framing


# One answer per HTTP request, never kept in a store (no client can resume it).
CHAT = DialectKind("chat", _chat, rotates_resume_token=False, continued_responses=_no_responses)
COMPLETIONS = DialectKind(
    "completions", _completions, rotates_resume_token=False, continued_responses=_no_responses
)
BY_NAME: dict[str, DialectKind] = {
    kind.name: kind for kind in (REALTIME, RESPONSES, CHAT, COMPLETIONS)
}
