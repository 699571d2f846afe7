"""W3C Trace Context (``traceparent``, ``tracestate``) as a client sends it, checked, with
no OpenTelemetry import: the gateway passes a client's context on to an upstream replica
even when it exports no traces of its own (docs/deployment.md, "Observability").

https://www.w3.org/TR/trace-context/: a ``traceparent`` the gateway cannot read is
ignored (the request is served, its trace starts here), never an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# version-traceid-parentid-flags; a future version may append fields after a dash.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
MAX_TRACESTATE = 512  # the spec's "at least 512 characters"; beyond, it is dropped
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A valid ``traceparent`` and the ``tracestate`` that came with it ("" if none)."""

    traceparent: str
    tracestate: str = ""

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    @property
    def span_id(self) -> str:
        return self.traceparent[36:52]

    @property
    def sampled(self) -> bool:
        return int(self.traceparent[53:55], 16) & 1 == 1

    def fields(self) -> tuple[tuple[str, str], ...]:
        """As the fields (HTTP headers) a request to another server carries."""
        if self.tracestate:
            return ((TRACEPARENT, self.traceparent), (TRACESTATE, self.tracestate))
        return ((TRACEPARENT, self.traceparent),)


def parse(traceparent: str | None, tracestate: Iterable[str] = ()) -> TraceContext | None:
    """The context these header values carry, or None if ``traceparent`` is missing or
    malformed (then ``tracestate`` is ignored too, as the spec says)."""
    if not traceparent:
        return None
    value = traceparent.strip().lower()
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, _flags, rest = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    if version == "00" and rest:
        return None  # version 00 has exactly four fields
    state = ",".join(v.strip() for v in tracestate if v.strip())
    if len(state) > MAX_TRACESTATE or not _PRINTABLE.fullmatch(state):
        state = ""
    return TraceContext(value[:55], state)


def from_headers(get_all: Callable[[str], list[str]]) -> TraceContext | None:
    """The context of a request's headers (``get_all``: every value of a header). Two
    ``traceparent`` headers are as malformed as one bad one."""
    parents = get_all(TRACEPARENT)
    if len(parents) != 1:
        return None
    return parse(parents[0], get_all(TRACESTATE))
