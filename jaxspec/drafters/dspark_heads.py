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
from typing import NamedTuple

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


def survival(conf_logits) -> jax.Array:
    """f32[B, γ]: S_i = prod_{j<=i} sigmoid(conf_j), the chance that draft i is accepted."""
    return jnp.cumprod(jax.nn.sigmoid(conf_logits.astype(jnp.float32)), axis=-1)


def step_cost_curve(costs, gamma: int) -> jax.Array:
    """f32[γ+1]: a step's cost verifying k = 0..γ drafts, in plain steps: `costs` a number
    (the slope c of 1 + c k) or the calibrated curve itself (at least γ + 1 entries)."""
    if isinstance(costs, (int, float)):
        return 1.0 + float(costs) * jnp.arange(gamma + 1, dtype=jnp.float32)
    return jnp.asarray(tuple(costs)[: gamma + 1], jnp.float32)


def curve_at(by_batch, batch: int) -> tuple[float, ...]:
    """The step-cost curve at `batch` rows from curves measured at some batch sizes
    (by_batch: ((batch size, (cost of k = 0..γ)), ...)): linear in the batch size between the two
    nearest, the end curve outside them. The batch is a static shape, so this runs at trace time."""
    pts = sorted(by_batch)
    lo = max((p for p in pts if p[0] <= batch), default=pts[0])
    hi = min((p for p in pts if p[0] >= batch), default=pts[-1])
    if hi[0] == lo[0]:
        return tuple(lo[1])
    t = (batch - lo[0]) / (hi[0] - lo[0])
    return tuple(a + t * (b - a) for a, b in zip(lo[1], hi[1]))


def scheduled_length(conf_logits, costs, active=None, shared: bool = False,
                     s=None) -> jax.Array:
    """int32[B]: the verify length per row from the confidence head: conf_logits f32[B, γ] are
    the per-draft acceptance logits, `survival` S_i the chance that draft i is accepted (or `s`
    f32[B, γ] given: the survival after `corrected_survival`), E(k) = 1 + sum_{i<k} S_i the
    expected tokens of a step verifying k drafts, and cost(k) its cost in plain steps
    (`step_cost_curve`); k = argmax_k E(k) / cost(k) over 0..γ (ties: the shorter). shared: one
    k for the batch, argmax_k sum_rows E(k) / cost(k) over the active rows (bool[B]) -- a
    lockstep batch verifies its widest row's window, so a row cut below it saves nothing and
    loses what it would have accepted."""
    s = survival(conf_logits) if s is None else s
    expected = 1.0 + jnp.concatenate([jnp.zeros_like(s[:, :1]), jnp.cumsum(s, axis=-1)],
                                     axis=-1)  # [B, γ+1]
    cost = step_cost_curve(costs, s.shape[-1])  # [γ+1]
    if not shared:
        return jnp.argmax(expected / cost, axis=-1).astype(jnp.int32)
    live = jnp.ones(s.shape[:1], bool) if active is None else active
    total = jnp.sum(jnp.where(live[:, None], expected, 0.0), axis=0)  # [γ+1]
    k = jnp.argmax(total / cost).astype(jnp.int32)
    return jnp.where(live, k, 0)


def corrected_survival(c: "Calibration", s, prior: float) -> jax.Array:
    """f32[B, g]: the head's survival s f32[B, g] scaled, per draft position, by what
    verification found so far in this batch: r_i = (observed_i + prior) / (predicted_i + prior),
    the sums over every row's verified steps (`Calibration`), `prior` pseudo-acceptances on each
    side (no evidence: r = 1). Clipped to [0, 1] and kept non-increasing along the block. Why:
    the head is trained on one domain and overconfident off it (a survival of 0.43 where 0.17 is
    seen); the correction reads only finished steps, so the stopping rule stays lossless."""
    g = s.shape[1]
    obs = jnp.sum(c.observed[:, :g], axis=0)
    pred = jnp.sum(c.predicted[:, :g], axis=0)  # [g]
    ratio = (obs + prior) / (pred + prior)
    return jax.lax.cummin(jnp.clip(s * ratio[None], 0.0, 1.0), axis=1)


