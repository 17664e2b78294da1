"""Continuous batching: a queue of requests and a fixed set of row slots. Each device call runs
the speculative loop (`speculate.decode`, the engine's program) for at most `steps_per_call`
steps over every slot; between calls the host streams what each row committed, releases rows
that finished (EOS, max_tokens, a stop id or string, a cancelled client) and admits queued
requests into the free slots (a batch-1 prefill spliced into the slot: `rows.insert_row`).

The target KV cache is paged on device (`serving.paged_cache.PagedTarget`): one page pool per
layer shared by the rows, each row's page table uploaded from `pages.PagePool` before every
device call, a request's prefill written straight into the pool through its table. A row holds
pages for what it has and the next call's growth (drafted slots included), never max_context.
Targets without a per-layer cache (the stacked layout) or under a mesh keep a contiguous
per-slot cache with the same page bookkeeping (`Scheduler.kv_layout` says which ran). Prefix
sharing (`serving.prefix`): a request whose prompt starts with full pages an earlier prompt
wrote starts its table with them (`pages.PagePool.admit`) and prefills only the rest.

Lossless and batch-independent: every row carries its own request's sampling values (per-row
`SamplingParams`), its own key (`row_ids` = the request's seed: `sampling.row_keys`), its own
drafter and controller state (reset by the splice); greedy output equals a solo run of the
request whatever shares the batch. Preemption under a short page pool restarts a request from
its prompt (recompute): the same seed replays the same tokens, and the ones already streamed
are not sent again.

Not thread-safe: one thread drives it (`api.Server` runs `run_once` in its own).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode import adaptive, speculate
from jaxspec.decode.sampling import SamplingParams
from jaxspec.engine.runner import bucket
from jaxspec.errors import JaxspecError
from jaxspec.models import paged_attention
from jaxspec.serving import paged_cache, prefix, rows
from jaxspec.serving import policy as policy_lib
from jaxspec.serving.batch import MIN_TABLE_PAGES, call_width, hole, program_widths
from jaxspec.serving.kv_manager import KVManager
from jaxspec.serving.pages import PagePool, pages_for
from jaxspec.serving.requests import Completion, QueueFull, Request, Sampling
from jaxspec.serving.stats import Stats
from jaxspec.serving.text import TextState

GREEDY = Sampling().values
# names that lived here before the split, importable from here still
__all__ = ["MIN_TABLE_PAGES", "QueueFull", "Request", "Scheduler", "Stats", "program_widths"]
# a row's prefill into the shared page pool, the pool donated (updated in place, not copied)
prefill_into_pool = jax.jit(speculate.prefill, static_argnames=("spec", "capacity"),
                            donate_argnames=("cache",))


class Scheduler:
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
        preempted when the pool is short)."""
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
        self.slots, self.capacity, self.steps = slots, max_context, steps_per_call
        self.max_queue = max_queue
        self.static = static
        spec = engine.spec
        if spec.adaptive is not None:  # rows of different requests: no batch-wide hand-off,
            # and a row that ends is replaced (the cap buys tokens, not a shorter tail)
            ctl = spec.adaptive
            spec = dataclasses.replace(spec, adaptive=dataclasses.replace(
                ctl, settings=dataclasses.replace(ctl.settings, handoff_after=0),
                rows_replaced=True))
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
        self._costs: dict[int, tuple] = {}  # width -> the controller's cost table (host)
        self.paged = paged and spec.mesh is None and paged_cache.pageable(engine.model.target,
                                                                engine.model.params)
        if self.paged:
            paged = paged_cache.PagedTarget(engine.model.target, page_size, self.pool.num_pages)
            spec = dataclasses.replace(spec, target=paged)
        self.spec = spec
        taps = spec.drafter is not None and spec.drafter.hidden_layers
        self.chunk = prefill_chunk if self.paged and not static and not taps else None
        self.prefix_cache = prefix.mode(prefix_cache, self.paged, bool(taps))
        self.kv = KVManager(self.pool, max_context, steps_per_call, spec.depth, spec.num_nodes,
                            self.prefix_cache)
        if prefill_chunk is not None and prefill_chunk < 1:
            raise JaxspecError(f"serving.prefill_chunk={prefill_chunk}: use an integer >= 1")
        self.prefilling: dict[int, list] = {}  # slot -> [request, prompt tokens in the pool]
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
                    priority: int = 0) -> Request:
        ids = self.engine.encode(prompt)
        self.engine.check_fits(ids, int(sampling.max_tokens))
        need = len(ids) + int(sampling.max_tokens) + self.spec.depth + 1
        if need > self.capacity:
            raise JaxspecError(
                f"prompt of {len(ids)} tokens + max_tokens={sampling.max_tokens} "
                f"(+ γ + 1 = {need} slots) exceeds serving.max_context={self.capacity}: "
                "shorten the prompt or lower max_tokens"
            )
        n = next(self._ids)
        seed = n if sampling.seed is None else int(sampling.seed)
        return Request(request_id or f"req-{n}", ids, sampling, seed, sink, time.perf_counter(),
                       text=TextState(tuple(sampling.stop)), priority=int(priority))

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

    def _free_slots(self) -> list[int]:
        return [s for s in range(self.slots) if s not in self.active and s not in self.prefilling]

    def _admit(self) -> None:
        used = self.pool.used_pages  # the running rows grown for their next call
        self.stats.peak_used_pages = max(self.stats.peak_used_pages, used)
        if self.static and self.active:
            return
        free = self._free_slots()
        for req in self.policy.order(self.queue):
            if not free:
                break
            if not self.policy.admit(req, self.pool):
                continue
            cached = self.kv.take(req, free[0], written=self.state is not None)
            if cached is None:
                break  # the pool is short: wait for a row to end
            self.queue.remove(req)
            slot = free.pop(0)
            req.peak_pages = max(req.peak_pages, self.pool.held(slot))
            req.cached_tokens = cached
            self.stats.prompt_tokens += len(req.prompt_ids)
            self.stats.prefix_cached_tokens += cached
            chunked = self.chunk is not None and len(req.prompt_ids) - cached > self.chunk
            if chunked and self.state is not None:
                self.prefilling[slot] = [req, cached]  # a chunk per round (`_prefill_chunks`)
            else:
                self._prefill_into(req, slot, cached)
        self.stats.peak_used_pages = max(self.stats.peak_used_pages, self.pool.used_pages)

    def _prefill_chunks(self) -> bool:
        """One chunk of every prefilling request's prompt written into its pages; the last
        (at most `chunk` tokens) through `speculate.prefill` with the pool already holding the
        rest (`paged_cache.TailTarget`), which splices the row in. False: none prefilling."""
        for slot, entry in list(self.prefilling.items()):
            req, done = entry
            if len(req.prompt_ids) - done > self.chunk:
                t0 = time.perf_counter()
                cache = self._take_pool(slot, done)
                tokens = jnp.asarray([req.prompt_ids[done : done + self.chunk]], jnp.int32)
                cache = paged_cache.write_chunk(self.spec.target, self.engine.model.params,
                                                tokens, cache)
                self._set_cache(k=cache.k, v=cache.v)
                entry[1] = done + self.chunk
                self.kv.written(slot, req.prompt_ids[: entry[1]])  # shareable already
                self.stats.prefill_s += time.perf_counter() - t0
            else:
                del self.prefilling[slot]
                self._prefill_into(req, slot, done)
        return bool(self.prefilling) or bool(self.active)

    def _prefill_into(self, req: Request, slot: int, done: int = 0) -> None:
        t0 = time.perf_counter()
        row = self._row_state(self.spec, req, slot, done)
        self.kv.written(slot, req.prompt_ids)
        if self.state is None:
            self.state = rows.tile_rows(row, self.slots, self._axes)
            if self.paged:  # the tiled state shares the row's pool: not donated with it
                self._set_cache(k=hole(row.cache.k), v=hole(row.cache.k))
        self.state = rows.insert_row(self.state, row, jnp.int32(slot), self._axes)
        if self.paged:  # the pool the prefill wrote (insert_row kept the batch's placeholder)
            self._set_cache(k=row.cache.k, v=row.cache.v)
        req.slot, req.admitted = slot, time.perf_counter()
        req.replay = len(req.generated)
        self.active[slot] = req
        self._sp_rows[slot] = req.sampling.values
        self.stats.admitted += 1
        self.stats.prefill_s += time.perf_counter() - t0

    def _row_state(self, spec, req: Request, slot: int, done: int = 0):
        """done: prompt tokens already in the row's pages (earlier chunks of chunked prefill,
        pages shared from the prefix cache): only the tokens from `done` on run, in a tail of
        a bucketed width (`paged_cache.TailTarget`: nothing below `done` is written)."""
        ids = req.prompt_ids
        if done:
            tail = paged_cache.TailTarget(spec.target, bucket(len(ids) - done))
            spec = dataclasses.replace(spec, target=tail)
        prompt = np.zeros((1, bucket(len(ids))), np.int32)
        prompt[0, : len(ids)] = ids
        sp = SamplingParams.rows([req.sampling.values])
        args = (spec, self.engine.model.params, self.engine.drafter_params, jnp.asarray(prompt),
                jnp.asarray([len(ids)], jnp.int32),
                jnp.asarray([req.sampling.max_tokens], jnp.int32), sp, self.key,
                jnp.asarray([req.seed], jnp.int32))
        if self.paged:
            cache = self._take_pool(slot, done)
            state = prefill_into_pool(*args, capacity=self.capacity, cache=cache)
        else:
            state = speculate.prefill_jit(*args, capacity=self.capacity)
        return self._with_adaptive(state, 1)

    def _take_pool(self, slot: int, start: int = 0) -> paged_attention.PagedKVCache:
        """The shared pool (taken out of the batch state, which holds zero-size placeholders
        until `_prefill_into` puts the written pool back) with row `slot`'s page table, for a
        prefill writing from `start` on (its length); never below the row's named pages, whose
        content other rows read."""
        if start < self.pool.frozen(slot):
            raise RuntimeError(f"a prefill of row {slot} from {start} would write into its "
                               f"shared pages (below {self.pool.frozen(slot)})")
        if self.state is None:
            empty = self.spec.target.init_cache(self.engine.model.params, 1, self.capacity)
            k, v = empty.k, empty.v
        else:
            k, v = self.state.cache.k, self.state.cache.v
            self._set_cache(k=hole(k), v=hole(k))
        table = self.pool.table(self.slots, self.max_pages)[slot : slot + 1]
        return paged_attention.PagedKVCache(k, v, jnp.asarray(table),
                                            jnp.asarray([start], jnp.int32))

    @property
    def kv_layout(self) -> str:
        """The target cache the device program holds: "paged" (a page pool and tables) or
        "contiguous" (max_context slots per row); read from the state, not from a setting."""
        if self.state is None:
            return "none yet"
        paged = isinstance(self.state.cache, paged_attention.PagedKVCache)
        return "paged" if paged else "contiguous"

    def _set_cache(self, **fields) -> None:
        self.state = dataclasses.replace(
            self.state, cache=dataclasses.replace(self.state.cache, **fields))

    def kv_bytes(self) -> dict[str, int]:
        """Device bytes of the target KV cache: the whole pool and one page of it."""
        if self.state is None:
            return {}
        cache = self.state.cache
        total = sum(x.nbytes for x in (*jax.tree.leaves(cache.k), *jax.tree.leaves(cache.v)))
        return {"kv_cache_bytes": total, "kv_page_bytes": total // self.pool.num_pages
                if self.paged else total // (self.slots * self.max_pages)}

    def _with_adaptive(self, state, batch: int):
        if self.spec.adaptive is None:
            return state
        costs = self.engine.step_costs(1)  # each call sets its width's (`_costs_at`)
        return dataclasses.replace(state, adaptive=self.spec.adaptive.init(batch, costs))

    def _costs_at(self, width: int) -> tuple:
        """(costs f32[F, G+1], fills f32[F]) the controller prices a `width`-row call with: the
        calibrated curve of that batch size (Engine.calibrate: measured once, announced)."""
        if width not in self._costs:  # host arrays: the call donates the device ones
            fills, table = adaptive.cost_table(self.engine.step_costs(width))
            self._costs[width] = (np.asarray(table, np.float32), np.asarray(fills, np.float32))
        return tuple(jnp.array(x) for x in self._costs[width])

    def _row_state_shape(self, batch: int):
        """The state a `batch`-row prefill leaves (traced only, for `rows.batch_axes`)."""
        sp = SamplingParams.rows([GREEDY] * batch)
        z = jnp.zeros((batch,), jnp.int32)
        state = speculate.prefill(
            self.spec, self.engine.model.params, self.engine.drafter_params,
            jnp.zeros((batch, 16), jnp.int32), z + 1, z + 1, sp, self.key, z, self.capacity,
        )
        if self.spec.adaptive is None:
            return state
        g = self.spec.adaptive.gamma
        return dataclasses.replace(state, adaptive=self.spec.adaptive.init(batch, [1.0] * (g + 1)))

    # ---- pages and preemption ---------------------------------------------------------------
    def _reserve_pages(self) -> None:
        """Every active row holds pages for the next call's growth; where the pool is short the
        policy's victims are preempted (their pages freed, the request requeued first,
        recomputed from its prompt when readmitted): `KVManager.reserve`."""
        self.kv.reserve(self.active, self._host_lengths(), self.policy.victim, self._preempt)

    def _host_lengths(self) -> np.ndarray:
        return np.asarray(jax.device_get(self.state.lengths))

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

    # ---- the device call ----------------------------------------------------------------
    def compile_programs(self) -> int:
        """Compile ahead every decode call this scheduler can make: each call width with each
        page-table width (one width, every slot, for a contiguous cache), as a server's warm-up
        (like a GPU server capturing its graphs): a call of a shape not seen yet otherwise
        compiles while requests wait. Nothing runs; the state is untouched. -> programs
        compiled (already compiled ones come from the compilation cache)."""
        engine, count = self.engine, 0
        widths = self.widths if self.paged else (self.slots,)
        for width in widths:
            shape = jax.eval_shape(lambda w=width: self._row_state_shape(w))
            sp = SamplingParams.rows([GREEDY] * width)
            if shape.adaptive is not None:
                costs, fills = self._costs_at(width)
                shape = dataclasses.replace(shape, adaptive=dataclasses.replace(
                    shape.adaptive, costs=costs, fills=fills))
            for cols in self.table_widths if self.paged else (None,):
                if cols is not None:
                    table = jax.ShapeDtypeStruct((width, cols), jnp.int32)
                    shape = dataclasses.replace(shape, cache=dataclasses.replace(
                        shape.cache, page_table=table))
                speculate.decode_jit.lower(self.spec, engine.model.params, engine.drafter_params,
                                           shape, sp, jnp.int32(self.steps)).compile()
                count += 1
        return count

    def _decode_call(self) -> None:
        """One device call over the live rows: compacted (`rows.take_rows`) into the narrowest
        program width that holds them, with a page table as wide as the longest live row's
        pages, then written back (`rows.put_rows`). The pool itself is never copied."""
        t0 = time.perf_counter()
        engine = self.engine
        live = sorted(self.active)
        # (a contiguous cache is per row: compacting it would copy every live row's KV)
        width = (call_width(self.widths, len(live)) if self.paged and not self.static
                 else self.slots)
        spare = [s for s in range(self.slots) if s not in self.active]  # done rows: padding
        order = live + spare[: width - len(live)]
        sp = SamplingParams.rows([self._sp_rows[s] for s in order])
        whole = order == list(range(self.slots))
        if self.paged:
            k, v = self.state.cache.k, self.state.cache.v
            self._set_cache(k=hole(k), v=hole(k))
        sub = self.state if whole else rows.take_rows(self.state, jnp.asarray(order, jnp.int32),
                                                      self._axes)
        if self.paged:  # the tables as the pool holds them now (grown, released, preempted);
            # a slot still prefilling gets none: its stale row must not write into its pages
            held = max(self.pool.held(s) for s in live)
            cols = call_width(self.table_widths, held)
            table = self.pool.table(self.slots, self.max_pages, only=self.active)[order, :cols]
            sub = dataclasses.replace(sub, cache=dataclasses.replace(
                sub.cache, k=k, v=v, page_table=jnp.asarray(table)))
        if sub.adaptive is not None:
            costs, fills = self._costs_at(width)
            sub = dataclasses.replace(sub, adaptive=dataclasses.replace(
                sub.adaptive, costs=costs, fills=fills))
        sub = speculate.decode_jit(
            self.spec, engine.model.params, engine.drafter_params, sub, sp, jnp.int32(self.steps),
        )
        view = sub.cache.page_table.shape[1] * self.pool.page_size if self.paged else self.capacity
        self.stats.calls_by_shape[(int(sub.tokens.shape[0]), int(view))] += 1
        if self.paged:  # the pool out, a full-width table placeholder in (the host's is truth)
            k, v = sub.cache.k, sub.cache.v
            sub = dataclasses.replace(sub, cache=dataclasses.replace(
                sub.cache, k=hole(k), v=hole(k),
                page_table=jnp.zeros((width, self.max_pages), jnp.int32)))
        self.state = sub if whole else rows.put_rows(self.state, sub,
                                                     jnp.asarray(order, jnp.int32), self._axes)
        if self.paged:
            self._set_cache(k=k, v=v)
        names = ("tokens", "lengths", "done", "row_steps", "num_draft", "num_accepted",
                 "accepted_per_position")
        fields = {n: getattr(self.state, n) for n in names}
        if self.state.adaptive is not None:
            fields["adaptive"] = self.state.adaptive
        host = types.SimpleNamespace(**({"adaptive": None} | jax.device_get(fields)))
        now = time.perf_counter()
        self.stats.device_calls += 1
        self.stats.decode_s += now - t0
        for slot, req in list(self.active.items()):
            self._stream_row(req, host, now)

    def _stream_row(self, req: Request, host, now: float) -> None:
        slot, p = req.slot, len(req.prompt_ids)
        out = host.tokens[slot, p : host.lengths[slot]].tolist()
        if len(out) < req.replay:  # a restarted row still recomputing what was streamed
            return
        req.replay = 0
        stop_ids = set(req.sampling.stop_token_ids)
        reason = None
        cut = next((i for i, t in enumerate(out) if t in stop_ids), None)
        if cut is not None:
            out, reason = out[: cut + 1], "stop"
        elif bool(host.done[slot]):
            hit_eos = bool(out) and out[-1] in self.engine.model.eos_token_ids
            reason = "stop" if hit_eos else "length"
        if len(out) > len(req.generated) and not req.first_token:
            req.first_token = now
        req.generated = out
        text = self.engine.decode_text([t for t in out if t not in stop_ids])
        piece, stopped = req.text.advance(text, final=reason is not None)
        if piece:
            req.sink.push(piece)
        if stopped:
            reason = "stop"
        if reason is not None:
            self._finish(req, reason, host)

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

    def _completion(self, req: Request, reason: str, host=None) -> Completion:
        n = len(req.generated)
        metrics: dict[str, Any] = {"method": self.engine.method}
        if host is not None:
            metrics = self.engine.row_metrics(host, req.slot, n)
        metrics |= {"kv_pages": req.peak_pages, "kv_page_size": self.pool.page_size,
                    "kv_layout": self.kv_layout, "prefix_cache": self.prefix_cache,
                    "prefix_cached_tokens": req.cached_tokens}
        now = time.perf_counter()
        first = req.first_token or now
        text = self.engine.decode_text([t for t in req.generated
                                        if t not in set(req.sampling.stop_token_ids)])
        if req.sampling.stop:
            cut = min((i for i in (text.find(s) for s in req.sampling.stop) if i >= 0),
                      default=len(text))
            text = text[:cut]
        return Completion(
            request_id=req.id,
            text=text,
            token_ids=list(req.generated),
            finish_reason=reason,
            num_prompt_tokens=len(req.prompt_ids),
            time_to_first_token_s=first - req.submitted,
            time_per_output_token_s=(now - first) / (n - 1) if n > 1 else 0.0,
            queue_s=(req.admitted or now) - req.submitted,
            preemptions=req.preemptions,
            metrics=metrics,
        )
