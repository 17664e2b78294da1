"""Adaptive speculation: each step, each row chooses how many of the γ_max draft nodes to verify,
from a decayed per-position estimate of its own acceptance and the measured step-cost curve.

Compiled once for γ_max: the chosen length is data (the proposal's `num_proposed` is cut to it,
nodes past it are padding), and the loop verifies the smallest window that fits the batch
(speculate.verify_windows). All state lives in `AdaptiveState`, carried in `DecodeState`.

The model (Leviathan et al., with a measured cost instead of a constant c), per row b:

    alpha[b, i]  running estimate of P(node i+1 accepted | node i accepted), decayed
    E[b, k]      = 1 + sum_{i<=k} prod_{j<=i} alpha[b, j]      expected tokens with k nodes
    cost[k]      = time of a step verifying 1 + k entries (+ k draft steps) / time of a plain step
                   at this batch size (jaxspec.calibration measures it)

A batch steps in lockstep: the window is as wide as its longest row, so once a window of c nodes
is paid every speculating row verifies c nodes (E is non-decreasing in k). Each row decides
whether to speculate at all: with its own estimate, some k >= 1 must give E[b, k] / cost[k] > 1
(expected gain above plain). The batch then takes c = argmax_c sum_b E[b, len_b(c)] / cost[c]
over the speculating rows (c = 0: a plain step; c < γ_max: shortened). A row that does not
speculate re-probes with `probe_length` nodes every `probe_every` steps (all such rows on the
same step, so a probe widens at most one window in `probe_every`), so its estimate can recover.

Why this is lossless: the lengths are computed at the start of the step from `AdaptiveState`
and `row_steps` only -- functions of committed history and of past steps' acceptance counts --
before this step's draft or target draws exist. Conditional on the past, the step is then the
usual rejection-sampling step on a proposal whose length is fixed in advance, which emits tokens
with the target's law for any fixed length (acceptance.py). Cutting a chain after its k-th node
keeps each kept node's q unchanged. A length that looked at the current draws (say, dropping a
node the drafter drew with low probability) would bias the output: the acceptance rule's
correctness assumes the proposal distribution is q, and conditioning on the draw changes it
(tests/test_adaptive.py runs that broken variant and sees it fail the exact-law test).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.drafters.base import Proposal


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
    alpha: jax.Array  # f32[B, G] decayed conditional acceptance per draft position
    costs: jax.Array  # f32[G+1] relative step cost with k = 0..G nodes (costs[0] = 1, plain)
    lengths: jax.Array  # int32[B] nodes each row was allowed this step (metrics, next update)
    length_hist: jax.Array  # int32[B, G+1] steps in which the row used k nodes
    plain_steps: jax.Array  # int32[B] steps in which the whole batch verified a 1-token window
    reached: jax.Array  # int32[B, G] steps in which draft position i was reached (allowed)
    hits: jax.Array  # int32[B, G] ... and accepted (hits / reached: the batch's mean alpha)


@dataclasses.dataclass(frozen=True)
class Controller:
    """Static settings (hashable: part of LoopSpec, so of the jit key)."""

    gamma: int  # γ_max: nodes compiled for
    decay: float = 0.9  # weight of the past in the running acceptance estimate
    prior: float = 0.6  # initial per-position acceptance estimate
    probe_every: int = 16  # steps between re-probes of a row that runs plain (0: never)
    probe_length: int = 1  # nodes a probe verifies

    def init(self, batch: int, costs) -> AdaptiveState:
        g = self.gamma
        costs = jnp.asarray(costs, jnp.float32)  # [G+1]
        return AdaptiveState(
            alpha=jnp.full((batch, g), self.prior, jnp.float32),
            costs=costs,
            lengths=jnp.zeros((batch,), jnp.int32),
            length_hist=jnp.zeros((batch, g + 1), jnp.int32),
            plain_steps=jnp.zeros((batch,), jnp.int32),
            reached=jnp.zeros((batch, g), jnp.int32),
            hits=jnp.zeros((batch, g), jnp.int32),
        )

    def choose(self, st: AdaptiveState, row_steps: jax.Array, active: jax.Array) -> jax.Array:
        """-> int32[B] nodes each row may verify this step. Reads only past-step statistics
        (alpha, costs) and the step counter: never this step's draws (see the module docstring)."""
        expected = expected_tokens(st.alpha)  # [B, G+1]
        gain = expected / st.costs[None]  # [B, G+1] tokens per unit time vs plain (k=0: 1)
        speculates = (jnp.max(gain[:, 1:], axis=1) > 1.0) & active  # [B]
        # batch cap: rows that speculate verify c nodes, the others none
        used = jnp.where(speculates[:, None], expected, expected[:, :1])  # [B, G+1] per cap c
        total = jnp.sum(jnp.where(active[:, None], used, 0.0), axis=0) / st.costs  # [G+1]
        cap = jnp.argmax(total).astype(jnp.int32)
        lengths = jnp.where(speculates, cap, 0)
        probe = (self.probe_every > 0) & (row_steps % max(self.probe_every, 1) == 0)
        probe_len = min(self.probe_length, self.gamma)
        lengths = jnp.where(active & probe & (lengths == 0), probe_len, lengths)
        return lengths.astype(jnp.int32)

    def limit(self, proposal: Proposal, lengths: jax.Array) -> Proposal:
        """Cut each row's chain to its chosen length (the rest become padding)."""
        return proposal._replace(num_proposed=jnp.minimum(proposal.num_proposed, lengths))

    def update(self, st: AdaptiveState, lengths, num_nodes, num_accepted, active) -> AdaptiveState:
        """After acceptance: position i (1-based) was reached when i <= min(n+1, allowed); a reached
        position was accepted when i <= n. Only reached positions move their estimate. A position
        the row was allowed but its drafter did not fill (prompt lookup without a match) counts as
        a miss: alpha estimates what an allowed node yields, which is what the step pays for."""
        i = jnp.arange(1, self.gamma + 1)[None]  # [1, G]
        reached = (i <= jnp.minimum(num_accepted + 1, lengths)[:, None]) & active[:, None]
        hit = (i <= num_accepted[:, None]).astype(jnp.float32)
        alpha = jnp.where(reached, self.decay * st.alpha + (1 - self.decay) * hit, st.alpha)
        used = jax.nn.one_hot(num_nodes, self.gamma + 1, dtype=jnp.int32) * active[:, None]
        plain = (jnp.max(jnp.where(active, num_nodes, 0)) == 0) & active
        return dataclasses.replace(
            st,
            alpha=alpha,
            lengths=lengths,
            length_hist=st.length_hist + used,
            plain_steps=st.plain_steps + plain.astype(jnp.int32),
            reached=st.reached + reached.astype(jnp.int32),
            hits=st.hits + (reached & (hit > 0)).astype(jnp.int32),
        )


