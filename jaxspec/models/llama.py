"""Llama-family decoder (Llama 2/3, Qwen2/3, Mistral, SmolLM) as pure functions over a param pytree.

Params (weights in torch `Linear` layout `[out, in]`, contracted on their last dim — the faster
layout for the small-M matmuls of decode and verify on XLA:CPU, see docs/architecture.md):

    {"embed": [V, D],
     "layers": tuple of L dicts (unrolled)  or  one dict with a leading [L] axis (lax.scan):
        {"attn_norm": [D], "wq": [N*H, D], "wk": [K*H, D], "wv": [K*H, D], "wo": [D, N*H],
         "bq"/"bk"/"bv": [N*H]/[K*H]/[K*H] (attention_bias), "q_norm"/"k_norm": [H] (qk_norm),
         "mlp_norm": [D], "w_gate": [F, D], "w_up": [F, D], "w_down": [D, F]},
     "final_norm": [D],
     "lm_head": [V, D] (absent when tie_word_embeddings)}

The "packed" load layout (float32 on one CPU device) replaces the layer matmul weights by
`kernels.PackedWeight` panels for the CPU panel kernel, fused as "wqkv" ([wq; wk; wv]) and
"w_gate_up" ([w_gate; w_up]) plus "wo" and "w_down", and adds a packed "lm_head".

Dimension letters: B batch, T query tokens, S cache slots, L layers, N query heads, K kv heads,
G query heads per kv head, H head dim, D model dim, F mlp dim, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.models import attention, base, blocks, fused_layout, paged_layer, registry
from jaxspec.models.cache import KVCache
from jaxspec.models.decoder import (  # the shared pieces; llama.ModelConfig stays this family's name
    ConfigTarget,
    ForwardOutput,
    ModelConfig,
    attention_kernel_on,
    linear,
    param_tree_axes,
    query_positions,
    run_layers,
    scan_layers,
    stack_layers,
    write_kv,
)

Params = dict[str, Any]


def param_axes(cfg: ModelConfig, *, stacked: bool = False, fused: bool = False) -> Params:
    """Logical axis names for every param leaf, in the same pytree structure as the params
    (`fused`: the accelerator layout's fused projections, models/fused_layout.py)."""
    layer = {
        "attn_norm": ("embed",),
        "wq": ("heads", "embed"),
        "wk": ("kv_heads", "embed"),
        "wv": ("kv_heads", "embed"),
        "wo": ("embed", "heads"),
        "mlp_norm": ("embed",),
        "w_gate": ("mlp", "embed"),
        "w_up": ("mlp", "embed"),
        "w_down": ("embed", "mlp"),
    }
    if cfg.attention_bias:
        layer |= {"bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",)}
    if cfg.qk_norm:
        layer |= {"q_norm": ("head_dim",), "k_norm": ("head_dim",)}
    if fused:
        layer = fused_layout.layer_axes(layer)
    return param_tree_axes(layer, cfg, stacked=stacked, tied=cfg.tie_word_embeddings)


def param_shapes(cfg: ModelConfig) -> Params:
    """Shape of every leaf of unstacked params (used by random init and by loaders to check)."""
    d, h = cfg.hidden_size, cfg.head_dim
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    layer = {
        "attn_norm": (d,),
        "wq": (nh, d),
        "wk": (kh, d),
        "wv": (kh, d),
        "wo": (d, nh),
        "mlp_norm": (d,),
        "w_gate": (cfg.intermediate_size, d),
        "w_up": (cfg.intermediate_size, d),
        "w_down": (d, cfg.intermediate_size),
    }
    if cfg.attention_bias:
        layer |= {"bq": (nh,), "bk": (kh,), "bv": (kh,)}
    if cfg.qk_norm:
        layer |= {"q_norm": (h,), "k_norm": (h,)}
    shapes: Params = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "layers": tuple(dict(layer) for _ in range(cfg.num_layers)),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, d)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random params (tests, and initialising small draft models)."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
    keys = jax.random.split(key, len(leaves))
    out = []
    for shape, k in zip(leaves, keys):
        if len(shape) == 1:  # norms start at one, biases small
            out.append(jnp.ones(shape, cfg.compute_dtype))
        else:
            out.append((scale * jax.random.normal(k, shape)).astype(cfg.compute_dtype))
    return jax.tree.unflatten(treedef, out)


