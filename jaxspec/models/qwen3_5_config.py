"""Qwen3.5's config (dense, and the MoE fields `models/qwen3_5_moe.py` fills), its config.json
reader, tensor-name map and the file hooks the family registry declares (conv reshape, layouts).
A dict in, no files.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.models import linear_attention as la
from jaxspec.models.decoder import DecoderDims

LAYER_TYPES = ("linear_attention", "full_attention")
DEFAULT_RING = 16  # linear-state slots per row: windows and draft rollbacks up to 15 tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35Config(DecoderDims):
    layer_types: tuple[str, ...]
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int = 4
    rope_theta: float = 10000000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"
    state_ring: int = DEFAULT_RING
    # Qwen3.5-MoE (`models/qwen3_5_moe.py`): every layer's MLP routed over num_experts > 0
    # experts of width moe_intermediate_size (top_k per token, weights renormed) plus a shared
    # expert of width shared_expert_intermediate_size behind a sigmoid gate
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def linear_dims(self) -> la.Dims:
        return la.Dims(self.linear_key_heads, self.linear_value_heads, self.linear_key_dim,
                       self.linear_value_dim, self.conv_kernel)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    def slot(self, i: int) -> int:
        """Layer i's index among the layers of its own type (its cache leaves)."""
        return sum(self.is_linear(j) == self.is_linear(i) for j in range(i))


# config.json tensor names in a layer -> our leaves
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "linear_attn.in_proj_qkv.weight": "in_qkv",
    "linear_attn.in_proj_z.weight": "in_z",
    "linear_attn.in_proj_b.weight": "in_b",
    "linear_attn.in_proj_a.weight": "in_a",
    "linear_attn.conv1d.weight": "conv",  # [C, 1, Kc] stored, [C, Kc] ours
    "linear_attn.dt_bias": "dt_bias",
    "linear_attn.A_log": "A_log",
    "linear_attn.norm.weight": "norm",
    "linear_attn.out_proj.weight": "out",
}


def text_config(hf: dict) -> dict:
    """The text model's config: `text_config` of a multimodal checkpoint, else the config."""
    return hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf


def qwen3_5_config_from_hf(hf: dict, *, dtype: str, source: str) -> Qwen35Config:
    """config.json of Qwen3_5ForCausalLM (`qwen3_5_text`) or the text part of the multimodal
    `qwen3_5` config, every field checked; layer types other than linear_attention /
    full_attention refused in one line before any tensor is read."""
    text = text_config(hf)
    if "num_experts" in text or "moe_intermediate_size" in text:
        raise JaxspecError(f"{source}: a dense Qwen3.5 config (model_type {hf.get('model_type')!r}) "
                           f"declares experts: a Qwen3.5-MoE checkpoint says model_type "
                           f"qwen3_5_moe_text (or qwen3_5_moe)")
    return hybrid_config_from_hf(hf, text, dtype=dtype, source=source)


