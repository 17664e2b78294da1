"""Gemma 2 and Gemma 3 text decoders as pure functions over a param pytree.

What sets them apart from Llama (each a block of `models/blocks.py`):
  * RMS norms scale by (1 + w), in float32, cast after the scale;
  * "sandwich" norms: the attention output and the MLP output are normed again before their
    residual adds (post_attn_norm, post_mlp_norm);
  * embeddings multiplied by sqrt(D) rounded to the compute dtype; LM head tied to them;
  * GeGLU MLP (gelu, tanh approximation);
  * attention scores scaled by query_pre_attn_scalar**-0.5 (not head_dim**-0.5);
  * Gemma 2: attention scores and final logits soft-capped (tanh);
  * Gemma 3: q/k RMS norms ((1 + w) too); local layers (sliding window) and global layers with
    two RoPE bases (`rope_local_theta` for local layers, `rope_theta` with an optional linear
    scaling for global ones).

Params (torch `Linear` layout `[out, in]`; same leaf names as `models/llama.py` where the role is
the same, so the packed CPU-kernel layout and the sharding rules apply unchanged):

    {"embed": [V, D],
     "layers": tuple of L dicts, or one dict of [L, ...] arrays (stacked):
        {"attn_norm": [D], "wq": [N*H, D], "wk": [K*H, D], "wv": [K*H, D], "wo": [D, N*H],
         "q_norm"/"k_norm": [H] (Gemma 3), "post_attn_norm": [D],
         "mlp_norm": [D], "w_gate": [F, D], "w_up": [F, D], "w_down": [D, F], "post_mlp_norm": [D]},
     "final_norm": [D]}

Attention paths per layer (`attention_path`): sliding-window and soft-capped layers take the
masked XLA path (`blocks.masked_attention`, any backend); Gemma 3's global layers take the shared
op `models.attention.attend` (Pallas kernels on TPU/GPU) or, in the packed layout, the CPU prefix
kernel. The stacked layout runs every layer on the masked path with the layer's window traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.models import attention, base, blocks, paged_layer, registry
from jaxspec.models.cache import KVCache
from jaxspec.models.decoder import (
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
from jaxspec.models.gemma_config import (
    GGUF_LAYER_NAMES, HF_LAYER_NAMES, GemmaConfig, gemma_config_from_gguf, gemma_config_from_hf)

Params = dict[str, Any]


def _layer_shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    d, h, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    layer = {
        "attn_norm": (d,), "wq": (nh, d), "wk": (kh, d), "wv": (kh, d), "wo": (d, nh),
        "post_attn_norm": (d,), "mlp_norm": (d,), "w_gate": (f, d), "w_up": (f, d),
        "w_down": (d, f), "post_mlp_norm": (d,),
    }
    if cfg.qk_norm:
        layer |= {"q_norm": (h,), "k_norm": (h,)}
    return layer


_LAYER_AXES = {
    "attn_norm": ("embed",), "wq": ("heads", "embed"), "wk": ("kv_heads", "embed"),
    "wv": ("kv_heads", "embed"), "wo": ("embed", "heads"), "post_attn_norm": ("embed",),
    "mlp_norm": ("embed",), "w_gate": ("mlp", "embed"), "w_up": ("mlp", "embed"),
    "w_down": ("embed", "mlp"), "post_mlp_norm": ("embed",), "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
}


def param_shapes(cfg: GemmaConfig) -> Params:
    """Shape of every leaf of unstacked params (random init; loaders check against it)."""
    layer = _layer_shapes(cfg)
    shapes: Params = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "final_norm": (cfg.hidden_size,),
        "layers": tuple(dict(layer) for _ in range(cfg.num_layers)),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def param_axes(cfg: GemmaConfig, *, stacked: bool = False) -> Params:
    """Logical axis names of every param leaf (same structure as the params)."""
    layer = {k: _LAYER_AXES[k] for k in _layer_shapes(cfg)}
    return param_tree_axes(layer, cfg, stacked=stacked, tied=cfg.tie_word_embeddings)


def init_params(cfg: GemmaConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random params: matrices N(0, scale), norms small around zero ((1 + w) scales near one)."""
    shapes = param_shapes(cfg)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    keys = jax.random.split(key, len(leaves))
    out = [
        ((0.1 if len(s) == 1 else scale) * jax.random.normal(k, s)).astype(cfg.compute_dtype)
        for s, k in zip(leaves, keys)
    ]
    return jax.tree.unflatten(treedef, out)


def rope_tables(cfg: GemmaConfig) -> tuple[jax.Array, jax.Array]:
    """(global, local) inverse frequencies f32[H/2]."""
    glob = blocks.rope_inv_freq(cfg.head_dim, cfg.rope_theta, linear_factor=cfg.rope_linear_factor)
    local = blocks.rope_inv_freq(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta)
    return glob, local


