"""Adaptive speculation: each step, each row chooses how many of the γ_max draft nodes to verify,
from a decayed per-position estimate of its own acceptance and the measured step-cost curve.

Compiled once for γ_max: the chosen length is data (the proposal's `num_proposed` is cut to it,
nodes past it are padding; `DraftContext.max_nodes` lets a drafter stop drafting early), and the
loop verifies the smallest window that fits the batch (speculate.verify_windows). All state lives
in `AdaptiveState`, carried in `DecodeState`.

The model (Leviathan et al., with measured costs instead of a constant c), per row b:

    alpha[b, i]  running estimate of P(node i+1 accepted | node i accepted), decayed
    E[b, k]      = 1 + sum_{i<=k} prod_{j<=i} alpha[b, j]      expected tokens with k nodes
    room[b]      = tokens the row may still emit (max length - length): at most room[b] - 1
                   nodes can ever be committed, so E_b(c) = E[b, min(c, room[b] - 1)]
    cost[c]      = the loop's step with c nodes (draft, verify of 1 + c entries, accept,
                   commit) / plain decoding's step, at this batch size and the batch's current
                   context (jaxspec.calibration.loop_costs times the loop's own step at a few
                   context lengths `fills`, every row allowed c; session 10 summed a verify
                   and a drafter timed apart, which under-priced EAGLE's wide steps). The
                   step reads the curve at the mean committed length of the active rows,
                   interpolated linearly between the measured fills (clamped at the ends):
                   the attention over the cache grows with the context, so a
                   window of 1 + c entries may cost relatively more at 1024 cached tokens than
                   at 128 (SmolLM2-135M, batch 2, measured: one EAGLE node 1.34 plain steps at
                   128, 1.51 at 1024). With c = 0 a drafter with commit_plain runs the plain
                   program's own step in speculate.decode's plain loop, so cost[0] = 1 + the
                   drafter's bookkeeping per step (EAGLE: one layer over a plain run's 16
                   roots after the run, /16 -- cost[0] 1.008 on SmolLM2; n-gram: none); a
                   drafter without it runs one entry through the window path + propose(0) +
                   commit (measured as such). alpha counts nodes the drafter filled: an allowed
                   node it left empty (prompt lookup without a match) shrinks the window, so is
                   not paid for.

Trees (a static or dynamic tree drafter): the length is a depth. A tree is cut to the levels
1..c before verification (`Controller.limit`: whole levels, so the kept set is ancestor-closed
with whole sibling lists, as the acceptance walk needs), alpha[b, i] estimates P(some node at
depth i+1 accepted | depth i accepted), and cost[c] is the loop's step with the tree cut to c
levels (the drafter still grows the whole tree: its cost is in every cost[c >= 1]).

The policy, and why it is the optimal one under this cost model. A batch steps in lockstep:
one target forward over B x (1 + c) entries, c = the longest row's length, and one drafter
pass whose while loop runs until no row wants another node, i.e. max_b len_b steps. Both are
dense over the batch: a row that verifies fewer nodes than c pays the same padded window, and a
row that stops drafting early still runs every drafter step the longest row runs. So, with c
fixed, the step's time is cost[c] whatever the rows' lengths below c, while E_b is
non-decreasing in k: every active row's best length is the cap itself, cut to what it can still
commit, len_b = min(c, room[b] - 1). A shorter row never saves time here; in particular a row
whose own estimate says speculation does not pay (max_k E[b, k] / cost[k] <= 1) should still
verify the c nodes its batch mates pay for (they are free to it), not run "plain" inside the
batch. What each row's acceptance decides is the cap. A batch's rows are not replaced as they
finish: the batch takes as long as its slowest row, and a window that speeds up the other rows
only adds to the cost of the steps that row still needs. So the cap minimises the expected
time until the last active row is done,

    c* = argmin_{c in 0..γ}  max_{active b} room_b / E_b(min(c, useful_b)) * cost[c]

(c = 0: a 1-entry window; useful_b = room_b - 1, and for prompt lookup at most the nodes its
match has), re-chosen every step as estimates, rooms and the active set change. (Summing the
rows' expected tokens instead, session 8's rule, is right where finished rows are replaced by
new requests; with static batches it let a fast row pull the cap up while a slow row set the
batch's time: EAGLE at batch 2 on SmolLM2 took 1.23 tokens per row and step where batch 1 took
1.53 on the same prompts.) At batch 1 this is max_k E(k) / cost[k]. The per-row lengths differ
within a step (room) and c follows the estimates across steps; the drafter's own per-node cost
(EAGLE: one decoder layer + head per step) enters through cost[c], measured, so a long chain stops
where its drafting is not worth its expected tokens. (Were some cost per row and node, e.g. ragged
kernels, each row would stop where its marginal E[b, k+1] - E[b, k] drops below the rate times that
cost; with dense kernels that cost is zero, so that rule gives the cap.) When c* = 0, every
`probe_every`-th step verifies `probe_length` nodes anyway, so the estimates can recover, and
so does every step where one node would pay at the optimistic estimate (`optimistic`: alpha +
`explore` standard errors of the decayed mean). Without it a row whose first drafts missed
sat on plain steps with only a probe every 16 steps to learn from, and a one-node probe that
misses pushes the estimate down again: simulated with independent outcomes at 0.25 (above the
break-even ~0.17 of a 1.17-step EAGLE node), a row drafted in a quarter of its steps and ran
1.02x where a fixed γ = 1 runs 1.07x (1.06x with the bonus); on a 1091-token summarization
prompt EAGLE's row ran 91% plain at 0.99x where fixed γ = 1 accepted 40% at 1.17x. The bonus
only lifts c* = 0 to one node: the length is still chosen from the estimates, and a row whose
drafts really miss settles where even the bonus says no (the variance floor keeps it at ~0.07
after 10 outcomes). Every
row starts a request from `prior`: at batch 1 the row is the request, and a request's choices
read its own steps only.
The host side (engine.spec_for) runs a whole batch on the plain program instead when this
size's cost curve says speculation cannot pay (`best_gain`); above batch 1 also at the
acceptance earlier batches measured (before any: the prior), or when the last adaptive batch of
the size did not win (`realized_gain`: its steps, each priced at its context -- `spent` --
against the plain program's steps).

The estimate. Each row's alpha[i] is a decayed mean of its outcomes at draft position i with
the prior worth `prior_weight` observations: weight w <- decay * w + 1 and alpha <- alpha +
(outcome - alpha) / w at each reached position (w starts at prior_weight). The steady-state
step is 1 - decay, as an exponential average; the first outcomes move the estimate fast, so a
batch whose drafts miss finds out in a few steps, not ~20 (prior_weight = 1 / (1 - decay) is
the plain exponential average).

Hand-off (lockstep batches only, B > PER_REQUEST_MAX_BATCH; every drafter but prompt lookup,
whose plain steps carry no bookkeeping). Inside the adaptive program a step without nodes still
pays the loop's bookkeeping and the drafter's catch-up after each plain run; the plain program
does not. Once the batch has taken `handoff_after` steps (its estimates mostly evidence
by then, or still the prior where the loop never verified a node) and they say no window
c >= 1 finishes the batch sooner than the plain program (min_{c>=1} of the finish time above >
max_b room_b), the rest of the batch runs plain decoding's own step in a loop of its own: no
drafting, no bookkeeping, the drafter's state left as it is (never read again in this batch),
each step priced at 1 plain step. The host's next choice for this batch size reads the whole
batch (`spent`). At batch 1 the row is the request and keeps its plain loop with probes: a
request whose text turns predictable later can come back.

Why this is lossless: the lengths are computed at the start of the step from `AdaptiveState`,
the step counter and the rows' committed lengths only -- functions of committed history and of
past steps' acceptance counts -- before this step's draft or target draws exist. (Whether the
step runs in decode's plain loop or takes the plain branch reads those lengths and the proposal's
size, never a draw; that step is the 0-node step itself, drawing its token from the target at the
root with the same uniform, so it changes the program's cost, not its output; the hand-off reads
the same statistics, and its steps are that 0-node step too.) Conditional on the past, the step
is then the usual rejection-sampling step on a proposal whose length is fixed in advance,
which emits tokens with the target's law for any fixed length (acceptance.py).
Cutting a chain after its k-th node keeps each kept node's q unchanged. A length that looked at
the current draws (say, dropping a node the drafter drew with low probability) would bias the
output: the acceptance rule's correctness assumes the proposal distribution is q, and
conditioning on the draw changes it (tests/test_adaptive.py runs that broken variant and sees it
fail the exact-law test). The cap couples rows: a row's *sample* may depend on its batch mates
(through c), its *law* does not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import tree
from jaxspec.drafters.base import Proposal


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
    alpha: jax.Array  # f32[B, G] decayed conditional acceptance per draft position
    costs: jax.Array  # f32[F, G+1] step cost with c = 0..G nodes at each fill, in plain steps
    fills: jax.Array  # f32[F] context lengths (committed tokens) the rows of `costs` are for
    lengths: jax.Array  # int32[B] nodes each row was allowed this step (metrics, next update)
    length_hist: jax.Array  # int32[B, G+1] steps in which the row used k nodes
    plain_steps: jax.Array  # int32[B] steps in which the whole batch verified a 1-token window
    window_hist: jax.Array  # int32[G+1] steps in which the batch's window held 1 + c entries
    reached: jax.Array  # int32[B, G] steps in which draft position i was reached (allowed)
    hits: jax.Array  # int32[B, G] ... and accepted (hits / reached: the batch's mean alpha)
    spent: jax.Array  # f32[] the steps' cost so far, in plain steps at their context (realized)
    weight: jax.Array  # f32[B, G] observations behind alpha (decayed; starts at prior_weight)
    handoff_at: jax.Array  # int32[] the step from which plain decoding's step ran, -1: none


PER_REQUEST_MAX_BATCH = 1  # batch sizes whose rows decide for themselves (no hand-off)


@dataclasses.dataclass(frozen=True)
class Controller:
    """Static settings (hashable: part of LoopSpec, so of the jit key)."""

    gamma: int  # γ_max: nodes compiled for
    decay: float = 0.9  # weight of the past in the running acceptance estimate
    prior: float = 0.6  # initial per-position acceptance estimate
    probe_every: int = 16  # steps between re-probes of a row that runs plain (0: never)
    probe_length: int = 1  # nodes a probe verifies
    prior_weight: float = 2.0  # observations the prior is worth (1 / (1 - decay): plain EMA)
    handoff_after: int = 8  # lockstep: steps before a hand-off (0: never)
    explore: float = 1.0  # c* = 0 but one node pays at alpha + explore standard errors: probe

    def init(self, batch: int, costs) -> AdaptiveState:
        """costs: one curve [G+1] (every context) or {fill: curve} (jaxspec.calibration)."""
        g = self.gamma
        fills, table = cost_table(costs)
        return AdaptiveState(
            alpha=jnp.full((batch, g), self.prior, jnp.float32),
            costs=jnp.asarray(table, jnp.float32),  # [F, G+1]
            fills=jnp.asarray(fills, jnp.float32),  # [F]
            lengths=jnp.zeros((batch,), jnp.int32),
            length_hist=jnp.zeros((batch, g + 1), jnp.int32),
            plain_steps=jnp.zeros((batch,), jnp.int32),
            window_hist=jnp.zeros((g + 1,), jnp.int32),
            reached=jnp.zeros((batch, g), jnp.int32),
            hits=jnp.zeros((batch, g), jnp.int32),
            spent=jnp.zeros((), jnp.float32),
            weight=jnp.full((batch, g), self.prior_weight, jnp.float32),
            handoff_at=jnp.full((), -1, jnp.int32),
        )

    def choose(
        self,
        st: AdaptiveState,
        row_steps: jax.Array,
        active: jax.Array,
        room: jax.Array,
        context: jax.Array,
        useful: jax.Array | None = None,
    ) -> jax.Array:
        """-> int32[B] nodes each row may verify this step: min(c*, useful) (module docstring).
        Reads only past-step statistics (alpha, costs), the step counter, room (tokens each row
        may still emit), context (int32[B] committed tokens) and useful (int32[B] nodes a row
        can commit this step; default room - 1; prompt lookup: also its match): committed
        history, never this step's draws."""
        g = self.gamma
        if useful is None:
            useful = jnp.clip(room - 1, 0, g).astype(jnp.int32)  # [B] nodes a row can commit
        times = finish_times(st, active, useful, room, context)  # [G+1]
        cap = jnp.argmin(times).astype(jnp.int32)  # ties: the shorter window
        if self.explore > 0:  # optimism: a row stuck on plain after early misses tries a node
            hopeful = dataclasses.replace(st, alpha=optimistic(st, self.explore))
            opt = finish_times(hopeful, active, useful, room, context)
            cap = jnp.where((cap == 0) & (opt[1] < opt[0]), 1, cap)
        step = jnp.max(jnp.where(active, row_steps, 0))  # rows of a batch step together
        probe = (self.probe_every > 0) & (step % max(self.probe_every, 1) == 0)
        cap = jnp.where(probe & (cap == 0), min(self.probe_length, g), cap)
        return jnp.where(active, jnp.minimum(cap, useful), 0).astype(jnp.int32)

    def limit(self, proposal: Proposal, lengths: jax.Array) -> Proposal:
        """Cut each row's chain to its chosen length (the rest become padding); a tree to its
        nodes no deeper than that: deeper ones become padding (parent -2: never tried), and the
        window ends at the last node kept -- a prefix for trees laid out level by level, as
        every tree drafter here lists them. Whole levels stay: the kept set is ancestor-closed
        and keeps every sibling list whole (the acceptance walk needs both, tree.py). The
        depth is chosen before the step's draws: lossless."""
        if proposal.parents is None:
            return proposal._replace(num_proposed=jnp.minimum(proposal.num_proposed, lengths))
        depths = node_depths(proposal)  # [B, N], 0 for padding
        keep = (depths > 0) & (depths <= lengths[:, None])
        n = jnp.arange(1, depths.shape[1] + 1, dtype=jnp.int32)[None]
        return proposal._replace(
            num_proposed=jnp.max(jnp.where(keep, n, 0), axis=1, initial=0),
            parents=jnp.where(keep, proposal.parents, -2).astype(jnp.int32),
        )

    def update(
        self, st: AdaptiveState, lengths, depths, num_accepted, active, context
    ) -> AdaptiveState:
        """After acceptance: position i (1-based) was reached when i <= min(n+1, verified
        depth); a reached position was accepted when i <= n. Only reached positions move their
        estimate. depths: int32[B] each row's deepest verified node (a chain: its nodes; a tree
        whose accepted path ends at a leaf still counts the next depth as a miss, which only
        lowers the estimate). A position the row was allowed but its drafter did not fill
        (prompt lookup without a match) is no evidence: the window shrinks to the nodes
        proposed, so an unfilled node is not paid for (a 1-entry step is: `window_hist`, and
        the engine's realized gain). context: int32[B] committed tokens before the step (what
        `choose` priced it at)."""
        i = jnp.arange(1, self.gamma + 1)[None]  # [1, G]
        reached = (i <= jnp.minimum(num_accepted + 1, depths)[:, None]) & active[:, None]
        hit = (i <= num_accepted[:, None]).astype(jnp.float32)
        weight = jnp.where(reached, self.decay * st.weight + 1.0, st.weight)
        alpha = jnp.where(reached, st.alpha + (hit - st.alpha) / weight, st.alpha)
        used = jax.nn.one_hot(depths, self.gamma + 1, dtype=jnp.int32) * active[:, None]
        window = jnp.max(jnp.where(active, depths, 0))  # the step's depth: its cost
        plain = (window == 0) & active
        stepped = jax.nn.one_hot(window, self.gamma + 1, dtype=jnp.int32) * jnp.any(active)
        return dataclasses.replace(
            st,
            alpha=alpha,
            weight=weight,
            lengths=lengths,
            length_hist=st.length_hist + used,
            plain_steps=st.plain_steps + plain.astype(jnp.int32),
            window_hist=st.window_hist + stepped,
            reached=st.reached + reached.astype(jnp.int32),
            hits=st.hits + (reached & (hit > 0)).astype(jnp.int32),
            spent=st.spent + jnp.any(active) * step_cost(st, context, active)[window],
        )

    def hands_off(self, st: AdaptiveState, row_steps, active, room, context) -> jax.Array:
        """-> bool[]: whether the rest of this lockstep batch runs plain decoding's step (module
        docstring): the batch has taken `handoff_after` steps, and no window of c >= 1 nodes is
        expected to finish the batch sooner than the plain program (its slowest row's room at 1
        token per plain step). Past statistics, the step counter and committed history only."""
        if self.handoff_after <= 0:
            return jnp.zeros((), bool)
        useful = jnp.clip(room - 1, 0, self.gamma).astype(jnp.int32)
        times = finish_times(st, active, useful, room, context)  # [G+1]
        plain = jnp.max(jnp.where(active, room, 0)).astype(jnp.float32)  # plain program: 1/step
        step = jnp.max(jnp.where(active, row_steps, 0))  # rows of a batch step together
        return (step >= self.handoff_after) & jnp.any(active) & (jnp.min(times[1:]) > plain)

    def update_handed_off(self, st: AdaptiveState, active, step) -> AdaptiveState:
        """A step of plain decoding's own after the hand-off: no node, no evidence, 1 plain step."""
        any_active = jnp.any(active)
        return dataclasses.replace(
            st,
            lengths=jnp.zeros_like(st.lengths),
            length_hist=st.length_hist.at[:, 0].add(active.astype(jnp.int32)),
            plain_steps=st.plain_steps + active.astype(jnp.int32),
            window_hist=st.window_hist.at[0].add(any_active.astype(jnp.int32)),
            spent=st.spent + any_active.astype(jnp.float32),
            handoff_at=jnp.where(st.handoff_at < 0, step, st.handoff_at),
        )


