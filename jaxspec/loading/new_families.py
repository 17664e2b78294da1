"""Checkpoint files of Qwen3-MoE (`model_type` qwen3_moe) and Gemma 4 text (gemma4_text, or the
text part of gemma4).

HF safetensors directories, as transformers' `save_pretrained` and the published checkpoints
write them: Qwen3-MoE one tensor per expert (`mlp.experts.j.{gate,up,down}_proj.weight`), stacked
here into `[E, ...]` leaves (`qwen3_moe.stack_experts`; the fused `[E, 2F, D]` layout is read
too); Gemma 4 its fused experts split (`gemma4_config.split_fused`). The config is read and
checked (a routing or layer type jaxspec does not implement is refused in one line) before any
tensor is opened, and every tensor's name and shape is checked before any is placed on a device:
a checkpoint is never loaded half-way. llama.cpp's MoE tensors (`ffn_*_exps`) are not read yet:
GGUF files of these architectures are refused by the registry, naming the supported ones.
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxspec import validate
from jaxspec.loading import families
from jaxspec.loading import tokenizer as tk
from jaxspec.loading.safetensors_dir import read_tensors, tensor_index
from jaxspec.errors import JaxspecError
from jaxspec.models import gemma4, gemma4_config, qwen3_moe
from jaxspec.models.gemma4_config import Gemma4Config
from jaxspec.models.qwen3_moe import MoeConfig, MoeTarget

FAMILIES = ("qwen3_moe", "gemma4")  # registry names of the families read here

_PREFIX = "model."
_SKIPPED = re.compile(r".*rotary_emb\.inv_freq")


def _our_name(hf_name: str) -> str | None:
    if hf_name == "lm_head.weight":
        return "lm_head"
    if not hf_name.startswith(_PREFIX):
        return None
    rest = hf_name[len(_PREFIX):]
    if rest == "embed_tokens.weight":
        return "embed"
    if rest == "norm.weight":
        return "final_norm"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
    ours = m and qwen3_moe.our_layer_name(m.group(2))
    return f"layers.{m.group(1)}.{ours}" if ours else None


_GEMMA4_SKIPPED = re.compile(r"(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio)\..*"
                             r"|.*rotary_emb\..*")


def read_hf_dir(path: Path, hf: dict, dtype: str):
    """(config, flat tensors under our names, tokenizer, eos ids, architecture)."""
    source = str(path / "config.json")
    if hf.get("model_type") in ("gemma4", "gemma4_text"):
        cfg = gemma4_config.gemma4_config_from_hf(hf, dtype=dtype, source=source)
        flat = read_tensors(path, tensor_index(path), gemma4_config.our_name,
                            tied=cfg.tie_word_embeddings, skip=_GEMMA4_SKIPPED.fullmatch,
                            variant="gemma4")
        flat, arch = gemma4_config.split_fused(flat, cfg), "gemma4"
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
        hf = hf if "eos_token_id" in hf else text
    else:
        cfg = qwen3_moe.qwen3_moe_config_from_hf(hf, dtype=dtype, source=source)
        flat = read_tensors(path, tensor_index(path), _our_name, tied=cfg.tie_word_embeddings,
                            skip=_SKIPPED.fullmatch, variant="qwen3_moe")
        flat, arch = qwen3_moe.stack_experts(flat, cfg, str(path)), "qwen3_moe"
    eos = validate.token_ids(validate.Fields(hf, source), "eos_token_id", cfg.vocab_size)
    gen = path / "generation_config.json"
    if gen.exists():
        gen_fields = validate.Fields(validate.read_json(gen, "generation_config.json"), str(gen))
        eos += validate.token_ids(gen_fields, "eos_token_id", cfg.vocab_size)
    return cfg, flat, tk.load_dir_tokenizer(path), eos, arch


def owns(cfg) -> bool:
    return isinstance(cfg, (MoeConfig, Gemma4Config))


def check_layout(cfg, layout: str, note: str, source: str) -> tuple[str, str]:
    """(layout, why) these params load in, decided before any weight is placed: Gemma 4 runs
    unrolled ("auto" falls back to it, an explicit other layout is refused); Qwen3-MoE stacks
    only when every layer has experts."""
    if isinstance(cfg, Gemma4Config):
        if layout == "unrolled":
            return layout, note
        if note.startswith("auto"):
            return "unrolled", "auto: Gemma 4's layers differ in head dims (unrolled only)"
        raise JaxspecError(f"{source}: layout {layout!r} is not supported for Gemma 4 (layers "
                           f"differ in head dims): load with layout 'unrolled' or 'auto'")
    if layout == "stacked":
        qwen3_moe.check_stackable(cfg, source)
    if layout == "packed":  # the CPU kernels pack attention and dense MLPs; experts stay arrays
        note += " (experts as XLA arrays)"
    return layout, note


def assemble(cfg, flat: dict, *, source: str) -> dict:
    if isinstance(cfg, Gemma4Config):
        return families.assemble(cfg, flat, source=source, shapes=gemma4.param_shapes(cfg),
                                 family="gemma4")
    return families.assemble(cfg, flat, source=source, shapes=qwen3_moe.param_shapes(cfg),
                             family="qwen3_moe")


def target_for(cfg, arch: str):
    if isinstance(cfg, Gemma4Config):
        return gemma4.Gemma4Target(cfg)
    return MoeTarget(cfg, name=arch)