def attention_path(cfg: GemmaConfig, i: int) -> str:
    """Which attention op layer i runs in the per-layer layouts: "masked" (blocks.masked_attention:
    sliding window and/or soft-capped scores) or "attend" (the shared op and its kernels)."""
    if cfg.sliding_layers[i] or cfg.attn_logit_softcapping is not None:
        return "masked"
    return "attend"


def _norm(x, w, cfg):
    return blocks.rms_norm(x, w, cfg.rms_norm_eps, offset=1.0)


def _qkv(cfg, lp, x, positions, inv_freq):
    """x: [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H] (normed, rotated)."""
    b, t, _ = x.shape
    h = cfg.head_dim
    y = _norm(x, lp["attn_norm"], cfg)
    if "wqkv" in lp:  # packed layout
        q_end = cfg.num_heads * h
        q, k, v = jnp.split(linear(y, lp["wqkv"]), (q_end, q_end + cfg.num_kv_heads * h), axis=-1)
    else:
        q, k, v = linear(y, lp["wq"]), linear(y, lp["wk"]), linear(y, lp["wv"])
    q = q.reshape(b, t, cfg.num_heads, h)
    k = k.reshape(b, t, cfg.num_kv_heads, h)
    v = v.reshape(b, t, cfg.num_kv_heads, h)
    if cfg.qk_norm:
        q, k = _norm(q, lp["q_norm"], cfg), _norm(k, lp["k_norm"], cfg)
    return blocks.apply_rope(q, positions, inv_freq), blocks.apply_rope(k, positions, inv_freq), v


def _out_and_mlp(cfg, lp, x, attn):
    """Sandwich-normed attention output + residual, then the sandwich-normed GeGLU + residual."""
    x = x + _norm(linear(attn, lp["wo"]), lp["post_attn_norm"], cfg)
    y = _norm(x, lp["mlp_norm"], cfg)
    if "w_gate_up" in lp:  # packed layout
        gate, up = jnp.split(linear(y, lp["w_gate_up"]), 2, axis=-1)
    else:
        gate, up = linear(y, lp["w_gate"]), linear(y, lp["w_up"])
    y = linear(blocks.geglu(gate, up), lp["w_down"])
    return x + _norm(y, lp["post_mlp_norm"], cfg)


def _attend(cfg, i, lp, q, k_cache, v_cache, k, v, positions, window_mask):
    """Layer i's attention over its cache [B, K, S, H] and the window's k/v -> [B, T, N*H]."""
    b, t, n, h = q.shape
    lengths = positions[:, 0]
    if isinstance(k_cache, paged_layer.PagedLayer):  # a paged pool, read through its table
        return paged_layer.attend(q, k_cache, v_cache, k, v, positions, scale=cfg.attn_scale,
                                  window=cfg.layer_window(i), window_mask=window_mask,
                                  softcap=cfg.attn_logit_softcapping)
    if attention_path(cfg, i) == "masked":
        return blocks.masked_attention(
            q, k_cache, v_cache, k, v, lengths, positions, scale=cfg.attn_scale,
            window=cfg.layer_window(i), window_mask=window_mask,
            softcap=cfg.attn_logit_softcapping,
        )
    if isinstance(lp.get("wqkv"), kernels.PackedWeight) and attention_kernel_on(q):
        out = kernels.prefix_attention(q, k_cache, v_cache, k, v, lengths, cfg.attn_scale,
                                       window_mask)
        return out.reshape(b, t, n * h).astype(q.dtype)
    # the shared op scales by head_dim**-0.5: fold the difference into q
    ratio = cfg.attn_scale * h**0.5
    q = q if ratio == 1.0 else (q * ratio).astype(q.dtype)
    return attention.attend(q, k_cache, v_cache, k, v, lengths, window_mask=window_mask,
                            impl="auto").astype(q.dtype)


def _layer(cfg, i, lp, x, k_cache, v_cache, positions, tables, write, window_mask):
    """Decoder layer i (per-layer layouts). Returns (x, k_cache, v_cache) when writing the cache,
    else (x, window k, window v) [B, T, K, H] with the cache untouched."""
    inv_freq = tables[1] if cfg.sliding_layers[i] else tables[0]
    q, k, v = _qkv(cfg, lp, x, positions, inv_freq)
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    if write:
        k_cache = write_kv(k_cache, k, positions)
        v_cache = write_kv(v_cache, v, positions)
    attn = _attend(cfg, i, lp, q, k_cache, v_cache, k, v, positions, window_mask)
    out = _out_and_mlp(cfg, lp, x, attn.astype(x.dtype))
    return (out, k_cache, v_cache) if write else (out, k, v)


