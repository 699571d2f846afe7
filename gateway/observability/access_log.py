"""The access log: one line per HTTP request and per answer on a WebSocket, at INFO on the
``gateway.access`` logger, as text (``--access-log text``, the default) or as one JSON
object a line (``--access-log json``); docs/deployment.md lists the fields.

Names, never keys: the tenant is its name, a path never carries its query (a resume token
may travel there), and what a client chose (its request id, a model name, an error's
``param``) is quoted in text so that it cannot pass for another field or line.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import orjson

from gateway.observability.record import Record

LOGGER = "gateway.access"
FORMATS = ("text", "json", "off")
_BARE = re.compile(r"[\w.:/@+\-{}]+")


def fields(record: Record, *, with_time: bool = True) -> dict[str, Any]:
    """The line's fields, in order; None, 0 counts and false flags are left out."""
    r = record
    head: dict[str, Any] = {
        "time": _iso(r.wall) if with_time else None,
        "kind": r.kind,
        "client": r.client or None,
        "method": r.method or None,
        "route": r.route or None,
        "path": r.path or None,
        "event": r.event or None,
        "status": r.status,
        "duration": _seconds(r.duration),
    }
    out = {k: v for k, v in head.items() if v is not None}
    out.update(_tail(r))
    return out


def _tail(r: Record) -> list[tuple[str, Any]]:
    """The fields after the duration (the same in text and JSON), those that are set."""
    tail = (
        ("request_id", r.request_id),
        ("client_request_id", r.client_request_id),
        ("connection_id", r.connection_id),
        ("session_id", r.session_id),
        ("tenant", r.tenant or None),
        ("model", r.model),
        ("response_id", r.response_id),
        ("response_status", r.response_status),
        ("input_tokens", r.input_tokens),
        ("cached_tokens", r.cached_tokens),
        ("output_tokens", r.output_tokens),
        ("slot_wait", _seconds(r.slot_wait)),
        ("time_to_first_token", _seconds(r.time_to_first_token)),
        ("error_code", r.error_code),
        ("error_param", r.error_param),
        ("client_event_id", r.client_event_id),
        ("cancel_reason", r.cancel_reason),
        ("close_code", r.close_code),
        ("resumes", r.resumes or None),
        ("moves", r.moves or None),
        ("takeover", r.takeover or None),
        ("handed_over", r.handed_over or None),
        ("background", r.background or None),
    )
    return [(key, value) for key, value in tail if value is not None]


def text(record: Record) -> str:
    """``CLIENT "METHOD PATH" STATUS DURATIONs key=value...`` (a socket's answer: ``"EVENT
    PATH"``); the log line's own prefix has the time. Written from the record itself, not
    from :func:`fields` (a line per request: the dict of every field is half its cost)."""
    r = record
    status = "-" if r.status is None else r.status
    parts = [
        f'{r.client or "-"} "{r.method or r.event or "-"} {r.path or r.route or "-"}" '
        f"{status} {_seconds(r.duration):.6f}s"
    ]
    for key, value in _tail(r):
        if value.__class__ is str:
            quoted = value if _BARE.fullmatch(value) else orjson.dumps(value).decode()
            parts.append(f"{key}={quoted}")
        elif value.__class__ is float:
            parts.append(f"{key}={value:.6f}")
        elif value is True:
            parts.append(f"{key}=true")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


class AccessLog:
    """Writes records as lines in one of :data:`FORMATS`."""

    def __init__(self, form: str = "text", logger: logging.Logger | None = None) -> None:
        if form not in FORMATS:
            raise ValueError(f"--access-log is one of {', '.join(FORMATS)}, not {form!r}")
        self.form = form
        self.logger = logger or logging.getLogger(LOGGER)

    @property
    def on(self) -> bool:
        return self.form != "off" and self.logger.isEnabledFor(logging.INFO)

    def write(self, record: Record) -> None:
        if not self.on:
            return
        line = orjson.dumps(fields(record)).decode() if self.form == "json" else text(record)
        # logger.info's record, but for the walk up the stack to find its caller (always
        # this line): the line is the message itself, with nothing to interpolate.
        logger = self.logger
        logger.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, line, (), None))


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _iso(wall: float) -> str:
    seconds = int(wall)
    millis = int((wall - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"