def optimistic(st: AdaptiveState, explore: float) -> jax.Array:
    """f32[B, G] alpha + explore standard errors of each estimate (a decayed mean of `weight`
    outcomes; variance floored at VARIANCE_FLOOR, so an estimate at 0 or 1 keeps some doubt),
    at most 1. Unobserved while a row runs plain, the weight stays: the doubt does not grow."""
    var = jnp.maximum(st.alpha * (1.0 - st.alpha), VARIANCE_FLOOR)
    return jnp.minimum(st.alpha + explore * jnp.sqrt(var / st.weight), 1.0)


VARIANCE_FLOOR = 0.05  # of a per-position acceptance estimate, for `optimistic`


def node_depths(proposal: Proposal) -> jax.Array:
    """int32[B, N] each proposed node's depth (1: a child of the root), 0 for padding (past
    num_proposed, or a parent outside -1..i-1); a chain's node i sits at depth i + 1."""
    n = proposal.tokens.shape[1]
    idx = jnp.arange(n, dtype=jnp.int32)[None]
    real = idx < proposal.num_proposed[:, None]
    if proposal.parents is None:
        return jnp.where(real, idx + 1, 0)
    parents = proposal.parents
    real = real & (parents >= -1) & (parents < idx)
    mask = tree.ancestors(parents, proposal.num_proposed)  # [B, 1+N, 1+N]
    depth = jnp.sum(mask, axis=-1, dtype=jnp.int32)[:, 1:] - 1
    return jnp.where(real, depth, 0)


