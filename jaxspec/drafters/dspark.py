"""`speculative.method: dspark`: DSpark (speculators 0.9.0 `speculators.models.dspark`): DFlash's
parallel block backbone (drafters/dflash_forward.py, shared, not copied) plus a light sequential head
that biases each block slot's logits by the token drafted before it, and a confidence head that
predicts each slot's acceptance (drafters/dspark_heads.py).

Slots: the block is [last committed token x_{L-1} (the anchor), mask x ...] at positions L-1 ...
  sample_from_anchor  slot s predicts x_{L+s}: γ drafts from a block of γ entries (γ <= block_size)
  otherwise           slot s >= 1 predicts x_{L-1+s} (DFlash's convention): γ + 1 entries
Draft i's previous token is the anchor for i = 0, else draft i - 1 (the RNN head also runs over
the unused anchor slot first when it does not draft, as the reference's does).

Target features: the speculators convention, aux_hidden_state_layer_ids[i] = the input of target
layer i (HF hidden_states[i], vLLM's taps).

Why sampling stays lossless (jaxspec.decode.acceptance needs each proposed token distributed
exactly as the q reported for it, given the drafts before it): the backbone's logits read only
the committed context; the bias of draft i reads draft i - 1 (and the RNN state, a function of
drafts < i); the chain walks the block in order, draws draft i from q_i = transform(z_i + b_i)
with its own key, and reports that q_i -- the law it was drawn from given its predecessors.
Trees (vanilla and gated heads; DFlash's builders, drafters/dflash.py): a node at depth d is
draft d - 1, its children's law is the slot's base logits plus the bias its own token gives, so
a node's law reads only its ancestors' tokens (static trees of ranks, or jaxspec.decode.tree.grow).
Confidence scheduling (cost_per_draft > 0 or a step_costs curve) cuts the chain after k drafts,
k a function of the confidences, each of which reads only earlier drafts: a stopping rule,
lossless as EAGLE's. The loop verifies the narrowest compiled window that holds the batch's
longest cut (every width 2..γ+1 is compiled: `traits.verify_windows`), and by default the batch
shares one k (dspark_heads.scheduled_length, shared): its window is paid whole anyway.

State: DFlash's (the per-layer context caches) plus, for a chain with a confidence head, the
head's calibration record (dspark_heads.Calibration: predicted survival vs verified acceptance
per position, and the verify lengths chosen), which propose fills and commit settles; the
engine's metrics read it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import yaml

from jaxspec import kernels
from jaxspec.decode import sampling, tree
from jaxspec.drafters import dflash_forward as net
from jaxspec.drafters import dspark_heads as hd
from jaxspec.drafters import trained
from jaxspec.drafters.base import DraftContext, Proposal
from jaxspec.decode.drafter import Traits
from jaxspec.drafters.dflash import BlockDraft, DFlashDrafter, DFlashOptions, DFlashState
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.errors import JaxspecError
from jaxspec.models import base


class DSparkState(NamedTuple):
    dflash: DFlashState  # the backbone's context caches
    calibration: hd.Calibration | None  # None: a tree, or no confidence head


@dataclasses.dataclass(frozen=True)
class DSparkDrafter(DFlashDrafter):
    heads: hd.HeadSpec = hd.HeadSpec(0)
    name: str = "dspark"
    report_unbiased_q: bool = False  # tests only: a broken variant reporting q without the bias
    # confidence-scheduled verification (> 0: variable_length): each verified draft's cost as a
    # fraction of a plain step; every row verifies dspark_heads.scheduled_length drafts
    cost_per_draft: float = 0.0
    # or the calibrated curve: a step's cost verifying k = 0..γ drafts, in plain steps (drafting
    # included); used instead of cost_per_draft when given
    step_costs: tuple[float, ...] = ()
    # or curves measured at several batch sizes ((batch, curve), ...): the program's batch picks
    # (dspark_heads.curve_at: linear between them), so a wider batch prices its wider window
    step_costs_by_batch: tuple[tuple[int, tuple[float, ...]], ...] = ()
    share_length: bool = True  # scheduled: one length for the batch (its window is shared)
    # scheduled: the survival corrected by the acceptance verification found so far
    # (dspark_heads.corrected_survival, this many pseudo-acceptances of prior); 0: the head's own
    online_calibration: float = 0.0

    @property
    def scheduled(self) -> bool:
        return self.cost_per_draft > 0 or bool(self.step_costs or self.step_costs_by_batch)

    @property
    def traits(self) -> Traits:
        t = super().traits
        if not self.scheduled:
            return t
        return dataclasses.replace(t, verify_windows=tuple(range(2, self.max_drafts + 2)))

    def __post_init__(self):
        super().__post_init__()
        if self.heads.stateful and (self.tree_choices is not None or self.tree_top_k):
            raise JaxspecError("an RNN DSpark head drafts chains only (its state follows one "
                               "path): set speculative.tree.kind=chain")
        if self.scheduled and not self.heads.confidence:
            raise JaxspecError("speculative.dspark.cost_per_draft schedules verification by the "
                               "confidence head, which this DSpark head lacks: set it to 0")

    def check_costs(self, gamma: int) -> None:
        """A step-cost curve needs a cost per verify length 0..γ (one line, before compiling)."""
        for curve in (self.step_costs, *(c for _, c in self.step_costs_by_batch)):
            if curve and len(curve) < gamma + 1:
                raise JaxspecError(f"speculative.dspark.step_costs holds {len(curve)} "
                                   f"costs: give one per verify length 0..{gamma}")

    def costs_at(self, batch: int):
        """What the scheduler prices verify lengths with at `batch` rows: the curve (measured
        at this batch, or between the batches measured) or the per-draft slope."""
        if self.step_costs_by_batch:
            return hd.curve_at(self.step_costs_by_batch, batch)
        return self.step_costs or self.cost_per_draft

    @property
    def hidden_layers(self) -> tuple[int, ...]:  # speculators ids are jaxspec taps (layer inputs)
        return tuple(self.spec.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        return self.spec.block_size - (0 if self.heads.sample_from_anchor else 1)

    @property
    def positions_read_no_parent(self) -> bool:
        return self.heads.markov_rank == 0

    def _block(self, dparams, tparams, state, ctx, drafts: int) -> BlockDraft:
        """The drafting slots' hidden and base logits (index i: draft i), for the tree builder."""
        h, base = self._entries(dparams, tparams, state, ctx, drafts)
        first = 0 if self.heads.sample_from_anchor else 1
        return BlockDraft(h[:, first:], base[:, first:], None, None, None)

    def position_logits(self, dparams, blk: BlockDraft, pos: int, prev) -> jax.Array:
        """f32[B, M, V]: the law of draft pos after M candidate predecessors prev int32[B, M]:
        the slot's base logits plus the sequential bias each predecessor gives (vanilla and
        gated heads: the bias reads only the predecessor and the slot)."""
        h = jnp.broadcast_to(blk.h[:, pos, None], (*prev.shape, blk.h.shape[-1]))
        bias, _, _ = hd.step(self.heads, dparams, prev, h, hd.init_state(self.heads, prev.shape))
        out = jnp.broadcast_to(blk.logits[:, pos, None], (*prev.shape, blk.logits.shape[-1]))
        return out if bias is None else out + bias

    def _entries(self, dparams, tparams, state: DFlashState, ctx: DraftContext, drafts: int):
        """The block forward for `drafts` drafts -> (h [B, E, D], base logits f32[B, E, V])."""
        masks = drafts - 1 if self.heads.sample_from_anchor else drafts
        h = self.block_entries(dparams, tparams, state, ctx, masks)
        return h, self.head_logits(tparams, h)

    def walk(self, dparams, h, base, anchor, pick):
        """The block's slots in order: h [B, E, D], base f32[B, E, V], anchor int32[B];
        pick(i, logits f32[B, V]) -> draft i int32[B]. Returns (logits f32[B, E, V] with the
        sequential bias, confidence logits f32[B, E] or None, drafts int32[B, γ])."""
        heads, first = self.heads, 0 if self.heads.sample_from_anchor else 1
        state = hd.init_state(heads, anchor.shape)
        prev, zs, confs, toks = anchor.astype(jnp.int32), [], [], []
        for s in range(h.shape[1]):
            bias, e, state = hd.step(heads, dparams, prev, h[:, s], state)
            z = base[:, s] if bias is None else base[:, s] + bias
            zs.append(z)
            confs.append(hd.confidence_logit(heads, dparams, h[:, s], e))
            if s >= first:
                prev = pick(s - first, z).astype(jnp.int32)
                toks.append(prev)
        conf = None if confs[0] is None else jnp.stack(confs, axis=1)
        return jnp.stack(zs, axis=1), conf, jnp.stack(toks, axis=1)

    def teacher_forced(self, dparams, tparams, state, ctx: DraftContext, tokens):
        """Given drafts tokens int32[B, γ] (the reference's training view: the true block):
        (logits f32[B, E, V], confidence logits f32[B, E] or None) of every block slot."""
        state = state.dflash if isinstance(state, DSparkState) else state
        h, base = self._entries(dparams, tparams, state, ctx, tokens.shape[1])
        z, conf, _ = self.walk(dparams, h, base, self._anchor(ctx), lambda i, _: tokens[:, i])
        return z, conf

    # ---- protocol: DFlash's on the wrapped state --------------------------------------------
    @property
    def _calibrates(self) -> bool:
        return self.heads.confidence and self.tree_choices is None and not self.tree_top_k

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        inner = super().init(dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden,
                             capacity)
        b = prompt_tokens.shape[0]
        calib = hd.init_calibration(b, self.max_drafts) if self._calibrates else None
        return DSparkState(inner, calib)

    def advance(self, dparams, tparams, state: DSparkState, ctx) -> DSparkState:
        return state

    def commit(self, dparams, tparams, state: DSparkState, ctx) -> DSparkState:
        inner = super().commit(dparams, tparams, state.dflash, ctx)
        calib = state.calibration
        if calib is not None:
            calib = hd.commit_calibration(calib, ctx.num_accepted)
        return DSparkState(inner, calib)

    def commit_plain(self, dparams, tparams, state: DSparkState, ctx) -> DSparkState:
        return state._replace(dflash=super().commit_plain(dparams, tparams, state.dflash, ctx))

    def propose(self, dparams, tparams, state: DSparkState, ctx: DraftContext, num_tokens, sp,
                keys):
        proposal, conf = self._propose(dparams, tparams, state.dflash, ctx, num_tokens, sp, keys)
        calib, used = state.calibration, None
        if self.scheduled:  # the lengths read only the drafts before each: lossless
            self.check_costs(num_tokens)
            if calib is not None and self.online_calibration > 0:
                used = hd.corrected_survival(calib, hd.survival(conf), self.online_calibration)
            num = hd.scheduled_length(conf, self.costs_at(ctx.lengths.shape[0]), ctx.active,
                                      self.share_length, s=used)
            proposal = proposal._replace(num_proposed=num)
        if calib is not None and conf is not None:
            num = jnp.where(ctx.active, proposal.num_proposed, -1)
            calib = hd.propose_calibration(calib, conf, num, used)
        return proposal, state._replace(calibration=calib)

    def _propose(self, dparams, tparams, state: DFlashState, ctx: DraftContext, num_tokens, sp,
                 keys):
        """(the proposal, the drafts' confidence logits f32[B, γ] or None)."""
        if self.tree_choices is not None or self.tree_top_k:
            return self._propose_tree(dparams, tparams, state, ctx, sp, keys), None
        if num_tokens > self.max_drafts:
            raise JaxspecError(
                f"num_speculative_tokens={num_tokens} exceeds this DSpark head's block "
                f"(block_size {self.spec.block_size}: {self.max_drafts} drafts): use "
                f"num_speculative_tokens <= {self.max_drafts}"
            )
        b = ctx.lengths.shape[0]
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, γ]
        h, base = self._entries(dparams, tparams, state, ctx, num_tokens)
        first = 0 if self.heads.sample_from_anchor else 1
        qs = []

        def pick(i, z):  # draft i: one draw from its biased law, which is what is reported
            q = sampling.logits_to_probs(z, sp)
            if self.report_unbiased_q:
                qs.append(sampling.logits_to_probs(base[:, first + i], sp))
            else:
                qs.append(q)
            if sp.mode == "greedy":  # the argmax itself: no vocabulary-sized prefix sum per row
                return sampling.greedy_tokens(z)
            return sampling.sample_rows(step_keys[:, i], q)

        _, conf, tokens = self.walk(dparams, h, base, self._anchor(ctx), pick)
        num = jnp.full((b,), num_tokens, jnp.int32)
        conf = None if conf is None else conf[:, first:]
        return Proposal(tokens, jnp.stack(qs, axis=1), num), conf


