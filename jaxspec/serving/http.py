"""The OpenAI-compatible HTTP surface over a `Server` (FastAPI; run by uvicorn in jaxspec.serve):
`/v1/completions`, `/v1/chat/completions` (the tokenizer's chat template), SSE streaming,
`/v1/models`, `/v1/models/{id}`, `/health` (alive), `/ready` (compiled and admitting),
`/metrics` (Prometheus). Bad requests get a 400 with a one-line message (fields it does not
honour included: `serving.fields`; the body itself: `serving.body`), a full queue a 429, an
unknown model a 404, a missing key a 401, a body over serving.max_body_bytes a 413 (one not whole
within 30 s a 408: `Limits.body_timeout_s`), any request
while compiling or stopping a 503 (429 and 503 with Retry-After); a client that disconnects
cancels its request, streamed or not (row and pages freed). `usage` counts
the tokens returned and carries the speculative loop's figures under `speculative`.

Finish reasons beyond OpenAI's: "length" also when serving.request_timeout_s ran out, "abort"
when a graceful stop ended the request, "error" when the request failed in the serving loop
(docs/serving.md: a failure is confined to its request; the loop's own death stops the process).
Extensions: `top_k`, `min_p`, `stop_token_ids`, `cache_salt` (the prefix cache's namespace).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxspec.errors import JaxspecError
from jaxspec.serving.answers import error
from jaxspec.serving.api import Server
from jaxspec.serving.asks import Parser
from jaxspec.serving.body import read_body
from jaxspec.serving.fields import HTTPError
from jaxspec.serving.gate import Gate
from jaxspec.serving.metrics import CONTENT_TYPE, ServerMetrics
from jaxspec.serving.replies import Replies
from jaxspec.serving.requests import EngineStopped, QueueFull

OPEN_PATHS = ("/health", "/ready")  # answered without a key, in any state


class Refusing:
    """ASGI middleware: HTTP requests that `refusal(request)` answers get that answer."""

    def __init__(self, app, refusal):
        self.app, self.refusal = app, refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            answer = self.refusal(Request(scope))
            if answer is not None:
                return await answer(scope, receive, send)
        await self.app(scope, receive, send)


def refusal(server: Server, gate: Gate, request: Request):
    """The answer a request gets before any handler (key, size, state), or None."""
    if request.url.path in OPEN_PATHS:
        return None
    if not gate.authorized(request.headers.get("authorization")):
        return error(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                     "authentication_error")
    size, most = request.headers.get("content-length", ""), gate.limits.max_body_bytes
    if most and size.isdigit() and int(size) > most:
        return error(413, f"the request body is {size} bytes: serving.max_body_bytes allows "
                          f"{most}", "request_too_large")
    if request.method != "POST":
        return None
    if server.failure is not None:
        return error(503, "the serving loop stopped and the process is exiting: send the "
                          "request to another replica", "unavailable")
    if gate.draining:
        return error(503, "the server is stopping: send the request to another replica",
                     "unavailable")
    if not gate.ready:
        return error(503, "the server is compiling its programs: retry when /ready answers "
                          "200", "unavailable")
    return None


class Endpoints:
    """One handler per route, on shared request parsing (`asks.Parser`) and replies
    (`replies.Replies`)."""

    def __init__(self, server: Server, gate: Gate, metrics: ServerMetrics):
        self.server, self.gate, self.metrics = server, gate, metrics
        self.parser = Parser(server, gate)
        self.replies = Replies(server, gate, metrics, self.parser.piece)

    async def health(self):
        h = self.server.health()
        return h if self.server.failure is None else JSONResponse(h, 503)

    async def ready(self):
        if self.server.failure is not None:
            return error(503, "the serving loop stopped: the process is exiting", "unavailable")
        if self.gate.draining:
            return error(503, "the server is stopping", "unavailable")
        if not self.gate.ready:
            return error(503, "the server is compiling its programs", "unavailable")
        return {"status": "ready"}

    async def prometheus(self):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(self) -> dict:
        return {"id": self.server.model_name, "object": "model", "created": 0,
                "owned_by": "jaxspec"}

    async def models(self):
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, name: str):
        self.parser.check_model({"model": name})
        return self.model_card()

    async def _body(self, request: Request) -> dict:
        limits = self.gate.limits
        return await read_body(request, limits.max_body_bytes, limits.body_timeout_s)

    async def completions(self, request: Request):
        body = await self._body(request)
        self.parser.check_model(body)
        ids, text = self.parser.completion_prompt(body)
        ask = await self.parser.ask(body, ids, False, text, request)
        return await self.replies.reply(ask, request)

    async def chat_completions(self, request: Request):
        body = await self._body(request)
        self.parser.check_model(body)
        ask = await self.parser.ask(body, self.parser.chat_ids(body), True, "", request)
        return await self.replies.reply(ask, request)


async def _http_error(_, e: HTTPError):
    return error(e.status, e.message, e.kind)


async def _full(_, e: QueueFull):
    return error(429, str(e), "rate_limit_error")


async def _stopped(_, e: EngineStopped):
    return error(503, str(e), "unavailable")


async def _bad(_, e: JaxspecError):
    return error(400, str(e), "invalid_request_error")


def make_app(server: Server, gate: Gate | None = None) -> FastAPI:
    """The app over a Server; `gate`: its key, limits and readiness (default: open, ready)."""
    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None)
    gate = app.state.gate = gate or Gate()
    metrics = app.state.metrics = ServerMetrics(server)
    # a plain ASGI middleware: the handlers keep the client's own `receive`, so a request not
    # streamed sees its client go away (`answers.drained`); Starlette's BaseHTTPMiddleware hides it
    app.add_middleware(Refusing, refusal=lambda request: refusal(server, gate, request))
    for kind, handler in ((HTTPError, _http_error), (QueueFull, _full),
                          (EngineStopped, _stopped), (JaxspecError, _bad)):
        app.add_exception_handler(kind, handler)
    routes = Endpoints(server, gate, metrics)
    app.get("/health")(routes.health)
    app.get("/ready")(routes.ready)
    app.get("/metrics")(routes.prometheus)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{name:path}")(routes.model)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    return app