def _stacked_layers(cfg, layers, x, k_all, v_all, positions, tables, write, collect, window_mask):
    """All layers as one lax.scan over [L, ...] params and an [L, B, K, S, H] cache; each layer's
    window and RoPE table are picked by its traced index. Returns (x, k_all, v_all, per-layer x
    [L, B, T, D] if collect, window k/v [L, B, T, K, H] if not write)."""
    sliding = jnp.asarray(cfg.sliding_layers[: cfg.num_layers])
    window = cfg.sliding_window or blocks.NO_WINDOW
    lengths = positions[:, 0]

    def body(carry, i):
        x, k_all, v_all = carry
        lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, 0, keepdims=False), layers)
        inv_freq = jnp.where(sliding[i], tables[1], tables[0])
        q, k, v = _qkv(cfg, lp, x, positions, inv_freq)
        k, v = k.astype(k_all.dtype), v.astype(v_all.dtype)
        if write:
            k_all = write_kv(k_all, k, positions, layer=i)
            v_all = write_kv(v_all, v, positions, layer=i)
        k_l = jax.lax.dynamic_index_in_dim(k_all, i, 0, keepdims=False)
        v_l = jax.lax.dynamic_index_in_dim(v_all, i, 0, keepdims=False)
        attn = blocks.masked_attention(
            q, k_l, v_l, k, v, lengths, positions, scale=cfg.attn_scale,
            window=jnp.where(sliding[i], window, blocks.NO_WINDOW), window_mask=window_mask,
            softcap=cfg.attn_logit_softcapping, window_span=cfg.sliding_window,
        )
        x = _out_and_mlp(cfg, lp, x, attn.astype(x.dtype))
        return (x, k_all, v_all), (x if collect else None, None if write else (k, v))

    return scan_layers(body, x, k_all, v_all, cfg.num_layers)


def forward(
    params: Params,
    tokens: jax.Array,
    cache: KVCache,
    cfg: GemmaConfig,
    hidden_layers: tuple[int, ...] = (),
    write_cache: bool = True,
    positions: jax.Array | None = None,
    window_mask: jax.Array | None = None,
) -> ForwardOutput:
    """`tokens: int[B, T]` at `positions` int32[B, T] (default the cache's next positions) over
    the committed cache slots and the window entries `window_mask` bool[B, T, T] allows (default
    causal; trees pass ancestors-and-self, with write_cache=False), each layer within its sliding
    window. Same contract as `models.llama.forward` (hidden_layers: HF hidden_states indexing)."""
    positions = query_positions(cache, tokens.shape[1], positions, window_mask, write_cache)
    tables = rope_tables(cfg)
    x = params["embed"][tokens].astype(cfg.compute_dtype)
    x = x * blocks.embed_scale(cfg.hidden_size, x.dtype)  # [B, T, D]
    return run_layers(
        x, cache, params["layers"], num_layers=cfg.num_layers, hidden_layers=hidden_layers,
        write_cache=write_cache,
        layer=lambda i, lp, x, k_l, v_l: _layer(
            cfg, i, lp, x, k_l, v_l, positions, tables, write_cache, window_mask),
        stacked=lambda x, k_all, v_all, collect: _stacked_layers(
            cfg, params["layers"], x, k_all, v_all, positions, tables, write_cache, collect,
            window_mask),
        final_norm=lambda x: _norm(x, params["final_norm"], cfg),
    )


def lm_head(params: Params, hidden: jax.Array, cfg: GemmaConfig) -> jax.Array:
    """hidden [..., D] -> f32 logits [..., V] (tied head; Gemma 2's final soft-cap)."""
    w = params.get("lm_head", params["embed"])
    if not isinstance(w, kernels.PackedWeight):
        w = w.astype(hidden.dtype)
    logits = linear(hidden, w).astype(jnp.float32)
    return blocks.soft_cap(logits, cfg.final_logit_softcapping)


