"""MoE model shapes for `jaxspec.tools.roofline` and the bytes a step reads of their *active*
weights: a step of N routed tokens (batch x window) reads the experts those tokens wake
(`models.moe.experts_woken`), not all of them, so a verify window costs more than a decode
token on an MoE model while its dense part costs the same.

    weight_bytes         every weight, once
    active_weight_bytes  the dense part + per MoE layer experts_woken(N) x one expert's bytes
                         (+ the shared expert, which every token runs)

Shapes: Qwen3-30B-A3B (48 layers, 128 experts top-8, width 768) and Qwen3.5-35B-A3B-like
(transformers' Qwen3_5MoeTextConfig defaults: 40 hybrid layers 3 linear : 1 full, 256 experts
top-8, width 512, shared expert 512).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models import moe, qwen3_5, qwen3_5_moe, qwen3_moe
from jaxspec.models.decoder import ModelConfig

EXPERT_LEAVES = ("we_gate", "we_up", "we_down")


def qwen3_30b_a3b(dtype: str) -> qwen3_moe.MoeTarget:
    base = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True,
                       rope_theta=1e6, max_position_embeddings=40960, dtype=dtype)
    cfg = qwen3_moe.MoeConfig(**{k: getattr(base, k) for k in base.__dataclass_fields__},
                              num_experts=128, top_k=8, moe_intermediate_size=768,
                              norm_topk_prob=True, moe_layers=(True,) * 48)
    return qwen3_moe.MoeTarget(cfg)


def qwen3_5_35b_a3b(dtype: str) -> qwen3_5_moe.Qwen35MoeTarget:
    cfg = qwen3_5.Qwen35Config(
        vocab_size=248320, hidden_size=2048, intermediate_size=512, num_layers=40,
        num_heads=16, num_kv_heads=2, head_dim=256,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(40)),
        linear_key_heads=16, linear_value_heads=32, linear_key_dim=128, linear_value_dim=128,
        max_position_embeddings=262144, dtype=dtype, num_experts=256, top_k=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512)
    return qwen3_5_moe.Qwen35MoeTarget(cfg)


def _moe_dims(target):
    """(num_experts, top_k) of an MoE target, None for a dense one."""
    cfg = getattr(target, "cfg", None)
    experts, top_k = getattr(cfg, "num_experts", 0), getattr(cfg, "top_k", 0)
    return (experts, top_k) if experts and top_k else None


def weight_bytes(target) -> tuple[float, float, int]:
    """(every weight's bytes, the routed experts' bytes, MoE layer count), from abstract params
    (no weights built)."""
    params = jax.eval_shape(lambda: target.init_params(jax.random.key(0)))
    nbytes = lambda x: x.size * jnp.dtype(x.dtype).itemsize  # noqa: E731
    total = sum(nbytes(x) for x in jax.tree.leaves(params))
    layers = params["layers"]
    experts = sum(nbytes(lp[k]) for lp in layers for k in EXPERT_LEAVES if k in lp)
    return float(total), float(experts), sum("router" in lp for lp in layers)


def active_weight_bytes(target, tokens: int) -> float:
    """Weight bytes a step of `tokens` routed tokens reads: the dense part whole, the routed
    experts as many as the tokens wake (`moe.active_weight_bytes`)."""
    dims = _moe_dims(target)
    total, experts, layers = weight_bytes(target)
    if dims is None or not layers:
        return total
    num_experts, top_k = dims
    one_expert = experts / (layers * num_experts)
    return total - experts + layers * moe.active_weight_bytes(tokens, top_k, num_experts,
                                                              one_expert)


def active_fields(target, batch: int, window: int) -> dict:
    """Extra roofline row fields for an MoE target ({} for a dense one): experts woken per
    layer, the active weight bytes and their share of all weights."""
    dims = _moe_dims(target)
    if dims is None:
        return {}
    total, _, _ = weight_bytes(target)
    active = active_weight_bytes(target, batch * window)
    return {"experts_woken": round(moe.experts_woken(batch * window, dims[1], dims[0]), 2),
            "active_weight_bytes": active, "active_share": round(active / total, 4)}
