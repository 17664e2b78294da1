"""The OpenAI-compatible HTTP surface over a `Server` (FastAPI; run by uvicorn in jaxspec.serve):
`/v1/completions`, `/v1/chat/completions` (the tokenizer's chat template), SSE streaming,
`/v1/models`, `/health`. Bad requests get a 400 with a one-line message, a full queue a 429, an
unknown model a 404; a client that disconnects mid-stream cancels its request (row and pages
freed). `usage` carries the speculative loop's figures for the request under `speculative`.

Extensions beyond OpenAI's fields: `top_k`, `min_p`, `stop_token_ids`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxspec.errors import JaxspecError
from jaxspec.serving.api import Server
from jaxspec.serving.requests import QueueFull, Sampling


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise HTTPError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return body


def _field(body, name, kinds, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise HTTPError(400, f"field {name!r}={value!r} must be {names}")
    return value


def sampling_of(body: dict[str, Any]) -> Sampling:
    """The request's Sampling (OpenAI's defaults: temperature 1, max_tokens 16)."""
    if _field(body, "n", (int,), 1) != 1:
        raise HTTPError(400, "field 'n' must be 1: one completion per request")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise HTTPError(400, "field 'stop' must be a string or a list of strings")
    ids = _field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise HTTPError(400, "field 'stop_token_ids' must be a list of integers")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return Sampling(
        temperature=_field(body, "temperature", (int, float), 1.0),
        top_k=_field(body, "top_k", (int,), 0),
        top_p=_field(body, "top_p", (int, float), 1.0),
        min_p=_field(body, "min_p", (int, float), 0.0),
        max_tokens=_field({"max_tokens": max_tokens}, "max_tokens", (int,), 16),
        stop=tuple(stop),
        stop_token_ids=tuple(ids),
        seed=_field(body, "seed", (int,), None),
    )


def make_app(server: Server) -> FastAPI:
    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None)
    tokenizer = server.engine.model.tokenizer

    @app.exception_handler(HTTPError)
    async def _http_error(_, e: HTTPError):
        return _error(e.status, e.message, e.kind)

    @app.exception_handler(QueueFull)
    async def _full(_, e: QueueFull):
        return _error(429, str(e), "rate_limit_error")

    @app.exception_handler(JaxspecError)
    async def _bad(_, e: JaxspecError):
        return _error(400, str(e), "invalid_request_error")

    @app.get("/health")
    async def health():
        return server.health()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxspec"}]}

    def check_model(body):
        name = body.get("model")
        if name is not None and name != server.model_name:
            raise HTTPError(404, f"model {name!r} is not served here: use {server.model_name!r}",
                            "not_found_error")

    def prompt_ids(prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tokenizer is None:
                raise HTTPError(400, "this model has no tokenizer: send 'prompt' as token ids")
            return [int(t) for t in tokenizer.encode(prompt)]
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise HTTPError(400, "field 'prompt' must be a string or a list of token ids (one prompt)")

    def chat_ids(messages) -> list[int]:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                for m in messages):
            raise HTTPError(400, "field 'messages' must be a non-empty list of {role, content}")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise HTTPError(400, "this model's tokenizer has no chat template: use /v1/completions")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    async def respond(body, ids, chat: bool):
        sampling = sampling_of(body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        stream = server.submit(ids, sampling, request_id=rid)
        created = int(time.time())
        head = {"id": rid, "created": created, "model": server.model_name}
        if not _field(body, "stream", (bool,), False):
            try:
                async for _ in stream:
                    pass
            finally:
                stream.cancel()  # no-op once finished; frees the row if the handler is cancelled
            done = stream.result()
            choice = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": done.text}
            else:
                choice["text"] = done.text
            kind = "chat.completion" if chat else "text_completion"
            return JSONResponse(head | {"object": kind, "choices": [choice], "usage": done.usage()})
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece, finish=None, usage=None, first=False):
            if chat:
                delta = {"content": piece} | ({"role": "assistant"} if first else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
            out = head | {"object": kind, "choices": [choice]}
            if usage is not None:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        async def events():
            try:
                first = True
                async for piece in stream:
                    yield chunk(piece, first=first)
                    first = False
                done = stream.result()
                yield chunk("", done.finish_reason, done.usage(), first=first)
                yield "data: [DONE]\n\n"
            finally:
                stream.cancel()  # the client went away mid-stream: free its row and pages

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        check_model(body)
        if "prompt" not in body:
            raise HTTPError(400, "field 'prompt' is required")
        return await respond(body, prompt_ids(body["prompt"]), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        check_model(body)
        return await respond(body, chat_ids(body.get("messages")), chat=True)

    return app
