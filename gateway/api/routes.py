"""The plain HTTP routes of the gateway's port: health, readiness, metrics, the chat page,
client secrets, a word for a GET that should have been a WebSocket upgrade, and OpenAI's
404 and 405 for everything else (gateway/api/not_served.py).

The APIs' routes are their modules' (responses_http.py, chat_http.py, completions_http.py,
embeddings_http.py); :func:`router` adds them.
"""

from __future__ import annotations

from gateway.api import auth, static_files
from gateway.api.admission import Admission, Entry, bearer
from gateway.api.chat_http import ChatCompletionsHttp
from gateway.api.completions_http import CompletionsHttp
from gateway.api.embeddings_http import EmbeddingsHttp
from gateway.api.http_api import HttpApi
from gateway.api.not_served import not_allowed, not_found
from gateway.api.responses_http import ResponsesHttp
from gateway.api.status import ServerState
from gateway.config import GatewayConfig
from gateway.session_table import SessionTable
from gateway.transport.http1 import HttpReply, HttpRequest
from gateway.transport.router import Router

# Where a GET with "Upgrade: websocket" becomes a WebSocket (each also with a trailing
# slash); anywhere else it is answered 404. The path picks the dialect.
REALTIME_PATH = "/v1/realtime"
RESPONSES_PATH = "/v1/responses"
WEBSOCKET_PATHS = (REALTIME_PATH, RESPONSES_PATH)
CLIENT_SECRETS_PATHS = ("/v1/realtime/client_secrets", "/v1/realtime/client_secrets/")
PAGE_CONFIG_PATH = "/page-config.json"
# Probes, the scrape and the page: an access log line each, but no trace span.
UNTRACED_ROUTES = ("/healthz", "/readyz", "/metrics", PAGE_CONFIG_PATH, "/", "/static/{name}")


def router(
    config: GatewayConfig,
    state: ServerState,
    table: SessionTable,
    admission: Admission,
    responses_http: ResponsesHttp,
    chat_http: ChatCompletionsHttp,
    completions_http: CompletionsHttp,
    embeddings_http: EmbeddingsHttp,
) -> Router:
    """Every plain HTTP route (gateway/transport/router.py says how to add one)."""
    routes = _Routes(config, state, table, admission)
    router = Router(not_found, not_allowed=not_allowed)
    router.add("GET", "/healthz", routes.healthz)
    router.add("GET", "/readyz", routes.readyz)
    router.add("GET", "/metrics", routes.metrics)
    router.add("GET", PAGE_CONFIG_PATH, routes.page_config)
    router.add("GET", "/", _page)
    router.add("GET", "/static/{name}", _page)
    for path in WEBSOCKET_PATHS:  # a GET that is no upgrade (an upgrade never gets here)
        router.add("GET", path, _websocket_only)
        router.add("GET", path + "/", _websocket_only)
    for path in CLIENT_SECRETS_PATHS:
        router.add("POST", path, routes.mint_client_secret)
    responses_http.register(router)
    chat_http.register(router)
    completions_http.register(router)
    embeddings_http.register(router)
    return router


class _Routes(HttpApi):
    """The routes that read the gateway's state."""

    async def healthz(self, request: HttpRequest, reply: HttpReply) -> None:
        # Where this client reaches each endpoint, in the scheme this port speaks.
        state = self._state
        host = request.headers.get("Host") or f"{self._config.host}:{state.port}"
        scheme = state.scheme
        ws = "wss" if scheme == "https" else "ws"
        urls = {
            "page": f"{scheme}://{host}/",
            "realtime": f"{ws}://{host}{REALTIME_PATH}",
            "responses": f"{ws}://{host}{RESPONSES_PATH}",
            "http": f"{scheme}://{host}/v1",
        }
        reply.send_json(200, {**state.health(), "urls": urls})

    async def readyz(self, request: HttpRequest, reply: HttpReply) -> None:
        ready = self._state.ready
        reply.send_json(200 if ready else 503, {"ready": ready})

    async def metrics(self, request: HttpRequest, reply: HttpReply) -> None:
        body = self._state.render_metrics()
        reply.send(200, body, "text/plain; version=0.0.4; charset=utf-8")

    async def page_config(self, request: HttpRequest, reply: HttpReply) -> None:
        reply.send_json(200, {"client_secret_url": self._config.client_secret_url})

    async def mint_client_secret(self, request: HttpRequest, reply: HttpReply) -> None:
        """``POST /v1/realtime/client_secrets``: the hosted Realtime API's shape."""
        refused = self._admission.refuse(request.headers, Entry.MINT)
        if refused is not None:
            api_error(reply, refused.status, refused.message, refused.code, refused.headers)
            return
        try:
            ttl = auth.parse_secret_request(request.body)
        except auth.SecretRequestError as err:
            api_error(reply, 400, err.message, err.code, param=err.param)
            return
        credentials = self._admission.credentials
        secret = credentials.mint(credentials.is_api_key(bearer(request.headers)), ttl)
        defaults = self._table.defaults
        session = {
            "object": "realtime.session",
            "type": "realtime",
            "model": defaults.model,
            "instructions": defaults.instructions,
            "output_modalities": ["text"],
        }
        reply.send_json(
            200, {"value": secret.value, "expires_at": secret.expires_at, "session": session}
        )


async def _page(request: HttpRequest, reply: HttpReply) -> None:
    found = static_files.page(request.params.get("name", "index.html"))
    if found is None:
        await not_found(request, reply)
        return
    body, content_type = found
    reply.send(200, body, content_type, static_files.PAGE_HEADERS)


async def _websocket_only(request: HttpRequest, reply: HttpReply) -> None:
    name = "Realtime" if request.path.rstrip("/") == REALTIME_PATH else "Responses"
    reply.send_text(
        426,
        f"This is the {name} WebSocket endpoint: connect with a WebSocket client.",
        {"Upgrade": "websocket"},
    )


def api_error(
    reply: HttpReply,
    status: int,
    message: str,
    code: str,
    extra: dict[str, str] | None = None,
    *,
    param: str | None = None,
) -> None:
    """An error in the OpenAI REST API's shape, which the SDK turns into its exceptions."""
    error_type = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": error_type, "code": code, "param": param}}
    reply.send_json(status, body, extra)
