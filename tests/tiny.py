"""Tiny random Llama models for fast tests (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import dataclasses

import jax

from jaxspec import kernels
from jaxspec.loading.params import pack_params
from jaxspec.models import llama


@dataclasses.dataclass(frozen=True)
class TinyModel:  # the fields of loading.LoadedModel that the engine reads
    cfg: llama.ModelConfig
    params: dict
    tokenizer: object = None
    eos_token_ids: tuple[int, ...] = (0,)
    name: str = "tiny"


def tiny_config(vocab=64, layers=4, hidden=64, **kw) -> llama.ModelConfig:
    return llama.ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        **kw,
    )


def tiny_model(seed=0, scale=0.3, eos=(0,), packed=False, **kw) -> TinyModel:
    """`packed=True`: the CPU panel-kernel layout (what configs load on a CPU), when available."""
    cfg = tiny_config(**kw)
    params = llama.init_params(cfg, jax.random.key(seed), scale=scale)
    if packed and kernels.available():
        params = pack_params(params)
    return TinyModel(cfg, params, eos_token_ids=eos)
