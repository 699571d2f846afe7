"""The plain-HTTP routes served on the WebSocket port: health, readiness, metrics, the page."""

from __future__ import annotations

import dataclasses
import http
from collections.abc import Callable
from pathlib import Path

import orjson
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

STATIC_DIR = Path(__file__).parent / "static"
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".ico": "image/x-icon",
}
# The page loads nothing from elsewhere; its socket goes back to the same host.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
        "style-src 'self'; script-src 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def response(
    status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None
) -> Response:
    headers = Headers(
        {"Content-Type": content_type, "Content-Length": str(len(body)), "Connection": "close"}
    )
    for name, value in (extra or {}).items():
        headers[name] = value
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def json_response(status: int, payload: object) -> Response:
    return response(status, orjson.dumps(payload), "application/json")


def text_response(status: int, text: str, extra: dict[str, str] | None = None) -> Response:
    return response(status, text.encode() + b"\n", "text/plain; charset=utf-8", extra)


def static_response(path: str) -> Response | None:
    """``/`` is the chat page; ``/static/NAME`` any file beside it. None: not found."""
    if path != "/" and not path.startswith("/static/"):
        return None
    name = "index.html" if path == "/" else path.removeprefix("/static/")
    if "/" in name or name.startswith("."):
        return None
    file = STATIC_DIR / name
    content_type = _CONTENT_TYPES.get(file.suffix)
    if content_type is None or not file.is_file():
        return None
    return response(200, file.read_bytes(), content_type, _PAGE_HEADERS)


# -- HEAD ------------------------------------------------------------------------

ProcessRequest = Callable[[ServerConnection, Request], Response | None]


class HeadAwareConnection(ServerConnection):
    """A connection that lets HEAD requests through (uptime probes, ``curl -I``).

    websockets parses GET requests only and drops anything else without a word. Here the
    request line's ``HEAD`` becomes ``GET`` before websockets reads it, and ``head`` tells
    :func:`answer_head` to send that GET's status and headers without its body.
    """

    head = False
    _start: bytes | None = b""  # the request's first bytes until its method is known

    def data_received(self, data: bytes) -> None:
        if self._start is not None:
            data = self._start + data
            if b" " not in data and len(data) < 8:  # the method may still be arriving
                self._start = data
                return
            self._start = None
            if data.startswith(b"HEAD "):
                self.head = True
                data = b"GET " + data[5:]
        super().data_received(data)


def answer_head(process_request: ProcessRequest) -> ProcessRequest:
    """``process_request`` that answers a HEAD like its GET, minus the body; never an upgrade."""

    def process(connection: ServerConnection, request: Request) -> Response | None:
        head = isinstance(connection, HeadAwareConnection) and connection.head
        if not head:
            return process_request(connection, request)
        if "Upgrade" in request.headers:
            del request.headers["Upgrade"]  # HEAD cannot open a WebSocket
        response = process_request(connection, request) or text_response(
            405, "HEAD is answered for the page and the HTTP routes only."
        )
        # Content-Length stays that of the GET body, as HTTP wants for HEAD.
        return dataclasses.replace(response, body=b"")

    return process
