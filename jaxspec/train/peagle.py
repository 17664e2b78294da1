"""Training a P-EAGLE head (drafters/peagle.py; speculators 0.9.0 `speculators.models.peagle`):
EAGLE-3's network plus a learned mask feature, all D draft positions trained in one parallel
pass, as drafting runs them.

Entries (the reference's COD layout, in jaxspec's pairing: position j holds token x_j with the
fused target feature g_{j-1}, its output predicts x_{j+1}):
  depth 0      every position j: (x_j, g_{j-1}), causal over depth 0 (EAGLE-3's step 1)
  depth d > 0  anchor a, position a + d: (mask token, fc(mask_hidden)); attends depth 0 at
               positions 1..a and its own rollout's depths 1..d; predicts x_{a+d+1}
Depth d's entry at anchor a is exactly draft d+1 of a proposal at committed length a + 1 (the
runtime's one pass writes the same entries at the same positions under the same mask), so the
training-time test is the parallel pass itself: each depth attends the keys and values the
drafter computed for the earlier positions of its own rollout, never the target's, and no entry
reads a drafted token (P-EAGLE's drafts do not condition on each other's tokens).

COD sampling (the reference's memory saving): depth d keeps a fraction max(r^d, r_min) of the
anchors, nested (depth d's anchors are a prefix of depth d-1's, so every rollout it extends
exists); the anchors are a permutation of 1..T-2 drawn with a key made from the batch (the loss
takes no key; the data order is a function of (seed, step), so a resumed run is exact). The loss
is the mean soft cross-entropy over all kept entries, as the reference averages over its sample.

Differences from the reference recipe, each for a reason: the token embedding is the target's,
frozen (the runtime reads the target's; the reference trains its own copy); targets are the
recorded top-K of the target (jaxspec.train.data), not its full logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafters import feature_chain
from jaxspec.drafters.peagle import PEagleDrafter
from jaxspec.errors import JaxspecError
from jaxspec.train import methods


@dataclasses.dataclass(frozen=True)
class PEagle(methods.Eagle3):
    num_depths: int = 4  # drafts per pass the head is trained for (speculative_tokens)
    mask_token_id: int = 3  # the token the depth > 0 entries embed
    down_sample_ratio: float = 0.7  # COD: depth d keeps max(r^d, r_min) of the anchors
    down_sample_ratio_min: float = 0.2
    mask_init_scale: float = 1.0  # mask_hidden starts N(0, scale^2) (the reference: randn)
    name: str = "peagle"

    def __post_init__(self):
        if self.num_depths < 1:
            raise JaxspecError(f"method_args.num_depths={self.num_depths}: use an integer >= 1")
        if not 0.0 < self.down_sample_ratio_min <= self.down_sample_ratio <= 1.0:
            raise JaxspecError(
                f"method_args.down_sample_ratio={self.down_sample_ratio}, down_sample_ratio_min="
                f"{self.down_sample_ratio_min}: use 0 < down_sample_ratio_min <= "
                f"down_sample_ratio <= 1")

    def init(self, target, d2t, key):
        vocab = target.target.vocab_size
        if not 0 <= self.mask_token_id < vocab:
            raise JaxspecError(f"method_args.mask_token_id={self.mask_token_id}: use a token id "
                               f"below the target's vocab_size {vocab}")
        params, frozen = super().init(target, d2t, key)
        n = len(self.feature_slots)
        shape = (n * target.target.hidden_size,)
        mask = self.mask_init_scale * jax.random.normal(jax.random.fold_in(key, 7), shape)
        return params | {"mask_hidden": mask}, frozen

    def drafter(self, target_cfg):
        base = super().drafter(target_cfg)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                  if f.name != "name"}
        return PEagleDrafter(**fields, mask_token=self.mask_token_id)

    def arch(self, target_cfg):
        return {
            "hidden_layers": list(self.taps(target_cfg)), "num_depths": self.num_depths,
            "mask_token_id": self.mask_token_id,
            "norm_before_residual": self.norm_before_residual,
        }

    def kept(self, t: int) -> list[int]:
        """Anchors kept at each depth 0..D-1 for rows of T positions (depth 0: all T)."""
        pool = max(t - 2, 1)
        return [t] + [max(1, int(pool * max(self.down_sample_ratio**d, self.down_sample_ratio_min)))
                      for d in range(1, self.num_depths)]

    def anchor_order(self, tokens):
        """int32[T-2]: the anchors 1..T-2 in a random order drawn with a key made from the batch;
        depth d takes the first kept(T)[d] (a prefix: nested across depths)."""
        t = tokens.shape[1]
        seed = jnp.sum(tokens.astype(jnp.uint32) * jnp.uint32(2654435761))
        return 1 + jax.random.permutation(jax.random.key(seed), max(t - 2, 1)).astype(jnp.int32)

    def depth_logits(self, params, frozen, batch, target_cfg):
        """[(logits f32[B, n_d, N], label positions int32[n_d], valid bool[B, n_d])] for depths
        0..D-1: depth 0 at every position, depth d at anchors anchor_order[:n_d] (position a + d,
        label x_{a+d+1}: the records' entry a + d)."""
        dr = self.drafter(target_cfg)
        cfg, lp = dr.cfg, params["layer"]
        dp = self.runtime(params, frozen)
        tok = batch["tokens"]
        b, t = tok.shape
        j = jnp.arange(t)
        full = lambda m: jnp.broadcast_to(m, (b, *m.shape))  # noqa: E731
        g = dr.fuse(dp, batch["hidden"][jnp.asarray(self.feature_slots)].astype(jnp.float32))
        prev = jnp.pad(g, [(0, 0), (1, 0), (0, 0)])[:, :t]  # g_{j-1} at j
        attn_in, res = dr.layer_input(dp, frozen["embed"][tok].astype(jnp.float32), prev)
        pos = jnp.broadcast_to(j.astype(jnp.int32), (b, t))
        h, k0, v0 = feature_chain.block(cfg, lp, attn_in, res, pos,
                                        full((j[None] <= j[:, None]) & (j[None] >= 1)))
        valid = j[None] < batch["lengths"][:, None]
        out = [(dr.draft_logits(dp, None, h), j.astype(jnp.int32), valid & (j[None] >= 1))]
        n = len(self.feature_slots)
        mask_feature = dr.fuse(dp, dp["mask_hidden"].reshape(n, -1))  # [H]
        m_in, m_res = dr.layer_input(dp, frozen["embed"][self.mask_token_id].astype(jnp.float32),
                                     mask_feature)
        order, kept = self.anchor_order(tok), self.kept(t)
        prev_k, prev_v = [], []
        for d in range(1, self.num_depths):
            nd = kept[d]
            a = order[:nd]  # [n_d]
            eye = jnp.eye(nd, dtype=bool)
            ctx_mask = [full((j[None] <= a[:, None]) & (j[None] >= 1))] + [full(eye)] * (d - 1)
            h, k, v = feature_chain.block(
                cfg, lp, jnp.broadcast_to(m_in, (b, nd, m_in.shape[-1])),
                jnp.broadcast_to(m_res, (b, nd, m_res.shape[-1])),
                jnp.broadcast_to(a + d, (b, nd)), full(eye),
                jnp.concatenate([k0] + [x[:, :nd] for x in prev_k], axis=1),
                jnp.concatenate([v0] + [x[:, :nd] for x in prev_v], axis=1),
                jnp.concatenate(ctx_mask, axis=2))
            prev_k.append(k)
            prev_v.append(v)
            label = jnp.minimum(a + d, t - 1)
            out.append((dr.draft_logits(dp, None, h), label,
                        (a + d < batch["lengths"][:, None]) & (a + d < t)))
        return out

    def loss(self, params, frozen, batch, target_cfg):
        """Mean soft cross-entropy over every kept entry of every depth (the reference's average
        over its COD sample); metrics: top-1 agreement per depth."""
        total, count, metrics = 0.0, 0.0, {}
        for d, (logits, label, valid) in enumerate(self.depth_logits(params, frozen, batch,
                                                                     target_cfg)):
            loss, top1 = methods.soft_ce(logits, batch["topk_ids"][:, label],
                                         batch["topk_probs"][:, label], frozen["t2d"], valid)
            n = jnp.sum(valid.astype(jnp.float32))
            total, count = total + loss * n, count + n
            metrics[f"top1_d{d}"] = top1
        metrics["top1"] = metrics["top1_d0"]
        return total / jnp.maximum(count, 1.0), metrics
