"""What every decoder family shares (Llama, Gemma, Phi-3 and the drafters built of their layers):
the layer config, `linear` (plain or CPU-kernel weights), cache writes, the CPU-kernel switches
and the target methods that read only the config. A family module (`models/llama.py`,
`models/gemma.py`) holds only what is its own.

Dimension letters: B batch, T query tokens, S cache slots, L layers, N query heads, K kv heads,
H head dim, D model dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.models import paged_layer
from jaxspec.models.cache import KVCache, cache_axes, init_cache

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderDims:
    """The sizes every family's config carries (`validate.decoder_dims` reads them from a
    checkpoint's config), grouped attention checked."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(DecoderDims):
    """Architecture of a Llama-family decoder layer stack (also the layer config other families
    hand their drafters). Hashable: passed to jit as a static argument."""

    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "float32"  # compute dtype; params are cast to it at load time
    # sliding-window attention (Mistral, Phi-3, Qwen2 use_sliding_window): a query at q sees keys
    # in (q - sliding_window, q]; sliding_layers picks the layers that slide (None: all of them)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window, or None (full causal attention)."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[i]):
            return None
        return self.sliding_window

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


def stack_layers(params: Params) -> Params:
    """Per-layer tuple -> one dict of `[L, ...]` arrays (the lax.scan layout, usual on TPU)."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    return params | {"layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}



def param_tree_axes(layer_axes: dict, cfg: DecoderDims, *, stacked: bool, tied: bool) -> Params:
    """A family's logical axis names for every param leaf, from one layer's: the embedding, the
    final norm, the layers (stacked: a leading "layers" axis; else one dict per layer) and the
    LM head where it is not tied to the embedding."""
    axes: Params = {"embed": ("vocab", "embed"), "final_norm": ("embed",)}
    if stacked:
        axes["layers"] = {k: ("layers", *v) for k, v in layer_axes.items()}
    else:
        axes["layers"] = tuple(dict(layer_axes) for _ in range(cfg.num_layers))
    if not tied:
        axes["lm_head"] = ("vocab", "embed")
    return axes

def linear(x: jax.Array, w) -> jax.Array:
    """x: [..., in] @ w: [out, in] -> [..., out] in x's dtype, accumulated in float32. `w` may be
    a CPU-kernel `PackedWeight`."""
    if isinstance(w, kernels.PackedWeight):
        return kernels.panel_matmul(x, w).astype(x.dtype)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if x.dtype == jnp.float32:
        return jax.lax.dot_general(x, w, dims)
    # bf16/f16: products and sums in float32, rounded once. XLA:GPU turns a one-token (M = 1)
    # projection into multiply + reduce and, asked for a bf16 result, rounds each product to bf16
    # first, while a window's GEMM accumulates exact products in f32: the two programs would round
    # differently, and greedy speculation would drift from greedy plain decoding.
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


def write_kv(cache_l: jax.Array, new: jax.Array, positions: jax.Array, layer=None,
             contiguous: bool = False) -> jax.Array:
    """cache_l: [B, K, S, H] <- new: [B, T, K, H] at positions [B, T] (past the end: dropped).
    With `layer` (an int32 scalar), cache_l is a stack [L, B, K, S, H] and layer `layer` is written.

    contiguous: positions[b] are positions[b, 0] + arange(T) (a writing forward's window): at
    batch 1 on TPU / GPU the write is one dynamic_update_slice (`_write_one`; one token always).

    Per-layer caches: a scatter vmapped over (B, K), each [S, H] block getting its T rows. XLA
    updates it in place, and with the cache sharded over batch and kv heads every device writes its
    own block with no collective (flattening B*K into one scatter dim made GSPMD all-gather the
    cache every step). Stacks (`layer` given): one scatter into [L, B, K, S, H] itself at
    (layer, iota rows, iota heads, positions): XLA updates it in place inside the layer scan, and
    GSPMD reads the iota indices as parallel dims, so a stack sharded by rows and kv heads is
    written per device (an [L*B*K, S, H] view merged the sharded dims: the whole stack was
    gathered every layer; a vmapped scatter re-laid the stack out on XLA:CPU, copying it).
    """
    if isinstance(cache_l, paged_layer.PagedLayer):  # a page pool: written through its table
        return cache_l.write(new, positions)
    if layer is None:
        one = lambda c, n, p: c.at[p].set(n, mode="drop")  # noqa: E731  c [S, H], n [T, H], p [T]
        scatter = lambda c, n, p: jax.vmap(jax.vmap(one, in_axes=(0, 1, None)))(  # noqa: E731
            c, n.astype(c.dtype), p)
        if (contiguous and 1 < new.shape[0] <= ROW_WRITES_MAX and new.shape[1] > 0
                and not _rows_sharded()):
            return jax.lax.platform_dependent(cache_l, new, positions, tpu=_write_rows,
                                              default=scatter)  # TPU: row by row, in place
        if new.shape[0] != 1 or new.shape[1] == 0 or (new.shape[1] > 1 and not contiguous):
            return scatter(cache_l, new, positions)
        return jax.lax.platform_dependent(cache_l, new, positions, cpu=scatter, default=_write_one)
    b, kv = cache_l.shape[1:3]
    rows = jnp.arange(b)[:, None, None]  # [B, 1, 1]
    heads = jnp.arange(kv)[None, :, None]  # [1, K, 1]
    updates = jnp.swapaxes(new, 1, 2).astype(cache_l.dtype)  # [B, K, T, H]
    return cache_l.at[layer, rows, heads, positions[:, None, :]].set(updates, mode="drop")


def _write_one(cache_l: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """One row's window of T consecutive slots on TPU / GPU: cache_l [1, K, S, H] <- new
    [1, T, K, H] at slots positions[0, 0] .. + T - 1 as one dynamic_update_slice. The scatter's
    drop-past-the-end cost XLA:GPU two extra kernels a layer at batch 1 (a read of the old rows
    and a select) and kept the RoPE out of the write's fusion; a window past the end is shifted
    back to end at the last slot instead, which the engine's capacity (prompt + max_new + the
    window) never reaches."""
    update = jnp.swapaxes(new, 1, 2).astype(cache_l.dtype)  # [1, K, T, H]
    return jax.lax.dynamic_update_slice(cache_l, update, (0, 0, positions[0, 0], 0))


def _rows_sharded() -> bool:
    """Whether the program being traced splits batch rows over devices (a "data" mesh axis):
    there the per-row writes would address rows other devices hold, so the scatter stays."""
    from jaxspec.models import attention_kernels  # the kernel mesh the engine traces under

    mesh = attention_kernels.trace_mesh()
    return mesh is not None and dict(mesh.shape).get("data", 1) > 1


# Batch rows a TPU window write takes one by one (`_write_rows`, unrolled): platform_dependent
# traces that branch on every platform, so CPU programs pay its tracing too (B writes a layer);
# past this the scatter. A fori_loop over the rows fails XLA:TPU's partitioner on a model mesh.
ROW_WRITES_MAX = 64


def _write_rows(cache_l: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Each row's window of T consecutive slots on a TPU, one dynamic_update_slice a row (as
    `_write_one`). At batch > 1 the vmapped scatter made XLA:TPU lay the written cache out with
    the kv heads second-minor ({3,1,2,0}, tiles of 2 x 128) while the Pallas kernel reads slots x
    head dim tiles ({3,2,1,0}, 8 x 128): every layer copied its whole k and v caches between the
    two layouts every step (v5e 1x4, 8B, batch 32: a step moved 2.2x its share). A window past
    the end is shifted back to end at the last slot, as in `_write_one` (the engine's capacity
    holds prompt + max_new + the window); a select keeping the old rows there brought the
    copies back."""
    update = jnp.swapaxes(new, 1, 2).astype(cache_l.dtype)  # [B, K, T, H]
    for b in range(cache_l.shape[0]):
        cache_l = jax.lax.dynamic_update_slice(cache_l, update[b : b + 1],
                                               (b, 0, positions[b, 0], 0))
    return cache_l