fixed_order_sum = blocks.fixed_order_sum  # a shape-independent sum over the last axis
rms_norm = blocks.rms_norm  # RMS norm in float32 (offset 0: Llama's weight)
apply_rope = blocks.apply_rope  # half-split (rotate_half) rotary embeddings, HF's convention


def rope_frequencies(cfg: ModelConfig) -> jax.Array:  # f32[H/2]
    """The rotary inverse frequencies of `cfg` (Llama 3.1's wavelength scaling if it has one)."""
    s = cfg.rope_scaling
    llama3 = None if s is None else (
        s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings
    )
    return blocks.rope_inv_freq(cfg.head_dim, cfg.rope_theta, llama3=llama3)


def qkv_splits(cfg: ModelConfig) -> tuple[int, int]:
    q = cfg.num_heads * cfg.head_dim
    return (q, q + cfg.num_kv_heads * cfg.head_dim)


def masked_attention(q, k, v, mask):
    """Attention under an arbitrary mask over the whole cache (drafter scratch trees, training):
    q: [B, T, N, H]; k, v: [B, K, S, H]; mask: bool[B, T, S] -> [B, T, N*H]. The target's forward
    attends through `jaxspec.models.attention.attend` (valid slots only) instead.

    Both products are batched over (B, K) with operands already in XLA's canonical dot order
    ([batch..., rows, contracted]), so no [S]-sized transpose is materialised.
    """
    b, t, n, h = q.shape
    kv = k.shape[1]
    g = n // kv
    q = q.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
    batch = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(q, k, (((3,), (3,)), batch), preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, g, t, -1) * (h**-0.5)  # [B, K, G, T, S]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv, g * t, -1)
    out = jax.lax.dot_general(weights, v, (((3,), (2,)), batch))  # [B, K, G*T, H]
    return out.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n * h)


def _kernel_attention(lp, q) -> bool:
    """The packed (CPU-kernel) layout attends with kernels.prefix_attention over short windows.
    JAXSPEC_CPU_ATTENTION=0 keeps XLA's attention (for A/B measurements)."""
    return isinstance(lp.get("wqkv"), kernels.PackedWeight) and attention_kernel_on(q)


def _qkv(cfg, lp, x, positions, inv_freq):
    """x: [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H] (normed, biased, rotated)."""
    b, t, _ = x.shape
    h = cfg.head_dim
    if fused_layout.is_fused_layer(lp) and not cfg.qk_norm:
        # the fused (accelerator) layout: the norm's scale after the projection, RoPE on q and k
        # heads in one pass over it (fused_layout.normed_linear, blocks.apply_rope_heads)
        qkv = fused_layout.normed_projection(x, lp["attn_norm"], lp["wqkv"], cfg.rms_norm_eps)
        if cfg.attention_bias:
            qkv = qkv + jnp.concatenate([lp["bq"], lp["bk"], lp["bv"]])
        n, kv = cfg.num_heads, cfg.num_kv_heads
        qkv = blocks.apply_rope_heads(qkv.reshape(b, t, n + 2 * kv, h), positions, inv_freq, n + kv)
        if b * t >= 16:  # written once: XLA:GPU otherwise re-sums the projection's split-K
            qkv = jax.lax.optimization_barrier(qkv)  # partials in each of q, k and v's readers
        return qkv[:, :, :n], qkv[:, :, n : n + kv], qkv[:, :, n + kv :]
    y = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in lp:  # packed layout: q, k and v projections fused into one weight
        q, k, v = jnp.split(linear(y, lp["wqkv"]), qkv_splits(cfg), axis=-1)
    else:
        q, k, v = linear(y, lp["wq"]), linear(y, lp["wk"]), linear(y, lp["wv"])
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(b, t, cfg.num_heads, h)
    k = k.reshape(b, t, cfg.num_kv_heads, h)
    v = v.reshape(b, t, cfg.num_kv_heads, h)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _out_and_mlp(cfg, lp, x, attn, mlp=None):
    """Attention output projection + residual, then the MLP block + residual. attn: [B, T, N*H].
    `mlp(lp, y)`: a family's own MLP block on the normed y [B, T, D] (None: the gated MLP; an
    MoE family passes its routed experts, `models/qwen3_moe.py`)."""
    if mlp is None and fused_layout.is_fused_layer(lp):  # the norm's scale after the projection
        x = fused_layout.residual_projection(attn, lp["wo"], x)  # one kernel each on a GPU at
        y = fused_layout.gated_mlp_input(x, lp["mlp_norm"], lp["w_gate_up"], cfg.rms_norm_eps)
        return fused_layout.residual_projection(y, lp["w_down"], x)  # one token (gemv_gpu)
    x = x + linear(attn, lp["wo"])
    y = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    if mlp is not None:
        return x + mlp(lp, y)
    if "w_gate_up" in lp:  # packed layout: gate and up fused
        gate, up = jnp.split(linear(y, lp["w_gate_up"]), 2, axis=-1)
    else:
        gate, up = linear(y, lp["w_gate"]), linear(y, lp["w_up"])
    y = jax.nn.silu(gate) * up
    return x + linear(y, lp["w_down"])


