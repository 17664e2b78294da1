"""The Python API: a Server runs the scheduler on its own thread; `submit` returns a Stream of
text pieces (an iterator and an async iterator) whose `result()` is the Completion.

    server = Server(engine, slots=4, max_context=512)  # or Server(engine, config.serving)
    stream = server.submit("Hi!", Sampling(max_tokens=32))
    for piece in stream: print(piece, end="")          # or: async for piece in stream
    print(stream.result().usage())
    server.close()

Every device call happens on the server's thread; submit, cancel and the streams may be used
from any thread or event loop (a notebook's included).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from jaxspec.errors import JaxspecError
from jaxspec.serving import lockstep, memory
from jaxspec.serving.requests import Completion, EngineStopped, QueueFull, Sampling
from jaxspec.serving.scheduler import Scheduler

_END = object()
IDLE_RELEASE_S = 1.0  # seconds idle after serving before the freed heap is handed back


def _one_line(error: BaseException) -> str:
    line = " ".join(f"{type(error).__name__}: {error}".split())
    return line if len(line) <= 240 else line[:237] + "..."


def _log_failure(error: BaseException) -> None:
    """The serving loop's death on stderr, with its traceback (an operator's log)."""
    import sys
    import traceback

    try:
        print(f"jaxspec.serve: the serving loop stopped: {_one_line(error)}", file=sys.stderr)
        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()
    except OSError:  # stderr closed
        pass


class Stream:
    """Pieces of one request's text as the scheduler commits them; ends with its Completion."""

    def __init__(self, server: Server):
        self._server = server
        self._cond = threading.Condition()
        self._pieces: list[str] = []
        self._done: Completion | None = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.request = None  # scheduler.Request, set by submit

    # called on the server thread
    def push(self, piece: str) -> None:
        with self._cond:
            self._pieces.append(piece)
            self._wake()

    def finish(self, completion: Completion | None, error: BaseException | None = None) -> None:
        with self._cond:
            self._done, self._error = completion, error
            self._wake()
        self._server._ended(self)

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, event in self._waiters:
            loop.call_soon_threadsafe(event.set)

    # consumers
    def _take(self, i: int):
        """(pieces from index i on, finished?) without waiting."""
        return self._pieces[i:], self._done is not None or self._error is not None

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._pieces) > i or self._finished())
                new, finished = self._take(i)
            i += len(new)
            yield from new
            if finished and not new:
                self._raise()
                return

    async def __aiter__(self):
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        try:
            i = 0
            while True:
                with self._cond:
                    new, finished = self._take(i)
                    if not new and not finished:
                        event.clear()
                if not new and not finished:
                    await event.wait()
                    continue
                i += len(new)
                for piece in new:
                    yield piece
                if finished and i == len(self._pieces):
                    self._raise()
                    return
        finally:
            with self._cond:
                self._waiters.remove((loop, event))

    def _finished(self) -> bool:
        return self._done is not None or self._error is not None

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the request to end; its Completion (text, tokens, usage, metrics)."""
        with self._cond:
            if not self._cond.wait_for(self._finished, timeout):
                raise TimeoutError("the request did not finish in time")
        self._raise()
        return self._done

    def cancel(self) -> None:
        """Stop the request (a client that went away): its row and pages are freed."""
        self._server._cancel(self)


class Server:
    """Continuous batching over an Engine (its model, drafter, adaptive options, tokenizer)."""

    def __init__(self, engine, config=None, *, model_name: str | None = None, seed: int = 0,
                 static: bool = False, paged: bool = True, **settings):
        """config: a `config.ServingConfig` (default: every default); keyword `settings`
        replace its fields (slots=, max_context=, ...). seed, static, paged: `Scheduler`'s."""
        self.scheduler = Scheduler(engine, config, seed=seed, static=static, paged=paged,
                                   **settings)
        self.engine = engine
        self.model_name = model_name or getattr(engine.model, "name", "model")
        self._lock = threading.Condition()  # guards the inbox, the closed flag, cancellations
        self._inbox: list = []
        # a mesh over several processes: each round broadcast to the followers (`lockstep`),
        # cancellations carried in it (flagged here only when every process flags them)
        self._lockstep = lockstep.spans_processes()
        self._cancels: list[str] = []
        self._closed = False
        self._failure: BaseException | None = None
        self.died = threading.Event()  # set when the serving loop stopped on an exception
        self._unfinished: set = set()  # streams submitted and not ended (under the lock)
        self._released_at_call = 0  # device calls run when the idle loop last freed the heap
        self._thread = threading.Thread(target=self._loop, name="jaxspec-serving", daemon=True)
        self._thread.start()

    def submit(self, prompt: str | Sequence[int], sampling: Sampling | None = None, *,
               request_id: str | None = None, priority: int = 0, constraint=None,
               cache_salt: bytes = b"") -> Stream:
        """Queue a request; raises JaxspecError (bad input) or QueueFull at once. Never waits
        for a device call: the request lands in the scheduler's queue between calls.
        constraint: a constrain.Constraint the output follows (needs structured=True).
        cache_salt: the prefix cache's namespace (a tenant's): pages its prompts wrote are
        shared only with requests of the same salt."""
        return self.submit_all(prompt, [sampling or Sampling()], [request_id], priority,
                               constraint, cache_salt)[0]

    def submit_all(self, prompt: str | Sequence[int], samplings: Sequence[Sampling],
                   request_ids: Sequence[str | None], priority: int = 0,
                   constraint=None, cache_salt: bytes = b"") -> list[Stream]:
        """One request per Sampling (n completions of one prompt), queued all or none: QueueFull
        when the queue cannot take every one, so no part of a refused request runs."""
        if self._closed:
            raise JaxspecError("the server is closed")
        if self._failure is not None:
            raise EngineStopped(f"the serving loop stopped ({_one_line(self._failure)}): the "
                                "process is exiting; retry on a restarted server")
        if constraint is not None and self._lockstep:
            raise JaxspecError("structured output is not served over several processes: "
                               "drop the response format or serve from one process")
        streams, reqs, s = [], [], self.scheduler
        for sampling, rid in zip(samplings, request_ids):
            stream = Stream(self)
            stream.request = s.new_request(prompt, sampling, stream, rid, priority, constraint,
                                           cache_salt)
            streams.append(stream)
            reqs.append(stream.request)
        with self._lock:
            free = s.slots - len(s.active)  # waiting requests that free slots will take now
            if len(self._inbox) + len(s.queue) + len(reqs) > s.max_queue + free:
                raise QueueFull(f"the queue holds {s.max_queue} requests and cannot take "
                                f"{len(reqs)} more: retry later")
            self._inbox.extend(reqs)
            self._unfinished.update(streams)
            self._lock.notify_all()
        return streams

    def _ended(self, stream: Stream) -> None:
        with self._lock:
            self._unfinished.discard(stream)

    def prompt_logprobs(self, ids):
        """The prompt's own tokens scored (echo with logprobs: `Engine.prompt_logprobs`). One
        process only: a forward on process 0 alone would wait for the others in a collective."""
        if self._lockstep:
            raise JaxspecError("echo with logprobs is not served over several processes: drop "
                               "logprobs or echo, or serve from one process")
        return self.engine.prompt_logprobs(ids)

    def generate(self, prompt, sampling: Sampling | None = None) -> Completion:
        return self.submit(prompt, sampling).result()

    def _cancel(self, stream: Stream) -> None:
        with self._lock:
            if stream.request is not None and self._lockstep:
                self._cancels.append(stream.request.id)
            elif stream.request is not None:
                stream.request.cancelled = True
            self._lock.notify_all()

    def health(self) -> dict:
        s = self.scheduler
        return {"status": "ok" if self._failure is None else "failed",
                "active": len(s.active), "queued": len(s.queue) + len(self._inbox),
                "slots": s.slots, "free_pages": s.pool.free_pages, "kv_pages": s.pool.num_pages,
                "cached_pages": s.pool.cached_pages, "prefix_cache": s.prefix_cache,
                "device_calls": s.stats.device_calls, "preemptions": s.stats.preemptions,
                "in_flight": len(self._unfinished), "failed": s.stats.failed,
                "heap_released_at_call": self._released_at_call,
                "prefill_chunks": s.stats.prefill_chunks,
                "max_prefill_call_tokens": s.stats.max_prefill_call_tokens} | self._programs()

    def _programs(self) -> dict:
        """Calls run through the server's prepared executables, and through the jit (a shape
        not prepared before /ready: 0 on a server that compiled ahead)."""
        table = getattr(self.engine, "serving_programs", None)
        if table is None:
            return {}
        return {"program_calls_prepared": table.hits, "program_calls_unprepared": table.misses}

    def _loop(self) -> None:
        s = self.scheduler
        try:
            while self._lockstep:
                if not self._lockstep_round():
                    break
            served = False  # a call ran since the heap was last released
            while not self._lockstep:
                with self._lock:
                    woke = self._lock.wait_for(lambda: self._closed or self._inbox or s.busy,
                                               timeout=IDLE_RELEASE_S if served else None)
                    if self._closed:
                        break
                    for req in self._inbox:
                        s.queue.append(req)  # counted against max_queue at submit
                    self._inbox.clear()
                if not woke:  # idle since the last call: its freed heap goes back to the system
                    memory.release_free_heap()
                    served, self._released_at_call = False, s.stats.device_calls
                    continue
                s.run_once()  # outside the lock: submit and cancel never wait for the device
                served = True
        except BaseException as e:  # noqa: BLE001 -- every waiting stream learns why
            self._failure = e
            _log_failure(e)
            if self._lockstep:  # the followers stop too (best effort: they wait in a collective)
                lockstep.exchange(closing=True)
        if self._failure is None:
            error = JaxspecError("the server closed")
        else:
            error = EngineStopped(f"the serving loop stopped ({_one_line(self._failure)}): the "
                                  "process is exiting")
        with self._lock:
            waiting = [*self._inbox, *s.queue, *s.active.values(),
                       *(r for r, _ in s.prefilling.values())]
            for req in waiting:
                req.sink.finish(None, error)
        if self._failure is not None:
            self.died.set()

    @property
    def failure(self) -> BaseException | None:
        """Why the serving loop stopped (None: it runs, or was closed)."""
        return self._failure

    def _lockstep_round(self) -> bool:
        """One round on process 0 of several: its inputs broadcast, applied, then run here as
        on every follower (`lockstep`). False once closed."""
        s = self.scheduler
        with self._lock:
            self._lock.wait_for(lambda: self._closed or self._inbox or self._cancels or s.busy,
                                timeout=lockstep.HEARTBEAT_S)
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            closed = self._closed
        events = {"new": [lockstep.describe(r) for r in new], "cancel": cancels}
        closing, events = lockstep.exchange(closed, events)
        if closing:
            self._inbox[:0] = new  # ended below with the queue's
            return False
        lockstep.apply(s, events, own=new)
        if s.busy:
            s.run_once()
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
