"""Hugging Face checkpoint directories: config.json + *.safetensors (single file or sharded).

Tensors are memory-mapped straight from the safetensors files with numpy (no torch; bfloat16 via
ml_dtypes, which numpy alone cannot name), so nothing is copied before the cast to the compute
dtype. The format is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}}`, then the raw bytes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec import validate
from jaxspec.loading.safetensors_file import SafetensorsFile
from jaxspec.models.decoder import ModelConfig, RopeScaling

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
    return validate.read_json(path / "config.json", "config.json")


def config_from_hf(hf: dict, *, dtype: str, source: str = "config.json") -> ModelConfig:
    """config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`), every
    field type- and range-checked (`jaxspec.validate.Fields`)."""
    f = validate.Fields(hf, source)
    arch = _architecture(hf, source)
    act = f.str("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise JaxspecError(f"{source}: hidden_act={act!r} is not supported (only silu)")
    if f.bool("mlp_bias", False):
        raise JaxspecError(f"{source}: mlp_bias=true is not supported by jaxspec's Llama model")
    if arch != "qwen2" and f.bool("attention_bias", False):
        raise JaxspecError(
            f"{source}: attention_bias=true on {arch} (which biases o_proj too) is not supported"
        )
    vocab = f.int("vocab_size", lo=1, hi=validate.MAX_DIM)
    dims = validate.decoder_dims(f)
    rope = f.dict("rope_parameters", None) if f.given("rope_parameters") else f.dict("rope_scaling", {})
    rf = validate.Fields(rope, source, "rope_parameters." if f.given("rope_parameters") else "rope_scaling.")
    theta = rf.float("rope_theta", None) if rf.given("rope_theta") else f.float("rope_theta", 10000.0)
    if not (theta > 0.0):
        (rf if rf.given("rope_theta") else f).fail("rope_theta", theta, "use a finite number > 0")
    max_pos = f.int("max_position_embeddings", 2048, lo=1, hi=(1 << 31) - 1)
    window = _sliding_window(hf, arch)  # masked per layer (models.llama), no context cap
    if window is not None:
        window = f.int("sliding_window", lo=1)
    return ModelConfig(
        vocab_size=vocab,
        **dims,
        rope_theta=theta,
        rope_scaling=_rope_scaling(rf, source),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=max_pos,
        dtype=dtype,
        sliding_window=int(window) if window else None,
        sliding_layers=_sliding_layers(hf, window),
    )


def _architecture(hf: dict, source: str) -> str:
    f = validate.Fields(hf, source)
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        f.fail("architectures", archs, "use a list of class names, e.g. [\"LlamaForCausalLM\"]")
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    model_type = f.str("model_type", "none")
    if not archs and model_type in ARCHITECTURES.values():
        return model_type
    got = ", ".join(archs) or model_type
    raise JaxspecError(
        f"{source}: architecture {got[:200]} is not supported: use one of "
        f"{', '.join(ARCHITECTURES)}"
    )


def _rope_scaling(rf: validate.Fields, source: str) -> RopeScaling | None:
    kind = rf.str("rope_type", None) if rf.given("rope_type") else rf.str("type", "default")
    if kind == "default":
        return None
    if kind != "llama3":
        raise JaxspecError(
            f"{source}: rope scaling {validate.short(kind)} is not supported (only 'default' and 'llama3')"
        )
    low = rf.float("low_freq_factor", 1.0, lo=0.0, lo_open=True)
    high = rf.float("high_freq_factor", 4.0, lo=0.0, lo_open=True)
    if high <= low:
        rf.fail("high_freq_factor", high, f"use a value > low_freq_factor={low:g}")
    return RopeScaling(
        factor=rf.float("factor", lo=0.0, lo_open=True),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=rf.int("original_max_position_embeddings", 8192, lo=1),
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
    if arch in ("qwen2", "qwen3") and hf.get("use_sliding_window") is True:
        return hf.get("sliding_window")
    layer_types = hf.get("layer_types") or ()
    if isinstance(layer_types, list) and "sliding_attention" in layer_types:
        return hf.get("sliding_window")
    return None


def load_hf_tensors(
    path: Path, cfg: ModelConfig, skip_from_layer: int | None = None
) -> dict[str, np.ndarray]:
    """Every tensor under our flat names (`embed`, `layers.3.wq`, ...), memory-mapped.
    `skip_from_layer`: ignore `model.layers.{i}.*` for i >= it (MTP modules stored with the
    target, `num_nextn_predict_layers`: read as a drafter by jaxspec.formats.mtp)."""
    index = tensor_index(path)
    validate.check_layer_count(
        cfg.num_layers, index, _LAYER_RE, str(path), "num_hidden_layers", below=skip_from_layer
    )

    def skipped(hf_name: str) -> bool:  # MTP layers past skip_from_layer; old rotary buffers
        m = _LAYER_RE.fullmatch(hf_name)
        if skip_from_layer is not None and m and int(m.group(1)) >= skip_from_layer:
            return True
        return _our_name(hf_name) is None and bool(_IGNORED.match(hf_name))

    flat = read_tensors(path, index, _our_name, tied=cfg.tie_word_embeddings, skip=skipped)
    if "lm_head" not in flat and not cfg.tie_word_embeddings and "embed" in flat:
        raise JaxspecError(
            f"{path}: no lm_head.weight although config.json says tie_word_embeddings=false: "
            f"the checkpoint is incomplete"
        )
    return flat



def read_tensors(path: Path, index: dict, our_name, *, tied: bool, skip=None,
                 variant: str = "model") -> dict[str, np.ndarray]:
    """The tensors of `index` (`tensor_index`) under our flat names, memory-mapped, float dtypes
    only. our_name: HF name -> ours, or None for a tensor this family does not know (refused,
    naming up to three); skip: HF names to pass over; tied: a stored lm_head copy is dropped."""
    flat: dict[str, np.ndarray] = {}
    unknown = []
    for hf_name, shard in index.items():
        if skip is not None and skip(hf_name):
            continue
        ours = our_name(hf_name)
        if ours is None:
            unknown.append(hf_name)
            continue
        if ours == "lm_head" and tied:
            continue  # some tied checkpoints also store the copy; transformers ignores it too
        validate.require_float(shard.file, hf_name, shard.header[hf_name]["dtype"])
        flat[ours] = shard.tensor(hf_name)
    if unknown:
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise JaxspecError(
            f"{path}: unexpected tensors {', '.join(sorted(unknown)[:3])}{more}: this {variant} "
            f"variant is not supported"
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
    if index_file.exists():
        return _indexed(path, index_file)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = (
            " (PyTorch .bin files are not read: convert to safetensors)"
            if any(path.glob("*.bin"))
            else ""
        )
        raise JaxspecError(f"{path} has no *.safetensors files{hint}")
    return {name: shard for shard in map(SafetensorsFile, files) for name in shard.header}


def _indexed(path: Path, index_file: Path) -> dict[str, SafetensorsFile]:
    """The index's weight map, checked: file names inside `path`, every listed tensor present."""
    source = str(index_file)
    weight_map = validate.Fields(validate.read_json(index_file, "safetensors index"), source).dict(
        "weight_map"
    )
    shards: dict[str, SafetensorsFile] = {}
    out = {}
    for name, file in weight_map.items():
        if file not in shards:
            full = validate.confined(path, file, source, f"weight_map[{validate.short(name)}]")
            if not full.exists():
                raise JaxspecError(f"{path}: shard {file} listed in the index is missing: re-download")
            shards[file] = SafetensorsFile(full)
        if name not in shards[file].header:
            raise JaxspecError(
                f"{source}: weight_map names tensor {validate.short(name)} in {file}, which does "
                f"not hold it: the index and the shards disagree; re-download the checkpoint"
            )
        out[name] = shards[file]
    return out
