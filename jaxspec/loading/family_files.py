"""The one reader of a registered family's Hugging Face directory: whatever the family, its
`models.registry.HfLayout` says how the checkpoint maps onto params, and this module opens the
files. A new family declares its layout beside its forward and adds nothing here.

    config.json  -> layout.config (every field checked; what the family does not implement
                    refused in one line before any tensor is read)
    layouts      -> layout.layout ("auto" resolved, the rest refused)
    *.safetensors-> our flat names (layout.tensor_name, layout.skip), memory-mapped
                 -> layout.convert (experts stacked, fused tensors split)
                 -> names, shapes and finiteness checked against layout.param_shapes, nested
    tokenizer, eos ids (config.json, or its text_config, and generation_config.json)

Nothing is placed on a device here: `loading.load_model` places the params it returns.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.loading import tokenizer as tk
from jaxspec.loading.params import check_finite
from jaxspec.loading.safetensors_dir import read_tensors, tensor_index
from jaxspec.models.registry import Family


@dataclasses.dataclass(frozen=True)
class FamilyCheckpoint:
    cfg: Any
    params: dict  # nested host arrays (memory-mapped numpy), names and shapes checked
    tokenizer: Any
    eos: list[int]
    architecture: str
    layout: str
    layout_note: str
    target: Any  # the models.base.Target that runs params


def read_hf_dir(path: Path, hf: dict, dtype: str, family: Family, *, layout: str, note: str,
                mesh=None) -> FamilyCheckpoint:
    """A checkpoint directory of `family` (its `hf` layout declared), checked whole before any
    weight is placed: a checkpoint is never loaded half-way."""
    spec = family.hf
    source = str(path / "config.json")
    cfg = spec.config(hf, dtype=dtype, source=source)
    if spec.layout is not None:
        layout, note = spec.layout(cfg, layout, note, str(path), mesh)
    skip = re.compile(spec.skip).fullmatch
    flat = read_tensors(path, tensor_index(path), spec.tensor_name,
                        tied=bool(getattr(cfg, "tie_word_embeddings", False)), skip=skip,
                        variant=family.name)
    if spec.convert is not None:
        flat = spec.convert(flat, cfg, str(path))
    arch = spec.architecture(cfg) if spec.architecture else family.name
    params = assemble(cfg, flat, spec.param_shapes(cfg), source=str(path), family=arch)
    return FamilyCheckpoint(cfg=cfg, params=params, tokenizer=tk.load_dir_tokenizer(path),
                            eos=eos_ids(path, hf, cfg.vocab_size), architecture=arch,
                            layout=layout, layout_note=note, target=spec.target(cfg, arch))


def eos_ids(path: Path, hf: dict, vocab_size: int) -> list[int]:
    """config.json's eos_token_id (its text_config's when the top level has none), then
    generation_config.json's, each checked against the vocabulary."""
    source = str(path / "config.json")
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    eos = validate.token_ids(validate.Fields(hf if "eos_token_id" in hf else text, source),
                             "eos_token_id", vocab_size)
    gen = path / "generation_config.json"
    if gen.exists():
        gen_fields = validate.Fields(validate.read_json(gen, "generation_config.json"), str(gen))
        eos += validate.token_ids(gen_fields, "eos_token_id", vocab_size)
    return eos


def assemble(cfg, flat: dict, shapes: dict, *, source: str, family: str) -> dict:
    """Check names and shapes against `shapes` (a family's `param_shapes`), refuse NaN/inf,
    then nest (`layers.3.wq` -> params["layers"][3]["wq"])."""
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
        for i in range(len(shapes["layers"])))
    return params
