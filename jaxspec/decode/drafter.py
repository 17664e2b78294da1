"""The drafter protocol. A drafter is a frozen (hashable) dataclass of static settings whose methods
are pure functions of (drafter params, target params, drafter state, context); the speculative loop
calls them inside one jitted `lax.while_loop`.

The target params come bound to their target (`models.base.Bound`: `tparams.params`,
`tparams.target`, `tparams.embed(tokens)`, `tparams.logits(hidden)`), so a drafter reaches the
target only through the target protocol (models/base.py), never by a param name; a drafter that
needs a trait the target lacks (taps, a shared embedding, a layer prefix) says so in one line
(`models.base.require`).

Token bookkeeping shared by every drafter (row b):
  ctx.tokens[b, :ctx.lengths[b]]  committed tokens: prompt, then generated ones. The last one was
                                  sampled from the target but not yet run through it.
  propose -> N draft nodes continuing that sequence: a chain (parents None: node i follows
             node i-1) or a tree (parents[b, i] = parent node, -1 = the last committed token;
             parents before children, siblings tried in index order), the distribution q each
             node was proposed from (after the same logits transform as the target's: this is
             what keeps sampling lossless; one-hot for a deterministic node) and how many nodes
             are real (`num_proposed`, <= N; the rest are ignored). See jaxspec.decode.tree.
  commit  -> after verification, the accepted path: `num_accepted` nodes kept, then one target
             token; lengths advance. `window` and `hidden` hold the path (root first), so a
             drafter that reads them needs no tree logic.

Optional behaviour: a drafter declares a `Traits` record as its `traits` attribute (typed, with
defaults); a drafter without one is read by these attribute names (`traits` below), so older
drafters keep working. The loop reads them through `traits(drafter)` only:
  tree_nodes, tree_depth  a tree drafter: N nodes per proposal, its deepest path; the loop verifies
                          1 + N window entries and commits at most tree_depth + 1 tokens per step
                          (None or absent: a chain of γ nodes)
  max_context             a drafter with its own position limit (a draft model's context)
  cfg                     the llama.ModelConfig of a drafter's own decoder layer (EAGLE-style):
                          placed on a mesh by the Llama layer's rules (sharding.place_drafter)
  model                   the Target (models/base.py) a draft model's params run through: placed
                          on a mesh by its own param axes
  advance                 (dparams, tparams, state, ctx) -> state: update the state for the last
                          committed token without drafting (EAGLE; used by prompt lookup first)
  commit_plain            (dparams, tparams, state, ctx: CommitContext) -> state: the state after
                          a plain run -- n = ctx.lengths - ctx.prev_lengths steps (n <= M) that
                          drafted nothing and ran the target over the root alone: ctx.window
                          [B, M] the run's roots (the tokens from prev_lengths - 1 on),
                          ctx.hidden [nl, B, M, D] their target features, entries past n
                          garbage; adaptive speculation's plain loop, without propose (the
                          drafter is left behind during the run and catches up in one pass).
                          Absent: the loop runs propose (max_nodes 0) and commit instead.
  target_needs            (dparams) -> tuple of target-protocol trait names the drafter calls
                          (models/base.py: "embed", "prefix", ...): `check_target` refuses a
                          target without one, in one line, before anything is compiled
  verify_windows          extra verify widths (1 + nodes) a variable-length drafter wants compiled:
                          a proposal is verified in the smallest that fits (default: 1, 2, full)
  observe                 (dparams, sequences) -> dparams: host side, after a batch has finished
                          (never inside the loop): the params given each finished request's
                          prompt + output token ids (suffix decoding's store of earlier requests)
  drafts_from_tokens      True when propose is a function of ctx alone (no state, no draws: prompt
                          lookup): adaptive speculation may then look at the proposal's size
                          before the step and run a step with nothing to verify as a plain step
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax

from jaxspec.errors import JaxspecError
from jaxspec.models import base
from jaxspec.decode.sampling import SamplingParams


class DraftContext(NamedTuple):
    tokens: jax.Array  # int32[B, W] committed tokens (valid below lengths)
    lengths: jax.Array  # int32[B]
    active: jax.Array  # bool[B]; finished rows may skip work where a drafter can
    # int32[B] nodes the loop will verify per row (adaptive speculation, jaxspec/decode/adaptive.py);
    # None: all. The loop cuts longer proposals itself; a drafter may use it to stop early.
    max_nodes: jax.Array | None = None


class Proposal(NamedTuple):
    tokens: jax.Array  # int32[B, N]
    probs: jax.Array  # f32[B, N, V] draft distribution each node was drawn from
    num_proposed: jax.Array  # int32[B] in 0..N
    parents: jax.Array | None = None  # int32[B, N], -1 = root; None = a chain (i - 1)


class CommitContext(NamedTuple):
    tokens: jax.Array  # int32[B, W] committed tokens after this step
    lengths: jax.Array  # int32[B] after this step
    prev_lengths: jax.Array  # int32[B] before this step
    window: jax.Array  # int32[B, D+1] the accepted path: last committed token, then the kept
    #                    nodes (garbage past num_accepted); a chain's whole verified window
    num_accepted: jax.Array  # int32[B]
    hidden: jax.Array | None  # [len(hidden_layers), B, D+1, D] target hidden states on the path
    path: jax.Array | None = None  # int32[B, D+1] window indices of the path (0 = root)


@dataclasses.dataclass(frozen=True)
class Traits:
    """A drafter's optional behaviour, typed, with the defaults of a chain drafter that has
    none of it (module docstring: what each means). A drafter declares it as its `traits`
    attribute (a property or a field); the loop reads it through `traits(drafter)` only."""

    tree_nodes: int | None = None  # None: a chain
    tree_depth: int | None = None
    max_context: int | None = None  # None: no limit of its own
    model_cfg: Any = None  # llama.ModelConfig of an EAGLE-style layer, or None
    model: Any = None  # models.base.Target a draft model runs through, or None
    advance: Callable | None = None  # (dparams, tparams, state, ctx) -> state
    commit_plain: Callable | None = None  # (dparams, tparams, state, CommitContext) -> state
    drafts_from_tokens: bool = False  # propose reads ctx.tokens/lengths/max_nodes only
    target_needs: Callable | None = None  # (dparams) -> tuple[str, ...] target traits
    observe: Callable | None = None  # (dparams, sequences) -> dparams, host side
    verify_windows: tuple[int, ...] = ()  # extra verify widths to compile (variable-length)


def traits(drafter: Drafter) -> Traits:
    """`drafter.traits` where the drafter declares one; else (a drafter written before the
    record) its optional attributes read by name, with the same defaults."""
    declared = getattr(drafter, "traits", None)
    if isinstance(declared, Traits):
        return declared
    return _legacy_traits(drafter)


def _legacy_traits(drafter) -> Traits:
    return Traits(
        tree_nodes=getattr(drafter, "tree_nodes", None) or None,
        tree_depth=getattr(drafter, "tree_depth", None) or None,
        max_context=getattr(drafter, "max_context", None),
        model_cfg=getattr(drafter, "cfg", None),
        model=getattr(drafter, "model", None),
        advance=getattr(drafter, "advance", None),
        commit_plain=getattr(drafter, "commit_plain", None),
        drafts_from_tokens=bool(getattr(drafter, "drafts_from_tokens", False)),
        target_needs=getattr(drafter, "target_needs", None),
        observe=getattr(drafter, "observe", None),
        verify_windows=tuple(getattr(drafter, "verify_windows", ())),
    )


def check_target(drafter: Drafter, target: base.Target, dparams: Any = None) -> None:
    """Refuse, in one line, a drafter this target cannot serve: taps (`hidden_layers`, HF
    indexing) outside 0..num_layers, or a target trait the drafter needs (`target_needs`)."""
    n = target.num_layers
    bad = [i for i in drafter.hidden_layers if not 0 <= i <= n]
    if bad:
        raise JaxspecError(
            f"drafter {drafter.name!r} reads target hidden states {bad}, but target "
            f"{base.describe(target)} has {n} layers (taps 0..{n}): use a drafter made for it"
        )
    needs = traits(drafter).target_needs
    for trait in needs(dparams) if needs is not None else ():
        base.require(target, trait, f"drafter {drafter.name!r}")


class Drafter(Protocol):
    name: str
    hidden_layers: tuple[int, ...]  # target hidden states (HF indexing) the drafter reads; () if none
    variable_length: bool  # num_proposed may be < γ: the loop then verifies a shorter window

    def init(
        self,
        dparams: Any,
        tparams: Any,
        prompt_tokens: jax.Array,  # int32[B, P]
        prompt_lengths: jax.Array,  # int32[B]
        prompt_hidden: jax.Array | None,  # [len(hidden_layers), B, P, D]
        capacity: int,
    ) -> Any: ...

    def propose(
        self,
        dparams: Any,
        tparams: Any,
        state: Any,
        ctx: DraftContext,
        num_tokens: int,
        sampling: SamplingParams,
        keys: jax.Array,  # [B] one key per row
    ) -> tuple[Proposal, Any]: ...

    def commit(self, dparams: Any, tparams: Any, state: Any, ctx: CommitContext) -> Any: ...
