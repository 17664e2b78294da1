"""Training a DSpark head (drafters/dspark.py): a DFlash backbone (train/dflash.py's block forward,
shared) plus DSpark's sequential (Markov) head and confidence head (drafters/dspark_heads.py).

Slots follow DFlash's convention (`sample_from_anchor` off): block entry i >= 1 predicts
x_{a+i}; its previous token is x_{a+i-1} (the anchor for i = 1). The sequential head reads the
true previous token (teacher forcing). That is the conditioning drafting sees wherever the draft
matters: entry i is verified only when drafts 1..i-1 were all accepted, i.e. equal to the
target's own tokens, which are what the distillation records hold (the target's generations).
The RNN variant runs over the anchor entry first, as the runtime walk does.

Training-time test (`own_drafts` > 0, as EAGLE-3 trains): in that fraction of each row's blocks
the sequential head reads the drafter's own previous draft (the argmax of the previous entry's
biased logits, no gradient) instead of the true token, so later entries see the conditioning the
runtime walk gives them, mistakes included. In those blocks the confidence head learns only on
entries whose earlier drafts were all accepted: survival is a product of acceptances given the
predecessors were accepted, and that is the event it must predict.

The confidence head learns, per entry, whether the draft is accepted given its predecessors
were: with `confidence_target: greedy` the label is 1 when the biased draft's argmax is the
target's top-1 (greedy verification), with `sampled` it is sum_x min(p(x), q(x)) (the acceptance
probability of speculative sampling at temperature 1). Labels carry no gradient.

`backbone_from` warm-starts the backbone from an exported DFlash head of the same architecture;
with `train_backbone: false` the backbone stays frozen (held in the frozen pieces, no gradient,
no weight decay) and only the two light heads learn: DSpark's heads on top of the shipped DFlash
head, the cheapest fair test of what the sequential head adds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafters import dspark_heads as hd
from jaxspec.drafters.dspark import DSparkDrafter
from jaxspec.errors import JaxspecError
from jaxspec.train import checkpoint as ckpt
from jaxspec.train import methods
from jaxspec.train.dflash import Blocks, DFlash

CONFIDENCE_TARGETS = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class DSpark(DFlash):
    markov_rank: int = 64  # 0: no sequential head
    markov_type: str = "gated"  # dspark_heads.MARKOV_TYPES
    confidence: bool = True
    confidence_with_markov: bool = True
    confidence_weight: float = 0.1  # the confidence BCE's weight beside the draft loss
    confidence_target: str = "greedy"  # CONFIDENCE_TARGETS
    backbone_from: str | None = None  # an exported DFlash head (same arch) to start from
    train_backbone: bool = True  # false: the backbone frozen, only the heads learn
    own_drafts: float = 0.0  # training-time test: the fraction of blocks fed their own drafts
    name: str = "dspark"

    def __post_init__(self):
        super().__post_init__()
        if self.markov_type not in hd.MARKOV_TYPES:
            raise JaxspecError(f"method_args.markov_type={self.markov_type!r}: use one of "
                               f"{', '.join(hd.MARKOV_TYPES)}")
        if self.confidence_target not in CONFIDENCE_TARGETS:
            raise JaxspecError(f"method_args.confidence_target={self.confidence_target!r}: use "
                               f"one of {', '.join(CONFIDENCE_TARGETS)}")
        if not 0.0 <= self.own_drafts <= 1.0:
            raise JaxspecError(f"method_args.own_drafts={self.own_drafts}: use a fraction in "
                               f"[0, 1] (of blocks fed the drafter's own earlier drafts)")
        if not self.train_backbone and not self.backbone_from:
            raise JaxspecError("method_args.train_backbone=false needs method_args.backbone_from "
                               "(an exported DFlash head): a random frozen backbone drafts noise")

    def heads(self) -> hd.HeadSpec:
        return hd.HeadSpec(self.markov_rank, self.markov_type, self.confidence,
                           self.confidence_with_markov, sample_from_anchor=False)

    def init(self, target, d2t, key):
        backbone, frozen = super().init(target, d2t, key)
        if self.backbone_from:
            backbone = self._stored_backbone(target, backbone)
        t = methods.as_target(target.target)
        heads = hd.init_params(self.heads(), jax.random.fold_in(key, 1),
                               t.layer_config.hidden_size, t.vocab_size)
        if "markov" in heads:  # the bias starts at zero: drafting starts as the backbone's
            heads["markov"]["w2"] = jnp.zeros_like(heads["markov"]["w2"])
        if self.train_backbone:
            return backbone | heads, frozen
        return heads, frozen | {"backbone": backbone}

    def _stored_backbone(self, target, fresh):
        """The backbone params of the DFlash export at `backbone_from` (shapes checked)."""
        _, stored = ckpt.load_drafter(self.backbone_from, "dflash", target.cfg, target.params)
        stored.pop("d2t", None)
        stored["layers"] = tuple(stored["layers"])
        same = jax.tree.structure(stored) == jax.tree.structure(fresh) and all(
            a.shape == b.shape for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(fresh)))
        if not same:
            raise JaxspecError(f"method_args.backbone_from={self.backbone_from}: its DFlash "
                               f"architecture differs from this head's method_args (block_size, "
                               f"num_layers, intermediate_size, hidden_layers): match them")
        return jax.tree.map(lambda x, p: jnp.asarray(x, p.dtype), stored, fresh)

    def runtime(self, params, frozen):
        return params if self.train_backbone else frozen["backbone"] | params

    def exported(self, params, frozen):
        """What the export holds: the backbone and the heads, whichever of them trained."""
        return self.runtime(params, frozen)

    def drafter(self, target_cfg):
        spec = self.spec(target_cfg)  # DSpark's ids are the taps themselves (layer inputs)
        spec = dataclasses.replace(spec, target_layer_ids=tuple(self.taps(target_cfg)))
        return DSparkDrafter(spec, methods.as_target(target_cfg).vocab_size, heads=self.heads())

    def arch(self, target_cfg):
        return super().arch(target_cfg) | {
            "markov_rank": self.markov_rank, "markov_type": self.markov_type,
            "confidence": self.confidence, "confidence_with_markov": self.confidence_with_markov,
        }

    def loss(self, params, frozen, batch, target_cfg):
        full = self.runtime(params, frozen)
        blocks = self.block_forward(full, frozen, batch, target_cfg)
        logits, conf = self.sequential(full, blocks, frozen["d2t"])
        loss, metrics = self.block_loss(logits, blocks, frozen)
        if conf is None:
            return loss, metrics
        bce, calib = self.confidence_loss(conf, logits, blocks, frozen)
        return loss + self.confidence_weight * bce, metrics | {"conf_bce": bce, **calib}

    def own_blocks(self, anchors: int) -> jax.Array:
        """bool[A]: the blocks fed their own drafts (the first round(own_drafts * A) anchors,
        which are drawn at random positions)."""
        return jnp.arange(anchors) < round(self.own_drafts * anchors)

    def sequential(self, params, blocks: Blocks, d2t=None):
        """The runtime walk over every block: (logits f32[B, A, G-1, V] with the sequential bias,
        confidence logits f32[B, A, G-1] or None). Entry i's previous token is the true
        x_{a+i-1}, or in the `own_blocks` the drafter's own draft i-1 (d2t: draft -> target ids)."""
        heads = self.heads()
        h = blocks.h  # [B, A, G, D]
        prevs = blocks.label_tokens  # [B, A, G-1]: x_{a+i-1} for entry i
        own = self.own_blocks(prevs.shape[1])[None]  # [1, A]
        state = hd.init_state(heads, prevs.shape[:2])
        _, _, state = hd.step(heads, params, prevs[:, :, 0], h[:, :, 0], state)  # anchor entry
        zs, confs, prev = [], [], prevs[:, :, 0]
        for i in range(1, self.block_size):
            bias, e, state = hd.step(heads, params, prev, h[:, :, i], state)
            base = blocks.logits[:, :, i - 1]
            zs.append(base if bias is None else base + bias)
            confs.append(hd.confidence_logit(heads, params, h[:, :, i], e))
            if i + 1 < self.block_size:
                prev = prevs[:, :, i]
                if self.own_drafts > 0:  # the draft the runtime walk would feed (greedy)
                    drafted = jax.lax.stop_gradient(jnp.argmax(zs[-1], -1))
                    drafted = drafted if d2t is None else d2t[drafted]
                    prev = jnp.where(own, drafted, prev)
        conf = None if confs[0] is None else jnp.stack(confs, axis=2)
        return jnp.stack(zs, axis=2), conf

    def confidence_loss(self, conf, logits, blocks: Blocks, frozen):
        """Mean BCE of the confidence logits against each entry's acceptance (no gradient into
        the labels), and the calibration per entry: mean predicted vs mean observed."""
        t2d = frozen["t2d"]
        hit = (t2d[blocks.ids[..., 0]] == jnp.argmax(logits, -1)).astype(jnp.float32)
        if self.confidence_target == "greedy":
            label = hit  # [B, A, G-1]
        else:
            idx = t2d[blocks.ids]
            p = jnp.where(idx >= 0, blocks.probs.astype(jnp.float32), 0.0)
            p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-6)
            q = jnp.take_along_axis(jax.nn.softmax(logits, -1), jnp.maximum(idx, 0), -1)
            label = jnp.sum(jnp.minimum(p, q), -1)
        label = jax.lax.stop_gradient(label)
        m = blocks.valid.astype(jnp.float32)
        if self.own_drafts > 0:  # own-draft blocks: only entries whose earlier drafts all hit
            before = jnp.cumprod(jnp.concatenate([jnp.ones_like(hit[..., :1]), hit[..., :-1]],
                                                 -1), -1)
            own = self.own_blocks(hit.shape[1])[None, :, None]
            m = m * jnp.where(own, jax.lax.stop_gradient(before), 1.0)
        bce = jnp.maximum(conf, 0) - conf * label + jnp.log1p(jnp.exp(-jnp.abs(conf)))
        per = lambda x: jnp.sum(x * m, (0, 1)) / jnp.maximum(m.sum((0, 1)), 1.0)  # noqa: E731
        pred, seen = per(jax.nn.sigmoid(conf)), per(label)
        calib = {f"conf_pred_s{i}": pred[i] for i in range(min(3, pred.shape[0]))} | {
            f"conf_seen_s{i}": seen[i] for i in range(min(3, seen.shape[0]))}
        return jnp.sum(bce * m) / jnp.maximum(m.sum(), 1.0), calib
