"""DeepSeek-V3-style multi-token-prediction (MTP) module as a chain drafter
(drafters/feature_chain.py), for a Llama-family target.

Module k = 1 (DeepSeek-V3 ships one; more are read but only the first drafts, chained for γ > 1,
as vLLM and SGLang do): with h the target's final-normed hidden state of the previous position,

  x = eh_proj · concat[enorm(embed(token)), hnorm(h)]      eh_proj [H, 2H]
  h' = one Llama decoder layer on x (residual x)           layer: attn_norm, wq.., mlp_norm, w_*
  logits = head · head_norm(h')                            shared_head.norm / shared_head.head

and h' (before head_norm) is the next step's feature. Params: {"enorm", "hnorm", "eh_proj",
"layer", "head_norm", optional "head" [V, H] (else the target's LM head), optional "embed" [V, H]
(else the target's)}. Full target vocabulary: no draft-vocabulary map.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jaxspec.drafters import trained
from jaxspec.drafters.feature_chain import ChainDrafter, linear
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.models import llama


@dataclasses.dataclass(frozen=True)
class MtpDrafter(ChainDrafter):
    name: str = "mtp"

    def fuse(self, dparams, feats):  # [1, ..., D] final-normed target hidden -> [..., D]
        return feats[0].astype(jnp.float32)

    def layer_input(self, dparams, emb, feature):
        eps = self.cfg.rms_norm_eps
        x = linear(
            jnp.concatenate(
                [
                    llama.rms_norm(emb, dparams["enorm"], eps),
                    llama.rms_norm(feature.astype(jnp.float32), dparams["hnorm"], eps),
                ],
                axis=-1,
            ),
            dparams["eh_proj"],
        )
        return llama.rms_norm(x, dparams["layer"]["attn_norm"], eps), x

    def draft_logits(self, dparams, tparams, h):
        x = llama.rms_norm(h.astype(jnp.float32), dparams["head_norm"], self.cfg.rms_norm_eps)
        if "head" in dparams:
            return linear(x, dparams["head"]).astype(jnp.float32)
        return tparams.logits(x)  # the target's LM head (the target protocol's `logits`)

    def draft_ids(self, dparams):
        return None


# ---- method "mtp" -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpOptions(trained.CheckpointOptions):
    """speculative.mtp: the MTP module stored with the target (checkpoint: the target's dir,
    its default)."""

    SECTION: ClassVar[str] = "speculative.mtp"


def build(options: MtpOptions, ctx: BuildContext):
    """No checkpoint: the target's own directory (Qwen3.5's `mtp.*` head, or DeepSeek-V3-style
    modules stored with the target)."""
    source = getattr(ctx.target, "source_path", None)
    if options.checkpoint is None and source:
        fmt = "mtp" if options.checkpoint_format == "auto" else options.checkpoint_format
        return ctx.load_checkpoint("mtp", source, ctx.target, fmt)
    return trained.load("mtp", options, ctx)


register_drafter(
    "mtp", build, formats=("mtp",),
    options=MtpOptions,
    summary="the target's MTP module (DeepSeek-V3, Qwen3.5), chained")
