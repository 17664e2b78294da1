"""Serving on a mesh that spans processes (`jax.distributed`, `jaxspec.distributed`): process 0
runs the HTTP front and the `api.Server` loop; every other process runs `follow`. Each round
process 0 broadcasts what the round takes in (requests submitted since the last round with their
seeds, cancellations, whether the server is closing) to every process with
`jax.experimental.multihost_utils.broadcast_one_to_all`: a fixed-shape int32 header [closing,
payload bytes] and then the payload (its bytes as an int32 array, padded to a power of two).
Every process applies it to its own `Scheduler`, built alike from the same config, and runs the
same round: the scheduler is deterministic given its inputs and the device state it reads (that
read gathers every process's rows: `sharding.fetch`), so all processes make the same admissions
and run the same compiled calls on the same global arrays, which a multi-controller program
needs. With nothing to do, process 0 still broadcasts an empty round every `HEARTBEAT_S`, so a
follower never waits in a collective for long.

Only process 0 streams to clients: a follower's requests write into a sink that drops them.
Structured output (a request's constraint) is not carried: refused by `Server.submit`.
"""

from __future__ import annotations

import pickle
import time

import jax
import numpy as np

from jaxspec.serving.requests import Request
from jaxspec.serving.text import TextState

HEARTBEAT_S = 1.0  # an idle leader's empty round, at most this far apart


def spans_processes() -> bool:
    return jax.process_count() > 1


def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def exchange(closing: bool = False, events: dict | None = None) -> tuple[bool, dict]:
    """Process 0's (closing, events) on every process (the others pass nothing). events:
    {"new": [(id, prompt ids, Sampling, seed, priority)], "cancel": [request ids]}."""
    primary = jax.process_index() == 0
    # the payload is bytes process 0 of this same job pickled: no other sender reaches it
    payload = pickle.dumps(events or {}) if primary else b""
    header = _broadcast(np.array([int(closing), len(payload)], np.int32) if primary
                        else np.zeros((2,), np.int32))
    n = int(header[1])
    if not n:
        return bool(header[0]), {}
    size = 1 << (-(-n // 4) - 1).bit_length()  # int32 words, a power of two (few shapes)
    buf = np.zeros((size * 4,), np.uint8)
    if primary:
        buf[:n] = np.frombuffer(payload, np.uint8)
    words = _broadcast(buf.view(np.int32))
    return bool(header[0]), pickle.loads(words.view(np.uint8)[:n].tobytes())


def describe(req: Request) -> tuple:
    """What a follower needs to build the same request (`apply`)."""
    return (req.id, list(req.prompt_ids), req.sampling, req.seed, req.priority, req.cache_salt)


class _Dropped:
    """A follower's sink: only process 0 answers clients."""

    def push(self, piece) -> None:
        pass

    def finish(self, completion, error=None) -> None:
        pass


def apply(scheduler, events: dict, own: list | None = None) -> None:
    """A round's events into `scheduler`: its new requests queued in order (process 0 passes
    its own Request objects, `own`, in the same order; a follower builds them as
    `Scheduler.new_request` would, with process 0's seed), then the cancellations flagged."""
    for i, (rid, ids, sampling, seed, priority, salt) in enumerate(events.get("new", ())):
        req = own[i] if own is not None else Request(rid, ids, sampling, seed, _Dropped(),
                                               time.perf_counter(),
                                               text=TextState(tuple(sampling.stop)),
                                               priority=priority, cache_salt=salt)
        scheduler.queue.append(req)  # counted against max_queue on process 0
    cancel = set(events.get("cancel", ()))
    if cancel:
        live = [*scheduler.queue, *scheduler.active.values(),
                *(entry[0] for entry in scheduler.prefilling.values())]
        for req in live:
            if req.id in cancel:
                req.cancelled = True


def follow(scheduler) -> int:
    """A follower process's loop: process 0's rounds applied and run until it closes.
    -> rounds run."""
    rounds = 0
    while True:
        closing, events = exchange()
        if closing:
            return rounds
        apply(scheduler, events)
        if scheduler.busy:
            scheduler.run_once()
            rounds += 1
