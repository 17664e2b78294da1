"""DSpark's two light heads over a DFlash block (speculators 0.9.0 `speculators.models.dspark`), as
pure functions over a params pytree.

Block slot s has the backbone's final-normed hidden h_s [D], its base logits z_s [V] and a
previous token p_s (the token just before the one slot s predicts: the anchor, then the block's
own drafts in order). The sequential (Markov) head adds a bias b_s to z_s, with e_s = W1[p_s]:

  vanilla  b_s = W2 e_s                                   (a first-order low-rank bigram)
  gated    b_s = W2 (sigmoid(Wg [h_s; e_s] + bg) * e_s)
  rnn      [g; c; o] = Wj [r_{s-1}; e_s; h_s] + bj;  r_s = sigmoid(g) r_{s-1} + (1 - sigmoid(g))
           tanh(c) (r_{-1} = 0, run over every slot from 0);  b_s = W2 tanh(o)

The confidence head predicts the probability that slot s's draft is accepted:
  conf_s = sigmoid(wc [h_s; e_s] + bc)   ([h_s] alone when confidence_with_markov is off).

Params (torch [out, in] layout; R = markov_rank, V the vocabulary):
  markov      {w1 [V, R], w2 [V, R]} + gated {gate_w [R, D+R], gate_b [R]}
              | rnn {joint_w [3R, 2R+D], joint_b [3R]}
  confidence  {w [1, D (+R)], b [1]}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MARKOV_TYPES = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The heads' static settings (hashable: part of the drafter's jit key)."""

    markov_rank: int  # 0: no sequential head (pure DFlash drafting)
    markov_type: str = "vanilla"  # one of MARKOV_TYPES
    confidence: bool = True
    confidence_with_markov: bool = True
    sample_from_anchor: bool = True  # slot 0 (the anchor) drafts too: block_size drafts

    @property
    def stateful(self) -> bool:
        return self.markov_rank > 0 and self.markov_type == "rnn"


def _lin(x, w, b=None):
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w.astype(jnp.float32))
    return y if b is None else y + b.astype(jnp.float32)


def init_state(spec: HeadSpec, batch_shape) -> jax.Array:
    """The RNN head's state before slot 0, f32[..., R] (zeros; [..., 0] for stateless heads)."""
    return jnp.zeros((*batch_shape, spec.markov_rank if spec.stateful else 0), jnp.float32)


def step(spec: HeadSpec, hp, prev, h, state):
    """One slot: prev int32[...] its previous token, h [..., D] its hidden, state f32[..., R]
    -> (bias f32[..., V] or None without a sequential head, e f32[..., R] or None, state')."""
    if spec.markov_rank == 0:
        return None, None, state
    mp = hp["markov"]
    e = mp["w1"][prev].astype(jnp.float32)  # [..., R]
    if spec.markov_type == "vanilla":
        return _lin(e, mp["w2"]), e, state
    if spec.markov_type == "gated":
        gate = jax.nn.sigmoid(_lin(jnp.concatenate([h.astype(jnp.float32), e], -1),
                                   mp["gate_w"], mp["gate_b"]))
        return _lin(gate * e, mp["w2"]), e, state
    z = jnp.concatenate([state, e, h.astype(jnp.float32)], -1)
    g, c, o = jnp.split(_lin(z, mp["joint_w"], mp["joint_b"]), 3, axis=-1)
    g = jax.nn.sigmoid(g)
    state = g * state + (1.0 - g) * jnp.tanh(c)
    return _lin(jnp.tanh(o), mp["w2"]), e, state


def confidence_logit(spec: HeadSpec, hp, h, e) -> jax.Array | None:
    """f32[...]: the confidence head's logit for a slot (None without the head)."""
    if not spec.confidence:
        return None
    x = h.astype(jnp.float32)
    if spec.confidence_with_markov:
        x = jnp.concatenate([x, e], -1)
    return _lin(x, hp["confidence"]["w"], hp["confidence"]["b"])[..., 0]


def scheduled_length(conf_logits, cost_per_draft: float) -> jax.Array:
    """int32[B]: the verify length per row from the confidence head: conf_logits f32[B, γ] are
    the per-draft acceptance logits, so survival S_i = prod_{j<=i} sigmoid(conf_j) estimates the
    chance that draft i is accepted, E(k) = 1 + sum_{i<k} S_i the expected tokens of a step
    verifying k drafts, and cost(k) = 1 + cost_per_draft * k its cost in plain steps (the
    step-cost curve's slope); k = argmax_k E(k) / cost(k) over 0..γ (ties: the shorter)."""
    survival = jnp.cumprod(jax.nn.sigmoid(conf_logits.astype(jnp.float32)), axis=-1)
    expected = 1.0 + jnp.concatenate([jnp.zeros_like(survival[:, :1]),
                                      jnp.cumsum(survival, axis=-1)], axis=-1)  # [B, γ+1]
    cost = 1.0 + cost_per_draft * jnp.arange(expected.shape[-1], dtype=jnp.float32)
    return jnp.argmax(expected / cost, axis=-1).astype(jnp.int32)


def init_params(spec: HeadSpec, key, hidden: int, vocab: int, scale: float = 0.5) -> dict:
    """Random head params (tests, a new head): weights N(0, scale^2 / fan_in)."""
    r = spec.markov_rank
    keys = iter(jax.random.split(key, 8))

    def w(*shape):
        return scale * jax.random.normal(next(keys), shape) / shape[-1] ** 0.5

    out = {}
    if r:
        mp = {"w1": jax.random.normal(next(keys), (vocab, r)), "w2": w(vocab, r)}
        if spec.markov_type == "gated":
            mp |= {"gate_w": w(r, hidden + r), "gate_b": w(r, 1)[:, 0]}
        if spec.markov_type == "rnn":
            mp |= {"joint_w": w(3 * r, 2 * r + hidden), "joint_b": w(3 * r, 1)[:, 0]}
        out["markov"] = mp
    if spec.confidence:
        din = hidden + (r if spec.confidence_with_markov else 0)
        out["confidence"] = {"w": w(1, din), "b": jnp.zeros((1,))}
    return out
