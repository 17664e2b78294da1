"""`speculative.method: peagle`: P-EAGLE (parallel EAGLE; speculators 0.9.0
`speculators.models.peagle`, vLLM's `peagle`): an EAGLE-3 head (drafters/eagle3.py, shared, not
copied) that drafts all γ positions in ONE forward instead of γ chained steps.

One pass over γ entries at positions L-1 .. L+γ-2 (the drafter's own cache, feature_chain.py):
  entry 0      the last committed token x_{L-1} with the target feature f_{L-2} (EAGLE-3's step 1)
  entry d > 0  the mask token (`mask_token_id`) with the learned feature `mask_hidden` [n·Dt]
               (through the same fc as the target features)
each attending the committed entries and the entries before it (the reference's COD mask: a
depth-d element sees depth 0 up to its anchor and its own rollout's depths <= d). Entry i's output
is draft i's law; none reads a drafted token, so each draft is an independent draw from the q it
reports: lossless as any chain whose laws do not depend on the drafts.

State, init, commit: EAGLE-3's (ChainState); propose's provisional entries past L-1 are
overwritten by commit with the verified tokens' real features, as EAGLE-3's are (for a tree,
commit writes the accepted path, as for any feature chain).

Dynamic tree (`speculative.tree.kind: dynamic`, EAGLE-2's rule through jaxspec.decode.tree.grow,
as DFlash's block trees): the one pass gives each depth's law, which reads no drafted token, so a
node at depth d proposes its children from depth d+1's law whatever its parent; grow's lossless
argument (a node's law reads only its ancestors' tokens) holds trivially.
Static tree (`speculative.tree.kind: static`, paths of ranks as for eagle and dflash): one pass
over the tree's depth; a node at depth d is the rank-r token of depth d's law (`top_k`, one-hot
q) or its own draw from that law (`sampled`, reporting it).

dparams: EAGLE-3's plus mask_hidden f32[n·Dt] (n tapped layers).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.decode import sampling, tree
from jaxspec.drafters import trained
from jaxspec.drafters.base import DraftContext, Proposal, Traits
from jaxspec.drafters.draft_vocab import scatter_to_target
from jaxspec.drafters.eagle3 import Eagle3Drafter
from jaxspec.drafters.feature_chain import ChainState
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.errors import JaxspecError

STATIC_CHILDREN = ("top_k", "sampled")  # a static tree's nodes: ranks of a law, or draws


@dataclasses.dataclass(frozen=True)
class PEagleDrafter(tree.DynamicTreeDrafter, Eagle3Drafter):
    name: str = "peagle"
    mask_token: int = 0  # the embedding the depth > 0 entries read
    report_q_of_first: bool = False  # tests only: a broken variant reporting entry 0's law
    tree_choices: tuple[tuple[int, ...], ...] | None = None  # static tree; None: none

    def __post_init__(self):
        if self.tree_choices is None:
            return
        if self.tree_top_k:
            raise JaxspecError("a P-EAGLE tree is static (tree.choices) or dynamic, not both: "
                               "set speculative.tree.kind")
        if self.tree_children not in STATIC_CHILDREN:
            raise JaxspecError(f"speculative.tree.children={self.tree_children!r} is invalid for "
                               f"a static P-EAGLE tree: use one of {', '.join(STATIC_CHILDREN)}")
        object.__setattr__(self, "tree_choices", tree.check_choices(self.tree_choices))

    @property
    def tree_nodes(self) -> int | None:
        return len(self.tree_choices) if self.tree_choices is not None else super().tree_nodes

    @property
    def tree_depth(self) -> int | None:
        if self.tree_choices is not None:
            return max(map(len, self.tree_choices))
        return super().tree_depth

    @property
    def traits(self) -> Traits:
        return dataclasses.replace(super().traits, tree_nodes=self.tree_nodes,
                                   tree_depth=self.tree_depth)

    def parallel_pass(self, dparams, tparams, state: ChainState, ctx: DraftContext, gamma: int):
        """The one drafting forward: (h [B, γ, H] (entry i: draft i), k, v: the cache with the
        γ entries written at L-1 .. L+γ-2)."""
        b = ctx.lengths.shape[0]
        last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)  # [B, 1]
        tokens = jnp.concatenate(
            [last, jnp.full((b, gamma - 1), self.mask_token, last.dtype)], axis=1)  # [B, γ]
        n = len(self.hidden_layers)
        mask_feature = self.fuse(dparams, dparams["mask_hidden"].reshape(n, -1))  # [H]
        feats = jnp.concatenate(
            [state.feature[:, None].astype(jnp.float32),
             jnp.broadcast_to(mask_feature, (b, gamma - 1, mask_feature.shape[-1]))], axis=1)
        pos = (ctx.lengths - 1)[:, None] + jnp.arange(gamma, dtype=jnp.int32)  # [B, γ]
        return self.step(dparams, tparams, tokens, feats.astype(state.feature.dtype),
                         state.k, state.v, pos)

    def parallel_logits(self, dparams, tparams, state, ctx: DraftContext, gamma: int):
        """f32[B, γ, N]: every draft's logits over the draft vocabulary, from one pass."""
        h, _, _ = self.parallel_pass(dparams, tparams, state, ctx, gamma)
        return self.draft_logits(dparams, tparams, h)

    def propose(self, dparams, tparams, state: ChainState, ctx: DraftContext, num_tokens, sp,
                keys):
        if self.tree_top_k:
            return self._propose_tree(dparams, tparams, state, ctx, sp, keys)
        if self.tree_choices is not None:
            return self._propose_static(dparams, tparams, state, ctx, sp, keys)
        b = ctx.lengths.shape[0]
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, γ]
        h, k, v = self.parallel_pass(dparams, tparams, state, ctx, num_tokens)
        drawn = [self._sample(dparams, tparams, h[:, i], sp, step_keys[:, i])
                 for i in range(num_tokens)]
        drafts = jnp.stack([t for t, _ in drawn], axis=1)  # [B, γ]
        q = jnp.stack([p for _, p in drawn], axis=1)  # [B, γ, V]
        if self.report_q_of_first:
            q = jnp.broadcast_to(q[:, :1], q.shape)
        num = jnp.full((b,), num_tokens, jnp.int32)
        return Proposal(drafts, q, num), state._replace(k=k, v=v)

    def _propose_tree(self, dparams, tparams, state: ChainState, ctx: DraftContext, sp, keys):
        """The dynamic tree over the pass's per-depth laws (tree_levels drafts per pass)."""
        b, k = ctx.lengths.shape[0], self.tree_top_k
        h, kc, vc = self.parallel_pass(dparams, tparams, state, ctx, self.tree_levels)
        logits = self.draft_logits(dparams, tparams, h)  # [B, levels, N]

        def expand(carry, level, front: tree.Frontier):  # frontier depth level + 1
            # its children (depth level + 2) draw from law level + 1, whatever their parent
            return carry, jnp.broadcast_to(logits[:, level + 1, None], (b, k, logits.shape[-1]))

        grown, _ = tree.grow(expand, None, logits[:, 0], sp, keys, top_k=k,
                             levels=self.tree_levels, budget=self.tree_budget,
                             children=self.tree_children)
        ids = self.draft_ids(dparams)
        tokens, q = grown.ids, grown.q
        if ids is not None:
            tokens, q = ids[grown.ids], scatter_to_target(grown.q, ids, self.target_vocab)
        num = jnp.full((b,), self.tree_budget, jnp.int32)
        return Proposal(tokens, q, num, grown.parents), state._replace(k=kc, v=vc)


    def _propose_static(self, dparams, tparams, state: ChainState, ctx: DraftContext, sp, keys):
        """The static tree over one pass of the tree's depth: node i at depth d is the rank-r
        token of depth d's law (one-hot q) or, sampled, its own draw from that law."""
        b = ctx.lengths.shape[0]
        parents, depth, rank = tree.static_layout(self.tree_choices)
        n = len(parents)
        h, kc, vc = self.parallel_pass(dparams, tparams, state, ctx, max(depth))
        logits = self.draft_logits(dparams, tparams, h)  # [B, depth, N]
        at = jnp.asarray(depth, jnp.int32) - 1  # [Nn] each node's law
        if self.tree_children == "top_k":  # one top_k per depth: its law reads no parent
            ranked = jax.lax.top_k(logits, max(rank) + 1)[1]  # [B, depth, R]
            idx = ranked[:, at, jnp.asarray(rank, jnp.int32)]  # [B, Nn]
            q = jax.nn.one_hot(idx, logits.shape[-1], dtype=jnp.float32)  # [B, Nn, N]
        else:
            q = sampling.logits_to_probs(logits, sp)[:, at]  # [B, Nn, N]
            node_keys = jax.vmap(lambda k: jax.random.split(k, n))(keys)  # [B, Nn]
            idx = jax.vmap(sampling.sample_rows, in_axes=(1, 1), out_axes=1)(node_keys, q)
        ids = self.draft_ids(dparams)
        if ids is not None:
            idx, q = ids[idx], scatter_to_target(q, ids, self.target_vocab)
        par = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
        proposal = Proposal(idx.astype(jnp.int32), q, jnp.full((b,), n, jnp.int32), par)
        return proposal, state._replace(k=kc, v=vc)


# ---- method "peagle" --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class PEagleOptions(trained.Eagle3LayoutOptions):
    """speculative.peagle: a P-EAGLE head in the speculators 0.9.0 layout (config.json with
    speculators_model_type "peagle"); chains of any γ (the head was trained for
    speculators_config's speculative_tokens depths)."""

    SECTION: ClassVar[str] = "speculative.peagle"


def build(options: PEagleOptions, ctx: BuildContext):
    drafter, dparams = trained.load("peagle", options, ctx)
    if ctx.spec.tree.kind == "dynamic":
        drafter = dataclasses.replace(drafter, **tree.dynamic_fields(ctx.spec.tree))
    if ctx.spec.tree.kind == "static":
        drafter = dataclasses.replace(
            drafter, tree_choices=tuple(tuple(p) for p in ctx.spec.tree.choices),
            tree_children=ctx.spec.tree.children)
    return drafter, dparams


register_drafter(
    "peagle", build, train="jaxspec.train.peagle:PEagle", formats=("jaxspec", "peagle"),
    options=PEagleOptions, tree_kinds=("static", "dynamic"), summary=(
    "P-EAGLE (speculators 0.9.0): EAGLE-3 drafting every position in one pass"))