def expected_tokens(alpha: jax.Array) -> jax.Array:
    """alpha f32[B, G] -> f32[B, G+1]: E[k] = 1 + sum_{i<=k} prod_{j<=i} alpha_j (E[0] = 1)."""
    run = jnp.cumprod(alpha, axis=1)
    return 1.0 + jnp.concatenate([jnp.zeros_like(run[:, :1]), jnp.cumsum(run, axis=1)], axis=1)


def best_gain(costs, acceptance) -> float:
    """Host side: the best expected speedup over plain for a row accepting node k with
    probability acceptance[k-1] (a float: every node), on the cost curve `costs` ([G+1],
    costs[0] = 1)."""
    g = len(costs) - 1
    if isinstance(acceptance, (int, float)):
        acceptance = [acceptance] * g
    best, run, expected = 1.0, 1.0, 1.0
    for k in range(1, g + 1):
        run *= acceptance[k - 1]
        expected += run
        best = max(best, expected / float(costs[k]))
    return best


def summarize(length_hist, plain_steps, steps: int) -> dict:
    """Host metrics for one row: histogram of nodes used, their mean, fraction of plain steps."""
    hist = [int(c) for c in length_hist]
    total = sum(hist)
    mean = sum(k * c for k, c in enumerate(hist)) / total if total else 0.0
    return {
        "adaptive_gamma_mean": mean,
        "adaptive_gamma_hist": hist,
        "adaptive_plain_fraction": int(plain_steps) / steps if steps else 0.0,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Host-side settings of adaptive speculation (Engine(..., adaptive=Options())).

    step_costs: the verify cost curve, relative ([γ+1] plain-step units for 1..γ+1 window
    entries): None measures it (jaxspec.calibration, cached), a sequence is used for every batch
    size, a callable maps the batch size to one. draft_cost: one draft step in plain-step units,
    added per node. switch_off_acceptance: a batch whose cost curve gives no gain over plain even
    for rows accepting each node with this probability runs the plain program (no drafter, a
    1-token window), not the adaptive one."""

    decay: float = 0.9
    prior: float = 0.6
    probe_every: int = 16
    probe_length: int = 1
    draft_cost: float = 0.0
    switch_off_acceptance: float = 0.8
    step_costs: Any = None
    recalibrate: bool = False

    def controller(self, gamma: int) -> Controller:
        return Controller(
            gamma=gamma,
            decay=self.decay,
            prior=self.prior,
            probe_every=self.probe_every,
            probe_length=self.probe_length,
        )