# Decode and verify windows up to the largest γ + 1 (and tree budgets); prompts go through XLA's
# GEMMs. The kernel computes each query row alone, so any window length gives the same rows.
KERNEL_ATTENTION_MAX_QUERIES = 64


def uses_cpu_kernels(params: Params) -> bool:
    """True for the packed layout (built only where the CPU kernels are available)."""
    layers = params["layers"]
    return isinstance(layers, tuple) and isinstance(layers[0].get("wqkv"), kernels.PackedWeight)


def attention_kernel_on(q: jax.Array) -> bool:
    """Whether a window of q's shape attends with kernels.prefix_attention (given CPU kernels)."""
    return (
        q.dtype == jnp.float32
        and q.shape[1] <= KERNEL_ATTENTION_MAX_QUERIES
        and os.environ.get("JAXSPEC_CPU_ATTENTION", "1").lower() not in ("0", "false", "no", "off")
    )


def write_window(cache: KVCache, window_kv, positions: jax.Array) -> KVCache:
    """Write `forward(..., write_cache=False)`'s window k/v into the cache at positions [B, T]."""
    k_win, v_win = window_kv
    if isinstance(cache.k, tuple):
        k = tuple(write_kv(c, w, positions) for c, w in zip(cache.k, k_win))
        v = tuple(write_kv(c, w, positions) for c, w in zip(cache.v, v_win))
    else:  # one in-place scatter into the stack itself, batched over (layer, B, K): no view of
        # it ([L*B, K, S, H], as before, made XLA:CPU copy the stack twice a step at batch 1)
        n, num_layers, slots = k_win.shape[0], cache.k.shape[0], cache.k.shape[-2]
        # n <= L written layers ([n, B, T, K, H]); the others get no entry (dropped positions)
        pos = jnp.where(jnp.arange(num_layers)[:, None, None] < n, positions[None], slots)
        pad = [(0, num_layers - n)] + [(0, 0)] * (k_win.ndim - 1)
        one = lambda c, w, p: c.at[p].set(w, mode="drop")  # noqa: E731  [S, H] <- [T, H] at [T]
        per_row = jax.vmap(jax.vmap(one, in_axes=(0, 1, None)))  # over (B, K)
        write = lambda c, w: jax.vmap(per_row)(c, jnp.pad(w.astype(c.dtype), pad), pos)  # noqa: E731
        k, v = write(cache.k, k_win), write(cache.v, v_win)
    return dataclasses.replace(cache, k=k, v=v)


class ForwardOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] after the final norm (feed to `lm_head`)
    cache: KVCache  # k/v written at lengths..lengths+T-1; lengths NOT advanced (see KVCache.commit)
    layer_hidden: jax.Array | None  # [len(hidden_layers), B, T, D], HF `hidden_states` indexing
    # write_cache=False: `cache` is the input cache, unwritten, and this holds the window's k/v
    # (per-layer tuples of [B, T, K, H], or [L, B, T, K, H] stacked) for `write_window`.
    window_kv: tuple | None = None


class ConfigTarget:
    """The `models.base.Target` methods that read only `self.cfg` (sizes, the cache, the window
    commit, axes, layout), shared by the Llama and Gemma targets."""

    cfg: Any

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def max_position_embeddings(self) -> int:
        return self.cfg.max_position_embeddings

    @property
    def dtype(self) -> str:
        return self.cfg.dtype

    def init_cache(self, params: Params, batch: int, capacity: int) -> KVCache:
        """An empty cache in the params' layout (a stack for stacked params) and compute dtype;
        slot s holds position s (sliding layers mask, never evict)."""
        c = self.cfg
        stacked = isinstance(params["layers"], dict)
        return init_cache(
            c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim, c.compute_dtype, stacked
        )

    def commit_window(self, cache: KVCache, window_kv, path, positions) -> KVCache:
        """The path's window k/v (path int32[B, P] along the window axis) at positions [B, P]."""
        def gather(w):  # [..., B, T, K, H] -> [..., B, P, K, H]
            idx = path.reshape((1,) * (w.ndim - 4) + path.shape + (1, 1))
            return jnp.take_along_axis(w, idx, axis=w.ndim - 3)

        return write_window(cache, jax.tree.map(gather, window_kv), positions)

    # optional traits
    def embedding_table(self, params: Params) -> jax.Array:
        return params["embed"]

    def head_table(self, params: Params) -> jax.Array:
        """LM-head rows (tied: the embedding), plain arrays."""
        w = params.get("lm_head", params["embed"])
        return kernels.unpack(w) if isinstance(w, kernels.PackedWeight) else w

    def head_weight(self, params: Params):
        """The LM head as stored ([V, D], or PackedWeight in the packed layout), for `linear`:
        unpacking it inside a decode step copied all V x D weights every step."""
        return params.get("lm_head", params["embed"])

    def cache_axes(self, cache: KVCache) -> KVCache:
        return cache_axes(self.cfg.num_layers, stacked=not isinstance(cache.k, tuple))

    def head_counts(self) -> dict[str, int]:
        return {"heads": self.cfg.num_heads, "kv_heads": self.cfg.num_kv_heads}

    def layout(self, params: Params) -> str:
        if isinstance(params["layers"], dict):
            return "stacked"
        if uses_cpu_kernels(params):
            return "packed"
        layers = params["layers"]
        return "fused" if layers and "wqkv" in layers[0] else "unrolled"  # models/fused_layout.py

    def uses_cpu_kernels(self, params: Params) -> bool:
        return uses_cpu_kernels(params)


