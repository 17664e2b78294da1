"""A target whose KV cache is paged (`models.paged_attention`): the serving scheduler's cache.

`PagedTarget(inner, num_pages, page_size)` is a `models.base.Target` wrapping any target whose
own cache is a per-layer `jaxspec.models.cache.KVCache` (Llama and Gemma in the unrolled and packed
layouts). Its cache is one page pool per layer shared by the batch's rows plus a page table per
row, so the speculative loop (`speculate.prefill` / `decode`) runs on it unchanged:

  forward     the inner target's forward with write_cache=False over a cache whose layers
              are the page pools and the table (`models.paged_layer.PagedLayer`): each layer's
              attention reads its pool through the table (a bounded XLA loop over the pages in
              use on CPU, JAX's paged kernels on TPU/GPU; no contiguous view is gathered;
              read="view" keeps the gather, for comparison), then the window's k/v written
              in place through the page table where write_cache=True;
  commit_window  the accepted path's k/v written through the page table.

num_pages None: a standalone cache (init_cache gives each row its own MP pages, as many as the
capacity needs). With num_pages the pool is fixed and the table starts unallocated: the
scheduler (`serving.scheduler`) fills it from `serving.pages.PagePool` before every device call.
The optional traits are the inner target's, except `prefix` and `cache_axes` (a layer-skip
drafter's prefix cache is not provided: refused in one line; on a mesh the pool is sharded by
`sharding.paged_cache_shardings`, not by the inner cache's axes).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.models.cache import KVCache
from jaxspec.errors import JaxspecError
from jaxspec.models import base
from jaxspec.models import paged_attention as pa
from jaxspec.models import paged_layer
from jaxspec.serving import paged_features, paged_hybrid
from jaxspec.serving.pages import pages_for

_DELEGATED = tuple(n for n in base.TRAIT_NAMES if n not in ("prefix", "cache_axes"))


def pageable(shape: Any) -> bool:
    """Whether a target's cache of this shape (`Engine.cache_shape`) is a per-layer KVCache or
    a hybrid target's per-layer cache (what PagedTarget pages)."""
    return (isinstance(shape, KVCache) and isinstance(shape.k, tuple)) or \
        paged_hybrid.is_hybrid(shape)


