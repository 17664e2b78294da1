"""GGUF files of the Gemma families (`general.architecture` gemma3, gemma2), read by
`loading.gguf_header`, and the Gemma params' assembly and target. HF directories of every
non-Llama family are read by `loading/family_files.py` from the family registry.

The config reader and tensor-name map live with the forward (`models/gemma_config.py`); this
module opens the file: tensors under our names, the tokenizer, the eos ids. llama.cpp stores
Gemma norm weights as (1 + w); transformers' GGUF reader subtracts the one again
(`Gemma2TensorProcessor`), and so do we.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.loading import tokenizer as tk
from jaxspec.loading.gguf_file import SUPPORTED_TYPES, LazyTensor
from jaxspec.loading.gguf_header import GGUFHeader
from jaxspec.loading import family_files
from jaxspec.models import gemma
from jaxspec.models.gemma import GemmaTarget
from jaxspec.models.gemma_config import (
    GGUF_LAYER_NAMES,
    GemmaConfig,
    gemma_config_from_gguf,
)
from jaxspec.models.llama import LlamaTarget

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


def read_gguf(path: Path, dtype: str, lazy: bool = False):
    """(config, flat tensors, tokenizer, eos ids, architecture) of a gemma2 / gemma3 GGUF file."""
    header = GGUFHeader(path)
    cfg = gemma_config_from_gguf(header, dtype=dtype, source=str(path))
    flat = gguf_tensors(header, cfg, source=str(path), lazy=lazy)
    return cfg, flat, gguf_tokenizer(path, header), gguf_eos(header, cfg.vocab_size, str(path)), cfg.family


def assemble(cfg, flat: dict, *, source: str, shapes: dict | None = None,
             family: str | None = None) -> dict:
    """Check names and shapes against the family's `param_shapes` (`shapes`; None: Gemma's),
    refuse NaN/inf, then nest (`family_files.assemble`)."""
    return family_files.assemble(cfg, flat, gemma.param_shapes(cfg) if shapes is None else shapes,
                                 source=source, family=family or cfg.family)


def owns(cfg) -> bool:
    """Whether `cfg` is a Gemma config (a GGUF this module read and assembles)."""
    return isinstance(cfg, GemmaConfig)


def target_for(cfg, arch: str):
    """The `models.base.Target` that runs a config the GGUF / Llama readers loaded."""
    if isinstance(cfg, GemmaConfig):
        return GemmaTarget(cfg, name=arch)
    return LlamaTarget(cfg, name=arch)


