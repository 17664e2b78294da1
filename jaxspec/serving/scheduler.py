"""Continuous batching: a queue of requests and a fixed set of row slots. Each device call runs
the speculative loop (the engine's program, `Engine.decode_rows`) for at most `steps_per_call`
steps over the live rows; between calls the host streams what each row committed, releases rows
that finished (EOS, max_tokens, a stop id or string, a cancelled client) and admits queued
requests into the free slots. This module is the loop (`run_once`: release, admit, one call,
stream); its parts live beside it: `admission` (prefill of queued requests, whole or chunked),
`device_call` (the call over the live rows), `streaming` (tokens -> text, completions),
`kv_manager` (pages, preemption), `policy` (order, admission, victims).

The target KV cache is paged on device (`serving.paged_cache.PagedTarget`): one page pool per
layer shared by the rows, each row's page table uploaded from `pages.PagePool` before every
device call; on a mesh the pool is sharded over kv heads (`sharding.paged_cache_shardings`), the
rows over data. Targets without a per-layer cache keep a contiguous per-slot cache
with the same page bookkeeping (`kv_layout` says which ran). Prefix sharing (`serving.prefix`):
a prompt starting with full pages an earlier prompt wrote shares them and prefills the rest.

Lossless and batch-independent: every row carries its own request's sampling values, its own
key (`row_ids` = the request's seed), its own drafter and controller state (reset by the
splice); greedy output equals a solo run of the request whatever shares the batch. Preemption
restarts a request from its prompt (recompute): the same seed replays the same tokens, and the
ones already streamed are not sent again. Not thread-safe: one thread drives it (`api.Server`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode.logit_bias import bias_vector
from jaxspec.decode.penalties import OFF
from jaxspec.decode.sampling import SamplingParams
from jaxspec.engine.serving_surface import prefill_into_cache as prefill_into_pool
from jaxspec.errors import JaxspecError
from jaxspec.serving import grammars, paged_cache, paged_hybrid, prefix, rows
from jaxspec.serving import policy as policy_lib
from jaxspec.serving.admission import Admission
from jaxspec.serving.batch import MIN_TABLE_PAGES, program_widths
from jaxspec.serving.device_call import GREEDY, DeviceCall
from jaxspec.serving.kv_manager import KVManager
from jaxspec.serving.pages import PagePool, pages_for
from jaxspec.serving.requests import QueueFull, Request, Sampling
from jaxspec.serving.stats import Stats
from jaxspec.serving.streaming import Streaming
from jaxspec.serving.text import TextState
from jaxspec.sharding import fetch

# names that lived here before the split, importable from here still
__all__ = ["MIN_TABLE_PAGES", "QueueFull", "Request", "Scheduler", "Stats", "prefill_into_pool",
           "program_widths"]


class Scheduler(Admission, DeviceCall, Streaming):
    def __init__(
        self,
        engine,
        *,
        slots: int = 4,
        max_context: int = 512,
        steps_per_call: int = 8,
        max_queue: int = 64,
        kv_pages: int | None = None,
        page_size: int = 16,
        seed: int = 0,
        static: bool = False,
        paged: bool = True,
        prefill_chunk: int | None = None,
        prefix_cache: bool = True,
        policy: str = "fcfs",
        batch_prefill: bool = False,
        max_batched_tokens: int | None = None,
        structured: bool = False,
    ):
        """static: the static-batching baseline (bench_serve): requests are admitted only into
        an empty batch, which then runs until its last row ends, every call over all `slots`
        rows (a lockstep batch, as `Engine.generate` runs: rows that ended keep computing).
        paged=False: the contiguous per-slot cache with the same page bookkeeping (A/B).
        prefill_chunk: prompts longer than this many tokens are prefilled a chunk per round,
        each round's decode call running between chunks, so the streams of running rows do not
        wait for a whole long prompt (paged cache, continuous batching, drafters without target
        taps; else whole). The last chunk runs through `speculate.prefill` itself.
        prefix_cache: a prompt starting with full pages another prompt already wrote shares
        them and prefills only the rest (`serving.prefix`; paged cache, drafters without
        target taps: `self.prefix_cache` says whether it is on, and why not).
        policy: the scheduling policy's name (`serving.policy`: admission order and the row
        preempted when the pool is short).
        batch_prefill: the requests admitted in a round are prefilled several rows a call (and
        chunked prompts' chunks likewise) instead of one call each (`admission`).
        max_batched_tokens: batched admission (implied) under a budget of prompt tokens per
        round: the prefilling rows' next chunks first, then queued prompts while they fit; a
        prompt longer than a chunk (prefill_chunk, else the budget) goes in chunks across
        rounds where chunking is possible (else alone, the first of its round).
        structured: rows may carry a constraint (`serving.grammars`: one fixed-size table in
        the state, so the program carries the mask whether or not a row is constrained)."""
        if slots < 1 or steps_per_call < 1 or max_queue < 1:
            raise JaxspecError(
                f"serving: slots={slots}, steps_per_call={steps_per_call}, max_queue={max_queue} "
                "must each be at least 1"
            )
        if engine.max_context not in (None, max_context):
            raise JaxspecError(
                f"serving.max_context={max_context} differs from the engine's max_context="
                f"{engine.max_context}: build the engine with max_context={max_context}"
            )
        self.engine = engine
        self.grammars = grammars.GrammarSlots(engine, slots) if structured else None
        self.slots, self.capacity, self.steps = slots, max_context, steps_per_call
        self.max_queue = max_queue
        self.static = static
        if max_batched_tokens is not None and max_batched_tokens < 1:
            raise JaxspecError(f"serving.max_batched_tokens={max_batched_tokens}: use an integer "
                               ">= 1 (0 in a config: no budget)")
        if max_batched_tokens and prefill_chunk and prefill_chunk > max_batched_tokens:
            raise JaxspecError(f"serving.prefill_chunk={prefill_chunk} exceeds serving."
                               f"max_batched_tokens={max_batched_tokens}: a chunk must fit a "
                               "round's budget; lower prefill_chunk")
        self.budget = max_batched_tokens or None  # prompt tokens prefilled per round at most
        self.batch_prefill = batch_prefill or self.budget is not None
        per_row = pages_for(max_context, page_size)
        self.pool = PagePool(kv_pages or slots * per_row, page_size)
        if self.pool.num_pages < per_row:
            raise JaxspecError(
                f"serving.kv_pages={self.pool.num_pages} cannot hold one request of max_context="
                f"{max_context} ({per_row} pages of {page_size}): raise kv_pages"
            )
        self.max_pages = per_row  # page-table entries per row
        self.policy = policy_lib.named(policy, self.pool)
        # the device call runs over the live rows only, compacted into the narrowest of these
        # widths (each its own compiled program), and its page table is as wide as the longest
        # live row needs (`table_widths`): a step's cost follows the load
        self.widths = program_widths(slots)
        self.table_widths = program_widths(per_row, MIN_TABLE_PAGES)
        spec = engine.serving_spec()
        taps = tuple(spec.drafter.hidden_layers) if spec.drafter is not None else ()
        self.paged = paged and paged_cache.pageable(
            engine.cache_shape(engine.target, 1, 8))
        if self.paged:  # a drafter's target features are paged too (`paged_features`)
            paged = paged_cache.PagedTarget(engine.target, page_size, self.pool.num_pages,
                                            features=taps)
            spec = engine.serving_spec(paged)
        self.spec = spec
        taps = bool(taps) and not self.paged  # prompt features only where no pages keep them
        chunk = prefill_chunk or self.budget  # under a budget, prompts over it go in chunks
        self.chunk = chunk if self.paged and not static and not taps else None
        if self.paged and spec.target.hybrid:  # linear state resumes at page ends only
            paged_hybrid.check_chunk(self.chunk, page_size)
        self.prefix_cache = prefix.mode(prefix_cache, self.paged, bool(taps))
        self.kv = KVManager(self.pool, max_context, steps_per_call, spec.depth, spec.num_nodes,
                            self.prefix_cache)
        if prefill_chunk is not None and prefill_chunk < 1:
            raise JaxspecError(f"serving.prefill_chunk={prefill_chunk}: use an integer >= 1")
        self.prefilling: dict[int, list] = {}  # slot -> [request, prompt tokens in the pool]
        self._round_left: int | None = None  # the round's budget left (`admission`)
        self._round_tokens = 0  # prompt tokens prefilled this round
        self.key = jax.random.key(seed)
        self.queue: collections.deque[Request] = collections.deque()
        self.active: dict[int, Request] = {}  # slot -> request
        self.stats = Stats()
        self._ids = itertools.count()
        self._axes = rows.batch_axes(self._row_state_shape)
        self.state = None  # built at the first admission
        self._sp_rows: list[tuple] = [GREEDY] * slots
        self.observed_acceptance: float | None = None  # adaptive: over finished requests

    # ---- submission (any thread; the api holds a lock around these) -----------------------
    def new_request(self, prompt, sampling: Sampling, sink, request_id: str | None = None,
                    priority: int = 0, constraint=None, cache_salt: bytes = b"") -> Request:
        regex = None
        if constraint is not None:
            if self.grammars is None:
                raise JaxspecError("structured output is off on this server: start it with "
                                   "serving.structured=true")
            regex = self.grammars.compile(constraint)
        ids = self.engine.encode(prompt)
        self.engine.check_fits(ids, int(sampling.max_tokens))
        need = len(ids) + int(sampling.max_tokens) + self.spec.depth + 1
        if need > self.capacity:
            raise JaxspecError(
                f"prompt of {len(ids)} tokens + max_tokens={sampling.max_tokens} "
                f"(+ γ + 1 = {need} slots) exceeds serving.max_context={self.capacity}: "
                "shorten the prompt or lower max_tokens"
            )
        vocab = self.engine.target.vocab_size
        bias_vector(dict(sampling.logit_bias), vocab)  # ids and values in range
        bad = next((t for t in sampling.stop_token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise JaxspecError(f"stop_token_ids holds {bad}, outside the vocabulary: use ids "
                               f"in [0, {vocab})")
        k = self.spec.logprobs
        if sampling.logprobs is not None and (k is None or sampling.logprobs > k):
            raise JaxspecError(
                f"{sampling.logprobs} top logprobs asked, but the server records "
                f"{'none' if k is None else k}: start it with generation.logprobs=20"
            )
        n = next(self._ids)
        seed = n if sampling.seed is None else int(sampling.seed)
        return Request(request_id or f"req-{n}", ids, sampling, seed, sink, time.perf_counter(),
                       text=TextState(tuple(sampling.stop)), priority=int(priority),
                       constraint=regex, cache_salt=bytes(cache_salt))

    def enqueue(self, req: Request) -> None:
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"the queue holds {self.max_queue} requests: retry later")
        self.queue.append(req)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.active or self.prefilling)

    # ---- one round: release, admit, one device call, stream -------------------------------
    def run_once(self) -> bool:
        """Admit, run one device call, stream and release. False when there was nothing to do."""
        for slot, req in list(self.active.items()):
            if req.cancelled:
                self._finish(req, "cancelled")
        for req in [r for r in self.queue if r.cancelled]:
            self.queue.remove(req)
            req.sink.finish(self._completion(req, "cancelled"))
        for slot, (req, _) in list(self.prefilling.items()):
            if req.cancelled:
                del self.prefilling[slot]
                self.pool.release(slot)
                req.sink.finish(self._completion(req, "cancelled"))
        if self.active:  # the running rows' next call first, then new rows with what is left
            self._reserve_pages()
        self._admit()
        chunked = self._prefill_chunks()
        if not self.active:
            return chunked
        # rows admitted this round hold their prompt and one step: grow them for the whole call
        # (a write past a row's pages is dropped, so its later steps would read a hole)
        self._reserve_pages()
        self._decode_call()
        return True

    def _row_state_shape(self, batch: int):
        """The state a `batch`-row prefill leaves (traced only, for `rows.batch_axes`)."""
        sp = SamplingParams.rows([GREEDY] * batch)
        z = jnp.zeros((batch,), jnp.int32)
        g = None if self.grammars is None else self.grammars.rows([None] * batch)
        state = self.engine.prefill_rows(self.spec, jnp.zeros((batch, 16), jnp.int32), z + 1,
                                         z + 1, sp, self.key, z, self.capacity,
                                         penalties=self.engine.row_penalties([OFF] * batch),
                                         grammar=g)
        if self.spec.adaptive is None:
            return state
        g = self.spec.adaptive.gamma
        return dataclasses.replace(state, adaptive=self.spec.adaptive.init(batch, [1.0] * (g + 1)))

    def _grammar_rows(self, reqs, slots):
        """The Grammar these rows' prefill takes (None: structured output off); a constraint
        new to the table is added, and the batch state given the table (`serving.grammars`)."""
        if self.grammars is None:
            return None
        live = (set(self.active) | set(self.prefilling)) - set(slots)
        regexes = [r.constraint for r in reqs]
        delta = self.grammars.admit(regexes, list(slots), live)
        if self.state is not None:
            self.state = self.grammars.into_state(self.state, delta)
        return self.grammars.rows(regexes)

    # ---- pages and preemption ---------------------------------------------------------------
    def _reserve_pages(self) -> None:
        """Every active row holds pages for the next call's growth; where the pool is short the
        policy's victims are preempted (their pages freed, the request requeued first,
        recomputed from its prompt when readmitted): `KVManager.reserve`."""
        self.kv.reserve(self.active, self._host_lengths(), self.policy.victim, self._preempt)

    def _host_lengths(self) -> np.ndarray:
        return np.asarray(fetch(self.state.lengths))  # several processes: every one's rows

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.preemptions += 1
        self.stats.preemptions += 1
        self.queue.appendleft(req)

    def _release(self, req: Request) -> None:
        self.pool.release(req.slot)
        self.active.pop(req.slot, None)
        self._sp_rows[req.slot] = GREEDY
        free = np.zeros((self.slots,), bool)
        free[req.slot] = True
        self.state = rows.release_rows(self.state, jnp.asarray(free))
        req.slot = -1

    def _finish(self, req: Request, reason: str, host=None) -> None:
        done = self._completion(req, reason, host)
        drafted = done.metrics.get("num_draft_tokens")
        if host is not None and self.spec.adaptive is not None and drafted:
            acc = done.metrics["acceptance_rate"]  # averaged with earlier requests
            prev = self.observed_acceptance
            self.observed_acceptance = acc if prev is None else 0.5 * (prev + acc)
        self._release(req)
        self.stats.finished += 1
        req.sink.finish(done)
