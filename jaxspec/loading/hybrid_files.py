"""Checkpoint directories of the hybrid (linear + full attention) families: Qwen3.5 dense.

    HF dirs   config.json `model_type` qwen3_5_text (Qwen3_5ForCausalLM) or qwen3_5 (the
              multimodal checkpoint: `text_config`, its vision tower skipped)

The config reader and tensor-name map live with the forward (`models/qwen3_5.py`); this module
opens the files and returns (config, params, tokenizer, eos ids, architecture) like
`loading/families.py`. The native MTP tensors (`mtp.*`) are not part of the target's params.
Per-layer arrays only: a "stacked" or "packed" layout is refused in one line.
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.loading import tokenizer as tk
from jaxspec.loading.params import check_finite
from jaxspec.loading.safetensors_dir import read_tensors, tensor_index
from jaxspec.models import qwen3_5

FAMILIES = ("qwen3_5",)  # registry names of the families read here
_PREFIXES = ("model.language_model.", "model.")
_GLOBAL_NAMES = {"embed_tokens.weight": "embed", "norm.weight": "final_norm"}
_SKIPPED = re.compile(r"(model\.)?visual\..*|mtp\..*|.*rotary_emb\.inv_freq")


def check_layout(layout: str, mesh=None) -> str:
    """The layout a hybrid model loads in ("auto" -> "unrolled"), or a one-line refusal."""
    if mesh is not None:
        raise JaxspecError("Qwen3.5 (hybrid linear attention) runs on one device: load it "
                           "without a mesh")
    if layout in ("auto", "unrolled"):
        return "unrolled"
    raise JaxspecError(f"layout {layout!r} is not available for Qwen3.5 (hybrid linear "
                       f"attention): use layout 'unrolled' or 'auto'")


def _our_name(hf_name: str) -> str | None:
    if hf_name == "lm_head.weight":
        return "lm_head"
    for prefix in _PREFIXES:
        if not hf_name.startswith(prefix):
            continue
        rest = hf_name[len(prefix):]
        if rest in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[rest]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if m and m.group(2) in qwen3_5.HF_LAYER_NAMES:
            return f"layers.{m.group(1)}.{qwen3_5.HF_LAYER_NAMES[m.group(2)]}"
    return None


def assemble(cfg: qwen3_5.Qwen35Config, flat: dict, *, source: str) -> dict:
    """Names and shapes checked against `qwen3_5.param_shapes`, NaN/inf refused, then nested."""
    shapes = qwen3_5.param_shapes(cfg)
    want = {k: v for k, v in shapes.items() if k != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        want |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    missing, extra = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
    if missing:
        raise JaxspecError(f"{source} lacks tensors {', '.join(missing[:4])}: the checkpoint is "
                           f"incomplete or does not match its config (layer_types)")
    if extra:
        raise JaxspecError(f"{source} has tensors {', '.join(extra[:4])} that Qwen3.5 does not "
                           f"use: the model variant is not supported")
    for key, shape in want.items():
        w = flat[key]
        if key.endswith(".conv") and w.ndim == 3 and w.shape[1] == 1:
            w = flat[key] = w[:, 0]  # [C, 1, Kc] depthwise conv -> [C, Kc]
        if tuple(w.shape) != tuple(shape):
            raise JaxspecError(f"{source}: tensor {key} has shape {tuple(w.shape)}, config "
                               f"implies {tuple(shape)}: the checkpoint does not match its config")
        check_finite(key, w, source)
    params = {k: flat[k] for k in want if not k.startswith("layers.")}
    params["layers"] = tuple(
        {k.split(".", 2)[2]: flat[k] for k in want if k.startswith(f"layers.{i}.")}
        for i in range(cfg.num_layers))
    return params


def read_hf_dir(path: Path, hf: dict, dtype: str):
    """(config, params (host arrays), tokenizer, eos ids, architecture) of a Qwen3.5 directory."""
    source = str(path / "config.json")
    cfg = qwen3_5.qwen3_5_config_from_hf(hf, dtype=dtype, source=source)
    flat = read_tensors(path, tensor_index(path), _our_name, tied=cfg.tie_word_embeddings,
                        skip=_SKIPPED.fullmatch, variant="qwen3_5")
    params = assemble(cfg, flat, source=str(path))
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    fields = validate.Fields(hf if "eos_token_id" in hf else text, source)
    eos = validate.token_ids(fields, "eos_token_id", cfg.vocab_size)
    gen = path / "generation_config.json"
    if gen.exists():
        gen_fields = validate.Fields(validate.read_json(gen, "generation_config.json"), str(gen))
        eos += validate.token_ids(gen_fields, "eos_token_id", cfg.vocab_size)
    return cfg, params, tk.load_dir_tokenizer(path), eos, "qwen3_5"


def owns(cfg) -> bool:
    return isinstance(cfg, qwen3_5.Qwen35Config)


def target_for(cfg) -> qwen3_5.Qwen35Target:
    return qwen3_5.Qwen35Target(cfg)

