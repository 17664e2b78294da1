"""Qwen3.5 and Qwen3.5-MoE GGUF files as llama.cpp's `convert_hf_to_gguf.py` writes them
(architectures `qwen35`, `qwen35moe`): its metadata read into a `Qwen35Config`, its tensor names
mapped onto our leaves, and the value changes it makes undone, so the params equal those read
from the Hugging Face checkpoint it was converted from (tests/test_qwen3_5_gguf.py, fixtures
written by the real converter: scripts/qwen3_5_gguf_fixtures.py).

What the converter changes (learned by running it, `conversion/qwen.py`):
  * every (1 + w) RMS norm (layer input, post-attention, q/k, final) is stored as w + 1; the
    linear layers' gated norm (`ssm_norm`, plain w) is not;
  * `A_log` is stored as A = -exp(A_log) (`ssm_a`); `dt_bias` as `ssm_dt.bias`;
  * value heads are regrouped from grouped-by-key-head ([Hk, r, Dv], ours and transformers')
    to tiled ([r, Hk, Dv], for ggml's broadcast) wherever they index a dim: the value rows of
    `attn_qkv` and the value channels of `ssm_conv1d`, the rows of `attn_gate` (z),
    `ssm_alpha`, `ssm_beta`, the entries of `ssm_a` / `ssm_dt.bias`, the columns of `ssm_out`;
  * the depthwise conv is squeezed to [C, Kc]; experts are stacked [E, ...] (ours already).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxspec import validate
from jaxspec.models import qwen3_5_config, qwen3_moe
from jaxspec.models.qwen3_5_config import Qwen35Config

# GGUF architecture -> has experts (`qwen3next`: Qwen3-Next, read by models/qwen3_next.py)
ARCHITECTURES = {"qwen35": False, "qwen35moe": True, "qwen3next": True}

# llama.cpp's names (`blk.<i>.` + this) -> our leaves: Qwen3-MoE's (but its `ffn_norm`), the
# post-attention norm, the linear layers' and the shared expert's
GGUF_LAYER_NAMES = {k: v for k, v in qwen3_moe.GGUF_LAYER_NAMES.items() if k != "ffn_norm.weight"} | {
    "post_attention_norm.weight": "mlp_norm",
    "attn_qkv.weight": "in_qkv", "attn_gate.weight": "in_z", "ssm_alpha.weight": "in_a",
    "ssm_beta.weight": "in_b", "ssm_conv1d.weight": "conv", "ssm_dt.bias": "dt_bias",
    "ssm_a": "A_log", "ssm_norm.weight": "norm", "ssm_out.weight": "out",
    "ffn_gate_shexp.weight": "ws_gate", "ffn_up_shexp.weight": "ws_up",
    "ffn_down_shexp.weight": "ws_down", "ffn_gate_inp_shexp.weight": "ws_router",
}
OFFSET_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")  # stored as w + 1


def config_from_gguf(header, *, dtype: str, source: str) -> Qwen35Config:
    """`qwen35` / `qwen35moe` / `qwen3next` metadata, every field checked: layer types from
    `attention.recurrent_layers`, linear dims from the `ssm.*` keys, the rotary share from
    `rope.dimension_count` over the head dim."""
    arch = str(header.fields["general.architecture"].value)
    f, dims, vocab, names = qwen3_moe.gguf_fields(header, source, bool(ARCHITECTURES.get(arch)))
    recurrent = f.get_raw("attention.recurrent_layers")
    if not isinstance(recurrent, list) or len(recurrent) != dims["num_layers"]:
        f.fail("attention.recurrent_layers", recurrent,
               f"give one entry per layer ({dims['num_layers']}): a file with MTP layers "
               f"appended is not supported (convert with --no-mtp)")
    value_heads = f.int("ssm.time_step_rank", lo=1)
    rotary = f.int("rope.dimension_count", lo=2, hi=dims["head_dim"])
    cfg = Qwen35Config(
        vocab_size=vocab, **dims,
        layer_types=tuple("linear_attention" if r else "full_attention" for r in recurrent),
        linear_key_heads=f.int("ssm.group_count", lo=1), linear_value_heads=value_heads,
        linear_key_dim=f.int("ssm.state_size", lo=1),
        linear_value_dim=f.int("ssm.inner_size", lo=value_heads) // value_heads,
        conv_kernel=f.int("ssm.conv_kernel", lo=2, hi=64),
        rope_theta=f.float("rope.freq_base", 1e7, lo=0.0, lo_open=True),
        partial_rotary_factor=rotary / dims["head_dim"],
        rms_norm_eps=f.float("attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0,
                             lo_open=True),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=f.int("context_length", 32768, lo=1, hi=(1 << 31) - 1),
        dtype=dtype)
    if cfg.linear_value_heads % cfg.linear_key_heads:
        f.fail("ssm.time_step_rank", value_heads,
               f"use a multiple of ssm.group_count={cfg.linear_key_heads}")
    if not ARCHITECTURES.get(arch):
        return cfg
    experts = f.int("expert_count", lo=1, hi=1 << 16)
    return dataclasses.replace(
        cfg, num_experts=experts, top_k=f.int("expert_used_count", lo=1, hi=experts),
        moe_intermediate_size=f.int("expert_feed_forward_length", lo=1, hi=validate.MAX_DIM),
        shared_expert_intermediate_size=f.int("expert_shared_feed_forward_length", lo=1,
                                              hi=validate.MAX_DIM))


def untile(x: np.ndarray, axis: int, key_heads: int, per_key: int, size: int) -> np.ndarray:
    """Value heads along `axis` from llama.cpp's tiled order [r, Hk, size] back to ours, grouped
    by key head [Hk, r, size]."""
    x = np.moveaxis(np.asarray(x), axis, 0)
    rest = x.shape[1:]
    x = x.reshape(per_key, key_heads, size, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest)))
    return np.moveaxis(x.reshape(key_heads * per_key * size, *rest), 0, axis)


def undo(leaf: str, w: np.ndarray, cfg: Qwen35Config, tiled: bool = True) -> np.ndarray:
    """One tensor as the converter stored it -> our leaf's values (tiled: value heads in
    llama.cpp's tiled order, as its Qwen3.5 classes write them; its Qwen3-Next class keeps
    transformers' grouped order)."""
    if leaf in OFFSET_NORMS:
        return (w.astype(np.float32) - 1.0).astype(w.dtype)
    hk, hv, dk, dv = (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
                      cfg.linear_value_dim)
    r = hv // hk
    if leaf == "A_log":
        w = np.log(-w.astype(np.float64)).astype(w.dtype)
    if r == 1 or not tiled or leaf not in ("in_qkv", "conv", "in_z", "in_a", "in_b", "A_log", "dt_bias",
                              "out"):
        return w
    if leaf in ("in_qkv", "conv"):  # only the value channels, after q and k
        qk = 2 * hk * dk
        return np.concatenate([w[:qk], untile(w[qk:], 0, hk, r, dv)], axis=0)
    if leaf == "in_z":
        return untile(w, 0, hk, r, dv)
    if leaf == "out":
        return untile(w, 1, hk, r, dv)
    return untile(w, 0, hk, r, 1)  # in_a, in_b [Hv, D]; A_log, dt_bias [Hv]


def convert(flat: dict, cfg: Qwen35Config, source: str, tiled: bool = True) -> dict:
    """Undo the converter's changes on every leaf (lazy tensors stay lazy: a leaf marked `lazy`,
    the loader's LazyTensor, is rebuilt as one of its own type, so models/ need not import
    loading/)."""
    out = {}
    for key, w in flat.items():
        leaf = key.rsplit(".", 1)[-1]
        if getattr(w, "lazy", False):
            out[key] = type(w)(w.shape, lambda w=w, leaf=leaf: undo(leaf, w[...], cfg, tiled))
        else:
            out[key] = undo(leaf, w, cfg, tiled)
    return qwen3_5_config.group_channels(out, cfg)
