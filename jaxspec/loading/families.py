"""Checkpoint files of the non-Llama families: Gemma 2, Gemma 3 (text) and Phi-3.

    HF dirs   config.json `model_type` gemma2 | gemma3_text | gemma3 (text part of the multimodal
              config, `text_config`; its vision tower is skipped) | phi3
    GGUF      `general.architecture` gemma3 (and gemma2), read by `loading.gguf_header`

Each family's config reader and tensor-name map live with its forward (`models/gemma_config.py`,
`models/phi3.py`); this module opens the files: safetensors and GGUF tensors under our names,
the tokenizer, the eos ids. Each reader returns (config, flat tensors under our names,
tokenizer, eos ids) like the Llama readers in `loading/__init__.py`, which dispatches here by
`model_type` / architecture.

Phi-3's fused projections are split on load (`phi3.split_fused`), so Phi-3 runs as a
Llama-family model (with its sliding window). llama.cpp stores Gemma norm weights as (1 + w);
transformers' GGUF reader subtracts the one again (`Gemma2TensorProcessor`), and so do we.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.loading import tokenizer as tk
from jaxspec.loading.gguf_file import SUPPORTED_TYPES, LazyTensor
from jaxspec.loading.gguf_header import GGUFHeader
from jaxspec.loading.params import check_finite
from jaxspec.loading.safetensors_dir import read_tensors, tensor_index
from jaxspec.models import gemma, phi3
from jaxspec.models.gemma import GemmaTarget
from jaxspec.models.gemma_config import (
    GGUF_LAYER_NAMES,
    HF_LAYER_NAMES,
    GemmaConfig,
    gemma_config_from_gguf,
    gemma_config_from_hf,
    hf_kind,
)
from jaxspec.models.llama import LlamaTarget
from jaxspec.models.phi3 import phi3_config_from_hf

HF_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3", "phi3")
GGUF_ARCHITECTURES = ("gemma2", "gemma3")
FAMILIES = ("gemma2", "gemma3", "phi3")  # registry names of the families read here

_GLOBAL_NAMES = {"embed_tokens.weight": "embed", "norm.weight": "final_norm"}
# text-model prefixes: plain CausalLM, Gemma 3 multimodal (transformers 4.x and 5.x)
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_SKIPPED = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\..*|.*rotary_emb\.inv_freq")


def hf_model_type(hf: dict) -> str | None:
    """The family this loader handles for a config.json, or None (a Llama-family config)."""
    if hf.get("model_type") == "phi3":
        return "phi3"
    kind = hf_kind(hf)
    if kind is None and "Phi3" in " ".join(hf.get("architectures") or ()):
        return "phi3"
    return kind


# ------------------------------------------------------------------------------------- tensors


def hf_tensors(path: Path, kind: str, cfg) -> dict[str, np.ndarray]:
    """Every text-decoder tensor under our flat names (memory-mapped); Phi-3's fused ones split."""
    names = phi3.HF_LAYER_NAMES if kind == "phi3" else HF_LAYER_NAMES
    flat = read_tensors(path, tensor_index(path), lambda n: _our_hf_name(n, names),
                        tied=cfg.tie_word_embeddings, skip=_SKIPPED.fullmatch, variant=kind)
    return phi3.split_fused(flat, cfg) if kind == "phi3" else flat


def _our_hf_name(hf_name: str, layer_names: dict) -> str | None:
    if hf_name == "lm_head.weight":
        return "lm_head"
    for prefix in _PREFIXES:
        if not hf_name.startswith(prefix):
            continue
        rest = hf_name[len(prefix):]
        if rest in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[rest]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if m and m.group(2) in layer_names:
            return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


# ---------------------------------------------------------------------------------------- GGUF


def gguf_tensors(header, cfg: GemmaConfig, *, source: str, lazy: bool = False) -> dict:
    """Every tensor dequantized under our names (norms back from llama.cpp's 1 + w to w)."""
    out_dtype = np.dtype(cfg.compute_dtype)
    flat = {}
    for t in header.tensors:
        ours = _our_gguf_name(t.name)
        if ours is None:
            raise JaxspecError(f"{source}: unexpected tensor {t.name}: this model variant is not supported")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise JaxspecError(
                f"{source}: tensor {t.name} is {t.tensor_type.name}, which jaxspec cannot dequantize"
            )

        def read(t=t, ours=ours):
            w = t.dequantize()
            if ours.endswith("norm"):
                w = w.astype(np.float32) - 1.0
            return w.astype(out_dtype, copy=False)

        flat[ours] = LazyTensor(t.shape, read) if lazy else read()
    return flat


def _our_gguf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "embed"
    if name == "output_norm.weight":
        return "final_norm"
    if name == "output.weight":
        return "lm_head"
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GGUF_LAYER_NAMES:
        return f"layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}"
    return None


