"""Gemma 2 and Gemma 3 (text): the architecture (`GemmaConfig`) and how checkpoints state it.

    config.json   `model_type` gemma2 | gemma3_text | gemma3 (the multimodal config: its text
                  decoder's config sits under `text_config`), transformers 4.x keys or 5.x
                  `rope_parameters` (`gemma_config_from_hf`)
    GGUF          `general.architecture` gemma2 | gemma3 metadata (`gemma_config_from_gguf`)

and the tensor names each uses for our leaves (HF_LAYER_NAMES, GGUF_LAYER_NAMES). The readers
take parsed data (a dict, a GGUF header's fields), never a file, so they sit in `models/` with
the forward (`models/gemma.py`, which registers the family); `loading/families.py` opens the
files. GGUF metadata does not carry Gemma 3's local RoPE base, its local/global pattern or
query_pre_attn_scalar: transformers' Gemma3TextConfig defaults (10000, every 6th layer global,
256) fill them, as they do for transformers' own GGUF load.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.models.decoder import DecoderDims

FAMILIES = ("gemma2", "gemma3")
MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig(DecoderDims):
    """Architecture of a Gemma 2 / Gemma 3 text decoder. Hashable (a static jit argument)."""

    family: str  # "gemma2" | "gemma3"
    query_pre_attn_scalar: float
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]  # per layer: True = local (sliding-window) attention
    rope_theta: float = 10000.0  # global layers (and every layer of Gemma 2)
    rope_local_theta: float | None = None  # local layers (Gemma 3 `rope_local_base_freq`)
    rope_linear_factor: float = 1.0  # global layers' linear position scaling (Gemma 3 4B+)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    # traits the generic loop code reads from every config
    attention_bias: bool = False
    rope_scaling: None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: use one of {FAMILIES}")
        super().__post_init__()
        if len(self.sliding_layers) != self.num_layers:
            raise ValueError(
                f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers"
            )
        if any(self.sliding_layers) and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")

    @property
    def qk_norm(self) -> bool:
        return self.family == "gemma3"

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.sliding_layers[i] else None


_GEMMA3_DEFAULTS = {"rope_local_theta": 10000.0, "rope_theta": 1_000_000.0, "pattern": 6,
                    "query_pre_attn_scalar": 256}

HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}

def hf_kind(hf: dict) -> str | None:
    """gemma2 | gemma3_text | gemma3 (multimodal) for a Gemma config.json, else None: its
    `model_type`, or without one its `architectures`."""
    kind = hf.get("model_type")
    if kind in MODEL_TYPES:
        return kind
    archs = " ".join(hf.get("architectures") or ())
    if "Gemma3" in archs:
        return "gemma3" if "text_config" in hf else "gemma3_text"
    return "gemma2" if "Gemma2" in archs else None


def gemma_config_from_hf(hf: dict, *, dtype: str, source: str) -> GemmaConfig:
    """Gemma 2 / Gemma 3 config.json (transformers 4.x keys or 5.x `rope_parameters`)."""
    kind = hf_kind(hf)
    if kind == "gemma3":  # multimodal: the text decoder's config is nested
        hf = dict(hf.get("text_config") or {})
        kind = "gemma3_text"
    family = "gemma2" if kind == "gemma2" else "gemma3"
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise JaxspecError(f"{source}: hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
    if hf.get("attention_bias"):
        raise JaxspecError(f"{source}: attention_bias=true is not supported for {family}")
    if hf.get("use_bidirectional_attention"):
        raise JaxspecError(f"{source}: use_bidirectional_attention=true is an encoder: not supported")
    f = validate.Fields(hf, source)
    dims = validate.decoder_dims(f)
    n = dims["num_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:  # the BC pattern: every `pattern`-th layer global
        pattern = f.int("sliding_window_pattern", 2 if family == "gemma2" else 6, lo=1, hi=n + 1)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        f.fail("layer_types", layer_types, "use a list of 'sliding_attention' / 'full_attention'")
    bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if bad or len(layer_types) != n:
        raise JaxspecError(f"{source}: layer_types {bad or len(layer_types)} not understood")
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    theta, local_theta, linear = _gemma_rope(hf, family, source)
    window = f.int("sliding_window", None, lo=1)
    if window is None:
        sliding = (False,) * n
    return GemmaConfig(
        family=family,
        vocab_size=f.int("vocab_size", lo=1, hi=validate.MAX_DIM),
        **dims,
        query_pre_attn_scalar=f.float("query_pre_attn_scalar", 256.0, lo=0.0, lo_open=True),
        sliding_window=window,
        sliding_layers=sliding,
        rope_theta=theta,
        rope_local_theta=local_theta,
        rope_linear_factor=linear,
        attn_logit_softcapping=_softcap(f, "attn_logit_softcapping", hf, 50.0 if family == "gemma2" else None),
        final_logit_softcapping=_softcap(f, "final_logit_softcapping", hf, 30.0 if family == "gemma2" else None),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings=f.bool("tie_word_embeddings", True),
        max_position_embeddings=f.int("max_position_embeddings", 8192, lo=1, hi=(1 << 31) - 1),
        dtype=dtype,
    )


def _softcap(f: validate.Fields, key: str, hf: dict, default: float | None) -> float | None:
    """A soft-capping value: absent -> the family's default, null -> off, else a number > 0."""
    if key in hf and hf[key] is None:
        return None
    return f.float(key, default, lo=0.0, lo_open=True) if default is not None or f.given(key) else None