def hybrid_config_from_hf(hf: dict, text: dict, *, dtype: str, source: str) -> Qwen35Config:
    """The hybrid decoder's fields of a Qwen3.5-style text config `text` (inside config.json
    `hf`), every field checked; the MLP is the caller's (dense here, `qwen3_5_moe` replaces it)."""
    f = validate.Fields(text, source)
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise JaxspecError(f"{source}: hidden_act={act!r} is not supported (Qwen3.5: silu)")
    if f.bool("attention_bias", False):
        raise JaxspecError(f"{source}: attention_bias=true is not supported by jaxspec's Qwen3.5")
    dims = validate.decoder_dims(f)
    types = text.get("layer_types")
    if types is None:
        every = f.int("full_attention_interval", 4, lo=1)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(dims["num_layers"])]
    if not isinstance(types, list) or len(types) != dims["num_layers"]:
        f.fail("layer_types", types, f"give one entry per layer ({dims['num_layers']})")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise JaxspecError(f"{source}: layer_types {bad} are not supported: jaxspec's Qwen3.5 "
                           f"implements {', '.join(LAYER_TYPES)}")
    if "full_attention" not in types:
        f.fail("layer_types", types, "give at least one full_attention layer")
    rope = f.dict("rope_parameters", None) if f.given("rope_parameters") else {}
    rf = validate.Fields(rope, source, "rope_parameters.")
    kind = rf.str("rope_type", "default")
    if kind != "default":
        raise JaxspecError(f"{source}: rope_type {kind!r} is not supported (Qwen3.5: default)")
    theta = rf.float("rope_theta", None) if rf.given("rope_theta") else f.float("rope_theta", 1e7)
    partial = rf.float("partial_rotary_factor", f.float("partial_rotary_factor", 0.25),
                       lo=0.0, hi=1.0, lo_open=True)
    lin = validate.Fields(text, source)
    cfg = Qwen35Config(
        vocab_size=f.int("vocab_size", lo=1, hi=validate.MAX_DIM), **dims,
        layer_types=tuple(types),
        linear_key_heads=lin.int("linear_num_key_heads", 16, lo=1),
        linear_value_heads=lin.int("linear_num_value_heads", 32, lo=1),
        linear_key_dim=lin.int("linear_key_head_dim", 128, lo=1),
        linear_value_dim=lin.int("linear_value_head_dim", 128, lo=1),
        conv_kernel=lin.int("linear_conv_kernel_dim", 4, lo=2, hi=64),
        rope_theta=theta, partial_rotary_factor=partial,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                        f.bool("tie_word_embeddings", False))),
        max_position_embeddings=f.int("max_position_embeddings", 32768, lo=1, hi=(1 << 31) - 1),
        dtype=dtype,
    )
    if cfg.linear_value_heads % cfg.linear_key_heads:
        lin.fail("linear_num_value_heads", cfg.linear_value_heads,
                 f"use a multiple of linear_num_key_heads={cfg.linear_key_heads}")
    if cfg.rotary_dim % 2:
        rf.fail("partial_rotary_factor", partial, "give an even number of rotary dims per head")
    return cfg


HF_PREFIXES = ("model.language_model.", "model.")  # the multimodal layout, then the plain one
HF_SKIPPED = r"(model\.)?visual\..*|mtp\..*|.*rotary_emb\.inv_freq"  # vision tower, MTP head


def convert(flat: dict, cfg: Qwen35Config, source: str) -> dict:
    """The stored depthwise conv [C, 1, Kc] -> ours [C, Kc]; in_qkv's and the conv's channels
    from the stored q | k | v order to ours (`grouped_channels`)."""
    flat = {k: (w[:, 0] if k.endswith(".conv") and w.ndim == 3 and w.shape[1] == 1 else w)
            for k, w in flat.items()}
    return group_channels(flat, cfg)


def group_channels(flat: dict, cfg: Qwen35Config) -> dict:
    """in_qkv [C, D] and conv [C, Kc] leaves' rows in `la.grouped_channels` order (a lazy leaf,
    marked `lazy`, is rebuilt as one of its own type, read when first indexed)."""
    order = la.grouped_channels(cfg.linear_dims)
    pick = lambda w: np.asarray(w[...] if getattr(w, "lazy", False) else w)[order]  # noqa: E731
    out = {}
    for k, w in flat.items():
        if k.endswith((".in_qkv", ".conv")):
            w = type(w)(w.shape, lambda w=w: pick(w)) if getattr(w, "lazy", False) else pick(w)
        out[k] = w
    return out


def check_layout(cfg, layout: str, note: str, source: str, mesh=None) -> tuple[str, str]:
    """(layout, why) a hybrid model loads in ("auto" -> "unrolled"), or a one-line refusal; on a
    mesh its params are placed by the target's `param_axes` (`sharding.py`)."""
    if layout in ("auto", "unrolled") or note.startswith("auto"):
        return "unrolled", "hybrid linear attention: per-layer arrays"
    raise JaxspecError(f"layout {layout!r} is not available for Qwen3.5 (hybrid linear "
                       f"attention): use layout 'unrolled' or 'auto'")


