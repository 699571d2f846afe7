"""OpenAI's answer to what the gateway does not serve: an unknown path is a 404 and a served
path asked with another method a 405 (with a true ``Allow``), each with OpenAI's error object
(``{"error": {"message": "Invalid URL (POST /v1/...)", "type": "invalid_request_error",
"param": null, "code": null}}``), which the SDKs raise as ``NotFoundError`` and
``APIStatusError``."""

from __future__ import annotations

from gateway.transport.http1 import Handler, HttpReply, HttpRequest


def _error(message: str) -> dict[str, object]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    }


async def not_found(request: HttpRequest, reply: HttpReply, why: str = "") -> None:
    """404: no route here (``why``, if given, says more)."""
    method = "GET" if request.method == "HEAD" else request.method  # HEAD: GET's headers
    message = f"Invalid URL ({method} {request.path})" + (f": {why}" if why else "")
    reply.send_json(404, _error(message))


def not_allowed(allow: str) -> Handler:
    """The handler of a 405 on a path whose methods are ``allow``."""

    async def answer(request: HttpRequest, reply: HttpReply) -> None:
        message = f"Invalid method for URL ({request.method} {request.path}): send {allow}."
        reply.send_json(405, _error(message), {"Allow": allow})

    return answer
