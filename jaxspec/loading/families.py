"""The one reader of a registered family's GGUF file (`general.architecture` read by
`loading.gguf_header`): the family's `models.registry.FileLayout` (its `gguf` layout) gives the
config reader, llama.cpp's tensor names for its leaves and the norm offset llama.cpp stored
(Gemma's norms as (1 + w): transformers' GGUF reader subtracts the one again,
`Gemma2TensorProcessor`, and so do we). The Llama family's GGUF files are read by
`loading/gguf_file.py`.
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

# ---------------------------------------------------------------------------------------- GGUF


def gguf_tensors(header, spec, cfg, *, source: str, lazy: bool = False) -> dict:
    """Every tensor dequantized under our names (`spec.tensor_name`), norms back from
    llama.cpp's (offset + w) to w."""
    out_dtype = np.dtype(cfg.compute_dtype)
    flat = {}
    for t in header.tensors:
        ours = spec.tensor_name(t.name)
        if ours is None:
            raise JaxspecError(f"{source}: unexpected tensor {t.name}: this model variant is not supported")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise JaxspecError(
                f"{source}: tensor {t.name} is {t.tensor_type.name}, which jaxspec cannot dequantize"
            )

        def read(t=t, ours=ours):
            w = t.dequantize()
            if spec.norm_offset and ours.endswith("norm"):
                w = w.astype(np.float32) - spec.norm_offset
            return w.astype(out_dtype, copy=False)

        flat[ours] = LazyTensor(t.shape, read) if lazy else read()
    return flat


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


def read_gguf(path: Path, dtype: str, family, *, layout: str, note: str, mesh=None,
              lazy: bool = False) -> family_files.FamilyCheckpoint:
    """A GGUF file of `family` (its `gguf` layout declared): config and layout checked before
    any tensor is dequantized, then names, shapes and finiteness (`family_files.assemble`)."""
    spec, source = family.gguf, str(path)
    header = GGUFHeader(path)
    cfg = spec.config(header, dtype=dtype, source=source)
    if spec.layout is not None:
        layout, note = spec.layout(cfg, layout, note, source, mesh)
    flat = gguf_tensors(header, spec, cfg, source=source, lazy=lazy)
    if spec.convert is not None:
        flat = spec.convert(flat, cfg, source)
    arch = spec.architecture(cfg) if spec.architecture else family.name
    params = family_files.assemble(cfg, flat, spec.param_shapes(cfg), source=source, family=arch)
    return family_files.FamilyCheckpoint(
        cfg=cfg, params=params, tokenizer=gguf_tokenizer(path, header),
        eos=gguf_eos(header, cfg.vocab_size, source), architecture=arch, layout=layout,
        layout_note=note, target=spec.target(cfg, arch))
