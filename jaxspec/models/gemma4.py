"""Gemma 4 text decoder as pure functions over a param pytree (unrolled layout: layers differ in
head dims, so they cannot be stacked).

What sets it apart from Gemma 3 (`models/gemma.py`), each from `models/blocks.py` or `moe.py`:
  * RMS norms scale by w (not 1 + w); values are RMS-normed too (no weight); attention scores
    are not scaled (q and k are normed instead);
  * per-layer head dims and kv heads (global layers wider); global layers use proportional RoPE
    (only a share of the dims rotates), local ones plain RoPE with their own base;
  * KV sharing: the last `num_kv_shared_layers` layers compute no k/v and attend the cache of the
    last earlier layer of their type, so the cache holds only the first layers' k/v;
  * `attention_k_eq_v`: global layers' values are their (unnormed) keys;
  * per-layer input embeddings (PLE): a second embedding, [V', L*P], plus a projection of the
    token embedding, give each layer a P-wide input, gated into the residual after its MLP;
  * an optional MoE block beside the MLP: its own router (RMS-normed input scaled per dim, a
    softmax top-k renormed, times a per-expert scale) over GeGLU experts, the two sums normed
    and added; each layer's output scaled by `layer_scalar`; final logits soft-capped.

Params (torch `Linear` layout [out, in]; per layer, the leaves its config implies):
    {"embed": [V, D], "final_norm": [D], ("lm_head": [V, D]),
     ("ple_embed": [V', L*P], "ple_model_proj": [L*P, D], "ple_proj_norm": [P]),
     "layers": tuple of L dicts:
        {"attn_norm", "wq" [N*H, D], "q_norm" [H], ("wk" [K*H, D], "k_norm" [H], "wv" [K*H, D]),
         "wo" [D, N*H], "post_attn_norm", "mlp_norm", "w_gate"/"w_up" [F, D], "w_down" [D, F],
         "post_mlp_norm", "layer_scalar" [1],
         ("ple_gate" [P, D], "ple_proj" [D, P], "ple_norm" [D]),
         ("router" [E, D], "router_scale" [D], "expert_scale" [E], "we_gate"/"we_up" [E, F', D],
          "we_down" [E, D, F'], "post_mlp_norm_1", "moe_norm", "post_moe_norm")}}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError
from jaxspec.models import base, blocks, gemma4_config, gemma4_gguf, moe, paged_layer, registry
from jaxspec.models.cache import CACHE_AXES, KVCache
from jaxspec.models.decoder import ForwardOutput, linear, query_positions, write_kv, write_window
from jaxspec.models.gemma4_config import Gemma4Config, gemma4_config_from_hf

Params = dict[str, Any]


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def layer_shapes(cfg: Gemma4Config, i: int) -> dict[str, tuple[int, ...]]:
    d, n = cfg.hidden_size, cfg.num_heads
    kv, h = cfg.heads[i]
    f = cfg.mlp_width[i]
    out = {"attn_norm": (d,), "wq": (n * h, d), "q_norm": (h,), "wo": (d, n * h),
           "post_attn_norm": (d,), "mlp_norm": (d,), "w_gate": (f, d), "w_up": (f, d),
           "w_down": (d, f), "post_mlp_norm": (d,), "layer_scalar": (1,)}
    if cfg.kv_source[i] == i:
        out |= {"wk": (kv * h, d), "k_norm": (h,)}
        if not cfg.k_eq_v[i]:
            out["wv"] = (kv * h, d)
    if cfg.ple_dim:
        out |= {"ple_gate": (cfg.ple_dim, d), "ple_proj": (d, cfg.ple_dim), "ple_norm": (d,)}
    if cfg.num_experts:
        out |= moe.layer_shapes(cfg.num_experts, cfg.moe_intermediate_size, d)
        out |= {"router_scale": (d,), "expert_scale": (cfg.num_experts,), "post_mlp_norm_1": (d,),
                "moe_norm": (d,), "post_moe_norm": (d,)}
    return out


def param_shapes(cfg: Gemma4Config) -> Params:
    d = cfg.hidden_size
    shapes: Params = {"embed": (cfg.vocab_size, d), "final_norm": (d,),
                      "layers": tuple(layer_shapes(cfg, i) for i in range(cfg.num_layers))}
    if cfg.ple_dim:
        lp = cfg.num_layers * cfg.ple_dim
        shapes |= {"ple_embed": (cfg.ple_vocab, lp), "ple_model_proj": (lp, d),
                   "ple_proj_norm": (cfg.ple_dim,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, d)
    return shapes


def init_params(cfg: Gemma4Config, key: jax.Array, scale: float = 0.02) -> Params:
    """Random params (tests): matrices N(0, scale), norms and scales one."""
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    leaves, treedef = jax.tree.flatten(param_shapes(cfg), is_leaf=is_shape)
    keys = jax.random.split(key, len(leaves))
    out = [jnp.ones(s, cfg.compute_dtype) if len(s) == 1
           else (scale * jax.random.normal(k, s)).astype(cfg.compute_dtype)
           for s, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


def rope_table(cfg: Gemma4Config, i: int) -> jax.Array:  # f32[H/2]
    """Layer i's inverse frequencies: plain RoPE (local), proportional RoPE (global: the first
    partial * H/2 frequencies of base theta over H, the rest zero, i.e. not rotated)."""
    h = cfg.heads[i][1]
    if cfg.sliding[i]:
        return blocks.rope_inv_freq(h, cfg.rope_local_theta)
    angles = int(cfg.rope_global_partial * h // 2)
    rotated = 1.0 / (cfg.rope_global_theta ** (jnp.arange(0, 2 * angles, 2, dtype=jnp.float32) / h))
    return jnp.concatenate([rotated, jnp.zeros(h // 2 - angles, jnp.float32)])


def _norm(x, w, cfg):
    return blocks.rms_norm(x, w, cfg.rms_norm_eps)


def _unit_norm(x, cfg):  # RMS norm with no weight (values, the router's input)
    return blocks.rms_norm(x, jnp.ones((x.shape[-1],), jnp.float32), cfg.rms_norm_eps)


def _own_kv(cfg, i, lp, y, positions, inv_freq):
    """Layer i's window keys and values [B, T, K, H] (normed; keys rotated)."""
    b, t, _ = y.shape
    kv, h = cfg.heads[i]
    k = linear(y, lp["wk"]).reshape(b, t, kv, h)
    v = k if cfg.k_eq_v[i] else linear(y, lp["wv"]).reshape(b, t, kv, h)
    k = blocks.apply_rope(_norm(k, lp["k_norm"], cfg), positions, inv_freq)
    return k, _unit_norm(v, cfg)


