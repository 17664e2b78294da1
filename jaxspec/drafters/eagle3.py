"""The published EAGLE-3 draft head (Li et al. 2025; the layout vLLM, SGLang, SpecForge and
`speculators` serve), as a chain drafter (drafters/feature_chain.py).

Network, params `dparams` (torch `[out, in]` layout):
  input_norm  [3Dt]       optional (speculators `norm_before_fc`): RMS norm over the concatenated
                          low/mid/high target features
  fc          [H, 3Dt]    (+ fc_bias [H], older speculators exports) -> the drafter feature g
  embed       [V, H]      optional: the token embedding (else the target's)
  layer       input_norm [H] (on the embedding), hidden_norm [H] (on the feature),
              wq/wk/wv [*, 2H] over concat[input_norm(embed), hidden_norm(g)], wo [H, N*Hd],
              mlp_norm [H] (post_attention_layernorm), w_gate, w_up, w_down;
              the attention residual is g (hidden_norm(g) with norm_before_residual)
  norm        [H]         final norm; its input h is fed back as the next step's feature
  lm_head     [Nd, H]     draft-vocabulary head
  d2t         int32[Nd]   draft index -> target token id (absolute ids; the files store offsets)

Tapped target layers (`hidden_layers`) use vLLM's indexing, which is jaxspec's: id i is the input
of layer i (HF `hidden_states[i]`, 0 = embeddings); the default is (2, L//2, L-3).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jaxspec.drafters import trained
from jaxspec.drafters.feature_chain import ChainDrafter, linear
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.models import llama


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / mid / high taps for a target of `num_layers` layers."""
    return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(ChainDrafter):
    name: str = "eagle3"
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # dparams has "input_norm"

    def fuse(self, dparams, feats):  # [3, ..., Dt] -> [..., H]
        x = jnp.concatenate([f.astype(jnp.float32) for f in feats], axis=-1)
        if self.norm_before_fc:
            x = llama.rms_norm(x, dparams["input_norm"], self.cfg.rms_norm_eps)
        g = linear(x, dparams["fc"])
        return g + dparams["fc_bias"] if "fc_bias" in dparams else g

    def layer_input(self, dparams, emb, feature):
        lp, eps = dparams["layer"], self.cfg.rms_norm_eps
        hn = llama.rms_norm(feature.astype(jnp.float32), lp["hidden_norm"], eps)
        residual = hn if self.norm_before_residual else feature.astype(jnp.float32)
        e = llama.rms_norm(emb, lp["input_norm"], eps)
        return jnp.concatenate([e, hn], axis=-1), residual

    def draft_logits(self, dparams, tparams, h):
        x = llama.rms_norm(h.astype(jnp.float32), dparams["norm"], self.cfg.rms_norm_eps)
        return linear(x, dparams["lm_head"]).astype(jnp.float32)


# ---- method "eagle3" --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Options(trained.Eagle3LayoutOptions):
    """speculative.eagle3: EAGLE-3 heads (published layouts, or jaxspec's trained `eagle3`)."""

    SECTION: ClassVar[str] = "speculative.eagle3"


def build(options: Eagle3Options, ctx: BuildContext):
    return trained.load("eagle3", options, ctx)


register_drafter(
    "eagle3", build, train="jaxspec.train.methods:Eagle3", formats=("jaxspec", "eagle3", "speculators"),
    options=Eagle3Options, summary=(
    "the published EAGLE-3 head (vLLM / SGLang / speculators layouts), trainable and exportable"))
