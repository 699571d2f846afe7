"""The common request, read without h11; a response head, written as h11 writes it.

gateway/transport/http1.py reads requests with h11, whose state machine checks
everything a client can get wrong, and that costs a request about as much as the rest
of a short answer. Nearly every request an API client sends has one shape, though: an
HTTP/1.1 request line, plain header lines (visible ASCII), one Host, at most one
Content-Length, no Transfer-Encoding, Expect or Upgrade. :func:`parse` reads exactly that
shape and returns None for anything else, which then goes to h11 as before (its
refusals, HTTP/1.0, HEAD, chunked bodies, 100-continue and upgrades among them). What
it accepts, h11 accepts and reads the same way: the same method, target, headers (names
as sent, values without the whitespace around them) and body framing.

:func:`response_head` writes a response's status line and headers as h11 writes them for
an HTTP/1.1 request, byte for byte: the headers in order, ``Transfer-Encoding: chunked``
after them when there is no Content-Length, and ``Connection: close`` moved last when
the request asked to close.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import h11
from websockets.datastructures import Headers

# h11's grammar (its _abnf module), narrowed to visible ASCII values.
_REQUEST_LINE = re.compile(rb"(GET|POST|PUT|PATCH|DELETE|OPTIONS) ([\x21-\x7e]+) HTTP/1\.1")
_FIELDS = re.compile(
    rb"(?:[-!#$%&'*+.^_`|~0-9a-zA-Z]+:[ \t]*(?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?[ \t]*\r\n)*"
)
_DIGITS = re.compile(rb"[0-9]{1,20}")
# Names that send a request to h11: their rules are its to apply.
_TO_H11 = frozenset({"transfer-encoding", "expect", "upgrade"})
_VALUE = re.compile(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*|")
_NAME = re.compile(r"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    target: str  # path and query, as sent
    headers: Headers
    length: int  # the body's, from Content-Length (0 without one)
    keep_alive: bool  # no Connection: close


def parse(raw: bytes | bytearray, end: int) -> RequestHead | None:
    """The head ending at ``raw[end]`` (where its blank line starts), if it has the common
    shape; else None (h11 reads it)."""
    line_end = raw.find(b"\r\n", 0, end + 2)
    line = _REQUEST_LINE.fullmatch(raw, 0, line_end)
    if line is None or not _FIELDS.fullmatch(raw, line_end + 2, end + 2):
        return None
    headers = Headers()
    length = -1
    hosts = 0
    keep_alive = True
    for field in bytes(raw[line_end + 2 : end]).split(b"\r\n"):
        raw_name, _, raw_value = field.partition(b":")
        name = raw_name.decode("ascii")
        value = raw_value.strip(b" \t").decode("ascii")
        lower = name.lower()
        if lower == "content-length":
            if length >= 0 or not _DIGITS.fullmatch(raw_value.strip(b" \t")):
                return None  # two of them, or one h11 would read otherwise
            length = int(value)
        elif lower == "host":
            hosts += 1
        elif lower == "connection":
            if "close" in (token.strip() for token in value.lower().split(",")):
                keep_alive = False
        elif lower in _TO_H11:
            return None
        headers[name] = value
    if hosts != 1:
        return None
    method, target = line.group(1).decode("ascii"), line.group(2).decode("ascii")
    return RequestHead(method, target, headers, max(length, 0), keep_alive)


def response_head(
    status: int, reason: bytes, fields: Iterable[tuple[str, str]], *, keep_alive: bool
) -> tuple[bytes, bool, bool]:
    """The head of a response to an HTTP/1.1 request (not HEAD), as h11 writes it; whether
    its body is chunked, and whether the connection closes after it. ``keep_alive``: the
    request did not ask to close."""
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, reason)]
    chunked = status not in (204, 304)  # h11 frames these bodies as empty
    closes = not keep_alive
    kept: list[tuple[str, str]] = []
    for name, value in fields:
        if not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
            # What h11 raises for a header it would not write (one that could split the head).
            raise h11.LocalProtocolError(f"Illegal response header {name!r}: {value!r}")
        lower = name.lower()
        if lower == "content-length":
            chunked = False
        elif lower == "connection":
            if not keep_alive:
                continue  # h11 puts the Connection it needs last
            closes = closes or "close" in value.lower()
        kept.append((name, value))
    for name, value in kept:
        lines.append(b"%b: %b\r\n" % (name.encode("ascii"), value.encode("ascii")))
    if chunked:
        lines.append(b"Transfer-Encoding: chunked\r\n")
    if not keep_alive:
        lines.append(b"Connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines), chunked, closes
