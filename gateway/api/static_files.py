"""The chat page and its files, served from ``/`` and ``/static/NAME`` (the routes are in
gateway/server.py; this module only finds the file)."""

from __future__ import annotations

from pathlib import Path

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
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
        "style-src 'self'; script-src 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def page(name: str) -> tuple[bytes, str] | None:
    """The file ``name`` beside the chat page and its content type; None: not found."""
    if "/" in name or name.startswith(".") or "\0" in name:
        return None
    file = STATIC_DIR / name
    content_type = _CONTENT_TYPES.get(file.suffix)
    if content_type is None or not file.is_file():
        return None
    return file.read_bytes(), content_type