def _gemma_rope(hf: dict, family: str, source: str) -> tuple[float, float | None, float]:
    """(global theta, local theta, global linear factor) from either config generation."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # 5.x, per layer type
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
    else:  # 4.x: rope_theta, rope_local_base_freq, rope_scaling (global layers)
        full = dict(hf.get("rope_scaling") or {}) | {"rope_theta": hf.get("rope_theta", params.get("rope_theta"))}
        local = {"rope_theta": hf.get("rope_local_base_freq")}
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise JaxspecError(f"{source}: rope_parameters / rope_scaling must be JSON objects")
    default = 10000.0 if family == "gemma2" else _GEMMA3_DEFAULTS["rope_theta"]
    positive = dict(lo=0.0, lo_open=True)
    full_f = validate.Fields(full, source, "rope (global layers).")
    theta = full_f.float("rope_theta", default, **positive)
    linear = 1.0
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        linear = full_f.float("factor", **positive)
    elif kind != "default":
        raise JaxspecError(f"{source}: rope type {kind!r} is not supported for {family} (default, linear)")
    if (local.get("rope_type") or "default") != "default":
        raise JaxspecError(f"{source}: scaled rope on sliding layers is not supported")
    if family == "gemma2":
        return theta, None, linear
    local_f = validate.Fields(local, source, "rope (sliding layers).")
    return theta, local_f.float("rope_theta", _GEMMA3_DEFAULTS["rope_local_theta"], **positive), linear


def gemma_config_from_gguf(header, *, dtype: str, source: str) -> GemmaConfig:
    """Gemma 2 / 3 hyperparameters from GGUF metadata, gaps filled as transformers fills them."""
    arch = str(header.fields["general.architecture"].value)

    def raw(key):
        field = header.fields.get(f"{arch}.{key}")
        return validate.MISSING if field is None else field.contents()

    f = validate.Fields(raw, source, f"{arch}.")
    dims = validate.decoder_dims(f, gguf=True)
    n = dims["num_layers"]
    embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise JaxspecError(f"{source} has no token_embd.weight: the file is incomplete")
    pattern = 2 if arch == "gemma2" else _GEMMA3_DEFAULTS["pattern"]
    window = f.int("attention.sliding_window", 0, lo=0) or None
    sliding = tuple(bool((i + 1) % pattern) and window is not None for i in range(n))
    names = {t.name for t in header.tensors}
    return GemmaConfig(
        family=arch,
        vocab_size=int(embed.shape[0]),
        **dims,
        query_pre_attn_scalar=float(_GEMMA3_DEFAULTS["query_pre_attn_scalar"]),
        sliding_window=int(window) if window else None,
        sliding_layers=sliding,
        rope_theta=f.float("rope.freq_base", 10000.0 if arch == "gemma2" else 1e6, lo=0.0, lo_open=True),
        rope_local_theta=None if arch == "gemma2" else _GEMMA3_DEFAULTS["rope_local_theta"],
        attn_logit_softcapping=(f.float("attn_logit_softcapping", 50.0, lo=0.0, lo_open=True)
                                if arch == "gemma2" else None),
        final_logit_softcapping=(f.float("final_logit_softcapping", 30.0, lo=0.0, lo_open=True)
                                 if arch == "gemma2" else None),
        rms_norm_eps=f.float("attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=f.int("context_length", 8192, lo=1, hi=(1 << 31) - 1),
        dtype=dtype,
    )
