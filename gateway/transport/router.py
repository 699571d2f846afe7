"""Which handler answers a plain HTTP request: method and path pattern, each route with
its own body limit. gateway/transport/http1.py asks :meth:`Router.resolve` once a request head
is whole (before the body is read, so that the route's limit applies to it).

Patterns are paths whose segments may be ``{name}``: one non-empty segment, handed to
the handler unquoted in ``request.params``. The first pattern registered that matches
wins. ``HEAD`` is answered by the ``GET`` route unless one is registered for it; the
method ``"*"`` takes any method that has no route of its own on that pattern. A path
that matches a pattern but not its methods gets 405 with ``Allow`` (answered by the
``not_allowed`` handler, if given); a path that matches nothing, and a WebSocket upgrade to
a path that has no WebSocket, go to the fallback.

    router.add("POST", "/v1/responses", create, body_limit=config.max_message_bytes)
    router.add("GET", "/v1/responses/{id}", retrieve)
    router.add("DELETE", "/v1/responses/{id}", delete)
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.transport.http1 import Handler, HttpReply, HttpRequest, Target

DEFAULT_BODY_LIMIT = 64 * 1024
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(slots=True)
class _Pattern:
    text: str
    regex: re.Pattern[str]
    methods: dict[str, tuple[Handler, int]] = field(default_factory=dict)

    def allowed(self) -> str:
        methods = sorted(m for m in self.methods if m != "*")
        if "GET" in methods and "HEAD" not in methods:
            methods.insert(methods.index("GET") + 1, "HEAD")
        return ", ".join(methods)


NotAllowed = Callable[[str], Handler]
"""Makes the handler of a 405 from the ``Allow`` header's value."""


class Router:
    """Routes for :class:`~gateway.transport.http1.HttpService`; see the module docstring."""

    def __init__(
        self,
        fallback: Handler,
        *,
        fallback_body_limit: int = DEFAULT_BODY_LIMIT,
        not_allowed: NotAllowed | None = None,
    ):
        self._fallback = Target(fallback, {}, fallback_body_limit)
        self._not_allowed = not_allowed or _method_not_allowed
        self._patterns: list[_Pattern] = []

    def routes(self) -> list[tuple[str, str]]:
        """Every (pattern, ``Allow`` value) routed, in the order they were added."""
        return [(p.text, p.allowed()) for p in self._patterns]

    def add(
        self,
        method: str,
        pattern: str,
        handler: Handler,
        *,
        body_limit: int = DEFAULT_BODY_LIMIT,
    ) -> None:
        """Answer ``method`` (or ``"*"``) on ``pattern`` with ``handler``, reading a body
        of at most ``body_limit`` bytes (beyond: 413)."""
        entry = next((p for p in self._patterns if p.text == pattern), None)
        if entry is None:
            entry = _Pattern(pattern, _compile(pattern))
            self._patterns.append(entry)
        if method in entry.methods:
            raise ValueError(f"{method} {pattern} is already routed")
        entry.methods[method] = (handler, body_limit)

    def route(
        self, method: str, pattern: str, *, body_limit: int = DEFAULT_BODY_LIMIT
    ) -> Callable[[Handler], Handler]:
        """:meth:`add` as a decorator."""

        def register(handler: Handler) -> Handler:
            self.add(method, pattern, handler, body_limit=body_limit)
            return handler

        return register

    def resolve(self, method: str, path: str, *, websocket: bool = False) -> Target:
        if websocket:
            return self._fallback
        for entry in self._patterns:
            match = entry.regex.fullmatch(path)
            if match is None:
                continue
            params = {k: urllib.parse.unquote(v) for k, v in match.groupdict().items()}
            found = entry.methods.get(method)
            if found is None and method == "HEAD":
                found = entry.methods.get("GET")
            if found is None:
                found = entry.methods.get("*")
            if found is None:
                answer = self._not_allowed(entry.allowed())
                return Target(answer, params, DEFAULT_BODY_LIMIT, entry.text)
            handler, limit = found
            return Target(handler, params, limit, entry.text)
        return self._fallback


def _compile(pattern: str) -> re.Pattern[str]:
    if not pattern.startswith("/"):
        raise ValueError(f"a route's pattern starts with '/': {pattern!r}")
    parts: list[str] = []
    last = 0
    for match in _PARAM.finditer(pattern):
        parts += [re.escape(pattern[last : match.start()]), f"(?P<{match[1]}>[^/]+)"]
        last = match.end()
    parts.append(re.escape(pattern[last:]))
    return re.compile("".join(parts))


def _method_not_allowed(allow: str) -> Handler:
    async def answer(request: HttpRequest, reply: HttpReply) -> None:
        reply.send_text(405, f"{request.method} is not served here.", {"Allow": allow})

    return answer
