"""Qwen3.5's native multi-token-prediction head (the `mtp.*` tensors of a Qwen3.5 checkpoint) as
a chain drafter (drafters/feature_chain.py) for its own Qwen3.5 target.

The published definition (as vLLM and SGLang run it), with h the target's final-normed hidden
state of the previous position and every norm a Qwen3.5 (1 + w) RMS norm:

  x  = fc · concat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)]   fc [D, 2D]
  h' = norm(one gated full-attention Qwen3.5 decoder layer on x)                mtp.norm
  logits = the target's LM head · h'

and h' (after `norm`) is the next chained step's hidden: one layer drafts every step (γ > 1
chains it, as vLLM does with one MTP layer). The embedding and LM head are the target's.
Params: {"pre_fc_norm_embedding", "pre_fc_norm_hidden": [D], "fc": [D, 2D], "norm": [D],
"layer": a Qwen3.5 full-attention layer's leaves (models/qwen3_5.py: attn_norm, wq [2 N Hd, D],
wk, wv, wo, q_norm, k_norm, mlp_norm, then w_gate, w_up, w_down, or on Qwen3.5-MoE the routed and
shared experts of `models/moe.py`)}. cfg: the target's Qwen35Config.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.drafters.feature_chain import ChainDrafter, attend, linear
from jaxspec.models import decoder, qwen3_5


def _finish(cfg, dparams, x, attn, gate):
    """Residual x [B, T, D] + gated attention output [B, T, N Hd] -> MLP -> mtp.norm."""
    x = qwen3_5.finish_attention(cfg, dparams["layer"], x, attn, gate)
    return qwen3_5.norm(x, dparams["norm"], cfg)


@dataclasses.dataclass(frozen=True)
class Qwen35MtpDrafter(ChainDrafter):
    name: str = "mtp"

    def fuse(self, dparams, feats):  # [1, ..., D] final-normed target hidden -> [..., D]
        return feats[0].astype(jnp.float32)

    def layer_input(self, dparams, emb, feature):
        c = self.cfg
        x = jnp.concatenate([qwen3_5.norm(emb, dparams["pre_fc_norm_embedding"], c),
                             qwen3_5.norm(feature.astype(jnp.float32),
                                           dparams["pre_fc_norm_hidden"], c)], axis=-1)
        x = linear(x, dparams["fc"])
        return x, x  # the decoder layer norms its own input

    def draft_logits(self, dparams, tparams, h):
        return tparams.logits(h.astype(self.cfg.compute_dtype)).astype(jnp.float32)

    def draft_ids(self, dparams):
        return None

    def step(self, dparams, tparams, tokens, feature, k_cache, v_cache, positions):
        """tokens int[B, T] with features [B, T, D] at positions [B, T] over the head's cache
        [B, K, S, Hd] -> (h' [B, T, D], k_cache, v_cache); slot 0 (x_0, no feature) unread."""
        x, _ = self.layer_input(dparams, self.embed(dparams, tparams, tokens), feature)
        x = x.astype(self.cfg.compute_dtype)
        q, k, v, gate = qwen3_5.project_attention(self.cfg, dparams["layer"], x, positions)
        k_cache = decoder.write_kv(k_cache, k.astype(k_cache.dtype), positions)
        v_cache = decoder.write_kv(v_cache, v.astype(v_cache.dtype), positions)
        slot = jnp.arange(k_cache.shape[2])[None, None, :]
        mask = (slot <= positions[..., None]) & (slot >= 1)  # [B, T, S]
        attn = attend(q, k_cache, v_cache, mask)
        return _finish(self.cfg, dparams, x, attn, gate), k_cache, v_cache

    def forward(self, dparams, tparams, tokens, features):
        """Reference form: tokens int[B, T], target features [1, B, T, D] -> draft logits
        f32[B, T, V]; position j (x_j with the hidden of j - 1) predicts x_{j+1} (0: garbage)."""
        b, t = tokens.shape
        prev = jnp.pad(self.fuse(dparams, features), [(0, 0), (1, 0), (0, 0)])[:, :t]
        x, _ = self.layer_input(dparams, self.embed(dparams, tparams, tokens), prev)
        x = x.astype(self.cfg.compute_dtype)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        q, k, v, gate = qwen3_5.project_attention(self.cfg, dparams["layer"], x, pos)
        j = jnp.arange(t)
        mask = jnp.broadcast_to((j[None, :] <= j[:, None]) & (j[None, :] >= 1), (b, t, t))
        attn = attend(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask)
        return self.draft_logits(dparams, tparams, _finish(self.cfg, dparams, x, attn, gate))