def proposal_depth(proposal: Proposal) -> jax.Array:
    """int32[B] the deepest proposed node (a chain: its length; 0: nothing proposed)."""
    if proposal.parents is None:
        return proposal.num_proposed
    return jnp.max(node_depths(proposal), axis=1, initial=0)


def finish_times(st: AdaptiveState, active, useful, room, context) -> jax.Array:
    """-> f32[G+1] the batch's expected time to finish, in plain steps, if every step verified
    a cap of c = 0..G nodes: the slowest active row's room_b / E_b(min(c, useful_b)) steps, each
    costing cost[c] (at the batch's context). A batch ends with its last row (rows are not
    replaced), so a window pays only where it shortens that row's remaining time."""
    expected = expected_tokens(st.alpha)  # [B, G+1]
    ks = jnp.arange(expected.shape[1])
    by_cap = jnp.take_along_axis(expected, jnp.minimum(ks[None], useful[:, None]), axis=1)
    steps = jnp.where(active[:, None], room[:, None].astype(jnp.float32) / by_cap, 0.0)
    return jnp.max(steps, axis=0) * step_cost(st, context, active)


def cost_table(costs) -> tuple[list[float], list[list[float]]]:
    """One curve [G+1] (every context: fills [0]) or {fill: curve} -> (fills ascending, rows)."""
    if isinstance(costs, dict):
        fills = sorted(costs, key=float)
        return [float(f) for f in fills], [[float(c) for c in costs[f]] for f in fills]
    return [0.0], [[float(c) for c in costs]]


