"""Training a DFlash head (drafters/dflash_forward.py) on the distillation records (train/data.py),
DFlash's recipe: random anchors, a block of mask entries per anchor, per-position loss weights.

For a record of T tokens the context entries c_0..c_{T-1} (the target's recorded features at
target_layer_ids, fused) are projected once per draft layer. A anchors a per row are drafted at
once, each a block of `block_size` entries at positions a..a+G-1: the true token x_a, then mask
entries, attending the context entries < a and the whole block -- exactly what a proposal at
committed length L = a + 1 computes (dflash_forward.block_hidden is shared). Entry i >= 1 learns the
target's distribution of x_{a+i} (recorded at position a+i-1): the soft cross-entropy of
`methods.soft_ce`, weighted by exp(-(i-1) / decay) (early entries decide most of the accepted
length; DFlash's weighting).

Anchors: A distinct positions drawn from 1..T-2 with a key that is a function of the batch's
tokens (the loss takes no key, and the data order is a pure function of (seed, step): exact resume
holds). The head reads the target's raw embedding and its full LM head (`draft_vocab` should be
the target's vocabulary: the runtime head is the full one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.drafters import dflash_forward as net
from jaxspec.drafters.dflash import DFlashDrafter
from jaxspec.train import methods


@dataclasses.dataclass(frozen=True)
class DFlash:
    hidden_layers: tuple[int, ...] | None = None  # taps (HF indexing: output of layer i - 1)
    block_size: int = 8  # entries per block: the last committed token + block_size - 1 drafts
    num_layers: int = 1
    intermediate_size: int = 0  # 0: the target's
    mask_token_id: int = -1  # -1: the target's last token id
    anchors: int = 16  # blocks per training row
    decay: float = 0.0  # loss weight of entry i: exp(-(i-1) / decay); 0: block_size - 1
    init_scale: float = 1.0
    name: str = "dflash"
    feature_slots: tuple[int, ...] | None = None  # recorded layers used (None: all, in order)

    def __post_init__(self):
        if self.feature_slots is None:  # the records' first len(taps) layers (Batches picks them)
            n = 3 if self.hidden_layers is None else len(self.hidden_layers)
            object.__setattr__(self, "feature_slots", tuple(range(n)))

    def taps(self, target_cfg) -> tuple[int, ...]:
        return methods.feature_taps(self.hidden_layers, target_cfg)

    def spec(self, target_cfg) -> net.DFlashSpec:
        t = methods.as_target(target_cfg)
        mask = self.mask_token_id if self.mask_token_id >= 0 else t.vocab_size - 1
        return net.make_spec(
            dataclasses.replace(t.layer_config, dtype="float32"), t.num_layers,
            num_layers=self.num_layers, block_size=self.block_size, mask_token_id=mask,
            target_layer_ids=tuple(i - 1 for i in self.taps(target_cfg)),
            intermediate_size=self.intermediate_size or None,
        )

    def init(self, target, d2t, key):
        if self.block_size < 2 or self.num_layers < 1:
            raise ValueError("block_size must be >= 2 and num_layers >= 1")
        spec = self.spec(target.target)
        params = net.init_params(spec, key, self.init_scale)
        params["norm"] = methods._final_norm(target)  # the LM head reads the target's scale
        return params, methods.frozen_pieces(target, d2t)

    def runtime(self, params, frozen):
        return params  # the embedding and LM head are read from the target at run time

    def drafter(self, target_cfg):
        return DFlashDrafter(self.spec(target_cfg), methods.as_target(target_cfg).vocab_size)

    def arch(self, target_cfg):
        return {
            "hidden_layers": list(self.taps(target_cfg)), "block_size": self.block_size,
            "num_layers": self.num_layers, "intermediate_size": self.intermediate_size,
            "mask_token_id": self.spec(target_cfg).mask_token_id,
        }

    def anchor_positions(self, tokens):
        """int32[A] distinct anchors in 1..T-2, drawn with a key made from the batch."""
        t = tokens.shape[1]
        a = min(self.anchors, t - 2)
        seed = jnp.sum(tokens.astype(jnp.uint32) * jnp.uint32(2654435761))
        key = jax.random.key(seed)
        return 1 + jax.random.choice(key, t - 2, (a,), replace=False).astype(jnp.int32)

    def weights(self):
        decay = self.decay or (self.block_size - 1)
        return jnp.asarray([math.exp(-i / decay) for i in range(self.block_size - 1)])

    def block_forward(self, params, frozen, batch, target_cfg) -> "Blocks":
        """The drafted blocks of a batch: A anchors per row, each block [x_a, mask x (G-1)]
        through the backbone exactly as a proposal at committed length a + 1 computes it."""
        spec = self.spec(target_cfg)
        tok = batch["tokens"]
        b, t = tok.shape
        g = self.block_size
        feats = batch["hidden"].astype(jnp.float32)  # [n, B, T, D]: Batches picked the slots
        c = net.context_features(spec, params, feats)  # [B, T, D]
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        anchors = self.anchor_positions(tok)  # [A]
        a = anchors.shape[0]
        contexts = []
        for lp in params["layers"]:  # per layer (k, v) [B*A, K, T, Hd]: each block its copy
            k, v = net.context_kv(spec, lp, c, pos)
            rep = lambda x: jnp.repeat(jnp.swapaxes(x, 1, 2), a, axis=0)  # noqa: E731
            contexts.append((rep(k), rep(v)))
        blk_pos = anchors[:, None] + jnp.arange(g, dtype=jnp.int32)  # [A, G]
        first = tok[:, anchors]  # [B, A] the true token at each anchor
        blk = jnp.concatenate(
            [first[..., None], jnp.full((b, a, g - 1), spec.mask_token_id, tok.dtype)], axis=-1
        )
        x = frozen["embed"][blk] * spec.input_embedding_scale  # [B, A, G, D]
        positions = jnp.broadcast_to(blk_pos, (b, a, g)).reshape(b * a, g)
        ctx_len = jnp.broadcast_to(anchors, (b, a)).reshape(b * a)
        h = net.block_hidden(spec, params, x.reshape(b * a, g, -1), positions, contexts, ctx_len)
        logits = net.logits(spec, frozen["head"], h[:, 1:]).reshape(b, a, g - 1, -1)
        label_at = blk_pos[:, 1:] - 1  # entry i predicts x_{a+i}: recorded at a + i - 1
        clipped = jnp.minimum(label_at, t - 1)
        valid = (label_at[None] < batch["lengths"][:, None, None]) & (label_at[None] < t)
        return Blocks(h.reshape(b, a, g, -1), logits, batch["topk_ids"][:, clipped],
                      batch["topk_probs"][:, clipped], valid, tok[:, clipped])

    def loss(self, params, frozen, batch, target_cfg):
        blocks = self.block_forward(params, frozen, batch, target_cfg)
        return self.block_loss(blocks.logits, blocks, frozen)

    def block_loss(self, logits, blocks: "Blocks", frozen):
        """The weighted soft cross-entropy of entries 1..G-1 (logits f32[B, A, G-1, V])."""
        losses, tops = [], []
        for i in range(self.block_size - 1):
            loss, top1 = methods.soft_ce(
                logits[:, :, i], blocks.ids[:, :, i], blocks.probs[:, :, i], frozen["t2d"],
                blocks.valid[:, :, i]
            )
            losses.append(loss)
            tops.append(top1)
        w = self.weights()
        metrics = {"top1": tops[0]} | {f"top1_s{i}": v for i, v in enumerate(tops)}
        return jnp.sum(jnp.stack(losses) * w) / jnp.sum(w), metrics


class Blocks(NamedTuple):
    """A batch's drafted blocks (A anchors a per row, G entries each)."""

    h: jax.Array  # [B, A, G, D] the backbone's final-normed hidden of every entry
    logits: jax.Array  # f32[B, A, G-1, V] entry i >= 1's logits (the target's LM-head rows)
    ids: jax.Array  # int32[B, A, G-1, K] the target's top-K ids for x_{a+i}
    probs: jax.Array  # [B, A, G-1, K] and their probabilities
    valid: jax.Array  # bool[B, A, G-1] entry i has a recorded label
    label_tokens: jax.Array  # int32[B, A, G-1] x_{a+i-1}: the true token before x_{a+i}
