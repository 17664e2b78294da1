"""The scheduler's device call: one run of the speculative loop (`Engine.decode_rows`) over the
live rows, compacted (`rows.take_rows`) into the narrowest compiled width that holds them, with
a page table as wide as the longest live row's pages, then written back (`rows.put_rows`); the
page pool is passed on its own (donated) and never copied. `compile_programs` compiles every
such call ahead (a server's warm-up).

A mixin of `scheduler.Scheduler` (its rows, pool and device state); the loop calls
`_decode_call` once a round."""

from __future__ import annotations

import dataclasses
import time
import types

import jax
import jax.numpy as jnp

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


class DeviceCall:
    def compile_programs(self) -> int:
        """Compile ahead every decode call this scheduler can make (`decode_programs`), as a
        server's warm-up (like a GPU server capturing its graphs): a call of a shape not seen
        yet otherwise compiles while requests wait. Nothing runs; the state is untouched.
        -> programs compiled (already compiled ones come from the compilation cache)."""
        rows_ = self.decode_programs()
        for row in rows_:
            fn, args, kwargs = row["program"]
            fn.lower(*args, **kwargs).compile()
        return len(rows_)

    def decode_programs(self) -> list[dict]:
        """Every decode call this scheduler can make: each call width with each page-table
        width (one width, every slot, for a contiguous cache). Each {"name": "decode", "rows",
        "table_pages" (None: contiguous), "program" ((jitted function, args, kwargs))}."""
        out = []
        for width in self.widths if self.paged else (self.slots,):
            shape = jax.eval_shape(lambda w=width: self._row_state_shape(w))
            sp = SamplingParams.rows([GREEDY] * width)
            shape = self._with_costs(shape, width)
            for cols in self.table_widths if self.paged else (None,):
                if cols is not None:
                    table = jax.ShapeDtypeStruct((width, cols), jnp.int32)
                    shape = dataclasses.replace(shape, cache=dataclasses.replace(
                        shape.cache, page_table=table))
                out.append({"name": "decode", "rows": width, "table_pages": cols,
                            "program": self.engine.decode_program(self.spec, shape, sp,
                                                                  self.steps)})
        return out

    def _with_costs(self, state, width: int):
        """`state` with the controller's cost table for a `width`-row call (adaptive only)."""
        if state.adaptive is None:
            return state
        costs, fills = (jnp.array(x) for x in self.engine.call_costs(width))
        return dataclasses.replace(state, adaptive=dataclasses.replace(
            state.adaptive, costs=costs, fills=fills))

    def _decode_call(self) -> None:
        t0 = time.perf_counter()
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
        sub = self.engine.decode_rows(self.spec, self._with_costs(sub, width), sp, self.steps)
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
        fields = {n: getattr(self.state, n) for n in HOST_FIELDS}
        if self.state.adaptive is not None:
            fields["adaptive"] = self.state.adaptive
        if self.state.logprobs is not None and any(  # only when a live request asked for them
                r.sampling.logprobs is not None for r in self.active.values()):
            fields["logprobs"] = self.state.logprobs
        host = types.SimpleNamespace(
            **({"adaptive": None, "logprobs": None} | fetch(fields)))  # every process's rows
        now = time.perf_counter()
        self.stats.device_calls += 1
        self.stats.decode_s += now - t0
        self._stream_rows(host, now)

    def _set_cache(self, **fields) -> None:
        self.state = dataclasses.replace(
            self.state, cache=dataclasses.replace(self.state.cache, **fields))

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
        return {"kv_cache_bytes": total, "kv_page_bytes": total // self.pool.num_pages
                if self.paged else total // (self.slots * self.max_pages)}
