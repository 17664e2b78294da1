"""Training the block drafter (drafters/parallel_block.py) on the distillation records (train/data.py).

For a record of T tokens, every drafter layer reads the context entries c_0..c_{T-1} once (their
k/v projections); A anchors a per row are drafted at once, each a block of G slots at positions
a..a+G-1 (slot 0 = c_a, slots i > 0 = the mask vectors) attending the context entries < a and
their own block causally -- exactly the attention a proposal at committed length L = a + 1 runs
(drafters/block.block_forward is shared). Slot i learns the target's distribution for x_{a+i+1}
(recorded at position a + i): the target's own next-token probabilities given the true prefix,
which in self-generated records is the text greedy verification follows. Loss: the soft
cross-entropy of `methods.soft_ce` per slot, weighted by slot_decay^i (early slots decide most
of the accepted length).

Anchors: A evenly spaced positions from 1 with an offset that is a function of the batch (the
loss takes no key, and the data order is a pure function of (seed, step): exact resume holds).

Initialisation: `init_eagle` (a jaxspec EAGLE checkpoint of the same target) seeds fuse, in_proj,
layer 0 and the final norm -- layer 0 over slot 0 is then EAGLE's first draft step -- otherwise
EAGLE's own initialisation. Layers >= 1 start as copies of the target's last layers with their
MLP cut to `extra_mlp` and their output projections (wo, w_down) zeroed, so the block starts as
the one-layer drafter and the extra layers grow from the identity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.drafters import parallel_block as block_lib
from jaxspec.drafters import eagle_head as eagle_lib
from jaxspec.train import checkpoint as ckpt
from jaxspec.train import methods


@dataclasses.dataclass(frozen=True)
class Block:
    hidden_layers: tuple[int, ...] | None = None  # None: low/mid/high of the target (2, L//2, L-3)
    block_size: int = 6  # slots per block: the most drafts one forward proposes
    num_layers: int = 2  # block layers
    extra_mlp: int = 512  # MLP width of layers >= 1 (0: the target's)
    anchors: int = 32  # blocks drafted per training row
    slot_decay: float = 0.8  # loss weight of slot i: slot_decay ** i
    init_eagle: str | None = None  # an EAGLE checkpoint seeding fuse, in_proj, layer 0, norm
    input_scale: float = 15.0  # EAGLE's initial layer-input scale (without init_eagle)
    name: str = "block"
    feature_slots: tuple[int, ...] = (0, 1, 2)  # which recorded layers are the features

    def layer_cfg(self, target_cfg):
        return methods.layer_config(
            target_cfg, "method block", num_layers=self.num_layers, dtype="float32"
        )

    def taps(self, target_cfg) -> tuple[int, ...]:
        return methods.feature_taps(self.hidden_layers, target_cfg)

    def _eagle_seed(self, target, key):
        """fuse, in_proj, layer 0 and norm: from `init_eagle`, else EAGLE's initialisation."""
        if self.init_eagle is None:
            eagle = methods.Eagle(hidden_layers=self.hidden_layers, input_scale=self.input_scale)
            params, _ = eagle.init(target, np.zeros((1,), np.int32), key)
            return params
        _, stored = ckpt.load_drafter(self.init_eagle, "eagle", target.cfg, target.params)
        return {k: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), stored[k])
                for k in ("fuse", "in_proj", "layer", "norm")}

    def init(self, target, d2t, key):
        if self.block_size < 1 or self.num_layers < 1:
            raise ValueError("block_size and num_layers must be >= 1")
        k_seed, k_mask = jax.random.split(key)
        seed = self._eagle_seed(target, k_seed)
        layers = {"l0": seed["layer"]}
        n_target = target.target.num_layers
        for i in range(1, self.num_layers):
            lp = methods._copy_layer(target, (n_target - i) % n_target, "method block")
            f = self.extra_mlp or lp["w_gate"].shape[0]
            lp = lp | {
                "w_gate": lp["w_gate"][:f], "w_up": lp["w_up"][:f],
                "w_down": jnp.zeros_like(lp["w_down"][:, :f]), "wo": jnp.zeros_like(lp["wo"]),
            }
            layers[f"l{i}"] = lp
        d = target.target.hidden_size
        mask_in = self.input_scale * jax.random.normal(k_mask, (max(self.block_size - 1, 1), d))
        params = {
            "fuse": seed["fuse"], "in_proj": seed["in_proj"], "block": layers,
            "mask_in": mask_in, "norm": seed["norm"],
        }
        return params, methods.frozen_pieces(target, d2t)

    def runtime(self, params, frozen):
        return {**params, "head": frozen["head"], "d2t": frozen["d2t"]}

    def drafter(self, target_cfg):
        return block_lib.BlockDrafter(
            cfg=self.layer_cfg(target_cfg),
            target_vocab=methods.as_target(target_cfg).vocab_size,
            hidden_layers=self.taps(target_cfg),
            block_size=self.block_size,
        )

    def arch(self, target_cfg):
        return {
            "hidden_layers": list(self.taps(target_cfg)), "block_size": self.block_size,
            "num_layers": self.num_layers, "extra_mlp": self.extra_mlp,
        }

    def anchor_positions(self, tokens):
        """int32[A] anchors in 1..T-1: evenly spaced, offset by a function of the batch."""
        t = tokens.shape[1]
        a = min(self.anchors, t - 1)
        stride = max((t - 1) // a, 1)
        offset = jnp.sum(tokens.astype(jnp.uint32)).astype(jnp.int32) % stride
        return jnp.minimum(1 + offset + stride * jnp.arange(a, dtype=jnp.int32), t - 1)

    def loss(self, params, frozen, batch, target_cfg):
        cfg = self.layer_cfg(target_cfg)
        dp = self.runtime(params, frozen)
        tok = batch["tokens"]
        b, t = tok.shape
        g = self.block_size
        feats = batch["hidden"][jnp.asarray(self.feature_slots)].astype(jnp.float32)
        f = eagle_lib.fuse(dp, feats)  # [B, T, D]; f_t follows token t
        before = jnp.pad(f, [(0, 0), (1, 0), (0, 0)])[:, :t]
        c = block_lib.entry_inputs(dp, frozen["embed"][tok], before)  # [B, T, D] context entries
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        contexts = [block_lib.context_kv(cfg, dp["block"][n], c, pos)
                    for n in block_lib.layer_names(dp)]
        anchors = self.anchor_positions(tok)  # [A]
        x = block_lib.block_inputs(dp, c[:, anchors], g)  # [B, A, G, D]
        slot_pos = anchors[:, None] + jnp.arange(g, dtype=jnp.int32)  # [A, G]
        positions = jnp.broadcast_to(slot_pos, (b, *slot_pos.shape))
        ctx_mask = jnp.arange(t)[None, None, :] < anchors[:, None, None]  # [A, 1, T]
        ctx_mask = jnp.broadcast_to(ctx_mask[None], (b, len(anchors), g, t))
        h = block_lib.block_forward(cfg, dp, x, positions, contexts, ctx_mask)
        logits = eagle_lib.head_logits(dp, h)  # [B, A, G, N]
        label_at = jnp.minimum(slot_pos, t - 1)  # slot i predicts x_{a+i+1}: recorded at a + i
        ids = batch["topk_ids"][:, label_at]  # [B, A, G, K]
        probs = batch["topk_probs"][:, label_at]
        valid = (slot_pos[None] < batch["lengths"][:, None, None]) & (slot_pos[None] < t)
        losses, tops = [], []
        for i in range(g):
            loss, top1 = methods.soft_ce(
                logits[:, :, i], ids[:, :, i], probs[:, :, i], frozen["t2d"], valid[:, :, i]
            )
            losses.append(loss)
            tops.append(top1)
        w = jnp.asarray([self.slot_decay**i for i in range(g)])
        metrics = {"top1": tops[0]} | {f"top1_s{i}": a for i, a in enumerate(tops)}
        return jnp.sum(jnp.stack(losses) * w) / jnp.sum(w), metrics