class Calibration(NamedTuple):
    """Per row, the confidence head against what verification found (chains): the survival it
    predicted for each draft of the pending step, and over the steps so far, for each draft
    position i that was verified: the predicted S_i summed, the acceptances of position i
    summed, the count; and how many steps verified each length 0..γ."""

    pending: jax.Array  # f32[B, γ] this step's predicted survival
    pending_num: jax.Array  # int32[B] drafts this step verifies (-1: the row is not drafting)
    predicted: jax.Array  # f32[B, γ]
    observed: jax.Array  # f32[B, γ]
    verified: jax.Array  # int32[B, γ]
    lengths: jax.Array  # int32[B, γ+1]
    pending_used: jax.Array = None  # f32[B, γ] the survival the scheduler used (corrected)
    used: jax.Array = None  # f32[B, γ] it, summed over the verified steps

    def row_metrics(self, row: int) -> dict:  # a fetched record (numpy leaves)
        return calibration_metrics(self, row)


def init_calibration(batch: int, gamma: int) -> Calibration:
    zf, zi = jnp.zeros((batch, gamma), jnp.float32), jnp.zeros((batch, gamma), jnp.int32)
    return Calibration(zf, jnp.full((batch,), -1, jnp.int32), zf, zf, zi,
                       jnp.zeros((batch, gamma + 1), jnp.int32), zf, zf)


def propose_calibration(c: Calibration, conf_logits, num, used=None) -> Calibration:
    """The pending step: conf_logits f32[B, g] (g <= γ drafts), num int32[B] verified (-1: a
    row not drafting, which commit leaves out); used f32[B, g] the survival the scheduler
    priced them with (None: the head's own)."""
    s = survival(conf_logits)
    pending = jnp.zeros_like(c.pending).at[:, : s.shape[1]].set(s)
    used = s if used is None else used
    pending_used = jnp.zeros_like(c.pending).at[:, : used.shape[1]].set(used)
    return c._replace(pending=pending, pending_num=num.astype(jnp.int32),
                      pending_used=pending_used)


def commit_calibration(c: Calibration, num_accepted) -> Calibration:
    """The pending step's outcome: num_accepted int32[B] of its pending_num verified drafts."""
    pos = jnp.arange(c.pending.shape[1])[None]  # [1, γ]
    seen = pos < c.pending_num[:, None]  # [B, γ] positions verified
    hit = (pos < num_accepted[:, None]) & seen
    lengths = c.lengths + jax.nn.one_hot(c.pending_num, c.lengths.shape[1], dtype=jnp.int32)
    return c._replace(
        predicted=c.predicted + jnp.where(seen, c.pending, 0.0),
        used=c.used + jnp.where(seen, c.pending_used, 0.0),
        observed=c.observed + hit.astype(jnp.float32),
        verified=c.verified + seen.astype(jnp.int32),
        lengths=lengths, pending_num=jnp.full_like(c.pending_num, -1))


def calibration_metrics(c: Calibration, row: int) -> dict:
    """One row's calibration as plain numbers: per draft position, the mean predicted survival
    and the observed acceptance over the steps that verified it; the verify-length histogram."""
    n = [int(x) for x in c.verified[row]]
    mean = lambda xs: [round(float(x) / k, 4) if k else None for x, k in zip(xs, n)]  # noqa: E731
    return {"confidence_predicted_per_position": mean(c.predicted[row]),
            "confidence_used_per_position": mean(c.used[row]),
            "confidence_observed_per_position": mean(c.observed[row]),
            "confidence_steps_per_position": n,
            "verify_length_hist": [int(x) for x in c.lengths[row]]}


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