def _layer(cfg, lp, x, k_cache, v_cache, positions, mask, inv_freq, write=True, window_mask=None,
           window=None, mlp=None):
    """One decoder layer. Writes this step's k/v into its cache `[B, K, S, H]` at `positions` and
    returns (x, k_cache, v_cache); with write=False the cache is only read and the window's own
    k/v `[B, T, K, H]` come back instead of the caches, and window entry t attends window entries
    j with window_mask[b, t, j] (None: causal). Window entry 0 sits at the cache's length.
    `window`: this layer's sliding window (None: none); `mlp`: see `_out_and_mlp`."""
    b, t, _ = x.shape
    h = cfg.head_dim
    q, k, v = _qkv(cfg, lp, x, positions, inv_freq)
    k = k.astype(k_cache.dtype)
    v = v.astype(v_cache.dtype)
    lengths = positions[:, 0]
    if write:
        k_cache = write_kv(k_cache, k, positions, contiguous=True)
        v_cache = write_kv(v_cache, v, positions, contiguous=True)
    if isinstance(k_cache, paged_layer.PagedLayer):  # a paged pool, read through its table
        attn = paged_layer.attend(q, k_cache, v_cache, k, v, positions, scale=h**-0.5,
                                  window=window, window_mask=window_mask)
        attn = attn.astype(q.dtype)
    elif window is not None:  # sliding-window hook: the masked XLA path (the kernels know no window)
        attn = blocks.masked_attention(q, k_cache, v_cache, k, v, lengths, positions,
                                       scale=h**-0.5, window=window, window_mask=window_mask)
    elif _kernel_attention(lp, q):  # the cache's prefix mask, valid slots only
        attn = kernels.prefix_attention(q, k_cache, v_cache, k, v, lengths, h**-0.5, window_mask)
        attn = attn.reshape(b, t, cfg.num_heads * h).astype(q.dtype)
    else:  # the valid cache prefix (blocks up to the longest row) + the window; prompts in chunks
        attn = attention.attend(
            q, k_cache, v_cache, k, v, lengths, window_mask=window_mask, impl="auto",
            window_in_cache=write,
        ).astype(q.dtype)
    out = _out_and_mlp(cfg, lp, x, attn, mlp)
    return (out, k_cache, v_cache) if write else (out, k, v)


