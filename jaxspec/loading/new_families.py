"""Checkpoint files of the mixture-of-experts families: Qwen3-MoE (`model_type` qwen3_moe).

HF safetensors directories, as transformers' `save_pretrained` and the published checkpoints
write them: one tensor per expert (`mlp.experts.j.{gate,up,down}_proj.weight`), stacked here into
`[E, ...]` leaves (`qwen3_moe.stack_experts`); the fused `[E, 2F, D]` layout is read too. The
config is read and checked (a routing jaxspec does not implement is refused in one line) before
any tensor is opened, and every tensor's name and shape is checked before any is placed on a
device: a checkpoint is never loaded half-way. llama.cpp's MoE tensors (`ffn_*_exps`) are not
read yet: GGUF MoE files are refused by the registry, naming the supported architectures.
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxspec import validate
from jaxspec.loading import families
from jaxspec.loading import tokenizer as tk
from jaxspec.loading.safetensors_dir import read_tensors, tensor_index
from jaxspec.models import qwen3_moe
from jaxspec.models.qwen3_moe import MoeConfig, MoeTarget

FAMILIES = ("qwen3_moe",)  # registry names of the families read here

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


def read_hf_dir(path: Path, hf: dict, dtype: str):
    """(config, flat tensors under our names, tokenizer, eos ids, architecture)."""
    source = str(path / "config.json")
    cfg = qwen3_moe.qwen3_moe_config_from_hf(hf, dtype=dtype, source=source)
    flat = read_tensors(path, tensor_index(path), _our_name, tied=cfg.tie_word_embeddings,
                        skip=_SKIPPED.fullmatch, variant="qwen3_moe")
    flat = qwen3_moe.stack_experts(flat, cfg, str(path))
    eos = validate.token_ids(validate.Fields(hf, source), "eos_token_id", cfg.vocab_size)
    gen = path / "generation_config.json"
    if gen.exists():
        gen_fields = validate.Fields(validate.read_json(gen, "generation_config.json"), str(gen))
        eos += validate.token_ids(gen_fields, "eos_token_id", cfg.vocab_size)
    return cfg, flat, tk.load_dir_tokenizer(path), eos, "qwen3_moe"


def owns(cfg) -> bool:
    return isinstance(cfg, MoeConfig)


def check_layout(cfg: MoeConfig, layout: str, source: str) -> None:
    """Refuse, before any weight is placed, a layout these params cannot take."""
    if layout == "stacked":
        qwen3_moe.check_stackable(cfg, source)


def assemble(cfg: MoeConfig, flat: dict, *, source: str) -> dict:
    return families.assemble(cfg, flat, source=source, shapes=qwen3_moe.param_shapes(cfg),
                             family="qwen3_moe")


def target_for(cfg: MoeConfig, arch: str) -> MoeTarget:
    return MoeTarget(cfg, name=arch)

