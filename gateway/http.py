"""The plain-HTTP routes served on the WebSocket port: health, readiness, metrics, the page."""

from __future__ import annotations

import http
from pathlib import Path

import orjson
from websockets.datastructures import Headers
from websockets.http11 import Response

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