def _mlp(cfg, lp, x):
    """The MLP half (+ the MoE block beside it) and its residual. x: [B, T, D]."""
    y = _norm(x, lp["mlp_norm"], cfg)
    y = linear(_gelu(linear(y, lp["w_gate"])) * linear(y, lp["w_up"]), lp["w_down"])
    if cfg.num_experts:
        flat = x.reshape(-1, x.shape[-1])  # [N, D]: routed from the residual itself
        r = _unit_norm(flat, cfg) * lp["router_scale"].astype(x.dtype) * cfg.hidden_size**-0.5
        logits = linear(r, lp["router"]).astype(jnp.float32)
        weights, experts = moe.top_k_of(jax.nn.softmax(logits, -1), cfg.top_k, True)
        weights = weights * lp["expert_scale"].astype(jnp.float32)[experts]
        routed = moe.run_experts(lp, _norm(flat, lp["moe_norm"], cfg), weights, experts, act=_gelu)
        y = _norm(y, lp["post_mlp_norm_1"], cfg) + _norm(routed.reshape(x.shape), lp["post_moe_norm"], cfg)
    return x + _norm(y, lp["post_mlp_norm"], cfg)


def _layer(cfg, i, lp, x, kv, positions, ple, window_mask):
    """Decoder layer i: x [B, T, D]; kv = (k_cache, v_cache [B, K, S, H], k_win, v_win
    [B, T, K, H]) of the layer whose k/v it reads (already written, when writing)."""
    b, t, _ = x.shape
    h = cfg.heads[i][1]
    y = _norm(x, lp["attn_norm"], cfg)
    q = linear(y, lp["wq"]).reshape(b, t, cfg.num_heads, h)
    q = blocks.apply_rope(_norm(q, lp["q_norm"], cfg), positions, rope_table(cfg, i))
    k_cache, v_cache, k, v = kv
    attn = blocks.masked_attention(q, k_cache, v_cache, k, v, positions[:, 0], positions,
                                   scale=1.0, window=cfg.window(i), window_mask=window_mask)
    x = x + _norm(linear(attn.astype(x.dtype), lp["wo"]), lp["post_attn_norm"], cfg)
    x = _mlp(cfg, lp, x)
    if cfg.ple_dim:
        g = _gelu(linear(x, lp["ple_gate"])) * ple[:, :, i]
        x = x + _norm(linear(g, lp["ple_proj"]), lp["ple_norm"], cfg)
    return x * lp["layer_scalar"].astype(x.dtype)