def stacked_layer(cfg, layers, positions, inv_freq, write, collect, carry, i, window_mask=None,
                  mlp=None):
    """One step of the stacked layer loop: layer `i` of `[L, ...]` params on carry
    (x [B, T, D], k_all, v_all [L', B, K, S, H]). The cache rides in the carry: the layer writes only
    its T new rows in place, then reads its slice inside the attention op (fused, never copied out).
    Weights are indexed from the whole stack, so a prefix of the layers (layer_skip) slices nothing.
    Returns (carry, (x if collect, window k/v [B, T, K, H] if not write))."""
    x, k_all, v_all = carry
    lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, 0, keepdims=False), layers)
    q, k, v = _qkv(cfg, lp, x, positions, inv_freq)
    k, v = k.astype(k_all.dtype), v.astype(v_all.dtype)
    if write:  # before the read: nothing reads the old buffer after it, so XLA writes in place
        k_all = write_kv(k_all, k, positions, layer=i)
        v_all = write_kv(v_all, v, positions, layer=i)
    if cfg.sliding_window is not None:  # sliding-window hook: the masked XLA path, window traced
        slides = jnp.asarray(cfg.sliding_layers or (True,) * cfg.num_layers)[i]
        window = jnp.where(slides, cfg.sliding_window, blocks.NO_WINDOW)
        k_l, v_l = (jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False) for c in (k_all, v_all))
        attn = blocks.masked_attention(q, k_l, v_l, k, v, positions[:, 0], positions,
                                       scale=cfg.head_dim**-0.5, window=window,
                                       window_mask=window_mask, window_span=cfg.sliding_window)
    else:
        attn = attention.attend(
            q, k_all, v_all, k, v, positions[:, 0], layer=i, window_mask=window_mask, impl="auto"
        )
    x = _out_and_mlp(cfg, lp, x, attn.astype(x.dtype), mlp)
    return (x, k_all, v_all), (x if collect else None, None if write else (k, v))


def _stacked_layers(cfg, layers, x, k_all, v_all, positions, inv_freq, write, collect,
                    window_mask=None, mlp=None):
    """The first cfg.num_layers layers of `[L, ...]` params as one lax.scan over the layer index
    (see `stacked_layer`). Returns (x, k_all, v_all, per-layer x [n, B, T, D] if collect, window
    k/v [n, B, T, K, H] if not write)."""
    body = lambda carry, i: stacked_layer(  # noqa: E731
        cfg, layers, positions, inv_freq, write, collect, carry, i, window_mask, mlp
    )
    return scan_layers(body, x, k_all, v_all, cfg.num_layers)


