"""Tiny random Llama models for fast tests (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

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

    @property
    def target(self) -> llama.LlamaTarget:  # the models.base.Target the engine runs
        return llama.LlamaTarget(self.cfg)


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


def near_tie_model(seed=0, delta=1e-6, layers=2, packed=True, **kw) -> TinyModel:
    """A packed tiny model on which every greedy step is a near-tie: LM-head rows come in pairs
    (2i, 2i+1) that differ by `delta` relative noise, so the argmax inside the winning pair turns
    on the last bits of the hidden state. Any shape-dependent rounding in the target's forward
    (a reduction whose order depends on batch or window size) flips tokens here."""
    cfg = tiny_config(layers=layers, **kw)
    params = llama.init_params(cfg, jax.random.key(seed), scale=0.3)
    head = params["lm_head"]
    noise = jax.random.normal(jax.random.key(seed + 1), head[1::2].shape)
    head = head.at[1::2].set(head[0::2] * (1.0 + delta * noise))
    params = params | {"lm_head": head}
    if packed and kernels.available():
        params = pack_params(params)
    return TinyModel(cfg, params, eos_token_ids=(-1,))


def eagle_like(target, draft_ids=None):
    """An untrained EAGLE drafter (jaxspec's own, taps 1, 2, 2) and its params, for a tiny target
    (packed for the CPU kernels or not). It drafts `draft_ids` only (default: every other token,
    the even ids 0..62); a test whose constraint allows odd ids passes the ids it needs drafted."""
    from jaxspec.train import methods  # training code: only the tests that need it import it

    ids = np.arange(0, 64, 2) if draft_ids is None else np.asarray(draft_ids)
    m = methods.Eagle(hidden_layers=(1, 2, 2), input_scale=1.0)
    params, frozen = m.init(target, ids.astype(np.int32), jax.random.key(7))
    return m.drafter(target.target), m.runtime(params, frozen)


def motif_prompts(lengths, vocab: int = 64, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of these lengths: half random, then a repeated 4-token motif (so prompt
    lookup finds matches); the same lengths and seed give the same prompts in every module."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        motif = list(rng.integers(1, vocab, size=4))
        out.append([int(t) for t in (list(rng.integers(1, vocab, size=n // 2)) + motif * 4)[:n]])
    return out


def dflash_like(target, block_size=5, seed=0):
    """A random DFlash head (2 bidirectional layers over taps after the first and last layers, mask token
    = the last id) and its params, for a tiny target."""
    from jaxspec.drafters import dflash_forward
    from jaxspec.drafters.dflash import DFlashDrafter

    t = target.target
    spec = dflash_forward.make_spec(t.layer_config, t.num_layers, num_layers=2, block_size=block_size,
                                mask_token_id=t.vocab_size - 1,
                                target_layer_ids=(0, t.num_layers - 1))
    return DFlashDrafter(spec, t.vocab_size), dflash_forward.init_params(spec, jax.random.key(seed))


@functools.partial(jax.jit, static_argnames="target")
def target_logits(params, ids, target):
    """i32[R, T] -> f32[R, T, V]: the target's logits over whole rows, one forward (any
    models.base.Target)."""
    cache = target.init_cache(params, ids.shape[0], ids.shape[1])
    return target.logits(params, target.forward(params, ids, cache).hidden)


def sequence_logits(target, params, ids, bucket: int = 32) -> np.ndarray:
    """f64[T, V]: the target's logits over one sequence, the reference the loop tests compare
    with. The row is padded to a multiple of `bucket` (attention is causal: what follows a
    position changes nothing at it), so sequences of every length share a few programs instead
    of each compiling its own eager forward."""
    width = -(-len(ids) // bucket) * bucket
    row = np.zeros((1, width), np.int32)
    row[0, : len(ids)] = ids
    return np.asarray(target_logits(params, row, target)[0, : len(ids)], np.float64)

