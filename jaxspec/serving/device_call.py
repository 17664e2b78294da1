"""The device runner: the batch's device state (`state`: every slot's row, the page pool, the
rows' sampling values) and every device call over it. One decode call runs the engine's
speculative loop (`Engine.decode_rows`) for `steps` steps over the live rows only, compacted
into the narrowest compiled width (`batch.program_widths`) with a page table as wide as the
longest live row needs, and returns what the host reads (tokens, lengths, done, metrics).
Prefilled rows are spliced in (`splice_row(s)`), finished rows released (`free_row`); the pool
is lent to a prefill (`take_pool_rows`) and put back (`set_cache`).

It owns the device state alone; the scheduler owns the requests, the page pool's bookkeeping
(`pages.PagePool`, read here for the tables) and the loop. The model is reached only through
the engine's serving surface (`Engine.decode_rows`, `prefill_rows`, `decode_program`).
"""

from __future__ import annotations

import dataclasses
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode.penalties import OFF
from jaxspec.decode.sampling import SamplingParams
from jaxspec.sharding import fetch
from jaxspec.models import paged_attention
from jaxspec.serving import rows
from jaxspec.serving.batch import call_width, hole
from jaxspec.serving.requests import Sampling

GREEDY = Sampling().values  # a free (padding) row's sampling values
# the fields of the device state the host reads after a call (streaming, metrics)
HOST_FIELDS = ("tokens", "lengths", "done", "row_steps", "num_draft", "num_accepted",
               "accepted_per_position")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The fixed shapes of a scheduler's device calls."""

    slots: int  # rows of the batch state
    capacity: int  # serving.max_context
    steps: int  # decode steps per call
    widths: tuple[int, ...]  # compiled row widths of a decode call
    table_widths: tuple[int, ...]  # compiled page-table widths
    max_pages: int  # page-table entries per row
    paged: bool  # a page pool (else a contiguous per-slot cache)
    static: bool  # the static-batching baseline: every call over all slots
    # decode calls always in sampling mode "any" (a temperature-0 row takes its argmax inside
    # it): one program a shape, not an all-greedy twin beside it (False: the twin, A/B only)
    one_mode: bool = True