@dataclasses.dataclass(frozen=True)
class PagedTarget:
    inner: Any  # a base.Target with a per-layer KVCache
    page_size: int = 16
    num_pages: int | None = None  # None: each row its own pages (a standalone cache)
    read: str = "pages"  # "pages": attention reads the pool through the table; "view": gathered
    features: tuple[int, ...] = ()  # target taps kept per slot (`serving.paged_features`)

    def __getattr__(self, name):  # the inner target's optional traits and plain attributes
        if name == "forward_prompt" and self.hybrid:  # the padding keeps no linear state
            return self._forward_prompt
        if name in _DELEGATED or name in ("name", "vocab_size", "hidden_size", "num_layers",
                                          "max_position_embeddings", "dtype", "logits"):
            return getattr(self.inner, name)
        raise AttributeError(name)

    @functools.cached_property
    def hybrid(self) -> bool:
        """Whether the inner target is hybrid (linear layers' rings beside the pages:
        `serving.paged_hybrid`). A cache whose shape needs the params (a layout chosen by
        them: Llama's stacked or not) is a KV cache."""
        try:
            return paged_hybrid.is_hybrid(self._one_row())
        except (TypeError, KeyError, AttributeError):
            return False

    def _one_row(self, params: Any = None):
        """The shapes of the inner target's one-row cache of one page (nothing allocated)."""
        return jax.eval_shape(lambda: self.inner.init_cache(params, 1, self.page_size))

    def init_cache(self, params: Any, batch: int, capacity: int) -> pa.PagedKVCache:
        cache = self._init_pools(params, batch, capacity)
        if not self.features:
            return cache
        return paged_features.attach(cache, paged_features.init_pool(
            cache.num_pages, self.page_size, len(self.features), self.inner.hidden_size,
            base.compute_dtype(self.inner)))

    def _init_pools(self, params: Any, batch: int, capacity: int) -> pa.PagedKVCache:
        one = self.inner.init_cache(params, 1, self.page_size)  # shapes and dtype (DCE'd)
        per_row = pages_for(capacity, self.page_size)
        if paged_hybrid.is_hybrid(one) and self.read == "pages":
            pages = batch * per_row if self.num_pages is None else self.num_pages
            return paged_hybrid.init_cache(one, batch, pages, self.page_size, per_row,
                                           identity=self.num_pages is None)
        if not isinstance(one, KVCache) or not isinstance(one.k, tuple):
            raise JaxspecError(
                f"a paged KV cache needs a target with a per-layer cache; "
                f"{base.describe(self.inner)} in this layout has none: use the unrolled layout"
            )
        _, kv, _, h = one.k[0].shape
        per_row = pages_for(capacity, self.page_size)
        pages = batch * per_row if self.num_pages is None else self.num_pages
        return pa.init_paged_cache(len(one.k), batch, pages, self.page_size, per_row, kv, h,
                                   one.k[0].dtype, identity=self.num_pages is None)

    def layers(self, cache: pa.PagedKVCache) -> KVCache:
        """What the inner forward reads: per layer the pool and the table (`read="pages"`,
        `models.paged_layer`: no view is built), or the gathered contiguous view (`"view"`)."""
        if self.read == "view":
            return pa.view(cache)
        if self.read != "pages":
            raise ValueError(f"PagedTarget(read={self.read!r}): use 'pages' or 'view'")
        k = tuple(paged_layer.PagedLayer(x, cache.page_table) for x in cache.k)
        v = tuple(paged_layer.PagedLayer(x, cache.page_table) for x in cache.v)
        return KVCache(k=k, v=v, lengths=cache.lengths)

    def forward(self, params, tokens, cache: pa.PagedKVCache, *, positions=None,
                window_mask=None, write_cache=True, taps=()) -> base.TargetOutput:
        return self._run(params, tokens, cache, positions=positions, window_mask=window_mask,
                         write_cache=write_cache, taps=tuple(taps))

    def _run(self, params, tokens, cache, *, positions=None, window_mask=None, write_cache=True,
             taps=(), count=None) -> base.TargetOutput:
        """The forward over the pools; with `features`, a forward that writes the cache also
        keeps the tapped features of every position it writes (`serving.paged_features`)."""
        if not self.features:
            return self._forward_pools(params, tokens, cache, positions, window_mask,
                                       write_cache, taps, count)
        cache, pool = paged_features.detach(cache)
        keep = write_cache and taps in ((), self.features)
        out = self._forward_pools(params, tokens, cache, positions, window_mask, write_cache,
                                  self.features if keep else taps, count)
        if keep:
            at = cache.positions(tokens.shape[1]) if positions is None else positions
            pool = paged_features.write(pool, out.taps, cache.page_table, at)
        return base.TargetOutput(out.hidden, out.taps if taps else None, out.window_kv,
                                 paged_features.attach(out.cache, pool))

    def _forward_pools(self, params, tokens, cache, positions, window_mask, write_cache, taps,
                       count) -> base.TargetOutput:
        if self.hybrid:
            return self._forward_hybrid(params, tokens, cache, positions=positions,
                                        window_mask=window_mask, write_cache=write_cache,
                                        taps=taps, count=count)
        if positions is None:
            positions = cache.positions(tokens.shape[1])
        if write_cache and self.read == "pages":  # each layer writes its pool, then reads it
            out = self.inner.forward(params, tokens, self.layers(cache), positions=positions,
                                     window_mask=window_mask, write_cache=True, taps=taps)
            k = tuple(layer.pages for layer in out.cache.k)
            v = tuple(layer.pages for layer in out.cache.v)
            return base.TargetOutput(out.hidden, out.taps, None,
                                     dataclasses.replace(cache, k=k, v=v))
        out = self.inner.forward(params, tokens, self.layers(cache), positions=positions,
                                 window_mask=window_mask, write_cache=False, taps=taps)
        if not write_cache:
            return base.TargetOutput(out.hidden, out.taps, out.window_kv, cache)
        cache = pa.write_window(cache, out.window_kv, positions)
        return base.TargetOutput(out.hidden, out.taps, None, cache)

    def _forward_hybrid(self, params, tokens, cache, *, positions=None, window_mask=None,
                        write_cache=True, taps=(), count=None) -> base.TargetOutput:
        out, cache = paged_hybrid.forward(self.inner, params, tokens, cache,
                                          self._one_row(params), positions=positions,
                                          window_mask=window_mask, write_cache=write_cache,
                                          taps=taps, count=count)
        return base.TargetOutput(out.hidden, out.taps, out.window_kv, cache)

    def _forward_prompt(self, params, tokens, cache, prompt_lengths, *, taps=()):
        """A right-padded prompt (prompt_lengths int32[B] real tokens from each row's length)."""
        return self._run(params, tokens, cache, taps=tuple(taps), count=prompt_lengths)

    def commit_window(self, cache: pa.PagedKVCache, window_kv, path, positions):
        """The path's window k/v (path int32[B, P] along the window axis) at positions [B, P]
        (a hybrid target: and its states into the rows' rings)."""
        if self.features:
            cache, pool = paged_features.detach(cache)
            bare = dataclasses.replace(self, features=())
            cache = bare.commit_window(cache, window_kv, path, positions)
            return paged_features.attach(cache, pool)
        if self.hybrid:
            return paged_hybrid.commit_window(self.inner, cache, window_kv, path, positions)

        def gather(w):  # [B, T, K, H] -> [B, P, K, H]
            return jnp.take_along_axis(w, path[:, :, None, None], axis=1)

        return pa.write_window(cache, jax.tree.map(gather, window_kv), positions)


