"""Phi-3 (4k/8k context variants): a Llama-family decoder whose q/k/v and gate/up projections are
stored fused (`qkv_proj` [(N + 2K) H, D], `gate_up_proj` [2F, D]), with a sliding window on every
layer when its config sets one.

The fused weights are split on load into the Llama leaves (wq, wk, wv, w_gate, w_up), so Phi-3
runs on `models.llama` unchanged: every layout, the CPU kernels (the packed layout fuses them
again, as it does for every Llama-family model) and the sharding rules (a fused [q; k; v] matrix
could not be split over heads). The target is a `LlamaTarget` named "phi3".

This module is Phi-3's one home: its config.json reader (`phi3_config_from_hf`, a dict in, so it
sits with the forward below the loading layer), the fused-weight split, the target and the
`register_family` call, with its tensor-name map. `loading/families.py` reads its files (tensors,
tokenizer, eos).
"""

from __future__ import annotations

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.models import llama, registry
from jaxspec.models.llama import LlamaTarget, ModelConfig

# config.json tensor names in a layer -> our leaves (the fused ones split by `split_fused`)
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.qkv_proj.weight": "wqkv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_up_proj.weight": "w_gate_up",
    "mlp.down_proj.weight": "w_down",
}


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


def phi3_config_from_hf(hf: dict, *, dtype: str, source: str) -> ModelConfig:
    """Phi-3 as a Llama-family config (fused weights are split on load)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise JaxspecError(f"{source}: hidden_act={act!r} is not supported (silu)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise JaxspecError(
            f"{source}: Phi-3 rope {kind!r} (the 128k variants) is not supported: use a 4k/8k model"
        )
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise JaxspecError(f"{source}: partial_rotary_factor != 1 is not supported")
    f = validate.Fields(hf, source)
    dims = validate.decoder_dims(f)
    rf = validate.Fields(rope, source, "rope_parameters.")
    theta = rf.float("rope_theta", None) if rf.given("rope_theta") else f.float("rope_theta", 10000.0)
    if not theta > 0.0:
        f.fail("rope_theta", theta, "use a finite number > 0")
    return ModelConfig(
        vocab_size=f.int("vocab_size", lo=1, hi=validate.MAX_DIM),
        **dims,
        rope_theta=theta,
        rms_norm_eps=f.float("rms_norm_eps", 1e-5, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        max_position_embeddings=f.int("max_position_embeddings", 4096, lo=1, hi=(1 << 31) - 1),
        dtype=dtype,
        sliding_window=f.int("sliding_window", None, lo=1),
    )


def _phi3_target_from_hf(hf: dict, *, dtype: str, source: str) -> LlamaTarget:
    return phi3_target(phi3_config_from_hf(hf, dtype=dtype, source=source))


registry.register_family(registry.Family(
    "phi3", ("phi3",), (), _phi3_target_from_hf,
    hf=registry.HfLayout(
        config=phi3_config_from_hf,
        tensor_name=lambda n: registry.hf_tensor_name(n, HF_LAYER_NAMES),
        param_shapes=llama.param_shapes, target=lambda cfg, arch: phi3_target(cfg),
        convert=lambda flat, cfg, source: split_fused(flat, cfg),
        architecture=lambda cfg: "phi3", llama_leaves=True)))