class DeviceRunner:
    def __init__(self, engine, spec, shape: Shape, pool, stats, grammars=None, seed: int = 0):
        self.engine, self.spec, self.shape = engine, spec, shape
        self.pool, self.stats, self.grammars = pool, stats, grammars
        self.key = jax.random.key(seed)
        self.state = None  # built at the first admission
        # the page pool before the batch state exists: a first long prompt's chunks written
        # into it (`take_pool_rows` / `set_cache`), the state built around it at its splice
        self.early_pool: tuple | None = None  # (k, v)
        self.sp_rows: list[tuple] = [GREEDY] * shape.slots  # each slot's sampling values
        self.axes = rows.batch_axes(self.row_state_shape)

    # ---- programs -----------------------------------------------------------------------------
    def row_state_shape(self, batch: int):
        """The state a `batch`-row prefill leaves (traced only, for `rows.batch_axes`)."""
        sp = SamplingParams.rows([GREEDY] * batch)
        z = jnp.zeros((batch,), jnp.int32)
        g = None if self.grammars is None else self.grammars.rows([None] * batch)
        state = self.engine.prefill_rows(self.spec, jnp.zeros((batch, 16), jnp.int32), z + 1,
                                         z + 1, sp, self.key, z, self.shape.capacity,
                                         penalties=self.engine.row_penalties([OFF] * batch),
                                         grammar=g)
        if self.spec.adaptive is None:
            return state
        g = self.spec.adaptive.gamma
        return dataclasses.replace(state, adaptive=self.spec.adaptive.init(batch, [1.0] * (g + 1)))

    def decode_programs(self) -> list[dict]:
        """Every decode call this runner can make: each call width with each page-table
        width (one width, every slot, for a contiguous cache). Each {"name": "decode", "rows",
        "table_pages" (None: contiguous), "program" ((jitted function, args, kwargs))}."""
        out, s = [], self.shape
        for width in s.widths if s.paged else (s.slots,):
            shape = jax.eval_shape(lambda w=width: self.row_state_shape(w))
            sp = self.call_sampling([GREEDY] * width)
            shape = self.with_costs(shape, width)
            for cols in s.table_widths if s.paged else (None,):
                if cols is not None:
                    table = jax.ShapeDtypeStruct((width, cols), jnp.int32)
                    shape = dataclasses.replace(shape, cache=dataclasses.replace(
                        shape.cache, page_table=table))
                out.append({"name": "decode", "rows": width, "table_pages": cols,
                            "program": self.engine.decode_program(self.spec, shape, sp, s.steps)})
        return out

    def call_sampling(self, values) -> SamplingParams:
        """A decode call's per-row sampling values; mode "any" whatever the rows ask where the
        shape has one mode (`Shape.one_mode`)."""
        sp = SamplingParams.rows(values)
        return dataclasses.replace(sp, mode="any") if self.shape.one_mode else sp

    def with_costs(self, state, width: int):
        """`state` with the controller's cost table for a `width`-row call (adaptive only)."""
        if state.adaptive is None:
            return state
        costs, fills = (jnp.array(x) for x in self.engine.call_costs(width))
        return dataclasses.replace(state, adaptive=dataclasses.replace(
            state.adaptive, costs=costs, fills=fills))

    # ---- one decode call ----------------------------------------------------------------------
    def decode(self, active: dict, logprobs: bool):
        """One call of `steps` steps over the `active` rows (slot -> request); -> the host's
        copy of `HOST_FIELDS` (and the adaptive state, and the logprob record when `logprobs`),
        every process's rows."""
        t0 = time.perf_counter()
        s, live = self.shape, sorted(active)
        # (a contiguous cache is per row: compacting it would copy every live row's KV)
        width = call_width(s.widths, len(live)) if s.paged and not s.static else s.slots
        spare = [i for i in range(s.slots) if i not in active]  # done rows: padding
        order = live + spare[: width - len(live)]
        sp = self.call_sampling([self.sp_rows[i] for i in order])
        whole = order == list(range(s.slots))
        self._call_rows(order, whole, active, live, sp)
        fields = {n: getattr(self.state, n) for n in HOST_FIELDS}
        if self.state.adaptive is not None:
            fields["adaptive"] = self.state.adaptive
        if self.state.logprobs is not None and logprobs:
            fields["logprobs"] = self.state.logprobs
        calib = getattr(self.state.drafter_state, "calibration", None)
        if calib is not None:  # a DSpark chain's confidence record (the served /metrics)
            fields["drafter_calibration"] = calib
        host = types.SimpleNamespace(**({"adaptive": None, "logprobs": None} | fetch(fields)))
        self.stats.device_calls += 1
        self.stats.decode_s += time.perf_counter() - t0
        return host

    def _call_rows(self, order, whole: bool, active, live, sp):
        """The decode program over rows `order` (the pool passed apart, with the tables as the
        host's pool holds them now), its rows put back into the batch state."""
        s = self.shape
        if s.paged:
            k, v = self.state.cache.k, self.state.cache.v
            self.set_cache(k=hole(k), v=hole(k))
        idx = jnp.asarray(order, jnp.int32)
        sub = self.state if whole else rows.take_rows(self.state, idx, self.axes)
        if s.paged:  # the tables as the pool holds them now (grown, released, preempted);
            # a slot still prefilling gets none: its stale row must not write into its pages
            cols = call_width(s.table_widths, max(self.pool.held(i) for i in live))
            table = self.pool.table(s.slots, s.max_pages, only=active)[order, :cols]
            sub = dataclasses.replace(sub, cache=dataclasses.replace(
                sub.cache, k=k, v=v, page_table=jnp.asarray(table)))
        sub = self.engine.decode_rows(self.spec, self.with_costs(sub, len(order)), sp, s.steps)
        view = sub.cache.page_table.shape[1] * self.pool.page_size if s.paged else s.capacity
        self.stats.calls_by_shape[(int(sub.tokens.shape[0]), int(view))] += 1
        if s.paged:  # the pool out, a full-width table placeholder in (the host's is truth)
            k, v = sub.cache.k, sub.cache.v
            sub = dataclasses.replace(sub, cache=dataclasses.replace(
                sub.cache, k=hole(k), v=hole(k),
                page_table=jnp.zeros((len(order), s.max_pages), jnp.int32)))
        self.state = sub if whole else rows.put_rows(self.state, sub, idx, self.axes)
        if s.paged:
            self.set_cache(k=k, v=v)

    # ---- rows in and out ----------------------------------------------------------------------
    def set_cache(self, **fields) -> None:
        if self.state is None:  # a chunk written before any row: the pool kept for the next
            self.early_pool = (fields["k"], fields["v"])
            return
        self.state = dataclasses.replace(
            self.state, cache=dataclasses.replace(self.state.cache, **fields))

    def splice_row(self, row, slot: int) -> None:
        """A one-row prefill's state into `slot` (the batch state built from it the first time);
        a paged row's pool becomes the batch's pool."""
        if self.state is None:
            self.state = rows.tile_rows(row, self.shape.slots, self.axes)
            if self.shape.paged:  # the tiled state shares the row's pool: not donated with it
                self.set_cache(k=hole(row.cache.k), v=hole(row.cache.k))
        self.state = rows.insert_row(self.state, row, jnp.int32(slot), self.axes)
        if self.shape.paged:  # the pool the prefill wrote (insert_row kept the placeholder)
            self.set_cache(k=row.cache.k, v=row.cache.v)

    def splice_rows(self, group, slots) -> None:
        """A several-row prefill's state into `slots` (its written pool kept apart, so the
        splice does not copy it)."""
        if self.shape.paged:
            k, v = group.cache.k, group.cache.v
            group = dataclasses.replace(group, cache=dataclasses.replace(
                group.cache, k=hole(k), v=hole(k)))
        if self.state is None:
            first = rows.take_rows(group, jnp.zeros((1,), jnp.int32), self.axes)
            self.state = rows.tile_rows(first, self.shape.slots, self.axes)
        self.state = rows.insert_rows(self.state, group, jnp.asarray(slots, jnp.int32),
                                      self.axes)
        if self.shape.paged:
            self.set_cache(k=k, v=v)

    def free_row(self, slot: int) -> None:
        """`slot`'s row released: greedy padding from now on."""
        self.sp_rows[slot] = GREEDY
        free = np.zeros((self.shape.slots,), bool)
        free[slot] = True
        self.state = rows.release_rows(self.state, jnp.asarray(free))

    def take_pool_rows(self, slots, starts) -> paged_attention.PagedKVCache:
        """The shared pool (taken out of the batch state, which holds zero-size placeholders
        until the prefill's caller puts the written pool back) with rows `slots`' page tables,
        for a prefill writing each from its `starts` on (its length); never below a row's named
        pages, whose content other rows read."""
        for slot, start in zip(slots, starts):
            if start < self.pool.frozen(slot):
                raise RuntimeError(f"a prefill of row {slot} from {start} would write into its "
                                   f"shared pages (below {self.pool.frozen(slot)})")
        if self.state is None and self.early_pool is not None:  # earlier chunks' pool
            (k, v), self.early_pool = self.early_pool, None
        elif self.state is None:
            empty = self.engine.empty_cache(self.spec.target, 1, self.shape.capacity)
            k, v = empty.k, empty.v
        else:
            k, v = self.state.cache.k, self.state.cache.v
            self.set_cache(k=hole(k), v=hole(k))
        table = self.pool.table(self.shape.slots, self.shape.max_pages)[list(slots)]
        return paged_attention.PagedKVCache(k, v, jnp.asarray(table),
                                            jnp.asarray(starts, jnp.int32))

    def pool_deleted(self) -> bool:
        """Whether the page pool went with a failed call (donated and deleted)."""
        return any(x.is_deleted() for x in jax.tree.leaves((self.state.cache.k,
                                                             self.state.cache.v)))

    @property
    def pool_written(self) -> bool:
        """Whether a page pool holds written prompts (the batch state's, or the one a first
        prompt's chunks went into before it): where prefix hits can come from."""
        return self.state is not None or self.early_pool is not None

    def grammar_rows(self, regexes, slots, live):
        """The Grammar a prefill of rows `slots` takes (None: structured output off); a
        constraint new to the table is added, and the batch state given the table."""
        if self.grammars is None:
            return None
        delta = self.grammars.admit(regexes, list(slots), set(live) - set(slots))
        if self.state is not None:
            self.state = self.grammars.into_state(self.state, delta)
        return self.grammars.rows(regexes)

    def host_lengths(self) -> np.ndarray:
        return np.asarray(fetch(self.state.lengths))  # several processes: every one's rows

    # ---- what the state holds -----------------------------------------------------------------
    @property
    def kv_layout(self) -> str:
        """The target cache the device program holds: "paged" (a page pool and tables) or
        "contiguous" (max_context slots per row); read from the state, not from a setting."""
        if self.state is None:
            return "none yet"
        paged = isinstance(self.state.cache, paged_attention.PagedKVCache)
        return "paged" if paged else "contiguous"

    def kv_bytes(self) -> dict[str, int]:
        """Device bytes of the target KV cache: the whole pool and one page of it."""
        if self.state is None:
            return {}
        cache = self.state.cache
        total = sum(x.nbytes for x in (*jax.tree.leaves(cache.k), *jax.tree.leaves(cache.v)))
        per = (self.pool.num_pages if self.shape.paged
               else self.shape.slots * self.shape.max_pages)
        return {"kv_cache_bytes": total, "kv_page_bytes": total // per}