@dataclasses.dataclass(frozen=True)
class GemmaTarget(ConfigTarget):
    """Gemma 2 / Gemma 3 as a `models.base.Target` (unrolled, stacked and packed layouts; the
    methods that read only the config come from decoder.ConfigTarget). Hashable: part of the
    jit key."""

    cfg: GemmaConfig
    name: str = "gemma3"

    @property
    def layer_config(self) -> ModelConfig:
        """A Llama layer of the same dims (sizes an EAGLE head's decoder layer)."""
        c = self.cfg
        return ModelConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size, num_layers=c.num_layers,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=c.tie_word_embeddings,
            max_position_embeddings=c.max_position_embeddings, dtype=c.dtype,
        )

    def forward(self, params, tokens, cache, *, positions=None, window_mask=None,
                write_cache=True, taps=()) -> base.TargetOutput:
        out = forward(params, tokens, cache, self.cfg, tuple(taps), write_cache, positions,
                      window_mask)
        return base.TargetOutput(out.hidden, out.layer_hidden, out.window_kv, out.cache)

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        return lm_head(params, hidden, self.cfg)

    # optional traits
    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        """The scaled embedding the first layer reads (embed * sqrt(D))."""
        x = params["embed"][tokens].astype(self.cfg.compute_dtype)
        return x * blocks.embed_scale(self.cfg.hidden_size, x.dtype)

    def layer_weights(self, params: Params, index: int) -> Params:
        """Layer `index` in the Llama layer's names, plain arrays: norms as (1 + w) scales (what a
        Llama norm multiplies by), the fused panels of the packed layout split."""
        layers = params["layers"]
        lp = jax.tree.map(lambda w: w[index], layers) if isinstance(layers, dict) else dict(layers[index])
        if isinstance(lp.get("wqkv"), kernels.PackedWeight):
            q_end = self.cfg.num_heads * self.cfg.head_dim
            k_end = q_end + self.cfg.num_kv_heads * self.cfg.head_dim
            wq, wk, wv = jnp.split(kernels.unpack(lp.pop("wqkv")), (q_end, k_end))
            gate, up = jnp.split(kernels.unpack(lp.pop("w_gate_up")), 2)
            lp |= {"wq": wq, "wk": wk, "wv": wv, "w_gate": gate, "w_up": up,
                   "wo": kernels.unpack(lp["wo"]), "w_down": kernels.unpack(lp["w_down"])}
        keys = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
        out = {k: lp[k] for k in keys}
        return out | {"attn_norm": 1.0 + lp["attn_norm"], "mlp_norm": 1.0 + lp["mlp_norm"]}

    def final_norm(self, params: Params) -> jax.Array:
        return 1.0 + params["final_norm"]

    def init_params(self, key: jax.Array, layout: str = "unrolled") -> Params:
        params = init_params(self.cfg, key)
        return stack_layers(params) if layout == "stacked" else params

    def prefix(self, num_layers: int) -> GemmaTarget:
        if not 1 <= num_layers <= self.cfg.num_layers:
            raise ValueError(f"prefix of {num_layers} layers: the target has {self.cfg.num_layers}")
        cfg = dataclasses.replace(self.cfg, num_layers=num_layers,
                                  sliding_layers=self.cfg.sliding_layers[:num_layers])
        return dataclasses.replace(self, cfg=cfg)

    def param_axes(self, params: Params) -> Params:
        return param_axes(self.cfg, stacked=isinstance(params["layers"], dict))


def _gemma_target_from_hf(hf: dict, *, dtype: str, source: str) -> GemmaTarget:
    cfg = gemma_config_from_hf(hf, dtype=dtype, source=source)
    return GemmaTarget(cfg, name=cfg.family)


def _gemma_target_from_gguf(header, *, dtype: str, source: str) -> GemmaTarget:
    cfg = gemma_config_from_gguf(header, dtype=dtype, source=source)
    return GemmaTarget(cfg, name=cfg.family)


# the text decoder's prefixes: plain CausalLM, Gemma 3 multimodal (transformers 4.x and 5.x)
HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
HF_SKIPPED = r"(model\.)?(vision_tower|multi_modal_projector)\..*|.*rotary_emb\.inv_freq"
_HF = registry.HfLayout(
    config=gemma_config_from_hf,
    tensor_name=lambda n: registry.hf_tensor_name(n, HF_LAYER_NAMES, prefixes=HF_PREFIXES),
    param_shapes=param_shapes, target=lambda cfg, arch: GemmaTarget(cfg, name=cfg.family),
    skip=HF_SKIPPED, architecture=lambda cfg: cfg.family, llama_leaves=True)
_GGUF = registry.FileLayout(
    config=gemma_config_from_gguf,
    tensor_name=lambda n: registry.gguf_tensor_name(n, GGUF_LAYER_NAMES),
    param_shapes=param_shapes, target=lambda cfg, arch: GemmaTarget(cfg, name=cfg.family),
    architecture=lambda cfg: cfg.family, llama_leaves=True, norm_offset=1.0)

for _family in (
    registry.Family("gemma2", ("gemma2",), ("gemma2",), _gemma_target_from_hf,
                    _gemma_target_from_gguf, hf=_HF, gguf=_GGUF),
    registry.Family("gemma3", ("gemma3", "gemma3_text"), ("gemma3",), _gemma_target_from_hf,
                    _gemma_target_from_gguf, hf=_HF, gguf=_GGUF),
):
    registry.register_family(_family)
