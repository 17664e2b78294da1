"""Adaptive speculation: each step, each row chooses how many of the γ_max draft nodes to verify,
from a decayed per-position estimate of its own acceptance and the measured step-cost curve.

The loop (speculate.decode) asks the `Controller` once per step for the step's `Plan` -- the
nodes each row may verify, and whether the batch has been handed off to plain decoding's step --
and tells it the step's `Outcome` once afterwards (`Controller.observe`). Everything else here is
the arithmetic behind those two calls. Compiled once for γ_max: the chosen length is data (the
proposal is cut to it by `cut`, nodes past it are padding; `DraftContext.max_nodes` lets a
drafter stop drafting early). All state lives in `AdaptiveState`, carried in `DecodeState`; the
settings are `config.AdaptiveConfig`, the config section itself.

The model (Leviathan et al., with measured costs instead of a constant c), per row b:

    alpha[b, i]  running estimate of P(node i+1 accepted | node i accepted), decayed
    E[b, k]      = 1 + sum_{i<=k} prod_{j<=i} alpha[b, j]      expected tokens with k nodes
    room[b]      = tokens the row may still emit: at most room[b] - 1 nodes can be committed
    cost[c]      = the loop's step with c nodes / plain decoding's step, at this batch size,
                   read at the active rows' mean committed length (linear between the
                   measured context lengths `fills`: attention grows with the context)

Trees: the length is a depth. A tree is cut to its levels 1..c (`cut`: whole levels, so the
kept set is ancestor-closed with whole sibling lists, as the acceptance walk needs); alpha[b, i]
estimates P(some node at depth i+1 accepted | depth i accepted).

The policy. A batch steps in lockstep: one target forward over B x (1 + c) entries and one
drafter pass as long as the longest row's draft, so with the cap c fixed a row gains nothing by
verifying fewer nodes: every active row verifies min(c, room[b] - 1). What acceptance decides is
the cap, and since a batch ends with its slowest row, the cap minimises the expected time until
the last active row is done:

    c* = argmin_{c in 0..γ}  max_{active b} room_b / E_b(min(c, useful_b)) * cost[c]

(useful_b = room_b - 1; prompt lookup: at most the nodes its match has). At batch 1 this is
max_k E(k) / cost[k]. Under continuous batching (`Controller.rows_replaced`, the serving
scheduler) a row that ends is replaced at once, so the cap instead maximises the active rows'
expected tokens per unit of cost, c* = argmax_c sum_b E_b(min(c, useful_b)) / cost[c], with
cost[] the curve of the live row count (the scheduler runs each call at that width). When c* = 0, every `probe_every`-th step verifies `probe_length` nodes, and
so does a step where one node would pay at the optimistic estimate (`optimistic`: alpha +
`explore` standard errors), so a row whose first drafts missed can recover.

The estimate: a decayed mean per position with the prior worth `prior_weight` observations
(w <- decay * w + 1, alpha <- alpha + (outcome - alpha) / w at each reached position), so the
first outcomes move it fast and the steady state is an exponential average with step 1 - decay.

Hand-off (lockstep batches, B > PER_REQUEST_MAX_BATCH; not prompt lookup, whose plain steps carry
no bookkeeping): once the batch has taken `handoff_after` steps and no window c >= 1 is expected
to finish it sooner than the plain program, the plan says so for good: the rest of the batch runs
plain decoding's own step, the drafter untouched. At batch 1 the row is the request and keeps
its plain runs with probes.

Why this is lossless: the plan is computed from `AdaptiveState`, the step counter and the rows'
committed tokens only -- committed history and past steps' acceptance counts -- before this
step's draws exist. Conditional on the past, the step is the usual rejection-sampling step on a
proposal whose length is fixed in advance, which emits tokens with the target's law for any fixed
length (acceptance.py); cutting a chain after its k-th node keeps each kept node's q. A length
that looked at the current draws would bias the output (tests/test_adaptive.py runs that broken
variant and sees it fail the exact-law test). The cap couples rows: a row's *sample* may depend
on its batch mates (through c), its *law* does not.

The host side (host.AdaptiveHost) runs a whole batch on the plain program instead
when this size's cost curve says speculation cannot pay (`best_gain`), or, above batch 1, when
earlier batches' acceptance or the last batch's realized gain (`realized_gain`) says so.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.decode import tree
from jaxspec.decode.adaptive.settings import AdaptiveConfig
from jaxspec.decode.drafter import Proposal

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
    reason_hist: jax.Array  # int32[B, R] steps of each row by why its length was chosen (REASONS)


# Why a row verifies the nodes it does, per step (`Plan.reasons`, counted in `reason_hist`):
# drafts      the step's cap (c* >= 1)
# room        fewer than the cap (or none): the row's room, or prompt lookup's match, is shorter
# acceptance  none: at its estimates no window pays, even at the shortest calibrated context
# context     none: a window would pay at the shortest calibrated context, not at this one
# probe       a probe or exploration step where c* = 0
# handoff     the lockstep batch runs plain decoding's step
REASONS = ("drafts", "room", "acceptance", "context", "probe", "handoff")
DRAFTS, ROOM, ACCEPTANCE, CONTEXT, PROBE, HANDOFF = range(len(REASONS))

PER_REQUEST_MAX_BATCH = 1  # batch sizes whose rows decide for themselves (no hand-off)

# the settings the loop reads (the rest of AdaptiveConfig is the host's): the jit key
LOOP_SETTINGS = ("decay", "prior", "probe_every", "probe_length", "prior_weight",
                 "handoff_after", "explore")


class Plan(NamedTuple):
    """What one step may do, decided before its draws (a pytree: carried through the loop)."""

    lengths: jax.Array  # int32[B] nodes each row may verify (a tree: levels); 0: none
    hand_off: jax.Array  # bool[] the rest of the batch runs plain decoding's step
    reasons: jax.Array | None = None  # int32[B] why each row's length (REASONS); None: fixed

    def drafts(self) -> jax.Array:
        """bool[]: some row may verify a node (else the step is a one-token step)."""
        return jnp.max(self.lengths) > 0


class Outcome(NamedTuple):
    """What one step did, per row: what the controller learns from."""

    depths: jax.Array  # int32[B] the deepest node verified (a chain: its nodes; 0: none)
    num_accepted: jax.Array  # int32[B] nodes accepted
    active: jax.Array  # bool[B] rows that took part
    context: jax.Array  # int32[B] committed tokens before the step (what the plan priced)
    step: jax.Array  # int32[] the batch's step counter before the step


@dataclasses.dataclass(frozen=True, eq=False)
class Controller:
    """The loop's adaptive policy: `plan` before a step, `observe` after it. Static (part of
    LoopSpec, so of the jit key): γ_max, the settings, and `fixed` -- a plan of this many nodes
    for every active row at every step, never handing off (calibration times the loop's step
    with k nodes through it)."""

    gamma: int  # γ_max: nodes compiled for (a tree: its depth)
    settings: AdaptiveConfig = AdaptiveConfig()
    fixed: int | None = None
    # continuous batching: a row that ends is replaced at once, so the cap maximises the active
    # rows' expected tokens per unit of step cost (`token_times`) instead of minimising the
    # lockstep batch's finish time (`finish_times`); the same at batch 1
    rows_replaced: bool = False

    def _key(self) -> tuple:
        loop = tuple(getattr(self.settings, f) for f in LOOP_SETTINGS)
        return type(self), self.gamma, self.fixed, self.rows_replaced, loop

    def _times(self, st, active, useful, room, context) -> jax.Array:
        if self.rows_replaced:
            return token_times(st, active, useful, context)
        return finish_times(st, active, useful, room, context)

    def __eq__(self, other) -> bool:
        return isinstance(other, Controller) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def init(self, batch: int, costs) -> AdaptiveState:
        """costs: one curve [G+1] (every context) or {fill: curve} (calibration.py)."""
        g, s = self.gamma, self.settings
        fills, table = cost_table(costs)
        return AdaptiveState(
            alpha=jnp.full((batch, g), s.prior, jnp.float32),
            costs=jnp.asarray(table, jnp.float32),  # [F, G+1]
            fills=jnp.asarray(fills, jnp.float32),  # [F]
            lengths=jnp.zeros((batch,), jnp.int32),
            length_hist=jnp.zeros((batch, g + 1), jnp.int32),
            plain_steps=jnp.zeros((batch,), jnp.int32),
            window_hist=jnp.zeros((g + 1,), jnp.int32),
            reached=jnp.zeros((batch, g), jnp.int32),
            hits=jnp.zeros((batch, g), jnp.int32),
            spent=jnp.zeros((), jnp.float32),
            weight=jnp.full((batch, g), s.prior_weight, jnp.float32),
            handoff_at=jnp.full((), -1, jnp.int32),
            reason_hist=jnp.zeros((batch, len(REASONS)), jnp.int32),
        )

    def plan(
        self,
        st: AdaptiveState,
        row_steps: jax.Array,  # int32[B]
        active: jax.Array,  # bool[B]
        room: jax.Array,  # int32[B] tokens each row may still emit
        context: jax.Array,  # int32[B] committed tokens
        useful: jax.Array | None = None,  # int32[B] nodes a row can commit (default room - 1)
        *,
        may_hand_off: bool = False,  # a lockstep batch whose drafter has plain bookkeeping
    ) -> Plan:
        """The step's plan from past statistics and committed history only (`choose`, and with
        may_hand_off `hands_off`): never this step's draws."""
        if self.fixed is not None:  # k nodes wherever a row can use them
            if useful is None:
                useful = jnp.clip(room - 1, 0, self.gamma).astype(jnp.int32)
            k = jnp.minimum(min(self.fixed, self.gamma), useful)
            return Plan(jnp.where(active, k, 0).astype(jnp.int32), jnp.zeros((), bool))
        lengths, reasons = self.decide(st, row_steps, active, room, context, useful)
        if not may_hand_off:
            return Plan(lengths, jnp.zeros((), bool), reasons)
        off = (st.handoff_at >= 0) | self.hands_off(st, row_steps, active, room, context)
        reasons = jnp.where(off, HANDOFF, reasons).astype(jnp.int32)
        return Plan(jnp.where(off, 0, lengths).astype(jnp.int32), off, reasons)

    def observe(self, st: AdaptiveState, plan: Plan, out: Outcome) -> AdaptiveState:
        """The state after a step run on `plan` (`update`); a handed-off step is plain
        decoding's own, priced at one plain step, and records where the hand-off began."""
        after = self.update(st, plan.lengths, out.depths, out.num_accepted, out.active, out.context)
        any_active = jnp.any(out.active)
        spent = jnp.where(plan.hand_off, st.spent + any_active.astype(jnp.float32), after.spent)
        first = plan.hand_off & (st.handoff_at < 0)
        why = st.reason_hist
        if plan.reasons is not None:
            why = why + jax.nn.one_hot(plan.reasons, len(REASONS), dtype=jnp.int32) * out.active[
                :, None]
        return dataclasses.replace(
            after, spent=spent, handoff_at=jnp.where(first, out.step, st.handoff_at),
            reason_hist=why,
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
        return self.decide(st, row_steps, active, room, context, useful)[0]

    def decide(self, st, row_steps, active, room, context, useful=None):
        """-> (int32[B] lengths, as `choose`; int32[B] why, an index into REASONS). A step
        without nodes is put down to the context when the same estimates would draft at the
        shortest calibrated context (`st.fills[0]`): the window's cost at this context is
        what stopped it."""
        g, s = self.gamma, self.settings
        if useful is None:
            useful = jnp.clip(room - 1, 0, g).astype(jnp.int32)  # [B] nodes a row can commit
        times = self._times(st, active, useful, room, context)  # [G+1]
        best = cap = jnp.argmin(times).astype(jnp.int32)  # ties: the shorter window
        if s.explore > 0:  # optimism: a row stuck on plain after early misses tries a node
            hopeful = dataclasses.replace(st, alpha=optimistic(st, s.explore))
            opt = self._times(hopeful, active, useful, room, context)
            cap = jnp.where((cap == 0) & (opt[1] < opt[0]), 1, cap)
        step = jnp.max(jnp.where(active, row_steps, 0))  # rows of a batch step together
        probe = (s.probe_every > 0) & (step % max(s.probe_every, 1) == 0)
        cap = jnp.where(probe & (cap == 0), min(s.probe_length, g), cap)
        lengths = jnp.where(active, jnp.minimum(cap, useful), 0).astype(jnp.int32)
        shortest = jnp.full_like(context, st.fills[0].astype(context.dtype))
        short_best = jnp.argmin(self._times(st, active, useful, room, shortest))
        off = jnp.where(short_best > 0, CONTEXT, ACCEPTANCE)
        why = jnp.where(best == 0, jnp.where(cap > 0, PROBE, off), DRAFTS)
        why = jnp.where(((why == DRAFTS) & (lengths < cap)) | (useful == 0), ROOM, why)
        return lengths, jnp.broadcast_to(why, lengths.shape).astype(jnp.int32)

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
        g, s = self.gamma, self.settings
        i = jnp.arange(1, g + 1)[None]  # [1, G]
        reached = (i <= jnp.minimum(num_accepted + 1, depths)[:, None]) & active[:, None]
        hit = (i <= num_accepted[:, None]).astype(jnp.float32)
        weight = jnp.where(reached, s.decay * st.weight + 1.0, st.weight)
        alpha = jnp.where(reached, st.alpha + (hit - st.alpha) / weight, st.alpha)
        used = jax.nn.one_hot(depths, g + 1, dtype=jnp.int32) * active[:, None]
        window = jnp.max(jnp.where(active, depths, 0))  # the step's depth: its cost
        plain = (window == 0) & active
        stepped = jax.nn.one_hot(window, g + 1, dtype=jnp.int32) * jnp.any(active)
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
        after = self.settings.handoff_after
        if after <= 0:
            return jnp.zeros((), bool)
        useful = jnp.clip(room - 1, 0, self.gamma).astype(jnp.int32)
        times = finish_times(st, active, useful, room, context)  # [G+1]
        plain = jnp.max(jnp.where(active, room, 0)).astype(jnp.float32)  # plain program: 1/step
        step = jnp.max(jnp.where(active, row_steps, 0))  # rows of a batch step together
        return (step >= after) & jnp.any(active) & (jnp.min(times[1:]) > plain)


def cut(proposal: Proposal, lengths: jax.Array) -> Proposal:
    """Cut each row's chain to its chosen length (the rest become padding); a tree to its
    nodes no deeper than that: deeper ones become padding (parent -2: never tried), and the
    window ends at the last node kept -- a prefix for trees laid out level by level, as every
    tree drafter here lists them. Whole levels stay: the kept set is ancestor-closed and keeps
    every sibling list whole (the acceptance walk needs both, tree.py). The depth is chosen
    before the step's draws: lossless."""
    if proposal.parents is None:
        return proposal._replace(num_proposed=jnp.minimum(proposal.num_proposed, lengths))
    depths = node_depths(proposal)  # [B, N], 0 for padding
    keep = (depths > 0) & (depths <= lengths[:, None])
    n = jnp.arange(1, depths.shape[1] + 1, dtype=jnp.int32)[None]
    return proposal._replace(
        num_proposed=jnp.max(jnp.where(keep, n, 0), axis=1, initial=0),
        parents=jnp.where(keep, proposal.parents, -2).astype(jnp.int32),
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


def token_times(st: AdaptiveState, active, useful, context) -> jax.Array:
    """-> f32[G+1] the expected cost per committed token, in plain steps, of a step with a cap
    of c = 0..G nodes: cost[c] / sum over active rows of E_b(min(c, useful_b)). Rows that end
    are replaced (continuous batching), so what a step buys is tokens, not a shorter tail."""
    expected = expected_tokens(st.alpha)  # [B, G+1]
    ks = jnp.arange(expected.shape[1])
    by_cap = jnp.take_along_axis(expected, jnp.minimum(ks[None], useful[:, None]), axis=1)
    tokens = jnp.sum(jnp.where(active[:, None], by_cap, 0.0), axis=0)  # [G+1]
    return step_cost(st, context, active) / jnp.maximum(tokens, 1e-6)


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


def summarize(length_hist, plain_steps, steps: int, reason_hist=None) -> dict:
    """Host metrics for one row: histogram of nodes used, their mean, fraction of plain steps,
    and (with reason_hist) the steps by why its length was chosen (REASONS, those that occur)."""
    hist = [int(c) for c in length_hist]
    total = sum(hist)
    mean = sum(k * c for k, c in enumerate(hist)) / total if total else 0.0
    out = {
        "adaptive_gamma_mean": mean,
        "adaptive_gamma_hist": hist,
        "adaptive_plain_fraction": int(plain_steps) / steps if steps else 0.0,
    }
    if reason_hist is not None:
        out["adaptive_reasons"] = {n: int(c) for n, c in zip(REASONS, reason_hist) if int(c)}
    return out