# ---- method "dspark" --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class DSparkOptions(DFlashOptions):
    """speculative.dspark: a DSpark head in the speculators 0.9.0 layout (config.json with
    speculators_model_type "dspark"). γ (num_speculative_tokens) is at most block_size
    (sample_from_anchor) or block_size - 1; trees as for dflash (vanilla and gated heads: the
    sequential bias along each path)."""

    SECTION: ClassVar[str] = "speculative.dspark"
    # > 0: confidence-scheduled verification: the batch verifies the number of drafts that
    # maximises expected tokens / (1 + cost_per_draft * drafts), from the confidence head's
    # survival estimate; cost_per_draft is one verified draft's cost in plain steps (the slope
    # of the calibrated step-cost curve at the serving batch); 0: always γ drafts
    cost_per_draft: float = 0.0
    # or the step-cost curve itself: a step's cost verifying k = 0..γ drafts, in plain steps
    # (drafting included), as scripts/dspark_step_costs.py measures it; used instead of
    # cost_per_draft when given. A mapping {batch size: curve}: curves measured at several
    # batch sizes, the program's batch picks (linear between). null: 1 + cost_per_draft * k
    step_costs: object = None
    # scheduled: one verify length for the whole batch (sum over rows of expected tokens / the
    # shared window's cost); false: each row its own (the window is still the batch's widest)
    share_length: bool = True
    # scheduled: the confidence corrected online by the acceptance verification found so far
    # in the batch (per draft position, observed over predicted with this many
    # pseudo-acceptances on each side: a head trained on one domain is overconfident off it);
    # 0: the head's own confidence
    online_calibration: float = 2.0

    def _validate(self):
        super()._validate()
        if not 0.0 <= self.online_calibration < 1e6:
            self._fail("online_calibration", "use a pseudo-count >= 0 (0: no correction)")
        if not 0.0 <= self.cost_per_draft < 100.0:
            self._fail("cost_per_draft", "use a number in [0, 100); 0 verifies γ drafts always")
        costs = self.step_costs
        if isinstance(costs, str):  # a command-line override: "[1, 1.2]", "1,1.2", "{1: [..]}"
            try:
                costs = yaml.safe_load(costs if costs.strip()[:1] in "[{" else f"[{costs}]")
            except yaml.YAMLError:
                pass
            object.__setattr__(self, "step_costs", costs)
        curves = list(costs.values()) if isinstance(costs, dict) else [costs]
        if costs is not None and not (
            all(isinstance(b, int) and b > 0 for b in (costs if isinstance(costs, dict) else [1]))
            and curves and all(isinstance(c, (list, tuple)) and len(c) >= 2
                               and all(isinstance(x, (int, float)) and 0 < x < 1e3 for x in c)
                               for c in curves)
        ):
            self._fail("step_costs", "use a list of positive numbers, a step's cost in plain "
                       "steps verifying 0, 1, ... γ drafts, a mapping {batch size: such a list}, "
                       "or null (1 + cost_per_draft * k)")