def step_cost(st: AdaptiveState, context: jax.Array, active: jax.Array) -> jax.Array:
    """-> f32[G+1] the cost curve at the mean committed length of the active rows (each row's
    attention reads its own prefix, so the batch's attention work goes with the mean),
    linear between the measured fills, clamped outside them."""
    n = jnp.maximum(jnp.sum(active), 1)
    x = jnp.sum(jnp.where(active, context, 0)).astype(jnp.float32) / n
    return jax.vmap(lambda col: jnp.interp(x, st.fills, col), in_axes=1)(st.costs)


def expected_tokens(alpha: jax.Array) -> jax.Array:
    """alpha f32[B, G] -> f32[B, G+1]: E[k] = 1 + sum_{i<=k} prod_{j<=i} alpha_j (E[0] = 1)."""
    run = jnp.cumprod(alpha, axis=1)
    return 1.0 + jnp.concatenate([jnp.zeros_like(run[:, :1]), jnp.cumsum(run, axis=1)], axis=1)


def best_gain(costs, acceptance) -> float:
    """Host side: the best expected speedup over plain for a row accepting node k with
    probability acceptance[k-1] (a float: every node), on the cost curve `costs` ([G+1] in
    plain steps; costs[0] ~ 1: the loop's plain step). 1.0: the plain program is best."""
    g = len(costs) - 1
    if isinstance(acceptance, (int, float)):
        acceptance = [acceptance] * g
    best, run, expected = 1.0, 1.0, 1.0
    for k in range(1, g + 1):
        run *= acceptance[k - 1]
        expected += run
        best = max(best, expected / float(costs[k]))
    return best