def forward(
    params: Params,
    tokens: jax.Array,
    cache: KVCache,
    cfg: ModelConfig,
    hidden_layers: tuple[int, ...] = (),
    write_cache: bool = True,
    positions: jax.Array | None = None,
    window_mask: jax.Array | None = None,
    mlp=None,
) -> ForwardOutput:
    """Run `tokens: int[B, T]` at `positions` int32[B, T] (default `cache.lengths[:, None] +
    arange(T)`), attending cache slots below `cache.lengths` and the window entries
    `window_mask` bool[B, T, T] allows (default causal; a draft tree passes ancestors-and-self,
    see `jaxspec.decode.tree`; needs write_cache=False, since tree nodes share positions).

    `hidden_layers` picks HF-style hidden states: 0 = embeddings, i = output of layer i
    (num_layers = after the final norm). Works on the unrolled (tuple) and stacked (scan) layouts.
    `write_cache=False` leaves the cache untouched and returns the window's k/v in `window_kv`
    (write them with `write_window`): inside a `lax.switch` branch, XLA:CPU copies a cache the
    branch writes, every step.
    """
    t = tokens.shape[1]
    positions = query_positions(cache, t, positions, window_mask, write_cache)  # [B, T]
    mask = cache.mask(t)  # [B, T, S] (write_cache=True: positions are cache.lengths + arange(T))
    inv_freq = rope_frequencies(cfg)
    x = params["embed"][tokens].astype(cfg.compute_dtype)  # [B, T, D]
    return run_layers(
        x, cache, params["layers"], num_layers=cfg.num_layers, hidden_layers=hidden_layers,
        write_cache=write_cache,
        layer=lambda i, lp, x, k_l, v_l: _layer(
            cfg, lp, x, k_l, v_l, positions, mask, inv_freq, write_cache, window_mask,
            cfg.layer_window(i), mlp),
        stacked=lambda x, k_all, v_all, collect: _stacked_layers(
            cfg, params["layers"], x, k_all, v_all, positions, inv_freq, write_cache, collect,
            window_mask, mlp),
        final_norm=lambda x: rms_norm(x, params["final_norm"], cfg.rms_norm_eps),
    )


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """hidden: [..., D] -> f32 logits [..., V]."""
    w = params.get("lm_head", params["embed"])
    if isinstance(w, kernels.PackedWeight):
        return linear(hidden, w).astype(jnp.float32)
    # accumulated and returned in f32: a bf16 model's logits are not rounded to bf16 first
    # (near-tied argmaxes would then turn on the batch's reduction order)
    dims = (((hidden.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(hidden, w.astype(hidden.dtype), dims,
                               preferred_element_type=jnp.float32)


def forward_logits(params, tokens, cache, cfg) -> tuple[jax.Array, KVCache]:
    """Convenience: logits for every query position, and the written cache."""
    out = forward(params, tokens, cache, cfg)
    return lm_head(params, out.hidden), out.cache


# ---- the target protocol (models/base.py) ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaTarget(ConfigTarget):
    """The Llama family as a `models.base.Target`: every layout (unrolled, stacked, packed CPU
    kernels) through the functions above. Hashable: part of the jit key."""

    cfg: ModelConfig
    name: str = "llama"  # the checkpoint's architecture (llama, mistral, qwen2, qwen3)

    @property
    def layer_config(self) -> ModelConfig:
        return self.cfg

    def forward(self, params, tokens, cache, *, positions=None, window_mask=None,
                write_cache=True, taps=()) -> base.TargetOutput:
        out = forward(params, tokens, cache, self.cfg, tuple(taps), write_cache, positions,
                      window_mask)
        return base.TargetOutput(out.hidden, out.layer_hidden, out.window_kv, out.cache)

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        return lm_head(params, hidden)

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        return params["embed"][tokens]

    def layer_weights(self, params: Params, index: int) -> Params:
        """Layer `index` as plain `[out, in]` arrays (the packed layout's fused panels split)."""
        layers = params["layers"]
        if isinstance(layers, dict):
            return jax.tree.map(lambda w: w[index], layers)
        lp = layers[index]
        if not isinstance(lp.get("wqkv"), kernels.PackedWeight):
            return fused_layout.split_layer(lp, qkv_splits(self.cfg))
        rest = {k: w for k, w in lp.items() if not isinstance(w, kernels.PackedWeight)}
        wq, wk, wv = jnp.split(kernels.unpack(lp["wqkv"]), qkv_splits(self.cfg))
        gate, up = jnp.split(kernels.unpack(lp["w_gate_up"]), 2)
        return rest | {"wq": wq, "wk": wk, "wv": wv, "wo": kernels.unpack(lp["wo"]),
                       "w_gate": gate, "w_up": up, "w_down": kernels.unpack(lp["w_down"])}

    def final_norm(self, params: Params) -> jax.Array:
        return params["final_norm"]

    def prefix(self, num_layers: int) -> LlamaTarget:
        """The first `num_layers` layers of the same params (the unrolled forward zips the layer
        tuple with a cache of num_layers entries; the stacked one scans the stack's first
        num_layers), then the final norm and LM head."""
        if not 1 <= num_layers <= self.cfg.num_layers:
            raise ValueError(f"prefix of {num_layers} layers: the target has {self.cfg.num_layers}")
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, num_layers=num_layers))

    def init_params(self, key: jax.Array, layout: str = "unrolled") -> Params:
        params = init_params(self.cfg, key)
        if layout == "fused":
            return fused_layout.fuse(params)
        return stack_layers(params) if layout == "stacked" else params

    def param_axes(self, params: Params) -> Params:
        return param_axes(self.cfg, stacked=isinstance(params["layers"], dict),
                          fused=fused_layout.is_fused(params))

    def pad_window(self, window_kv, entries: int):
        """Window k/v ([B, T, K, H] per layer, or [L, B, T, K, H]) padded to `entries`."""
        pad = lambda w: jnp.pad(  # noqa: E731
            w, [(0, 0)] * (w.ndim - 3) + [(0, entries - w.shape[-3]), (0, 0), (0, 0)]
        )
        return jax.tree.map(pad, window_kv)


registry.register_family(
    registry.Family(
        name="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3"),
        gguf_architectures=("llama", "qwen2", "qwen3"),
    )
)
