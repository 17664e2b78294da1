"""Gemma 4 (text) configuration: what config.json says, per layer, and the checkpoint's tensor
names. A dict in, no files (`loading/family_files.py` opens them).

Per layer i (HF `layer_types`, `per_layer_config`, `num_kv_shared_layers`):
  sliding[i]     a local layer (sliding window) or a global one;
  heads[i]       (kv heads, head dim): global layers may have their own (`global_head_dim`,
                 `num_global_key_value_heads`);
  kv_source[i]   the layer whose k/v it attends: itself, or for the last `num_kv_shared_layers`
                 layers the last earlier layer of the same type (KV sharing: no k/v of their own);
  k_eq_v[i]      a global layer of an `attention_k_eq_v` model: values are its keys, unnormed;
  mlp_width[i]   the gated MLP's width (doubled on KV-sharing layers under `use_double_wide_mlp`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.models import moe, registry

SUPPORTED = ("sliding/full layers, per-layer head dims, KV sharing, per-layer input embeddings, "
             "the optional MoE block, default/proportional RoPE")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    sliding: tuple[bool, ...]
    heads: tuple[tuple[int, int], ...]  # per layer (kv heads, head dim)
    kv_source: tuple[int, ...]
    k_eq_v: tuple[bool, ...]
    mlp_width: tuple[int, ...]
    sliding_window: int
    rope_local_theta: float = 10000.0
    rope_global_theta: float = 1e6
    rope_global_partial: float = 1.0  # proportional RoPE: the rotated share of the head dim
    ple_dim: int = 0  # hidden_size_per_layer_input (0: no per-layer inputs)
    ple_vocab: int = 0
    num_experts: int = 0  # 0: no MoE block
    top_k: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: float | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    dtype: str = "float32"

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def cache_layers(self) -> int:
        """Layers holding k/v of their own (the first ones; the sharing layers come last)."""
        return sum(1 for i, s in enumerate(self.kv_source) if s == i)

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.sliding[i] else None


def gemma4_config_from_hf(hf: dict, *, dtype: str, source: str) -> Gemma4Config:
    """config.json of a gemma4_text checkpoint (or the text part of gemma4), every field
    checked; what jaxspec does not implement is refused in one line naming what it does."""
    if isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]
    f = validate.Fields(hf, source)

    def refuse(what: str):
        raise JaxspecError(f"{source}: {what} is not supported: Gemma 4 in jaxspec runs {SUPPORTED}")

    if hf.get("use_bidirectional_attention") not in (None,):
        refuse(f"use_bidirectional_attention={validate.short(hf['use_bidirectional_attention'])}")
    if f.bool("attention_bias", False):
        refuse("attention_bias=true")
    if f.str("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        refuse(f"hidden_activation={validate.short(hf['hidden_activation'])}")
    n = f.int("num_hidden_layers", lo=1, hi=validate.MAX_LAYERS)
    types = hf.get("layer_types")
    if not isinstance(types, list) or len(types) != n or not set(types) <= {
            "sliding_attention", "full_attention"}:
        f.fail("layer_types", types, f"use {n} of 'sliding_attention' / 'full_attention'")
    sliding = tuple(t == "sliding_attention" for t in types)
    heads_n = f.int("num_attention_heads", lo=1, hi=validate.MAX_DIM)
    base = (f.int("num_key_value_heads", lo=1, hi=heads_n), f.int("head_dim", lo=2, hi=validate.MAX_DIM))
    overrides = f.dict("per_layer_config", {})
    heads = []
    for i in range(n):
        o = overrides.get(str(i), overrides.get(i, {})) or {}
        if set(o) - {"head_dim", "num_key_value_heads"}:
            refuse(f"per_layer_config keys {sorted(set(o) - {'head_dim', 'num_key_value_heads'})}")
        kv, h = int(o.get("num_key_value_heads", base[0])), int(o.get("head_dim", base[1]))
        if heads_n % kv or h % 2:
            f.fail("per_layer_config", o, "kv heads must divide the query heads; head dims even")
        heads.append((kv, h))
    shared = f.int("num_kv_shared_layers", 0, lo=0, hi=n - 1)
    first = n - shared
    kv_source = kv_sources(sliding, shared, refuse)
    k_eq_v = tuple(f.bool("attention_k_eq_v", False) and not s for s in sliding)
    double = f.bool("use_double_wide_mlp", False)
    width = f.int("intermediate_size", lo=1, hi=validate.MAX_DIM)
    moe = f.bool("enable_moe_block", False)
    rope = f.dict("rope_parameters", {})
    local = validate.Fields(rope.get("sliding_attention") or {}, source, "rope_parameters.sliding_attention.")
    glob = validate.Fields(rope.get("full_attention") or {}, source, "rope_parameters.full_attention.")
    if local.str("rope_type", "default") != "default":
        refuse(f"sliding rope_type {validate.short(rope['sliding_attention']['rope_type'])}")
    if glob.str("rope_type", "default") not in ("default", "proportional"):
        refuse(f"full-attention rope_type {validate.short(rope['full_attention']['rope_type'])}")
    if glob.float("factor", 1.0) != 1.0:
        refuse("a full-attention rope factor != 1")
    ple = f.int("hidden_size_per_layer_input", 0, lo=0, hi=validate.MAX_DIM) if f.given(
        "hidden_size_per_layer_input") else 0
    vocab = f.int("vocab_size", lo=1, hi=validate.MAX_DIM)
    cap = f.float("final_logit_softcapping", None, lo=0.0, lo_open=True) if f.given(
        "final_logit_softcapping") else None
    return Gemma4Config(
        vocab_size=vocab, hidden_size=f.int("hidden_size", lo=1, hi=validate.MAX_DIM),
        num_layers=n, num_heads=heads_n, sliding=sliding, heads=tuple(heads),
        kv_source=kv_source, k_eq_v=k_eq_v,
        mlp_width=tuple(width * (2 if double and i >= first else 1) for i in range(n)),
        sliding_window=f.int("sliding_window", lo=1),
        rope_local_theta=local.float("rope_theta", 10000.0, lo=0.0, lo_open=True),
        rope_global_theta=glob.float("rope_theta", 1e6, lo=0.0, lo_open=True),
        rope_global_partial=glob.float("partial_rotary_factor", 1.0, lo=0.0, hi=1.0),
        ple_dim=ple, ple_vocab=f.int("vocab_size_per_layer_input", vocab, lo=1) if ple else 0,
        num_experts=f.int("num_experts", lo=1, hi=1 << 16) if moe else 0,
        top_k=f.int("top_k_experts", lo=1) if moe else 0,
        moe_intermediate_size=f.int("moe_intermediate_size", lo=1) if moe else 0,
        final_logit_softcapping=cap, rms_norm_eps=f.float("rms_norm_eps", 1e-6, lo=0.0, lo_open=True),
        tie_word_embeddings=f.bool("tie_word_embeddings", True),
        max_position_embeddings=f.int("max_position_embeddings", 8192, lo=1, hi=(1 << 31) - 1),
        dtype=dtype,
    )


def kv_sources(sliding: tuple[bool, ...], shared: int, refuse) -> tuple[int, ...]:
    """Per layer, the layer whose k/v it attends: itself, or for the last `shared` layers the
    last earlier layer of the same type (`refuse(what)` raises where there is none)."""
    first = len(sliding) - shared
    out = list(range(first))
    for i in range(first, len(sliding)):
        same = [j for j in range(first) if sliding[j] == sliding[i]]
        if not same:
            refuse(f"layer {i} sharing k/v with no earlier layer of its type")
        out.append(same[-1])
    return tuple(out)


# HF names (after `model.` or `model.language_model.`) -> ours
GLOBAL_NAMES = {
    "embed_tokens.weight": "embed", "norm.weight": "final_norm",
    "embed_tokens_per_layer.weight": "ple_embed",
    "per_layer_model_projection.weight": "ple_model_proj",
    "per_layer_projection_norm.weight": "ple_proj_norm",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm", "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
    "post_feedforward_layernorm.weight": "post_mlp_norm", "layer_scalar": "layer_scalar",
    "per_layer_input_gate.weight": "ple_gate", "per_layer_projection.weight": "ple_proj",
    "post_per_layer_input_norm.weight": "ple_norm",
    "router.proj.weight": "router", "router.scale": "router_scale",
    "router.per_expert_scale": "expert_scale", "experts.gate_up_proj": "we_gate_up",
    "experts.down_proj": "we_down", "post_feedforward_layernorm_1.weight": "post_mlp_norm_1",
    "pre_feedforward_layernorm_2.weight": "moe_norm",
    "post_feedforward_layernorm_2.weight": "post_moe_norm",
}
_PREFIXES = ("model.language_model.", "model.")


def our_name(hf_name: str) -> str | None:
    return registry.hf_tensor_name(hf_name, LAYER_NAMES, prefixes=_PREFIXES,
                                   globals_=GLOBAL_NAMES)


def split_fused(flat: dict, cfg: Gemma4Config) -> dict:
    """`we_gate_up` [E, 2F, D] -> `we_gate`, `we_up` [E, F, D] (numpy views; the shared
    `moe.stack_expert_tensors`)."""
    return moe.stack_expert_tensors(flat, cfg.num_experts, cfg.moe_intermediate_size,
                                    "the checkpoint")