def per_layer_inputs(params, cfg: Gemma4Config, tokens, x) -> jax.Array:  # [B, T, L, P]
    """PLE: the token's per-layer embedding (scaled by sqrt(P)) and a normed projection of its
    scaled embedding x, averaged with weight 1/sqrt(2) each."""
    b, t = tokens.shape
    shape = (b, t, cfg.num_layers, cfg.ple_dim)
    scale = jnp.asarray(math.sqrt(cfg.ple_dim), jnp.float32).astype(x.dtype)
    tok = (params["ple_embed"][tokens].astype(x.dtype) * scale).reshape(shape)
    proj = (linear(x, params["ple_model_proj"]) * cfg.hidden_size**-0.5).reshape(shape)
    return (_norm(proj, params["ple_proj_norm"], cfg) + tok) * 2.0**-0.5


def forward(params, tokens, cache: KVCache, cfg: Gemma4Config, hidden_layers=(), write_cache=True,
            positions=None, window_mask=None) -> ForwardOutput:
    """Same contract as `models.llama.forward`; the cache holds `cfg.cache_layers` layers (a
    sharing layer reads its source layer's entry) and `window_kv` only theirs."""
    if any(isinstance(k, paged_layer.PagedLayer) for k in cache.k):
        raise JaxspecError("Gemma 4 does not run on the paged serving cache yet (its layers differ "
                           "in k/v shapes): use the engine's contiguous cache")
    positions = query_positions(cache, tokens.shape[1], positions, window_mask, write_cache)
    x = params["embed"][tokens].astype(cfg.compute_dtype)
    x = x * blocks.embed_scale(cfg.hidden_size, x.dtype)  # [B, T, D]
    ple = per_layer_inputs(params, cfg, tokens, x) if cfg.ple_dim else None
    collected = {0: x}
    kv_of, k_new, v_new = {}, list(cache.k), list(cache.v)
    for i, lp in enumerate(params["layers"][: cfg.num_layers]):
        src = cfg.kv_source[i]
        if src == i:
            y = _norm(x, lp["attn_norm"], cfg)
            k, v = _own_kv(cfg, i, lp, y, positions, rope_table(cfg, i))
            k, v = k.astype(k_new[i].dtype), v.astype(v_new[i].dtype)
            if write_cache:
                k_new[i], v_new[i] = write_kv(k_new[i], k, positions), write_kv(v_new[i], v, positions)
            kv_of[i] = (k_new[i], v_new[i], k, v)
        x = _layer(cfg, i, lp, x, kv_of[src], positions, ple, window_mask)
        collected[i + 1] = x
    x = _norm(x, params["final_norm"], cfg)
    collected[cfg.num_layers] = x
    taps = jnp.stack([collected[i] for i in hidden_layers]) if hidden_layers else None
    n = cfg.cache_layers
    if not write_cache:
        window = (tuple(kv_of[i][2] for i in range(n)), tuple(kv_of[i][3] for i in range(n)))
        return ForwardOutput(x, cache, taps, window)
    return ForwardOutput(x, dataclasses.replace(cache, k=tuple(k_new), v=tuple(v_new)), taps)


