"""How the HTTP surface answers beyond its happy path: errors as one line with their status
(and `Retry-After` on 429 and 503), the end of a stream whose request failed (a finish reason,
the error, `[DONE]`), the tokens a returned text stands for, and the wait for a request not
streamed that a client's disconnect cancels."""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import JSONResponse

from jaxspec.errors import JaxspecError
from jaxspec.serving.fields import HTTPError
from jaxspec.serving.requests import EngineStopped

DISCONNECT_POLL_S = 0.25  # how often a request not streamed checks that its client is there
RETRY_AFTER_S = {429: 1, 503: 5}  # the Retry-After a 429 (queue full) and a 503 carry


def error(status: int, message: str, kind: str) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S[status])} if status in RETRY_AFTER_S else None
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status,
                        headers=headers)


DONE = "data: [DONE]\n\n"  # a stream's last event


def stream_error(e: JaxspecError) -> str:
    """The event that ends a stream whose request failed (headers are long sent)."""
    why = failure(e)
    err = {"message": why.message, "type": why.kind, "code": why.status}
    return f"data: {json.dumps({'error': err})}\n\n"


def failure(e: JaxspecError) -> HTTPError:
    """A request ended by the serving loop, on one line: a 500 when it failed alone, a 503 when
    the loop itself stopped (the process exits)."""
    line = " ".join(str(e).split())
    line = line if len(line) <= 300 else line[:297] + "..."
    if isinstance(e, EngineStopped):
        return HTTPError(503, line, "unavailable")
    return HTTPError(500, line, "server_error")


def returned_tokens(engine, done, stop_ids) -> int:
    """Tokens behind the text returned: a stop string cuts the text, and the tokens generated
    past it (in the same device call) are not counted."""
    ids, stop_ids = done.token_ids, set(stop_ids)

    def shown(k):
        return len(engine.decode_text([t for t in ids[:k] if t not in stop_ids]))

    if shown(len(ids)) <= len(done.text):
        return len(ids)
    return next(k for k in range(len(ids) + 1) if shown(k) >= len(done.text))


async def drained(request, streams) -> None:
    """Wait for every stream to end (not streamed: nothing is sent before); a client that
    goes away first cancels them, so no dropped request keeps its row."""
    async def consume():
        for stream in streams:
            async for _ in stream:
                pass

    task = asyncio.ensure_future(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            for stream in streams:
                stream.cancel()
            await asyncio.wait({task})
    task.result()

