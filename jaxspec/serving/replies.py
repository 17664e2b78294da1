"""The answers to a parsed request (`asks.Ask`): one completion as JSON or as server-sent
events, n streamed completions of one prompt, n (or the best n of best_of) completions as JSON.
Each submits to the `Server`, counts the request in flight under the request time limit
(`gate.Gate`), frees its rows when the client goes away, and counts the finish in the metrics
once."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from fastapi.responses import JSONResponse, StreamingResponse

from jaxspec.errors import JaxspecError
from jaxspec.serving import choices, structured
from jaxspec.serving.answers import DONE, drained, failure, returned_tokens, stream_error
from jaxspec.serving.asks import Ask


def _event(out: dict) -> str:
    return f"data: {json.dumps(out)}\n\n"


def _chunk(head: dict, chat: bool, index: int, text: str, finish=None, logprobs=None,
           first: bool = False, usage=None) -> str:
    """One server-sent event of choice `index`: its text (a chat delta, with the role
    first), finish reason and logprobs."""
    if chat:
        part = {"delta": {"content": text} | ({"role": "assistant"} if first else {})}
    else:
        part = {"text": text}
    out = head | {"choices": [{"index": index, **part, "finish_reason": finish,
                               "logprobs": logprobs}]}
    return _event(out if usage is None else out | {"usage": usage})


class Replies:
    def __init__(self, server, gate, metrics, piece):
        self.server, self.gate, self.metrics = server, gate, metrics
        self.piece = piece  # token id -> its text (logprob entries)

    # ---- a request's life: in flight, timed, finished, closed ---------------------------------
    def finished(self, stream, sampling):
        """(completion, finish reason, usage) as returned; counted in the metrics once."""
        done = stream.result()
        reason = self.gate.finish_reason(stream, done.finish_reason)
        if reason == "cancelled":  # only the gate cancels a request it still answers
            reason = "abort"
        usage = done.usage()
        n = returned_tokens(self.server.engine, done, sampling.stop_token_ids)
        usage |= {"completion_tokens": n, "total_tokens": usage["prompt_tokens"] + n}
        self.metrics.observe(reason, usage, done.metrics)
        return done, reason, usage

    def watch(self, stream):
        """`stream` counted in flight, under the request time limit: its timer (or None)."""
        self.gate.enter(stream)
        limit = self.gate.limits.request_timeout_s
        if not limit:
            return None
        return asyncio.get_running_loop().call_later(limit, self.gate.time_out, stream)

    def closed(self, stream, timer) -> None:
        if timer is not None:
            timer.cancel()
        stream.cancel()  # no-op once finished; frees the row if the handler is cancelled
        self.gate.leave(stream)

    def submit_n(self, ask: Ask, count: int, sampling=None):
        """`count` requests of one prompt, seeds seed + i (None: each its own): (streams, their
        time-limit timers)."""
        sampling = sampling or ask.sampling
        seeds = [None if sampling.seed is None else sampling.seed + i for i in range(count)]
        streams = self.server.submit_all(
            ask.ids, [dataclasses.replace(sampling, seed=s) for s in seeds],
            [f"{ask.rid}-{i}" for i in range(count)], constraint=ask.wanted.constraint,
            cache_salt=ask.salt)
        return streams, [self.watch(stream) for stream in streams]

    def _lp(self, ask: Ask, done, returned: int):
        """The choice's logprobs block (as many as the request asked: best_of's own ranking
        logprobs are not returned)."""
        return choices.logprobs_block(self.piece, done, returned, ask.sampling.logprobs,
                                      ask.chat, ask.echo)

    def _head(self, ask: Ask, streamed: bool) -> dict:
        kind = ("chat.completion" if ask.chat else "text_completion") + (
            ".chunk" if streamed and ask.chat else "")
        return {"id": ask.rid, "created": int(time.time()), "model": self.server.model_name,
                "object": kind}

    # ---- the replies ----------------------------------------------------------------------------
    async def reply(self, ask: Ask, request):
        """The answer `ask` gets: by its stream flag, n and best_of."""
        if ask.streamed and ask.n > 1:
            return self.stream_n(ask)
        if ask.candidates > 1:
            return await self.respond_n(request, ask)
        stream = self.server.submit(ask.ids, ask.sampling, request_id=ask.rid,
                                    constraint=ask.wanted.constraint, cache_salt=ask.salt)
        timer = self.watch(stream)
        if ask.streamed:
            return StreamingResponse(self._events(ask, stream, timer),
                                     media_type="text/event-stream")
        try:
            await drained(request, [stream])
            done, reason, usage = self.finished(stream, ask.sampling)
        except JaxspecError as e:
            raise failure(e) from None
        finally:
            self.closed(stream, timer)
        lp = self._lp(ask, done, usage["completion_tokens"])
        choice = choices.message_choice(0, ask.wanted, done, reason, lp, ask.chat, ask.echoed)
        return JSONResponse(self._head(ask, False) | {"choices": [choice], "usage": usage})

    async def _events(self, ask: Ask, stream, timer):
        """One streamed completion's events: the echo, the text as it comes (tool calls held
        and sent whole at the end), the finish reason with usage and logprobs, [DONE]."""
        head, first = self._head(ask, True), True
        try:
            try:
                if ask.echoed:  # the prompt first, as it was sent
                    yield _chunk(head, ask.chat, 0, ask.echoed)
                held = structured.Streamed(ask.wanted)  # calls go out whole, parsed, at the end
                async for text in stream:
                    if text := held.feed(text):
                        yield _chunk(head, ask.chat, 0, text, first=first)
                        first = False
                done, reason, usage = self.finished(stream, ask.sampling)
                rest, calls = held.end(done.text, reason)
                if rest:  # cut short, not a call, or the text around the calls
                    yield _chunk(head, ask.chat, 0, rest, first=first)
                    first = False
                if calls:
                    delta = {"role": "assistant", "content": None,
                             "tool_calls": [c | {"index": i} for i, c in enumerate(calls)]}
                    yield _event(head | {"choices": [
                        {"index": 0, "delta": delta, "finish_reason": None}]})
                    reason, first = "tool_calls", False
                # the tokens' logprobs come with the last chunk, all of them at once
                lp = self._lp(ask, done, usage["completion_tokens"])
                yield _chunk(head, ask.chat, 0, "", reason, lp, first=first, usage=usage)
            except JaxspecError as e:  # it failed: a finish reason, the error, the end
                yield _chunk(head, ask.chat, 0, "", "error", first=first)
                yield stream_error(e)
            yield DONE
        finally:
            self.closed(stream, timer)  # the client went away mid-stream: free its row and pages

    def stream_n(self, ask: Ask):
        """n streamed completions of one prompt (seeds as `respond_n`'s): each choice's chunks
        carry its index as they come, each ends with its finish reason (and logprobs), then one
        chunk without choices holds the summed usage."""
        streams, timers = self.submit_n(ask, ask.n)
        return StreamingResponse(self._events_n(ask, streams, timers),
                                 media_type="text/event-stream")

    async def _events_n(self, ask: Ask, streams, timers):
        head = self._head(ask, True)
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
        total, first = {"prompt_tokens": len(ask.ids), "completion_tokens": 0}, [True] * ask.n
        i = 0
        try:
            try:
                for i in range(ask.n if ask.echoed else 0):
                    yield _chunk(head, ask.chat, i, ask.echoed)
                for _ in range(ask.n):  # each stream's end, in the order they come
                    i, text, error = await queue.get()
                    while text is not None:
                        yield _chunk(head, ask.chat, i, text, first=first[i])
                        first[i] = False
                        i, text, error = await queue.get()
                    if error is not None:
                        raise error
                    done, reason, usage = self.finished(streams[i], ask.sampling)
                    total["completion_tokens"] += usage["completion_tokens"]
                    lp = self._lp(ask, done, usage["completion_tokens"])
                    yield _chunk(head, ask.chat, i, "", reason, lp, first=first[i])
                total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
                yield _event(head | {"choices": [], "usage": total})
            except JaxspecError as e:  # it failed: a finish reason, the error, the end
                yield _chunk(head, ask.chat, i, "", "error")
                yield stream_error(e)
            yield DONE
        finally:
            for task in tasks:
                task.cancel()
            for stream, timer in zip(streams, timers):
                self.closed(stream, timer)  # a client gone mid-stream frees every row

    async def respond_n(self, request, ask: Ask):
        """n completions of one prompt (not streamed): best_of requests (at least n), seeds
        seed + i (None: each its own); past n, the n with the highest summed logprob of their
        returned tokens, in that order. One choice each (each with the echoed prompt); usage
        counts every candidate's tokens."""
        candidates = max(ask.candidates, ask.n)
        ranked, sampling = candidates > ask.n, ask.sampling
        if ranked and sampling.logprobs is None:
            sampling = dataclasses.replace(sampling, logprobs=0)  # the chosen tokens' only
        streams, timers = self.submit_n(ask, candidates, sampling)
        results, total = [], {"prompt_tokens": len(ask.ids), "completion_tokens": 0}
        try:
            await drained(request, streams)
            for stream in streams:
                done, reason, usage = self.finished(stream, sampling)
                total["completion_tokens"] += usage["completion_tokens"]
                results.append((done, reason, usage["completion_tokens"]))
        except JaxspecError as e:
            raise failure(e) from None
        finally:
            for stream, timer in zip(streams, timers):
                self.closed(stream, timer)
        if ranked:
            results = sorted(results, key=_summed_logprob, reverse=True)[: ask.n]
        made = [choices.message_choice(i, ask.wanted, done, reason, self._lp(ask, done, returned),
                                       ask.chat, ask.echoed)
                for i, (done, reason, returned) in enumerate(results)]
        total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
        return JSONResponse(self._head(ask, False) | {"choices": made, "usage": total})


def _summed_logprob(result) -> float:
    """A candidate's returned tokens' logprobs, added (best_of's rank)."""
    done, _, returned = result
    return sum(e["logprob"] for e in (done.logprobs or [])[:returned])


async def _pump(i: int, stream, queue) -> None:
    """Stream i's pieces into `queue` as (index, text or None at its end, error)."""
    try:
        async for text in stream:
            await queue.put((i, text, None))
    except JaxspecError as e:
        await queue.put((i, None, e))
        return
    await queue.put((i, None, None))