def gguf_tokenizer(path: Path, header):
    """The GGUF's tokenizer, built from the parsed metadata by transformers' own converter (no
    second parse of the file) and cached like `loading.tokenizer.load_gguf_tokenizer`'s."""
    if "tokenizer.ggml.model" not in header.fields:
        return None
    cache = tk._cache_dir(path)
    if cache is not None and (cache / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        try:
            with tk.quiet():
                return AutoTokenizer.from_pretrained(cache)
        except Exception:  # noqa: BLE001 — a damaged cache entry: rebuild it
            pass
    tok = tk.tokenizer_from_metadata(header)
    template = header.fields.get("tokenizer.chat_template")
    if template is not None and not tok.chat_template:
        tok.chat_template = template.contents()
    if cache is not None:
        tk._save(tok, cache)
    return tok


def gguf_eos(header, vocab_size: int, source: str) -> list[int]:
    """The EOS-like ids the file names, each checked against the vocabulary."""
    fields = validate.Fields(
        lambda k: header.fields[k].contents() if k in header.fields else validate.MISSING, source
    )
    return [i for k in ("eos", "eot", "eom")
            for i in validate.token_ids(fields, f"tokenizer.ggml.{k}_token_id", vocab_size)]


# ------------------------------------------------------------------------------------ readers


def read_hf_dir(path: Path, hf: dict, dtype: str):
    """(config, flat tensors, tokenizer, eos ids, architecture) of a gemma2 / gemma3(_text) / phi3
    directory."""
    kind = hf_model_type(hf)
    source = str(path / "config.json")
    if kind == "phi3":
        cfg = phi3_config_from_hf(hf, dtype=dtype, source=source)
    else:
        cfg = gemma_config_from_hf(hf, dtype=dtype, source=source)
    flat = hf_tensors(path, kind, cfg)
    arch = "phi3" if kind == "phi3" else cfg.family
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    fields = validate.Fields(hf if "eos_token_id" in hf else text, source)
    eos = validate.token_ids(fields, "eos_token_id", cfg.vocab_size)
    gen = path / "generation_config.json"
    if gen.exists():
        gen_fields = validate.Fields(validate.read_json(gen, "generation_config.json"), str(gen))
        eos += validate.token_ids(gen_fields, "eos_token_id", cfg.vocab_size)
    return cfg, flat, tk.load_dir_tokenizer(path), eos, arch


def read_gguf(path: Path, dtype: str, lazy: bool = False):
    """(config, flat tensors, tokenizer, eos ids, architecture) of a gemma2 / gemma3 GGUF file."""
    header = GGUFHeader(path)
    cfg = gemma_config_from_gguf(header, dtype=dtype, source=str(path))
    flat = gguf_tensors(header, cfg, source=str(path), lazy=lazy)
    return cfg, flat, gguf_tokenizer(path, header), gguf_eos(header, cfg.vocab_size, str(path)), cfg.family


def assemble(cfg, flat: dict, *, source: str, shapes: dict | None = None,
             family: str | None = None) -> dict:
    """Check names and shapes against the family's `param_shapes` (`shapes`; None: Gemma's),
    refuse NaN/inf, then nest (`layers.3.wq` -> params["layers"][3]["wq"]), as
    `loading.params.assemble` does for Llama."""
    shapes = gemma.param_shapes(cfg) if shapes is None else shapes
    family = family or cfg.family
    want = {k: v for k, v in shapes.items() if k != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        want |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    missing, extra = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
    if missing:
        raise JaxspecError(f"{source} lacks tensors {', '.join(missing[:4])}: the checkpoint is "
                           f"incomplete or does not match its config")
    if extra:
        raise JaxspecError(f"{source} has tensors {', '.join(extra[:4])} that {family} does "
                           f"not use: the model variant is not supported")
    for key, shape in want.items():
        got = tuple(flat[key].shape)
        if got != tuple(shape):
            raise JaxspecError(f"{source}: tensor {key} has shape {got}, config implies "
                               f"{tuple(shape)}: the checkpoint does not match its config")
        if not getattr(flat[key], "lazy", False):
            check_finite(key, flat[key], source)
    params = {k: flat[k] for k in want if not k.startswith("layers.")}
    params["layers"] = tuple(
        {k.split(".", 2)[2]: flat[k] for k in want if k.startswith(f"layers.{i}.")}
        for i in range(cfg.num_layers)
    )
    return params


def owns(cfg) -> bool:
    """Whether `cfg` is a family config this module assembles (Phi-3 assembles as Llama)."""
    return isinstance(cfg, GemmaConfig)


def target_for(cfg, arch: str):
    """The `models.base.Target` that runs a loaded config."""
    if isinstance(cfg, GemmaConfig):
        return GemmaTarget(cfg, name=arch)
    return phi3.phi3_target(cfg) if arch == "phi3" else LlamaTarget(cfg, name=arch)


