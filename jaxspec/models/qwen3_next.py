"""Qwen3-Next (`Qwen3NextForCausalLM`, model_type qwen3_next): Qwen3.5-MoE's decoder before it
(`models/qwen3_5_moe.py`: Gated DeltaNet linear layers, gated full attention, routed experts
and a gated shared expert on every layer, the exact state rollback), stored differently: each
linear layer's input projections are fused per key head,

    in_proj_qkvz [Hk (2 Dk + 2 r Dv), D]   per key head: q (Dk), k (Dk), v (r Dv), z (r Dv)
    in_proj_ba   [Hk (2 r), D]             per key head: b (r), a (r)       (r = Hv / Hk)

split on load into Qwen3.5's `in_qkv` (all q, all k, all v: the convolution's channel order,
then grouped by key head like Qwen3.5's, `linear_attention.grouped_channels`), `in_z`, `in_b`,
`in_a`. Everything else is Qwen3.5-MoE's: config reader (dense layers by `mlp_only_layers` /
`decoder_sparse_step` are refused in one line), names, forward, target. GGUF: llama.cpp's
`qwen3next` files (its converter splits qkvz itself and keeps `ssm_ba` fused; read by
`gguf_convert`).
"""

from __future__ import annotations

import numpy as np

from jaxspec.models import qwen3_5, qwen3_5_gguf, qwen3_5_moe, registry
from jaxspec.models.qwen3_5 import Qwen35Config

_FUSED = {"linear_attn.in_proj_qkvz.weight": "in_qkvz", "linear_attn.in_proj_ba.weight": "in_ba"}


def qwen3_next_config_from_hf(hf: dict, *, dtype: str, source: str) -> Qwen35Config:
    return qwen3_5_moe.qwen3_5_moe_config_from_hf(hf, dtype=dtype, source=source,
                                                  family="Qwen3-Next")


def our_layer_name(rest: str) -> str | None:
    return _FUSED.get(rest) or qwen3_5_moe.our_layer_name(rest)


def split_fused(flat: dict, cfg: Qwen35Config) -> dict:
    """`layers.i.in_qkvz` / `in_ba` (per key head) -> Qwen3.5's in_qkv, in_z, in_b, in_a."""
    ld = cfg.linear_dims
    hk, dk, dv, r = ld.key_heads, ld.key_dim, ld.value_dim, ld.value_heads // ld.key_heads
    out = {}
    for name, w in flat.items():
        stem, _, leaf = name.rpartition(".")
        if leaf == "in_qkvz":
            w = np.asarray(w).reshape(hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = np.split(w, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            d = w.shape[-1]
            out[f"{stem}.in_qkv"] = np.concatenate(
                [q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
            out[f"{stem}.in_z"] = z.reshape(-1, d)
        elif leaf == "in_ba":
            w = np.asarray(w).reshape(hk, 2 * r, -1)
            out[f"{stem}.in_b"] = w[:, :r].reshape(hk * r, -1)
            out[f"{stem}.in_a"] = w[:, r:].reshape(hk * r, -1)
        else:
            out[name] = w
    return out


def convert(flat: dict, cfg: Qwen35Config, source: str) -> dict:
    return qwen3_5_moe.convert(split_fused(flat, cfg), cfg, source)


def _target(cfg: Qwen35Config, arch: str = "qwen3_next") -> qwen3_5_moe.Qwen35MoeTarget:
    return qwen3_5_moe.Qwen35MoeTarget(cfg, name="qwen3_next")


def _target_from_hf(hf: dict, *, dtype: str, source: str) -> qwen3_5_moe.Qwen35MoeTarget:
    return _target(qwen3_next_config_from_hf(hf, dtype=dtype, source=source))


def _target_from_gguf(header, *, dtype: str, source: str) -> qwen3_5_moe.Qwen35MoeTarget:
    return _target(qwen3_5_gguf.config_from_gguf(header, dtype=dtype, source=source))


def gguf_convert(flat: dict, cfg: Qwen35Config, source: str) -> dict:
    """llama.cpp's `qwen3next` file: its fused `ssm_ba` (per key head, as transformers stores
    it) split, then the Qwen3.5 converter's value changes undone, value heads already grouped
    (its Qwen3-Next class does not tile them)."""
    return qwen3_5_gguf.convert(split_fused(flat, cfg), cfg, source, tiled=False)


GGUF_LAYER_NAMES = qwen3_5_gguf.GGUF_LAYER_NAMES | {"ssm_ba.weight": "in_ba"}

registry.register_family(registry.Family(
    "qwen3_next", ("qwen3_next",), ("qwen3next",), _target_from_hf, _target_from_gguf,
    hf=registry.FileLayout(
        config=qwen3_next_config_from_hf,
        tensor_name=lambda n: registry.hf_tensor_name(n, our_layer_name,
                                                      prefixes=qwen3_5.HF_PREFIXES),
        param_shapes=qwen3_5.param_shapes, target=_target, skip=qwen3_5.HF_SKIPPED,
        convert=convert, layout=qwen3_5.check_layout, architecture=lambda cfg: "qwen3_next"),
    gguf=registry.FileLayout(
        config=qwen3_5_gguf.config_from_gguf,
        tensor_name=lambda n: registry.gguf_tensor_name(n, GGUF_LAYER_NAMES),
        param_shapes=qwen3_5.param_shapes, target=_target, convert=gguf_convert,
        layout=qwen3_5.check_layout, architecture=lambda cfg: "qwen3_next")))