def build(options: DSparkOptions, ctx: BuildContext):
    drafter, dparams = trained.load("dspark", options, ctx)
    if kernels.available() and base.uses_cpu_kernels(ctx.target.target, ctx.target.params):
        dparams = net.pack_for_cpu(dparams)  # the backbone as DFlash packs it; the heads as read
    given = options.step_costs
    by_batch = tuple(sorted((int(b), tuple(float(x) for x in c)) for b, c in given.items())
                     ) if isinstance(given, dict) else ()
    costs = () if by_batch else tuple(float(x) for x in given or ())
    if options.cost_per_draft > 0 or costs or by_batch:
        if ctx.spec.tree.kind != "chain":
            raise JaxspecError("speculative.dspark.cost_per_draft / step_costs schedule chains: "
                               "set speculative.tree.kind=chain or leave them unset")
        drafter = dataclasses.replace(drafter, cost_per_draft=options.cost_per_draft,
                                      step_costs=costs, step_costs_by_batch=by_batch,
                                      share_length=options.share_length,
                                      online_calibration=options.online_calibration,
                                      variable_length=True)
        drafter.check_costs(ctx.spec.num_speculative_tokens)
    if ctx.spec.tree.kind == "static":
        choices = tuple(tuple(p) for p in ctx.spec.tree.choices)
        drafter = dataclasses.replace(drafter, tree_choices=choices,
                                      tree_children=options.tree_children)
    if ctx.spec.tree.kind == "dynamic":
        drafter = dataclasses.replace(drafter, **tree.dynamic_fields(ctx.spec.tree))
    return drafter, dparams


register_drafter(
    "dspark", build, train="jaxspec.train.dspark:DSpark", formats=("jaxspec", "dspark"),
    options=DSparkOptions,
    tree_kinds=("static", "dynamic"), summary=(
    "DSpark (speculators 0.9.0): DFlash's parallel block plus a sequential Markov / gated / RNN "
    "logit bias along the drafted block and a per-position confidence head"))