def lm_head(params, hidden, cfg: Gemma4Config) -> jax.Array:
    w = params.get("lm_head", params["embed"]).astype(hidden.dtype)
    logits = jax.lax.dot_general(hidden, w, (((hidden.ndim - 1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    return blocks.soft_cap(logits, cfg.final_logit_softcapping)


@dataclasses.dataclass(frozen=True)
class Gemma4Target:
    """Gemma 4 text as a `models.base.Target` (unrolled layout; per-layer caches of their own
    shapes, only for the layers that compute k/v). Hashable: part of the jit key."""

    cfg: Gemma4Config
    name: str = "gemma4"

    vocab_size = property(lambda self: self.cfg.vocab_size)
    hidden_size = property(lambda self: self.cfg.hidden_size)
    num_layers = property(lambda self: self.cfg.num_layers)
    max_position_embeddings = property(lambda self: self.cfg.max_position_embeddings)
    dtype = property(lambda self: self.cfg.dtype)

    def init_cache(self, params, batch: int, capacity: int) -> KVCache:
        shapes = [(batch, kv, capacity, h) for kv, h in self.cfg.heads[: self.cfg.cache_layers]]
        zeros = tuple(jnp.zeros(s, self.cfg.compute_dtype) for s in shapes)
        return KVCache(k=zeros, v=tuple(jnp.zeros_like(z) for z in zeros),
                       lengths=jnp.zeros((batch,), jnp.int32))

    def forward(self, params, tokens, cache, *, positions=None, window_mask=None,
                write_cache=True, taps=()) -> base.TargetOutput:
        out = forward(params, tokens, cache, self.cfg, tuple(taps), write_cache, positions,
                      window_mask)
        return base.TargetOutput(out.hidden, out.layer_hidden, out.window_kv, out.cache)

    def logits(self, params, hidden):
        return lm_head(params, hidden, self.cfg)

    def commit_window(self, cache, window_kv, path, positions):
        """The path's window k/v (path int32[B, P]) written at positions [B, P]."""
        gather = lambda w: jnp.take_along_axis(w, path[:, :, None, None], axis=1)  # noqa: E731
        return write_window(cache, jax.tree.map(gather, window_kv), positions)

    # optional traits
    def embed(self, params, tokens):
        x = params["embed"][tokens].astype(self.cfg.compute_dtype)
        return x * blocks.embed_scale(self.cfg.hidden_size, x.dtype)

    def embedding_table(self, params):
        return params["embed"]

    def head_table(self, params):
        return params.get("lm_head", params["embed"])

    def final_norm(self, params):
        return params["final_norm"]

    def init_params(self, key, layout: str = "unrolled"):
        if layout != "unrolled":
            raise ValueError(f"Gemma 4 runs the unrolled layout only, not {layout!r}")
        return init_params(self.cfg, key)

    def cache_axes(self, cache):
        per_layer = tuple(CACHE_AXES[1:] for _ in cache.k)
        return KVCache(k=per_layer, v=per_layer, lengths=("batch",))

    def layout(self, params) -> str:
        return "unrolled"


def _target_from_hf(hf: dict, *, dtype: str, source: str) -> Gemma4Target:
    return Gemma4Target(gemma4_config_from_hf(hf, dtype=dtype, source=source))


def check_layout(cfg, layout: str, note: str, source: str, mesh=None) -> tuple[str, str]:
    """Gemma 4 runs unrolled ("auto" falls back to it, an explicit other layout is refused)."""
    if layout == "unrolled":
        return layout, note
    if note.startswith("auto"):
        return "unrolled", "auto: Gemma 4's layers differ in head dims (unrolled only)"
    raise JaxspecError(f"{source}: layout {layout!r} is not supported for Gemma 4 (layers "
                       f"differ in head dims): load with layout 'unrolled' or 'auto'")


def _target_from_gguf(header, *, dtype: str, source: str) -> Gemma4Target:
    return Gemma4Target(gemma4_gguf.config_from_gguf(header, dtype=dtype, source=source))


registry.register_family(registry.Family(
    "gemma4", ("gemma4", "gemma4_text"), ("gemma4",), _target_from_hf, _target_from_gguf,
    hf=registry.HfLayout(
        config=gemma4_config.gemma4_config_from_hf, tensor_name=gemma4_config.our_name,
        param_shapes=param_shapes, target=lambda cfg, arch: Gemma4Target(cfg),
        skip=r"(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio)\..*"
             r"|.*rotary_emb\..*",
        convert=lambda flat, cfg, source: gemma4_config.split_fused(flat, cfg),
        layout=check_layout, architecture=lambda cfg: "gemma4"),
    gguf=registry.FileLayout(  # module functions looked up per call (tests patch them)
        config=lambda header, **kw: gemma4_gguf.config_from_gguf(header, **kw),
        tensor_name=gemma4_gguf.tensor_name, param_shapes=param_shapes,
        target=lambda cfg, arch: Gemma4Target(cfg),
        convert=lambda flat, cfg, source: gemma4_gguf.convert(flat, cfg, source),
        layout=check_layout, architecture=lambda cfg: "gemma4")))
