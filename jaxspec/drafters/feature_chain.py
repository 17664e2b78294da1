"""Chain drafters with one decoder layer over target features and their own KV cache: the
published EAGLE-3 head (drafters/eagle3.py) and DeepSeek-V3-style MTP modules (drafters/mtp.py).
This module holds what they share: the layer cache, the drafting scan, commit.

Sequence pairing (the same as jaxspec's own EAGLE, drafters/eagle_head.py): drafter position j holds
token x_j with the (drafter-space) feature f_{j-1} of the position before it, and its output h_j
predicts x_{j+1}. Position 0 has no feature: the published drafters never see x_0, so slot 0 is
never attended (the mask starts at slot 1). RoPE is relative, so the published drafters' position
ids (one less than ours, or one more) give the same attention scores.

Drafting: step 1 enters the last committed token x_{L-1} with the target feature f_{L-2}; step
i > 1 feeds the drafter's own output h (before its final norm) back as the feature, as EAGLE-3
and chained MTP do. Provisional cache entries of steps > 1 are overwritten by commit() with real
ones from the verify window's target features; entries past the committed length are masked.

Subclasses define (all pure, over the drafter params `dparams` and target params `tparams`):
  fuse(dparams, feats)                          [nl, ..., Dt] target features -> [..., H]
  layer_input(dparams, emb, feat)               emb: the tokens' embedding [..., De] (`embed`)
                                                -> (attention input [..., Din], residual [..., H])
  draft_logits(dparams, tparams, h)             [..., H] -> f32[..., N]
  draft_ids(dparams)                            int32[N] target ids of the N draft logits, or None
                                                (the full target vocabulary)
Layer params (torch `[out, in]` layout): wq [N*Hd, Din], wk/wv [K*Hd, Din], wo [H, N*Hd],
mlp_norm [H], w_gate/w_up [F, H], w_down [H, F] under dparams["layer"].
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.decode import sampling
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal, Traits
from jaxspec.drafters.draft_vocab import scatter_to_target
from jaxspec.models import decoder, llama


def linear(x, w):  # x [..., in] @ w [out, in] -> [..., out]
    return jax.lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))


def attend(q, k, v, mask):
    """q [B, T, N, Hd]; k, v [B, K, S, Hd]; mask bool[B, T, S] -> [B, T, N*Hd] (f32 softmax)."""
    b, t, n, hd = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, n // kv, hd)
    s = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * hd**-0.5
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    w = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bksh->btkgh", w, v).reshape(b, t, n * hd)


def mlp(cfg, lp, x):  # post-attention half of a Llama layer: x [..., H] -> [..., H]
    y = llama.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    y = jax.nn.silu(linear(y, lp["w_gate"])) * linear(y, lp["w_up"])
    return x + linear(y, lp["w_down"])


def qkv(cfg, lp, attn_in, positions):
    """attn_in [B, T, Din] at positions [B, T] -> q [B, T, N, Hd], k, v [B, T, K, Hd] (roped)."""
    b, t, _ = attn_in.shape
    inv_freq = llama.rope_frequencies(cfg)
    q = linear(attn_in, lp["wq"]).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = linear(attn_in, lp["wk"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = linear(attn_in, lp["wv"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    return llama.apply_rope(q, positions, inv_freq), llama.apply_rope(k, positions, inv_freq), v


def cached_block(cfg, lp, attn_in, residual, k_cache, v_cache, positions, window=None):
    """One decoder layer over the drafter cache [B, K, S, Hd]: writes k/v at positions [B, T],
    attends slots 1..position (with a sliding `window`: only the last `window` of them, keys with
    position - slot < window). Returns (h [B, T, H], k_cache, v_cache)."""
    q, k, v = qkv(cfg, lp, attn_in, positions)
    k_cache = decoder.write_kv(k_cache, k, positions)
    v_cache = decoder.write_kv(v_cache, v, positions)
    slot = jnp.arange(k_cache.shape[2])[None, None, :]
    mask = (slot <= positions[..., None]) & (slot >= 1)  # [B, T, S]; slot 0: x_0, no feature
    if window is not None:
        mask &= positions[..., None] - slot < window
    x = residual + linear(attend(q, k_cache, v_cache, mask), lp["wo"])
    return mlp(cfg, lp, x), k_cache, v_cache


def block(cfg, lp, attn_in, residual, positions, mask, k_ctx=None, v_ctx=None, ctx_mask=None):
    """Cache-free form (reference, training): attn_in [B, T, Din] at positions [B, T] attends its
    own keys under mask bool[B, T, T], plus optional extra keys k_ctx/v_ctx [B, S, K, Hd] under
    ctx_mask [B, T, S] (training-time test). Returns (h [B, T, H], k, v [B, T, K, Hd])."""
    q, k, v = qkv(cfg, lp, attn_in, positions)
    ks, vs, m = k, v, mask
    if k_ctx is not None:
        ks = jnp.concatenate([k_ctx, k], axis=1)
        vs = jnp.concatenate([v_ctx, v], axis=1)
        m = jnp.concatenate([ctx_mask, mask], axis=2)
    heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # [B, S, K, Hd] -> [B, K, S, Hd]
    x = residual + linear(attend(q, heads_first(ks), heads_first(vs), m), lp["wo"])
    return mlp(cfg, lp, x), k, v


class ChainState(NamedTuple):
    k: jax.Array  # [B, K, S, Hd] the drafter layer's cache
    v: jax.Array  # [B, K, S, Hd]
    feature: jax.Array  # [B, H] fused target feature f_{L-2} for the next proposal


@dataclasses.dataclass(frozen=True)
class ChainDrafter(abc.ABC):
    cfg: llama.ModelConfig  # the drafter layer: hidden size H, heads, mlp, rope, eps (num_layers=1)
    target_vocab: int
    hidden_layers: tuple[int, ...]  # target hidden states (HF indexing) the drafter reads
    name: str = "chain"
    variable_length: bool = False
    window: int | None = None  # sliding window of the layer's attention (None: the whole context)

    @property
    def traits(self) -> Traits:  # the protocol's optional behaviour (decode/drafter.py)
        return Traits(model_cfg=self.cfg, advance=self.advance, target_needs=self.target_needs)

    # ---- hooks (subclasses) -------------------------------------------------------------------
    @abc.abstractmethod
    def fuse(self, dparams, feats):
        """Subclasses (eagle3.py, mtp.py) define it."""

    @abc.abstractmethod
    def layer_input(self, dparams, emb, feature):
        """Subclasses (eagle3.py, mtp.py) define it."""

    def target_needs(self, dparams) -> tuple[str, ...]:
        return () if "embed" in dparams else ("embed",)

    def embed(self, dparams, tparams, tokens):
        """int[...] -> f32[..., De]: the head's own embedding ("embed" in dparams), else the
        target's (`tparams.embed`, the target protocol's shared-embedding trait)."""
        if "embed" in dparams:
            return jnp.asarray(dparams["embed"])[tokens].astype(jnp.float32)
        return tparams.embed(tokens).astype(jnp.float32)

    @abc.abstractmethod
    def draft_logits(self, dparams, tparams, h):
        """Subclasses (eagle3.py, mtp.py) define it."""

    def draft_ids(self, dparams):
        return dparams.get("d2t")

    # ---- forward ------------------------------------------------------------------------------
    def step(self, dparams, tparams, tokens, feature, k_cache, v_cache, positions):
        """tokens int[B, T] with features [B, T, H] at positions [B, T] -> (h, k, v)."""
        attn_in, residual = self.layer_input(dparams, self.embed(dparams, tparams, tokens), feature)
        dt = self.cfg.compute_dtype
        return cached_block(
            self.cfg,
            dparams["layer"],
            attn_in.astype(dt),
            residual.astype(dt),
            k_cache,
            v_cache,
            positions,
            self.window,
        )

    def with_sliding_window(self, window: int):
        """This head with its attention reading the last `window` positions of the context."""
        return dataclasses.replace(self, window=window)

    def forward(self, dparams, tparams, tokens, features):
        """Reference form over a whole sequence: tokens int[B, T], target features
        [nl, B, T, Dt] -> draft logits f32[B, T, N] at every position (position 0: garbage)."""
        b, t = tokens.shape
        f = self.fuse(dparams, features)
        prev = jnp.pad(f, [(0, 0), (1, 0), (0, 0)])[:, :t]
        attn_in, residual = self.layer_input(dparams, self.embed(dparams, tparams, tokens), prev)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        j = jnp.arange(t)
        mask = jnp.broadcast_to((j[None, :] <= j[:, None]) & (j[None, :] >= 1), (b, t, t))
        h, _, _ = block(self.cfg, dparams["layer"], attn_in, residual, pos, mask)
        return self.draft_logits(dparams, tparams, h)

    def _sample(self, dparams, tparams, h, sp, keys):
        """h [B, H] -> (target token [B], full-vocab draft probs f32[B, V])."""
        logits = self.draft_logits(dparams, tparams, h)  # [B, N]
        probs_n = sampling.logits_to_probs(logits, sp)  # greedy: read by nothing, compiled out
        greedy = sp.mode == "greedy"  # the argmax, no draw
        idx = sampling.greedy_tokens(logits) if greedy else sampling.sample_rows(keys, probs_n)
        ids = self.draft_ids(dparams)
        if ids is None:  # full vocabulary
            return idx, probs_n
        return ids[idx], scatter_to_target(probs_n, ids, self.target_vocab)

    # ---- protocol -----------------------------------------------------------------------------
    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        c = self.cfg
        b, p = prompt_tokens.shape
        shape = (b, c.num_kv_heads, capacity, c.head_dim)
        k = jnp.zeros(shape, c.compute_dtype)
        v = jnp.zeros(shape, c.compute_dtype)
        f = self.fuse(dparams, prompt_hidden)  # [B, P, H]; f_t follows token t
        prev = jnp.pad(f, [(0, 0), (1, 0), (0, 0)])[:, :p]
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, k, v = self.step(dparams, tparams, prompt_tokens, prev, k, v, pos)
        last = jnp.take_along_axis(f, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
        return ChainState(k, v, last)

    def advance(self, dparams, tparams, state: ChainState, ctx: DraftContext) -> ChainState:
        """The state `propose` leaves for the committed text, drafting nothing (drafters/prompt_lookup_first.py)."""
        last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)
        pos = (ctx.lengths - 1)[:, None]
        _, k, v = self.step(dparams, tparams, last, state.feature[:, None], state.k, state.v, pos)
        return state._replace(k=k, v=v)

    def propose(self, dparams, tparams, state: ChainState, ctx: DraftContext, num_tokens, sp, keys):
        b = ctx.lengths.shape[0]
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, G]
        last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)  # [B, 1]
        pos = (ctx.lengths - 1)[:, None]
        h, k, v = self.step(dparams, tparams, last, state.feature[:, None], state.k, state.v, pos)
        token, probs = self._sample(dparams, tparams, h[:, 0], sp, step_keys[:, 0])

        def one(carry, key_col):
            k, v, token, h, pos = carry
            h, k, v = self.step(dparams, tparams, token[:, None], h, k, v, pos)
            nxt, p = self._sample(dparams, tparams, h[:, 0], sp, key_col)
            return (k, v, nxt, h, pos + 1), (nxt, p)

        carry = (k, v, token, h, ctx.lengths[:, None])
        (k, v, _, _, _), (tokens, all_probs) = jax.lax.scan(
            one, carry, jnp.swapaxes(step_keys[:, 1:], 0, 1)
        )
        drafts = jnp.concatenate([token[:, None], jnp.swapaxes(tokens, 0, 1)], axis=1)  # [B, G]
        q = jnp.concatenate([probs[:, None], jnp.swapaxes(all_probs, 0, 1)], axis=1)  # [B, G, V]
        num = jnp.full((b,), num_tokens, jnp.int32)
        return Proposal(drafts, q, num), state._replace(k=k, v=v)

    def commit(self, dparams, tparams, state: ChainState, ctx: CommitContext) -> Any:
        """Real entries for window positions 1..G (x_L.. with target features f_{L-1}..)."""
        f = self.fuse(dparams, ctx.hidden)  # [B, G+1, H]; f[:, i] follows window token i
        g1 = ctx.window.shape[1]
        pos = ctx.prev_lengths[:, None] + jnp.arange(g1 - 1, dtype=jnp.int32)
        _, k, v = self.step(dparams, tparams, ctx.window[:, 1:], f[:, :-1], state.k, state.v, pos)
        feature = jnp.take_along_axis(f, ctx.num_accepted[:, None, None], axis=1)[:, 0]
        return ChainState(k, v, feature)
