"""Phi-3 (4k/8k context variants): a Llama-family decoder whose q/k/v and gate/up projections are
stored fused (`qkv_proj` [(N + 2K) H, D], `gate_up_proj` [2F, D]), with a sliding window on every
layer when its config sets one.

The fused weights are split on load into the Llama leaves (wq, wk, wv, w_gate, w_up), so Phi-3
runs on `models.llama` unchanged: every layout, the CPU kernels (the packed layout fuses them
again, as it does for every Llama-family model) and the sharding rules (a fused [q; k; v] matrix
could not be split over heads). The target is a `LlamaTarget` named "phi3".
"""

from __future__ import annotations

from jaxspec.errors import JaxspecError
from jaxspec.models.llama import LlamaTarget, ModelConfig


def split_fused(flat: dict, cfg: ModelConfig) -> dict:
    """Flat tensors with `layers.i.wqkv` / `layers.i.w_gate_up` -> the split Llama leaves (numpy
    views, no copy); every other tensor passes through."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, w in flat.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "wqkv":
            if w.shape[0] != q + 2 * kv:
                raise JaxspecError(
                    f"{name}: qkv_proj has {w.shape[0]} rows, config implies {q + 2 * kv}: the "
                    f"checkpoint does not match its config"
                )
            out |= {f"{prefix}.wq": w[:q], f"{prefix}.wk": w[q : q + kv], f"{prefix}.wv": w[q + kv :]}
        elif leaf == "w_gate_up":
            if w.shape[0] != 2 * cfg.intermediate_size:
                raise JaxspecError(
                    f"{name}: gate_up_proj has {w.shape[0]} rows, config implies "
                    f"{2 * cfg.intermediate_size}: the checkpoint does not match its config"
                )
            f = cfg.intermediate_size
            out |= {f"{prefix}.w_gate": w[:f], f"{prefix}.w_up": w[f:]}
        else:
            out[name] = w
    return out


def phi3_target(cfg: ModelConfig) -> LlamaTarget:
    return LlamaTarget(cfg, name="phi3")
