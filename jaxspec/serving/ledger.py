"""The scheduler's requests: the queue, the slots running a request (`active`), and the moves
between them (activate, release, finish, fail, preempt), each keeping the page pool, the device
rows and the counters in step. Admission and the loop move requests only through these, so a
slot is never half released.

Host side; it owns `queue`, `active` and `observed_acceptance`; the pool's pages, the device
state and the completions are asked of their owners (`pages.PagePool`,
`device_call.DeviceRunner`, `streaming.Streaming`)."""

from __future__ import annotations

import collections
import time

from jaxspec.serving.requests import QueueFull, Request, RequestFailed


class Ledger:
    def __init__(self, max_queue: int, pool, device, streaming, stats, adaptive: bool):
        self.max_queue = max_queue
        self.pool, self.device, self.streaming, self.stats = pool, device, streaming, stats
        self.adaptive = adaptive  # average the finished requests' acceptance
        self.queue: collections.deque[Request] = collections.deque()
        self.active: dict[int, Request] = {}  # slot -> request
        self.observed_acceptance: float | None = None  # adaptive: over finished requests

    def enqueue(self, req: Request) -> None:
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"the queue holds {self.max_queue} requests: retry later")
        self.queue.append(req)

    def activate(self, req: Request, slot: int) -> None:
        """A prefilled request's row is live: streamed and decoded from the next call on."""
        req.slot, req.admitted = slot, time.perf_counter()
        req.replay = len(req.generated)
        self.active[slot] = req
        self.device.sp_rows[slot] = req.sampling.values
        self.stats.admitted += 1

    def release(self, req: Request) -> None:
        """`req`'s slot, pages and device row freed."""
        self.pool.release(req.slot)
        self.active.pop(req.slot, None)
        self.device.free_row(req.slot)
        req.slot = -1

    def finish(self, req: Request, reason: str, host=None) -> None:
        done = self.streaming.completion(req, reason, host)
        drafted = done.metrics.get("num_draft_tokens")
        if host is not None and self.adaptive and drafted:
            acc = done.metrics["acceptance_rate"]  # averaged with earlier requests
            prev = self.observed_acceptance
            self.observed_acceptance = acc if prev is None else 0.5 * (prev + acc)
        self.release(req)
        self.stats.finished += 1
        req.sink.finish(done)

    def fail(self, req: Request, error: BaseException) -> None:
        """End `req` with RequestFailed: its row (if it holds one) and pages are freed."""
        if req.slot >= 0 and self.active.get(req.slot) is req:
            self.release(req)
        self.stats.failed += 1
        req.sink.finish(None, RequestFailed.of(error))

    def preempt(self, req: Request) -> None:
        """`req` out of its row (pages freed) and first in the queue: recomputed from its
        prompt when readmitted."""
        self.release(req)
        req.preemptions += 1
        self.stats.preemptions += 1
        self.queue.appendleft(req)

    def cancel(self, req: Request) -> None:
        """A request not holding a row ends "cancelled"."""
        req.sink.finish(self.streaming.completion(req, "cancelled"))

    def drop_cancelled(self) -> None:
        """Cancelled requests out: running ones finished, queued ones removed."""
        for req in list(self.active.values()):
            if req.cancelled:
                self.finish(req, "cancelled")
        for req in [r for r in self.queue if r.cancelled]:
            self.queue.remove(req)
            self.cancel(req)
