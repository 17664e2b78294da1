"""Continuous batching: a queue of requests and a fixed set of row slots. Each device call runs
the speculative loop (the engine's program, `Engine.decode_rows`) for at most `steps_per_call`
steps over the live rows; between calls the host streams what each row committed, releases rows
that finished (EOS, max_tokens, a stop id or string, a cancelled client) and admits queued
requests into the free slots. This module is the loop (`run_once`: release, admit, one call,
stream), composed of parts that each own their state behind a small interface: `ledger` (the
queue and the running requests), `admission` (prefill of queued requests, whole or chunked),
`device_call.DeviceRunner` (the device state and every call over it), `streaming` (tokens ->
text, completions), `kv_manager` (pages, preemption), `policy` (order, admission, victims).
Its settings are one `config.ServingConfig` (one set of defaults; keyword arguments override
its fields).

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

import dataclasses
import itertools
import time

from jaxspec.config import ServingConfig
from jaxspec.decode.logit_bias import bias_vector
from jaxspec.engine.serving_surface import prefill_into_cache as prefill_into_pool
from jaxspec.errors import JaxspecError
from jaxspec.serving import grammars, paged_cache, paged_hybrid, prefix
from jaxspec.serving import policy as policy_lib
from jaxspec.serving.admission import Admission
from jaxspec.serving.batch import MIN_TABLE_PAGES, program_widths, table_widths
from jaxspec.serving.device_call import DeviceRunner, Shape
from jaxspec.serving.kv_manager import KVManager
from jaxspec.serving.ledger import Ledger
from jaxspec.serving.pages import PagePool, pages_for
from jaxspec.serving.requests import QueueFull, Request, Sampling
from jaxspec.serving.stats import Stats
from jaxspec.serving.streaming import Streaming
from jaxspec.serving.text import TextState

# names that lived here before the split, importable from here still
__all__ = ["MIN_TABLE_PAGES", "QueueFull", "Request", "Scheduler", "Stats", "prefill_into_pool",
           "program_widths", "serving_config"]

NONE_IS_ZERO = ("kv_pages", "prefill_chunk", "max_batched_tokens")  # None here, 0 in a config


def serving_config(config: ServingConfig | None = None, **settings) -> ServingConfig:
    """`config` (default: every default) with `settings` (its field names) replacing fields;
    None for kv_pages, prefill_chunk, max_batched_tokens means the config's 0 (unset)."""
    names = {f.name for f in dataclasses.fields(ServingConfig)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise JaxspecError(f"unknown serving setting(s) {unknown}: use fields of "
                           "config.ServingConfig")
    settings = {k: (0 if v is None and k in NONE_IS_ZERO else v) for k, v in settings.items()}
    return dataclasses.replace(config or ServingConfig(), **settings)


def check_settings(engine, c: ServingConfig) -> None:
    """The settings the config alone cannot check: against the engine and each other."""
    if engine.max_context not in (None, c.max_context):
        raise JaxspecError(
            f"serving.max_context={c.max_context} differs from the engine's max_context="
            f"{engine.max_context}: build the engine with max_context={c.max_context}"
        )
    if c.max_batched_tokens and c.prefill_chunk and c.prefill_chunk > c.max_batched_tokens:
        raise JaxspecError(f"serving.prefill_chunk={c.prefill_chunk} exceeds serving."
                           f"max_batched_tokens={c.max_batched_tokens}: a chunk must fit a "
                           "round's budget; lower prefill_chunk")
    per_row = pages_for(c.max_context, c.page_size)
    if c.kv_pages and c.kv_pages < per_row:
        raise JaxspecError(
            f"serving.kv_pages={c.kv_pages} cannot hold one request of max_context="
            f"{c.max_context} ({per_row} pages of {c.page_size}): raise kv_pages"
        )


class Scheduler:
    def __init__(self, engine, config: ServingConfig | None = None, *, seed: int = 0,
                 static: bool = False, paged: bool = True, tables: str = "octaves",
                 **settings):
        """config: the `serving` section (slots, max_context, steps_per_call, max_queue,
        kv_pages, page_size, prefill_chunk, prefix_cache, policy, batch_prefill,
        max_batched_tokens, structured: each described there); keyword `settings` replace its
        fields. seed: the key every row's randomness folds its request's seed into.
        static: the static-batching baseline (bench_serve): requests are admitted only into
        an empty batch, which then runs until its last row ends, every call over all slots
        (a lockstep batch, as `Engine.generate` runs: rows that ended keep computing).
        paged=False: the contiguous per-slot cache with the same page bookkeeping (A/B).
        tables: the page-table widths decode calls are compiled for: "octaves" (powers of two
        from MIN_TABLE_PAGES: a call's table is as wide as its longest row needs) or "one"
        (every call the full table: one decode program per row width, what a server holding
        every program resident takes; `batch.table_widths`)."""
        self.config = c = serving_config(config, **settings)
        check_settings(engine, c)
        self.engine, self.static = engine, static
        self.slots, self.capacity, self.steps = c.slots, c.max_context, c.steps_per_call
        self.max_queue = c.max_queue
        per_row = pages_for(c.max_context, c.page_size)
        self.pool = PagePool(c.kv_pages or c.slots * per_row, c.page_size)
        self.max_pages = per_row  # page-table entries per row
        self.policy = policy_lib.named(c.policy, self.pool)
        # the device call runs over the live rows only, compacted into the narrowest of these
        # widths (each its own compiled program), and its page table is as wide as the longest
        # live row needs (`table_widths`): a step's cost follows the load
        self.widths = program_widths(c.slots)
        self.table_widths = table_widths(per_row, tables)
        self.paged = paged and paged_cache.pageable(engine.cache_shape(engine.target, 1, 8))
        spec = engine.serving_spec()
        taps = tuple(spec.drafter.hidden_layers) if spec.drafter is not None else ()
        if self.paged:  # a drafter's target features are paged too (`paged_features`)
            spec = engine.serving_spec(paged_cache.PagedTarget(
                engine.target, c.page_size, self.pool.num_pages, features=taps))
        self.spec = spec
        self._compose(c, seed)

    def _compose(self, c: ServingConfig, seed: int) -> None:
        """The parts, each owning its state: KV manager, device runner, streaming, ledger,
        admission."""
        drafter = self.spec.drafter
        # prompt features only where no pages keep them (`paged_features`)
        taps = drafter is not None and bool(drafter.hidden_layers) and not self.paged
        budget = c.max_batched_tokens or None  # prompt tokens prefilled per round at most
        chunk = c.prefill_chunk or budget  # under a budget, prompts over it go in chunks
        chunk = chunk if self.paged and not self.static and not taps else None
        if self.paged and self.spec.target.hybrid:  # linear state resumes at page ends only
            paged_hybrid.check_chunk(chunk, c.page_size)
        self.prefix_cache = prefix.mode(c.prefix_cache, self.paged, taps)
        self.kv = KVManager(self.pool, c.max_context, c.steps_per_call, self.spec.depth,
                            self.spec.num_nodes, self.prefix_cache)
        self.stats = Stats()
        self.grammars = grammars.GrammarSlots(self.engine, c.slots) if c.structured else None
        shape = Shape(c.slots, c.max_context, c.steps_per_call, self.widths, self.table_widths,
                      self.max_pages, self.paged, self.static)
        self.device = DeviceRunner(self.engine, self.spec, shape, self.pool, self.stats,
                                   self.grammars, seed)
        self.streaming = Streaming(self.engine, self.spec, c.page_size, self.prefix_cache,
                                   lambda: self.device.kv_layout)
        self.ledger = Ledger(c.max_queue, self.pool, self.device, self.streaming, self.stats,
                             adaptive=self.spec.adaptive is not None)
        self.admission = Admission(
            self.engine, self.spec, shape, pool=self.pool, kv=self.kv, policy=self.policy,
            stats=self.stats, device=self.device, ledger=self.ledger,
            chunk=chunk, budget=budget, batch_prefill=c.batch_prefill or budget is not None,
            prefix_cache=self.prefix_cache)
        self._ids = itertools.count()

    # ---- what the parts hold, read by the server, metrics, lockstep and the tests ---------
    queue = property(lambda self: self.ledger.queue)
    active = property(lambda self: self.ledger.active)
    prefilling = property(lambda self: self.admission.prefilling)
    state = property(lambda self: self.device.state)
    key = property(lambda self: self.device.key)
    chunk = property(lambda self: self.admission.chunk)
    budget = property(lambda self: self.admission.budget)
    batch_prefill = property(lambda self: self.admission.batch_prefill)
    observed_acceptance = property(lambda self: self.ledger.observed_acceptance)
    kv_layout = property(lambda self: self.device.kv_layout)

    def kv_bytes(self) -> dict[str, int]:
        return self.device.kv_bytes()

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
        self._check_request(ids, sampling)
        n = next(self._ids)
        seed = n if sampling.seed is None else int(sampling.seed)
        return Request(request_id or f"req-{n}", ids, sampling, seed, sink, time.perf_counter(),
                       text=TextState(tuple(sampling.stop)), priority=int(priority),
                       constraint=regex, cache_salt=bytes(cache_salt))

    def _check_request(self, ids, sampling: Sampling) -> None:
        """A one-line JaxspecError for a request this server cannot run."""
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

    def enqueue(self, req: Request) -> None:
        self.ledger.enqueue(req)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.active or self.prefilling)

    # ---- one round: release, admit, one device call, stream -------------------------------
    def run_once(self) -> bool:
        """Admit, run one device call, stream and release. False when there was nothing to do."""
        self.ledger.drop_cancelled()
        self.admission.drop_cancelled()
        if self.active:  # the running rows' next call first, then new rows with what is left
            self._reserve_pages()
        self.admission.admit()
        chunked = self.admission.prefill_chunks()
        if not self.active:
            return chunked
        # rows admitted this round hold their prompt and one step: grow them for the whole call
        # (a write past a row's pages is dropped, so its later steps would read a hole)
        self._reserve_pages()
        logprobs = any(r.sampling.logprobs is not None for r in self.active.values())
        host = self.device.decode(self.active, logprobs)
        self._stream(host, time.perf_counter())
        return True

    def _stream(self, host, now: float) -> None:
        """Every live row streamed; a row whose tokens or text cannot be read fails alone (its
        request gets the error, its row and pages are freed), the others go on."""
        for req in list(self.active.values()):
            try:
                reason = self.streaming.read(req, host, now)
            except Exception as e:  # noqa: BLE001 -- confined to the request that caused it
                self.ledger.fail(req, e)
                continue
            if reason is not None:
                self.ledger.finish(req, reason, host)

    def _reserve_pages(self) -> None:
        """Every active row holds pages for the next call's growth; where the pool is short the
        policy's victims are preempted (their pages freed, the request requeued first,
        recomputed from its prompt when readmitted): `KVManager.reserve`."""
        self.kv.reserve(self.active, self.device.host_lengths(), self.policy.victim,
                        self.ledger.preempt)

    # ---- the programs it calls, compiled ahead (the server's warm-up) ----------------------
    def decode_programs(self) -> list[dict]:
        """Every decode call this scheduler can make (`DeviceRunner.decode_programs`)."""
        return self.device.decode_programs()

    def prefill_programs(self, prompt_lengths) -> list[dict]:
        """Every prefill program admission may call for prompts of these lengths
        (`Admission.prefill_programs`)."""
        return self.admission.prefill_programs(prompt_lengths)

    def compile_programs(self) -> int:
        """Compile ahead every decode call this scheduler can make, as a server's warm-up
        (like a GPU server capturing its graphs): a call of a shape not seen yet otherwise
        compiles while requests wait. Nothing runs; the state is untouched. -> programs
        compiled (already compiled ones come from the compilation cache)."""
        return _compile(self.decode_programs())

    def compile_prefills(self, prompt_lengths) -> int:
        """Compile ahead every prefill program admission may call for prompts of these
        lengths, so no admission waits for one. -> programs compiled (compiling ahead fills
        jit's own cache, so the calls made while serving find them and lower nothing)."""
        return _compile(self.prefill_programs(prompt_lengths))


def _compile(programs: list[dict]) -> int:
    for row in programs:
        fn, args, kwargs = row["program"]
        fn.lower(*args, **kwargs).compile()
    return len(programs)
