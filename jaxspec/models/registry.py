"""The target registry: architecture name -> the family that implements it (`models/base.py`).

A family is one module that builds its `Target` and registers the names checkpoints use for it:

    register_family(Family(
        name="gemma3",
        model_types=("gemma3", "gemma3_text"),   # config.json "model_type"
        gguf_architectures=("gemma3",),          # GGUF "general.architecture"
        target_from_hf=gemma3_target_from_hf,    # (hf: dict, *, dtype, source) -> Target
        target_from_gguf=gemma3_target_from_gguf,  # (reader, *, dtype, source) -> Target
    ))

The loaders pick the family from the checkpoint (`family_for_model_type`, `family_for_gguf`);
an architecture nobody registered is refused in one line that lists the supported ones. The
Llama family (llama, mistral, qwen2, qwen3) registers in `models/llama.py` with no
`target_from_*` hooks: the loaders' own Llama readers build its config. No jax here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from jaxspec.errors import JaxspecError


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """How a family's checkpoint files map onto its params, read by the one family reader of
    each format (`loading/family_files.py` for HF directories, `loading/families.py` for GGUF):
    a new family declares this and adds no string to `loading/`.

    config        (hf config dict | GGUF header, *, dtype, source) -> the family's config
                  (refusing what it does not implement in one line, before any tensor is read)
    tensor_name   stored tensor name -> our flat name (`embed`, `final_norm`, `lm_head`,
                  `layers.<i>.<leaf>`), None for a tensor the family does not know (refused)
    param_shapes  config -> {"embed": shape, ..., "layers": (per-layer {leaf: shape}, ...)}
    target        (config, architecture) -> the `models.base.Target` that runs it
    skip          regex of HF names read past (vision towers, rotary buffers, `mtp.*`)
    convert       (flat, config, source) -> flat: stack per-expert tensors, split fused ones
    layout        (config, layout, note, source, mesh) -> (layout, note): the layouts the
                  family runs ("auto" resolved), the rest refused in one line
    architecture  config -> the architecture name the loaded model reports
    llama_leaves  the params are Llama-shaped leaves (gemma, phi3): on a mesh the loader builds
                  each leaf straight onto its shards; otherwise placed, then `place_target`
    norm_offset   GGUF: llama.cpp stores these norms as (offset + w) (Gemma's 1): subtracted
    """

    config: Callable[..., Any]
    tensor_name: Callable[[str], str | None]
    param_shapes: Callable[[Any], dict]
    target: Callable[[Any, str], Any]
    skip: str = r".*rotary_emb\.inv_freq"
    convert: Callable[..., dict] | None = None
    layout: Callable[..., tuple[str, str]] | None = None
    architecture: Callable[[Any], str] | None = None
    llama_leaves: bool = False
    norm_offset: float = 0.0


HfLayout = FileLayout  # an HF directory's layout


def gguf_tensor_name(name: str, layer_names: dict) -> str | None:
    """A llama.cpp tensor name -> ours: token_embd, output_norm, output, `blk.<i>.<rest>` with
    `layer_names[rest]` the leaf; None for anything else."""
    top = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
           "output.weight": "lm_head"}
    if name in top:
        return top[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def hf_tensor_name(hf_name: str, layer_names, *, prefixes=("model.",),
                   globals_=None) -> str | None:
    """A decoder's HF tensor name -> ours: `lm_head.weight`, then under one of `prefixes` the
    embedding, the final norm and `layers.<i>.<rest>` with `layer_names(rest)` (a dict or a
    function) giving the leaf; None for anything else."""
    if hf_name == "lm_head.weight":
        return "lm_head"
    globals_ = globals_ or {"embed_tokens.weight": "embed", "norm.weight": "final_norm"}
    leaf = layer_names.get if isinstance(layer_names, dict) else layer_names
    for prefix in prefixes:
        if not hf_name.startswith(prefix):
            continue
        rest = hf_name[len(prefix):]
        if rest in globals_:
            return globals_[rest]
        m = _LAYER.fullmatch(rest)
        ours = m and leaf(m.group(2))
        if ours:
            return f"layers.{m.group(1)}.{ours}"
    return None


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture values
    # (hf config dict, *, dtype, source) -> Target; None: the loaders' Llama reader
    target_from_hf: Callable[..., Any] | None = None
    # (gguf.GGUFReader, *, dtype, source) -> Target; None: the loaders' Llama reader
    target_from_gguf: Callable[..., Any] | None = None
    # how its HF directory maps onto params (loading/family_files.py); None: the Llama reader
    hf: FileLayout | None = None
    # how its GGUF file maps onto params (loading/families.py); None: the Llama reader
    gguf: FileLayout | None = None


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> None:
    """Make checkpoints whose model_type / GGUF architecture the family names load as it."""
    if FAMILIES.get(family.name, family) != family:
        raise ValueError(f"target family {family.name!r} is already registered")
    for other in FAMILIES.values():
        if other.name == family.name:
            continue
        clash = set(other.model_types) & set(family.model_types)
        clash |= set(other.gguf_architectures) & set(family.gguf_architectures)
        if clash:
            raise ValueError(
                f"target family {family.name!r}: {sorted(clash)} already belong to {other.name!r}"
            )
    FAMILIES[family.name] = family


def supported_model_types() -> list[str]:
    return sorted({t for f in FAMILIES.values() for t in f.model_types})


def supported_gguf_architectures() -> list[str]:
    return sorted({a for f in FAMILIES.values() for a in f.gguf_architectures})


def family_for_model_type(model_type: str | None, source: str = "config.json") -> Family:
    for f in FAMILIES.values():
        if model_type in f.model_types:
            return f
    raise JaxspecError(
        f"{source}: model_type {model_type!r} is not supported: jaxspec implements "
        f"{', '.join(supported_model_types())}"
    )


def family_for_gguf(architecture: str | None, source: str = "the GGUF file") -> Family:
    for f in FAMILIES.values():
        if architecture in f.gguf_architectures:
            return f
    raise JaxspecError(
        f"{source}: GGUF architecture {architecture!r} is not supported: jaxspec implements "
        f"{', '.join(supported_gguf_architectures())}"
    )