def query_positions(cache: KVCache, t: int, positions, window_mask, write_cache: bool) -> jax.Array:
    """A forward's query positions int32[B, T] (default the cache's next T), refusing a window
    mask with a cache write (tree nodes share positions: write the kept entries after)."""
    if window_mask is not None and write_cache:
        raise ValueError("forward(window_mask=...) needs write_cache=False (write the kept entries after)")
    return cache.positions(t) if positions is None else positions


def scan_layers(body, x, k_all, v_all, num_layers: int):
    """The stacked layout's layer loop: `body((x, k_all, v_all), i)` -> (carry, (layer x or None,
    window k/v or None)) scanned over layers 0..num_layers-1. Returns (x, k_all, v_all, per-layer x
    [L, B, T, D] or None, window k/v [L, B, T, K, H] or None)."""
    steps = jnp.arange(num_layers, dtype=jnp.int32)
    (x, k_all, v_all), (per_layer, window_kv) = jax.lax.scan(body, (x, k_all, v_all), steps)
    return x, k_all, v_all, per_layer, window_kv


def run_layers(x, cache: KVCache, layers, *, num_layers: int, hidden_layers: tuple[int, ...],
               write_cache: bool, layer, stacked, final_norm) -> ForwardOutput:
    """The layer loop every family's forward shares, over either layout, from the embedded
    x [B, T, D] to the `ForwardOutput`:

      per-layer params (a tuple) and cache: `layer(i, lp, x, k_l, v_l)` -> (x, k_l, v_l) writing,
        else (x, window k, window v) [B, T, K, H];
      stacked params ([L, ...]) and cache: `stacked(x, k_all, v_all, collect)` -> (x, k_all, v_all,
        per-layer x [L, B, T, D] if collect, window k/v [L, B, T, K, H] if not write_cache);

    then `final_norm(x)`. `hidden_layers` picks HF-style hidden states (0 = embeddings, i = layer
    i's output, num_layers = after the final norm)."""
    collected = {0: x}
    if isinstance(layers, dict):  # stacked: scan over layers and the [L, ...] cache together
        if isinstance(cache.k, tuple):
            raise ValueError("stacked params need a stacked cache: init_cache(..., stacked=True)")
        if jax.tree.leaves(layers)[0].shape[0] < num_layers:
            raise ValueError(f"stacked params hold fewer than cfg.num_layers={num_layers} layers")
        collect = any(0 < i < num_layers for i in hidden_layers)
        x, k_new, v_new, per_layer, window_kv = stacked(x, cache.k, cache.v, collect)
        if not write_cache:
            k_new, v_new = window_kv  # [L, B, T, K, H]
        for i in hidden_layers:
            if 0 < i < num_layers:
                collected[i] = per_layer[i - 1]
    else:
        if not isinstance(cache.k, tuple):
            raise ValueError("per-layer params need a per-layer cache: init_cache(..., stacked=False)")
        k_new, v_new = [], []
        for i, (lp, k_l, v_l) in enumerate(zip(layers[:num_layers], cache.k, cache.v)):
            x, k_l, v_l = layer(i, lp, x, k_l, v_l)
            k_new.append(k_l)
            v_new.append(v_l)
            collected[i + 1] = x
        k_new, v_new = tuple(k_new), tuple(v_new)
    x = final_norm(x)
    collected[num_layers] = x
    layer_hidden = jnp.stack([collected[i] for i in hidden_layers]) if hidden_layers else None
    if not write_cache:
        return ForwardOutput(x, cache, layer_hidden, (k_new, v_new))
    return ForwardOutput(x, dataclasses.replace(cache, k=k_new, v=v_new), layer_hidden)