def realized_gain(costs, window_hist, tokens_per_row) -> float:
    """Host side, after an adaptive batch: its speedup over the plain program by the cost
    model -- the plain program would have run max(tokens_per_row) steps of cost 1 (rows in
    lockstep), the adaptive one ran window_hist[c] steps of cost costs[c]."""
    spent = sum(float(c) * int(n) for c, n in zip(costs, window_hist))
    return max(tokens_per_row, default=0) / spent if spent > 0 else 1.0


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

    step_costs: None with draft_cost "auto" (the default): the loop's whole step with 0..γ
    nodes (a tree: cut to 0..D levels) is measured against plain decoding's step
    (jaxspec.calibration.loop_costs, cached). Else the verify cost curve, relative ([γ+1]
    plain-step units for 1..γ+1 window entries, the first the loop's 1-entry step; a tree: per
    depth): None measures it (chains), a sequence is used for every batch size, a callable maps
    the batch size to one; draft_cost "auto" then measures the drafter's work per step (propose
    with c nodes + commit) and adds it, a number adds that many plain steps per drafted node.
    switch_off_acceptance: a batch whose cost curve gives no gain over plain even for rows
    accepting each node with this probability runs the plain program (no drafter, a 1-token
    window), not the adaptive one (above batch 1 the acceptance earlier batches measured
    replaces it once there is one: engine.spec_for). prior_weight: observations the prior
    acceptance is worth; explore: standard errors of optimism that lift c* = 0 to a one-node
    probe (module docstring); handoff_after: steps before a lockstep batch may hand
    the rest of its steps to plain decoding's step (0: never; module docstring)."""

    decay: float = 0.9
    prior: float = 0.6
    probe_every: int = 16
    probe_length: int = 1
    draft_cost: float | str = "auto"
    switch_off_acceptance: float = 0.8
    prior_weight: float = 2.0
    explore: float = 1.0
    handoff_after: int = 8
    step_costs: Any = None
    recalibrate: bool = False

    def controller(self, gamma: int) -> Controller:
        return Controller(
            gamma=gamma,
            decay=self.decay,
            prior=self.prior,
            probe_every=self.probe_every,
            probe_length=self.probe_length,
            prior_weight=self.prior_weight,
            explore=self.explore,
            handoff_after=self.handoff_after,
        )
