"""Hugging Face checkpoint directories: config.json + *.safetensors (single file or sharded).

Tensors are memory-mapped straight from the safetensors files with numpy (no torch; bfloat16 via
ml_dtypes, which numpy alone cannot name), so nothing is copied before the cast to the compute
dtype. The format is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}}`, then the raw bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.loading.safetensors_file import SafetensorsFile
from jaxspec.models.llama import ModelConfig, RopeScaling

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some old checkpoints saved



def read_hf_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise JaxspecError(
            f"cannot read {path / 'config.json'} ({e}): fix or re-download it"
        ) from e


def config_from_hf(hf: dict, *, dtype: str, source: str = "config.json") -> ModelConfig:
    """config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
    arch = _architecture(hf, source)
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise JaxspecError(f"{source}: hidden_act={act!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
        raise JaxspecError(f"{source}: mlp_bias=true is not supported by jaxspec's Llama model")
    if arch != "qwen2" and hf.get("attention_bias"):
        raise JaxspecError(
            f"{source}: attention_bias=true on {arch} (which biases o_proj too) is not supported"
        )
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    max_pos = hf.get("max_position_embeddings", 2048)
    window = _sliding_window(hf, arch)  # masked per layer (models.llama), no context cap
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(theta),
        rope_scaling=_rope_scaling(rope, source),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(max_pos),
        dtype=dtype,
        sliding_window=int(window) if window else None,
        sliding_layers=_sliding_layers(hf, window),
    )


def _architecture(hf: dict, source: str) -> str:
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs and hf.get("model_type") in ARCHITECTURES.values():
        return hf["model_type"]
    got = ", ".join(archs) or hf.get("model_type", "none")
    raise JaxspecError(
        f"{source}: architecture {got} is not supported: use one of {', '.join(ARCHITECTURES)}"
    )


def _rope_scaling(rope: dict, source: str) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise JaxspecError(
            f"{source}: rope scaling {kind!r} is not supported (only 'default' and 'llama3')"
        )
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
    )


def _sliding_layers(hf: dict, window) -> tuple[bool, ...] | None:
    """Which layers slide when the config says per layer (layer_types, or Qwen2's
    max_window_layers: layers from it on slide); None: every layer."""
    if not window:
        return None
    if hf.get("layer_types"):
        return tuple(t == "sliding_attention" for t in hf["layer_types"])
    if hf.get("use_sliding_window") and hf.get("max_window_layers") is not None:
        return tuple(i >= hf["max_window_layers"] for i in range(hf["num_hidden_layers"]))
    return None


def _sliding_window(hf: dict, arch: str) -> int | None:
    if arch == "mistral":
        return hf.get("sliding_window")
    if arch in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        return hf.get("sliding_window")
    if "sliding_attention" in (hf.get("layer_types") or ()):
        return hf.get("sliding_window")
    return None


def load_hf_tensors(
    path: Path, cfg: ModelConfig, skip_from_layer: int | None = None
) -> dict[str, np.ndarray]:
    """Every tensor under our flat names (`embed`, `layers.3.wq`, ...), memory-mapped.
    `skip_from_layer`: ignore `model.layers.{i}.*` for i >= it (MTP modules stored with the
    target, `num_nextn_predict_layers`: read as a drafter by jaxspec.formats.mtp)."""
    index = tensor_index(path)
    flat: dict[str, np.ndarray] = {}
    unknown = []
    for hf_name, shard in index.items():
        m = _LAYER_RE.fullmatch(hf_name)
        if skip_from_layer is not None and m and int(m.group(1)) >= skip_from_layer:
            continue
        ours = _our_name(hf_name)
        if ours is None:
            if not _IGNORED.match(hf_name):
                unknown.append(hf_name)
            continue
        if ours == "lm_head" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints also store the copy; transformers ignores it too
        flat[ours] = shard.tensor(hf_name)
    if unknown:
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise JaxspecError(
            f"{path}: unexpected tensors {', '.join(sorted(unknown)[:3])}{more}: this model variant "
            f"is not supported"
        )
    if "lm_head" not in flat and not cfg.tie_word_embeddings and "embed" in flat:
        raise JaxspecError(
            f"{path}: no lm_head.weight although config.json says tie_word_embeddings=false: "
            f"the checkpoint is incomplete"
        )
    return flat


def _our_name(hf_name: str) -> str | None:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    return None


def tensor_index(path: Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file holding it (from model.safetensors.index.json, else every file)."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise JaxspecError(
                f"{path}: shard {missing[0]} listed in the index is missing: re-download"
            )
        shards = {f: SafetensorsFile(path / f) for f in files}
        return {name: shards[f] for name, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = (
            " (PyTorch .bin files are not read: convert to safetensors)"
            if any(path.glob("*.bin"))
            else ""
        )
        raise JaxspecError(f"{path} has no *.safetensors files{hint}")
    return {name: shard for shard in map(SafetensorsFile, files) for name in shard.header}
