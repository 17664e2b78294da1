"""The OpenAI-compatible HTTP surface over a `Server` (FastAPI; run by uvicorn in jaxspec.serve):
`/v1/completions`, `/v1/chat/completions` (the tokenizer's chat template), SSE streaming,
`/v1/models`, `/v1/models/{id}`, `/health` (alive), `/ready` (compiled and admitting),
`/metrics` (Prometheus). Bad requests get a 400 with a one-line message (fields it does not
honour included: `serving.fields`; the body itself: `serving.body`), a full queue a 429, an
unknown model a 404, a missing key a 401, a body over serving.max_body_bytes a 413, any request
while compiling or stopping a 503 (429 and 503 with Retry-After); a client that disconnects
cancels its request, streamed or not (row and pages freed). `usage` counts
the tokens returned and carries the speculative loop's figures under `speculative`.

Finish reasons beyond OpenAI's: "length" also when serving.request_timeout_s ran out, "abort"
when a graceful stop ended the request, "error" when the request failed in the serving loop
(docs/serving.md: a failure is confined to its request; the loop's own death stops the process).
Extensions: `top_k`, `min_p`, `stop_token_ids`, `cache_salt` (the prefix cache's namespace).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxspec.errors import JaxspecError
from jaxspec.serving import choices, structured, tool_parse
from jaxspec.serving.answers import DONE, drained, error, failure, returned_tokens, stream_error
from jaxspec.serving.api import Server
from jaxspec.serving.body import read_body
from jaxspec.serving.fields import (
    HTTPError,
    check_recorded,
    chat_messages,
    best_of_of,
    cache_salt_of,
    choices_of,
    echo_of,
    refuse_unsupported,
    requested_max_tokens,
    sampling_of,
    wants_stream,
)
from jaxspec.serving.gate import Gate
from jaxspec.serving.metrics import CONTENT_TYPE, ServerMetrics
from jaxspec.serving.requests import EngineStopped, QueueFull


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


def _clip(n: int) -> str:
    text = str(n)
    return text if len(text) <= 24 else text[:21] + "..."


def make_app(server: Server, gate: Gate | None = None) -> FastAPI:
    """The app over a Server; `gate`: its key, limits and readiness (default: open, ready)."""
    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None)
    tokenizer = server.engine.model.tokenizer
    gate = app.state.gate = gate or Gate()
    metrics = app.state.metrics = ServerMetrics(server)
    limits = gate.limits
    sched = server.scheduler
    open_paths = ("/health", "/ready")

    def refusal(request: Request):
        """The answer a request gets before any handler (key, size, state), or None."""
        if request.url.path in open_paths:
            return None
        if not gate.authorized(request.headers.get("authorization")):
            return error(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                          "authentication_error")
        size = request.headers.get("content-length", "")
        if limits.max_body_bytes and size.isdigit() and int(size) > limits.max_body_bytes:
            return error(413, f"the request body is {size} bytes: serving.max_body_bytes allows "
                               f"{limits.max_body_bytes}", "request_too_large")
        if request.method == "POST" and server.failure is not None:
            return error(503, "the serving loop stopped and the process is exiting: send the "
                               "request to another replica", "unavailable")
        if request.method == "POST" and gate.draining:
            return error(503, "the server is stopping: send the request to another replica",
                          "unavailable")
        if request.method == "POST" and not gate.ready:
            return error(503, "the server is compiling its programs: retry when /ready "
                               "answers 200", "unavailable")
        return None

    # a plain ASGI middleware: the handlers keep the client's own `receive`, so a request not
    # streamed sees its client go away (`answers.drained`); Starlette's BaseHTTPMiddleware hides it
    app.add_middleware(Refusing, refusal=refusal)

    @app.exception_handler(HTTPError)
    async def _http_error(_, e: HTTPError):
        return error(e.status, e.message, e.kind)

    @app.exception_handler(QueueFull)
    async def _full(_, e: QueueFull):
        return error(429, str(e), "rate_limit_error")

    @app.exception_handler(EngineStopped)
    async def _stopped(_, e: EngineStopped):
        return error(503, str(e), "unavailable")

    @app.exception_handler(JaxspecError)
    async def _bad(_, e: JaxspecError):
        return error(400, str(e), "invalid_request_error")

    @app.get("/health")
    async def health():
        h = server.health()
        return h if server.failure is None else JSONResponse(h, 503)

    @app.get("/ready")
    async def ready():
        if server.failure is not None:
            return error(503, "the serving loop stopped: the process is exiting", "unavailable")
        if gate.draining:
            return error(503, "the server is stopping", "unavailable")
        if not gate.ready:
            return error(503, "the server is compiling its programs", "unavailable")
        return {"status": "ready"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card():
        return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxspec"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != server.model_name:
            raise HTTPError(404, f"model {name!r} is not served here: use {server.model_name!r}",
                            "not_found_error")
        return model_card()

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
            vocab = server.engine.target.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise HTTPError(400, f"field 'prompt' holds token id {_clip(bad)}, outside the "
                                     f"vocabulary: use ids in [0, {vocab})")
            return prompt
        raise HTTPError(400, "field 'prompt' must be a string or a list of token ids (one prompt)")

    def chat_ids(messages, tools=None) -> list[int]:
        messages = chat_messages(messages)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise HTTPError(400, "this model's tokenizer has no chat template: use /v1/completions")
        extra = {"tools": tools} if tools else {}  # rendered as the model's template does
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **extra)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def settle_max_tokens(body, ids) -> int:
        """The request's max_tokens, or all the context (and serving.max_tokens_limit) allows."""
        if limits.max_prompt_tokens and len(ids) > limits.max_prompt_tokens:
            raise HTTPError(400, f"the prompt is {len(ids)} tokens: serving.max_prompt_tokens "
                                 f"allows {limits.max_prompt_tokens}; shorten it")
        name, asked = requested_max_tokens(body)
        room = sched.capacity - len(ids) - sched.spec.depth - 1  # γ + 1 slots for the last step
        if room < 1:
            raise HTTPError(400, f"the prompt is {len(ids)} tokens: serving.max_context="
                                 f"{sched.capacity} leaves no room to generate; shorten it")
        ceiling = min(room, limits.max_tokens or room)
        if asked is None:
            return ceiling
        if asked < 1:
            raise HTTPError(400, f"field {name!r}={asked} must be at least 1")
        if limits.max_tokens and asked > limits.max_tokens:
            raise HTTPError(400, f"field {name!r}={asked} is above serving.max_tokens_limit="
                                 f"{limits.max_tokens}: lower it")
        if asked > room:
            raise HTTPError(400, f"field {name!r}={asked} is too large: a prompt of {len(ids)} "
                                 f"tokens leaves room for {room} (serving.max_context="
                                 f"{sched.capacity}); lower it or shorten the prompt")
        return asked

    def piece(tok: int) -> str:
        return server.engine.decode_text([int(tok)])

    async def echoed_scores(ids, k):
        """(ids, the prompt's own tokens scored) for echo with logprobs, else None."""
        if k is None:
            return None
        try:
            return ids, await asyncio.to_thread(server.prompt_logprobs, ids)
        except JaxspecError as e:
            raise failure(e) from None

    async def respond(body, ids, chat: bool, prompt_text: str = "", request=None):
        """One request: `prompt_text` is what echo returns (completions)."""
        refuse_unsupported(body)
        wanted = structured.asked(body, tool_parse.template_format(tokenizer))
        if wanted.constraint is not None and sched.grammars is None:
            raise HTTPError(400, f"field {wanted.field!r} is not supported on this server: start "
                                 "it with serving.structured=true")
        if wanted.has_tools and not chat:
            raise HTTPError(400, "tool calls need /v1/chat/completions")
        sampling = sampling_of(body, settle_max_tokens(body, ids), chat)
        streamed = wants_stream(body)
        n_choices = choices_of(body)
        candidates = best_of_of(body, n_choices)
        check_recorded(body, sampling.logprobs, sched.spec.logprobs, chat)
        if candidates > n_choices and streamed:
            raise HTTPError(400, f"field 'best_of'={candidates} with 'stream': true is not "
                                 "supported (the best are known only at the end): set stream false")
        if candidates > n_choices and sched.spec.logprobs is None:
            raise HTTPError(400, f"field 'best_of'={candidates} is not supported by this server "
                                 "(it ranks candidates by their recorded logprobs): start it with "
                                 "generation.logprobs=0 or more")
        echoed = prompt_text if echo_of(body, chat) else ""
        if streamed and n_choices > 1 and wanted.has_tools:
            raise HTTPError(400, f"field 'n'={n_choices} with 'stream': true and tools is not "
                                 "supported yet: set stream false or send n requests")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        if wanted.constraint is not None:  # off the event loop, under its budget
            await asyncio.to_thread(sched.grammars.compile, wanted.constraint)
        echo = await echoed_scores(ids, sampling.logprobs) if echoed else None
        if streamed and n_choices > 1:
            return stream_n(ids, sampling, n_choices, rid, chat, wanted, echoed, echo,
                            tenant_salt(request, body))
        if candidates > 1:
            return await respond_n(request, ids, sampling, n_choices, rid, chat, wanted, echoed,
                                   echo, candidates, tenant_salt(request, body))
        salt = tenant_salt(request, body)
        stream = server.submit(ids, sampling, request_id=rid, constraint=wanted.constraint,
                               cache_salt=salt)
        timer = watch(stream)
        created = int(time.time())
        head = {"id": rid, "created": created, "model": server.model_name}

        def ended():
            """(finish reason, usage) as returned; counted in the metrics once."""
            return finished(stream, sampling)

        def close():
            closed(stream, timer)

        if not streamed:
            try:
                await drained(request, [stream])
                done, reason, usage = ended()
            except JaxspecError as e:
                raise failure(e) from None
            finally:
                close()
            lp = choices.logprobs_block(piece, done, usage["completion_tokens"], sampling.logprobs,
                                        chat, echo)
            choice = choices.message_choice(0, wanted, done, reason, lp, chat, echoed)
            kind = "chat.completion" if chat else "text_completion"
            return JSONResponse(head | {"object": kind, "choices": [choice], "usage": usage})
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, finish=None, usage=None, first=False, logprobs=None):
            if chat:
                delta = {"content": text} | ({"role": "assistant"} if first else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish,
                          "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish,
                          "logprobs": logprobs}
            out = head | {"object": kind, "choices": [choice]}
            if usage is not None:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        async def events():
            first = True
            try:
                try:
                    if echoed:  # the prompt first, as it was sent
                        yield chunk(echoed)
                    held = structured.Streamed(wanted)  # calls go out whole, parsed, at the end
                    async for text in stream:
                        if text := held.feed(text):
                            yield chunk(text, first=first)
                            first = False
                    done, reason, usage = ended()
                    rest, calls = held.end(done.text, reason)
                    if rest:  # cut short, not a call, or the text around the calls
                        yield chunk(rest, first=first)
                        first = False
                    if calls:
                        delta = {"role": "assistant", "content": None,
                                 "tool_calls": [c | {"index": i} for i, c in enumerate(calls)]}
                        out = head | {"object": kind, "choices": [
                            {"index": 0, "delta": delta, "finish_reason": None}]}
                        yield f"data: {json.dumps(out)}\n\n"
                        reason, first = "tool_calls", False
                    # the tokens' logprobs come with the last chunk, all of them at once
                    lp = choices.logprobs_block(piece, done, usage["completion_tokens"],
                                                sampling.logprobs, chat, echo)
                    yield chunk("", reason, usage, first=first, logprobs=lp)
                except JaxspecError as e:  # it failed: a finish reason, the error, the end
                    yield chunk("", "error", first=first)
                    yield stream_error(e)
                yield DONE
            finally:
                close()  # the client went away mid-stream: free its row and pages

        return StreamingResponse(events(), media_type="text/event-stream")

    def finished(stream, sampling):
        """(completion, finish reason, usage) as returned; counted in the metrics once."""
        done = stream.result()
        reason = gate.finish_reason(stream, done.finish_reason)
        if reason == "cancelled":  # only the gate cancels a request it still answers
            reason = "abort"
        usage = done.usage()
        n = returned_tokens(server.engine, done, sampling.stop_token_ids)
        usage |= {"completion_tokens": n, "total_tokens": usage["prompt_tokens"] + n}
        metrics.observe(reason, usage)
        return done, reason, usage

    def watch(stream):
        """`stream` counted in flight, under the request time limit: its timer (or None)."""
        gate.enter(stream)
        if not limits.request_timeout_s:
            return None
        return asyncio.get_running_loop().call_later(limits.request_timeout_s, gate.time_out,
                                                     stream)

    def closed(stream, timer):
        if timer is not None:
            timer.cancel()
        stream.cancel()  # no-op once finished; frees the row if the handler is cancelled
        gate.leave(stream)

    def tenant_salt(request, body) -> bytes:
        """The request's cache namespace: its cache_salt under its API key (with a key set)."""
        tenant = request.headers.get("authorization", "") if gate.api_key else ""
        return cache_salt_of(body, tenant)

    def submit_n(ids, sampling, count: int, rid: str, wanted, salt: bytes):
        """`count` requests of one prompt, seeds seed + i (None: each its own): (streams, their
        time-limit timers)."""
        seeds = [None if sampling.seed is None else sampling.seed + i for i in range(count)]
        streams = server.submit_all(ids, [dataclasses.replace(sampling, seed=s) for s in seeds],
                                    [f"{rid}-{i}" for i in range(count)],
                                    constraint=wanted.constraint, cache_salt=salt)
        return streams, [watch(stream) for stream in streams]

    def stream_n(ids, sampling, n_choices: int, rid: str, chat: bool, wanted, echoed, echo,
                 salt: bytes):
        """n streamed completions of one prompt (seeds as `respond_n`'s): each choice's chunks
        carry its index as they come, each ends with its finish reason (and logprobs), then one
        chunk without choices holds the summed usage."""
        streams, timers = submit_n(ids, sampling, n_choices, rid, wanted, salt)
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "created": int(time.time()), "model": server.model_name, "object": kind}

        def chunk(i, text, finish=None, lp=None, first=False):
            if chat:
                part = {"delta": {"content": text} | ({"role": "assistant"} if first else {})}
            else:
                part = {"text": text}
            one = {"index": i, **part, "finish_reason": finish, "logprobs": lp}
            return f"data: {json.dumps(head | {'choices': [one]})}\n\n"

        async def pump(i, stream, queue):  # (index, text or None at its end, error)
            try:
                async for text in stream:
                    await queue.put((i, text, None))
            except JaxspecError as e:
                await queue.put((i, None, e))
                return
            await queue.put((i, None, None))

        async def events():
            queue: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.create_task(pump(i, s, queue)) for i, s in enumerate(streams)]
            total, first = {"prompt_tokens": len(ids), "completion_tokens": 0}, [True] * n_choices
            i = 0
            try:
                try:
                    for i in range(n_choices if echoed else 0):
                        yield chunk(i, echoed)
                    for _ in range(n_choices):  # each stream's end, in the order they come
                        i, text, error = await queue.get()
                        while text is not None:
                            yield chunk(i, text, first=first[i])
                            first[i] = False
                            i, text, error = await queue.get()
                        if error is not None:
                            raise error
                        done, reason, usage = finished(streams[i], sampling)
                        total["completion_tokens"] += usage["completion_tokens"]
                        lp = choices.logprobs_block(piece, done, usage["completion_tokens"],
                                                    sampling.logprobs, chat, echo)
                        yield chunk(i, "", reason, lp, first=first[i])
                    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
                    yield f"data: {json.dumps(head | {'choices': [], 'usage': total})}\n\n"
                except JaxspecError as e:  # it failed: a finish reason, the error, the end
                    yield chunk(i, "", "error")
                    yield stream_error(e)
                yield DONE
            finally:
                for task in tasks:
                    task.cancel()
                for stream, timer in zip(streams, timers):
                    closed(stream, timer)  # a client gone mid-stream frees every row

        return StreamingResponse(events(), media_type="text/event-stream")

    async def respond_n(request, ids, sampling, n_choices: int, rid: str, chat: bool, wanted,
                        echoed="", echo=None, candidates: int = 0, salt: bytes = b""):
        """n completions of one prompt (not streamed): `candidates` (best_of, at least n)
        requests, seeds seed + i (None: each its own); past n, the n with the highest summed
        logprob of their returned tokens, in that order. One choice each (each with the echoed
        prompt); usage counts every candidate's tokens."""
        candidates = max(candidates, n_choices)
        ranked = candidates > n_choices
        asked = sampling.logprobs
        if ranked and asked is None:
            sampling = dataclasses.replace(sampling, logprobs=0)  # the chosen tokens' only
        streams, timers = submit_n(ids, sampling, candidates, rid, wanted, salt)
        results, total = [], {"prompt_tokens": len(ids), "completion_tokens": 0}
        try:
            await drained(request, streams)
            for stream in streams:
                done, reason, usage = finished(stream, sampling)
                total["completion_tokens"] += usage["completion_tokens"]
                results.append((done, reason, usage["completion_tokens"]))
        except JaxspecError as e:
            raise failure(e) from None
        finally:
            for stream, timer in zip(streams, timers):
                closed(stream, timer)
        if ranked:
            def summed(result):  # the returned tokens' logprobs, added
                done, _, returned = result
                return sum(e["logprob"] for e in (done.logprobs or [])[:returned])

            results = sorted(results, key=summed, reverse=True)[:n_choices]
        made = [choices.message_choice(i, wanted, done, reason, choices.logprobs_block(
                    piece, done, returned, asked, chat, echo), chat, echoed)
                   for i, (done, reason, returned) in enumerate(results)]
        total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": rid, "created": int(time.time()), "model": server.model_name,
                             "object": kind, "choices": made, "usage": total})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, limits.max_body_bytes)
        check_model(body)
        if "prompt" not in body:
            raise HTTPError(400, "field 'prompt' is required")
        ids = prompt_ids(body["prompt"])
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else "".join(piece(t) for t in ids)
        return await respond(body, ids, chat=False, prompt_text=text, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, limits.max_body_bytes)
        check_model(body)
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        return await respond(body, chat_ids(body.get("messages"), tools), chat=True,
                             request=request)

    return app