@dataclasses.dataclass(frozen=True)
class TailTarget:
    """A prompt's tail over pages that already hold its head: a PagedTarget whose forward over
    a prompt [B, W] runs only the `chunk` tokens from each row's `cache.lengths` on (the tokens
    before are in its pages: earlier chunks of chunked prefill, or pages shared from the prefix
    cache) and returns hidden states at their prompt positions (zeros elsewhere), so
    `speculate.prefill` samples the first token, sets up the drafter and advances lengths as
    for a whole prompt. The tail starts exactly at the length, never before it: no position
    below it is recomputed or written (a shared page is never written). Tail slots past the
    prompt are padding, written into the row's own pages past its length or dropped past its
    table (never read). Taps only where the PagedTarget pages them (`features`): the whole
    prompt's, read back from the feature pool (the positions before the tail ran earlier).
    A hybrid target's rows start from the state snapshot at their length (`paged_hybrid`)."""

    paged: PagedTarget
    chunk: int

    def __getattr__(self, name):
        if name in ("paged", "chunk") or name.startswith("__"):
            raise AttributeError(name)
        if name == "forward_prompt" and self.paged.hybrid:  # the tail's padding keeps no state
            return self._forward_prompt
        return getattr(self.paged, name)

    def forward(self, params, tokens, cache: pa.PagedKVCache, *, positions=None,
                window_mask=None, write_cache=True, taps=()) -> base.TargetOutput:
        if positions is not None or window_mask is not None:
            raise ValueError("TailTarget.forward runs a prompt's tail only (no positions)")
        return self._tail(params, tokens, cache, write_cache, tuple(taps))

    def _forward_prompt(self, params, tokens, cache, prompt_lengths, *, taps=()):
        return self._tail(params, tokens, cache, True, tuple(taps), prompt_lengths)

    def _tail(self, params, tokens, cache, write_cache, taps, prompt_lengths=None):
        """taps: the paged features' (read back for the whole prompt: the shared pages' and the
        tail's own), else none."""
        if taps and (taps != self.paged.features or not write_cache):
            raise ValueError(f"TailTarget: taps {taps} are not the paged features "
                             f"{self.paged.features}")
        b, w = tokens.shape
        start = cache.lengths  # [B]
        padded = jnp.pad(tokens, [(0, 0), (0, self.chunk)])  # [B, W + chunk]: no slice clamps
        tail = jax.vmap(lambda t, s: jax.lax.dynamic_slice_in_dim(t, s, self.chunk))(padded, start)
        count = None if prompt_lengths is None else prompt_lengths - start  # hybrid: the states
        out = self.paged._run(params, tail, cache, write_cache=write_cache, count=count)
        hidden = jnp.zeros((b, w + self.chunk) + out.hidden.shape[-1:], out.hidden.dtype)
        hidden = jax.vmap(jax.lax.dynamic_update_slice_in_dim, in_axes=(0, 0, 0, None))(
            hidden, out.hidden, start, 0)
        feats = None
        if taps:  # [nT, B, W, D]
            feats = paged_features.read(out.cache.k[-1], out.cache.page_table, w)
        return base.TargetOutput(hidden[:, :w], feats, out.window_kv, out.cache)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def write_chunk(target: PagedTarget, params, tokens: jax.Array, cache: pa.PagedKVCache):
    """tokens [B, C] run at cache.lengths.. and their k/v written through the page table (the
    pool donated: updated in place); lengths not advanced. A prompt chunk of chunked prefill."""
    return target.forward(kernels.for_prompts(params), tokens, cache).cache


def choose_attention(backend: str, num_queries: int, dtype="bfloat16", sliding: bool = False) -> str:
    """Which committed-part attention a serving program over `num_queries` queries per row
    compiles on `backend` ("tpu", "gpu"/"cuda", "cpu") for a pool of `dtype`
    (`models.paged_layer`): "pallas_tpu" (JAX's paged flash kernel) and "pallas_gpu" (JAX's
    Triton paged kernel) for bfloat16 pools, any window (decode, chain and tree verify, prompt
    chunks: the window itself is a dense part merged by log-sum-exp); "xla" (the bounded loop
    over the pages in use) on CPU, for float32 pools and for sliding-window layers."""
    del num_queries  # every window length takes the same path
    backend = "gpu" if backend == "cuda" else backend
    return "xla" if sliding else paged_layer.resolve("auto", dtype, backend)
