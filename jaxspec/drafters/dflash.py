"""`speculative.method: dflash`: the published DFlash / DFlash 2 drafters (drafters/dflash_forward.py
is the network) over the drafter protocol: a whole block of γ drafts from ONE drafter forward.

State: per draft layer, the context keys/values [B, K, S, Hd] of every committed position whose
target features exist (slot = position). init() writes the prompt's, commit() the accepted path's
(root first); entries past a row's committed length are masked garbage, rewritten later (the
target cache's masked rollback). propose() writes nothing.

Why sampling stays lossless (jaxspec.decode.acceptance needs each proposed token distributed
exactly as the q reported for it, given the drafts before it):
  DFlash 1 chain  the block's inputs are the context, the last committed token and fixed mask
                  entries, never a drafted token: q_i is a function of the committed context.
                  Token i is one draw from q_i (its own key), after the target's logits
                  transform; given x_1..x_{i-1} it is still distributed as q_i.
  DFlash 2 chain  the selector walks the block in order: position i's scores over its top-k
                  candidates depend on the token chosen at i-1; q_i (those scores through the
                  target's logits transform) is the law x_i is drawn from given x_{i-1}, and
                  that conditional is what is reported.
  trees           a node at depth d sits at block position d; its children's law is
                  q_{d+1}(. | node): DFlash 1's position distribution (the node's token
                  unused), DFlash 2's selector scores with the node's token as predecessor.
                  static  a tree of ranks (jaxspec.decode.tree.check_choices): node [r_1..r_d]
                          under tree_children "top_k" is the rank-r_d token of its law, reported
                          one-hot (deterministic given context and parent); "sampled": each node
                          its own draw from its law, reporting it (i.i.d. siblings, SpecInfer).
                  dynamic the DDTree idea through jaxspec.decode.tree.grow (EAGLE-2's rule): the
                          shape chosen per step from the drafter's own path probabilities
                          (levels <= block positions, tree_budget nodes: one compiled shape);
                          its lossless argument holds since a node's law reads only its
                          ancestors' tokens (see grow).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.decode import sampling, tree
from jaxspec.drafters import dflash_forward as net
from jaxspec.drafters import trained
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal, Traits
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.errors import JaxspecError
from jaxspec.models import base, decoder

TREE_CHILDREN = ("top_k", "sampled")


class BlockDraft(NamedTuple):
    """One block forward's outputs, read per position by the tree and chain builders."""

    h: jax.Array  # [B, G, D] final-normed hidden of the mask entries
    logits: jax.Array  # f32[B, G, V]
    hp: jax.Array | None  # DFlash 2: [B, G, R] the selector's projected hidden
    unary: jax.Array | None  # DFlash 2: f32[B, G, Kc] the candidates' logits
    cands: jax.Array | None  # DFlash 2: int32[B, G, Kc] the candidates


class DFlashState(NamedTuple):
    k: tuple  # per draft layer [B, K, S, Hd]: context keys at slot = position
    v: tuple  # per draft layer [B, K, S, Hd]


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    spec: net.DFlashSpec
    target_vocab: int
    name: str = "dflash"
    variable_length: bool = False
    tree_choices: tuple[tuple[int, ...], ...] | None = None  # static tree; None: no static tree
    tree_children: Literal["top_k", "sampled", "without_replacement"] = "top_k"
    tree_top_k: int = 0  # dynamic tree (> 0): nodes expanded per level, children per node
    tree_levels: int = 0  # dynamic: levels (block positions drafted)
    tree_budget: int = 0  # dynamic: nodes kept (best path probabilities)
    causal_override: bool | None = None  # tests only: force every layer's block mask

    @property
    def traits(self) -> Traits:  # the protocol's optional behaviour (decode/drafter.py)
        return Traits(tree_nodes=self.tree_nodes, tree_depth=self.tree_depth, advance=self.advance,
                      commit_plain=self.commit_plain, target_needs=self.target_needs)

    def __post_init__(self):
        dynamic = self.tree_top_k > 0
        allowed = tree.CHILDREN if dynamic else TREE_CHILDREN
        if self.tree_children not in allowed:
            raise JaxspecError(
                f"speculative.dflash.tree_children={self.tree_children!r} is invalid: use one "
                f"of {', '.join(allowed)}"
            )
        if dynamic and self.tree_choices is not None:
            raise JaxspecError("a DFlash tree is static (tree.choices) or dynamic, not both: "
                               "set speculative.tree.kind")
        kc = self.spec.selector_top_k
        if self.tree_choices is not None:
            choices = tree.check_choices(self.tree_choices)
            self._check_depth(max(map(len, choices)), "tree choices reach")
            if kc is not None and max(max(p) for p in choices) >= kc:
                raise JaxspecError(
                    f"tree choices use rank {max(max(p) for p in choices)} but this DFlash 2 "
                    f"head's selector keeps {kc} candidates per position: use ranks < {kc}"
                )
            object.__setattr__(self, "tree_choices", choices)
        if dynamic:
            self._check_depth(self.tree_levels, "speculative.tree.depth is")
            if kc is not None and self.tree_top_k > kc:
                raise JaxspecError(
                    f"speculative.tree.top_k={self.tree_top_k} exceeds this DFlash 2 head's "
                    f"{kc} selector candidates per position: use top_k <= {kc}"
                )

    def with_sliding_window(self, window: int):
        """This head with every draft layer's attention sliding by `window` (the published
        config's `sliding_window` for all layers; each layer's causal flag stays as read)."""
        spec = dataclasses.replace(self.spec, windows=(window,) * self.spec.num_layers)
        return dataclasses.replace(self, spec=spec)

    def _check_depth(self, depth: int, what: str) -> None:
        if depth > self.max_drafts:
            raise JaxspecError(
                f"{what} depth {depth} but this DFlash head drafts at most {self.max_drafts} "
                f"positions (block_size {self.spec.block_size}): use at most {self.max_drafts}"
            )

    @property
    def hidden_layers(self) -> tuple[int, ...]:  # jaxspec taps: input of layer i = HF i
        return tuple(i + 1 for i in self.spec.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        return self.spec.block_size - 1

    @property
    def positions_read_no_parent(self) -> bool:  # a position's law is the same under any parent
        return self.spec.version == 1

    @property
    def tree_nodes(self) -> int | None:
        if self.tree_top_k:
            return self.tree_budget
        return None if self.tree_choices is None else len(self.tree_choices)

    @property
    def tree_depth(self) -> int | None:
        if self.tree_top_k:
            return self.tree_levels
        return None if self.tree_choices is None else max(map(len, self.tree_choices))

    def target_needs(self, dparams) -> tuple[str, ...]:
        return ("embedding_table", "head_table")  # raw embedding in, raw LM head out

    # ---- pieces -------------------------------------------------------------------------------
    def _write(self, dparams, state: DFlashState, feats, start) -> DFlashState:
        """Context entries of target features feats [n, B, T, D] at slots start[B] + arange(T)."""
        c = net.context_features(self.spec, dparams, feats)  # [B, T, D]
        positions = start[:, None] + jnp.arange(c.shape[1], dtype=jnp.int32)
        ks, vs = [], []
        for lp, kc, vc in zip(dparams["layers"], state.k, state.v):
            k, v = net.context_kv(self.spec, lp, c, positions)
            ks.append(decoder.write_kv(kc, k.astype(kc.dtype), positions))
            vs.append(decoder.write_kv(vc, v.astype(vc.dtype), positions))
        return DFlashState(tuple(ks), tuple(vs))

    def block_hidden(self, dparams, tparams, state: DFlashState, ctx: DraftContext, drafts: int):
        """One forward over the block [last, mask x drafts] -> h [B, drafts, D] of the masks."""
        return self.block_entries(dparams, tparams, state, ctx, drafts)[:, 1:]

    def block_entries(self, dparams, tparams, state: DFlashState, ctx: DraftContext, masks: int):
        """One forward over the block [last, mask x masks] -> h [B, masks + 1, D], every entry
        (DSpark drafts from the anchor entry too)."""
        drafts = masks
        last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)  # [B, 1]
        b = last.shape[0]
        masks = jnp.full((b, drafts), self.spec.mask_token_id, jnp.int32)
        blk = jnp.concatenate([last.astype(jnp.int32), masks], axis=1)  # [B, G]
        table = base.require(tparams.target, "embedding_table", "drafter 'dflash'")(tparams.params)
        dt = self.spec.layer.compute_dtype
        x = (table[blk].astype(jnp.float32) * self.spec.input_embedding_scale).astype(dt)
        positions = (ctx.lengths - 1)[:, None] + jnp.arange(drafts + 1, dtype=jnp.int32)
        h = net.block_hidden(self.spec, dparams, x, positions, zip(state.k, state.v),
                             ctx.lengths - 1, causal=self.causal_override)
        return h

    def draft_logits(self, dparams, tparams, state, ctx, drafts: int) -> jax.Array:
        """f32[B, drafts, V]: the distributions of tokens L .. L+drafts-1 (before sampling)."""
        return self.head_logits(tparams, self.block_hidden(dparams, tparams, state, ctx, drafts))

    def head_logits(self, tparams, h) -> jax.Array:
        """The target's LM head as it stores it (head_weight: the packed CPU-kernel layout runs
        as one panel matmul; unpacking it through head_table would copy the whole [V, D] head
        every step), else its plain rows (head_table)."""
        found = base.target_traits(tparams.target).head_weight
        if found is None:
            found = base.require(tparams.target, "head_table", "drafter 'dflash'")
        return net.logits(self.spec, found(tparams.params), h)

    # ---- protocol -----------------------------------------------------------------------------
    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        c = self.spec.layer
        b = prompt_tokens.shape[0]
        shape = (b, c.num_kv_heads, capacity, c.head_dim)
        zeros = tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(self.spec.num_layers))
        return self._write(dparams, DFlashState(zeros, zeros), prompt_hidden,
                           jnp.zeros((b,), jnp.int32))

    def propose(self, dparams, tparams, state: DFlashState, ctx: DraftContext, num_tokens, sp,
                keys):
        b = ctx.lengths.shape[0]
        if self.tree_choices is not None or self.tree_top_k:
            return self._propose_tree(dparams, tparams, state, ctx, sp, keys), state
        if num_tokens > self.max_drafts:
            raise JaxspecError(
                f"num_speculative_tokens={num_tokens} exceeds this DFlash head's block "
                f"(block_size {self.spec.block_size}: {self.max_drafts} drafts): use "
                f"num_speculative_tokens <= {self.max_drafts}"
            )
        blk = self._block(dparams, tparams, state, ctx, num_tokens)
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, G]
        if self.spec.version == 2:
            tokens, q = self._select(dparams, blk, self._anchor(ctx), sp, step_keys)
        else:
            q = sampling.logits_to_probs(blk.logits, sp)  # [B, G, V]: q_i from the context alone
            tokens = sampling.greedy_tokens(blk.logits) if sp.mode == "greedy" else jax.vmap(
                sampling.sample_rows, in_axes=(1, 1), out_axes=1)(step_keys, q)  # greedy: argmax
        return Proposal(tokens, q, jnp.full((b,), num_tokens, jnp.int32)), state

    @staticmethod
    def _anchor(ctx: DraftContext) -> jax.Array:  # int32[B]: the last committed token
        return jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)[:, 0]

    def _block(self, dparams, tparams, state, ctx, drafts: int) -> BlockDraft:
        h = self.block_hidden(dparams, tparams, state, ctx, drafts)  # [B, G, D]
        logits = self.head_logits(tparams, h)  # [B, G, V]
        if self.spec.version == 1:
            return BlockDraft(h, logits, None, None, None)
        unary, cands = jax.lax.top_k(logits, self.spec.selector_top_k)  # [B, G, Kc]
        hp = decoder.linear(h, dparams["selector"]["proj"])  # [B, G, R]
        return BlockDraft(h, logits, hp, unary, cands)

    def position_logits(self, dparams, blk: BlockDraft, pos: int, prev) -> jax.Array:
        """f32[B, M, V]: the law of block position pos (token L + pos) after M predecessors
        prev int32[B, M] (the tokens at position pos - 1). DFlash 1: the position's logits
        (prev unused); DFlash 2: the selector's scores given each predecessor, -inf off its
        candidates."""
        b, m = prev.shape
        v = blk.logits.shape[-1]
        if self.spec.version == 1:
            return jnp.broadcast_to(blk.logits[:, pos, None], (b, m, v))
        rep = lambda a: jnp.repeat(a[:, pos], m, axis=0)  # noqa: E731  [B*M, ...]
        cands = rep(blk.cands)
        scores = net.selector_scores(dparams, rep(blk.hp), rep(blk.unary), cands,
                                     prev.reshape(-1))  # [B*M, Kc]
        full = jnp.full((b * m, v), -jnp.inf, jnp.float32)
        full = full.at[jnp.arange(b * m)[:, None], cands].set(scores)
        return full.reshape(b, m, v)

    def _select(self, dparams, blk: BlockDraft, anchor, sp, step_keys):
        """DFlash 2's candidate selector, in block order: (tokens int32[B, G], q f32[B, G, V])."""
        prev, toks, qs = anchor.astype(jnp.int32), [], []
        for i in range(blk.logits.shape[1]):
            logits = self.position_logits(dparams, blk, i, prev[:, None])[:, 0]  # [B, V]
            q = sampling.logits_to_probs(logits, sp)
            prev = (sampling.greedy_tokens(logits) if sp.mode == "greedy"  # [B]
                    else sampling.sample_rows(step_keys[:, i], q))
            toks.append(prev)
            qs.append(q)
        return jnp.stack(toks, axis=1), jnp.stack(qs, axis=1)

    def _propose_tree(self, dparams, tparams, state, ctx, sp, keys) -> Proposal:
        b = ctx.lengths.shape[0]
        anchor = self._anchor(ctx).astype(jnp.int32)
        if self.tree_top_k:
            blk = self._block(dparams, tparams, state, ctx, self.tree_levels)

            def expand(carry, level, front: tree.Frontier):  # children of depth level + 1
                return carry, self.position_logits(dparams, blk, level + 1, front.ids)

            root = self.position_logits(dparams, blk, 0, anchor[:, None])[:, 0]  # [B, V]
            grown, _ = tree.grow(expand, None, root, sp, keys, top_k=self.tree_top_k,
                                 levels=self.tree_levels, budget=self.tree_budget,
                                 children=self.tree_children)
            num = jnp.full((b,), self.tree_budget, jnp.int32)
            return Proposal(grown.ids, grown.q, num, grown.parents)
        parents, depth, rank = tree.static_layout(self.tree_choices)
        n = len(parents)
        blk = self._block(dparams, tparams, state, ctx, max(depth))
        node_keys = jax.vmap(lambda k: jax.random.split(k, n))(keys)  # [B, Nn]
        ranked = None  # DFlash 1, top_k children: a position's ranks read no parent, so one
        # top_k over the block's own logits; per level over parent-broadcast copies, XLA:CPU
        # sorts each copy's whole vocabulary (BENCHMARKS.md, "DFlash step cost")
        if self.tree_children == "top_k" and self.positions_read_no_parent:
            ranked = top_indices(blk.logits, max(rank) + 1)  # [B, depth, R]
        tokens, probs = [None] * n, [None] * n
        for d in range(1, max(depth) + 1):  # level by level: a node's law reads its parent
            at = [i for i in range(n) if depth[i] == d]
            if ranked is not None:  # the rank-r token of the position, one-hot q
                toks = jnp.stack([ranked[:, d - 1, rank[i]] for i in at], axis=1)  # [B, M]
                q = jax.nn.one_hot(toks, self.target_vocab, dtype=jnp.float32)
                for j, i in enumerate(at):
                    tokens[i], probs[i] = toks[:, j].astype(jnp.int32), q[:, j]
                continue
            prev = jnp.stack([anchor if parents[i] < 0 else tokens[parents[i]] for i in at], 1)
            logits = self.position_logits(dparams, blk, d - 1, prev)  # [B, M, V]
            if self.tree_children == "top_k":  # the rank-r token of the node's law, one-hot q
                top = jax.lax.top_k(logits, max(rank[i] for i in at) + 1)[1]  # [B, M, R]
                toks = jnp.stack([top[:, j, rank[i]] for j, i in enumerate(at)], axis=1)
                q = jax.nn.one_hot(toks, self.target_vocab, dtype=jnp.float32)
            else:  # each node its own draw from its law, reporting it
                q = sampling.logits_to_probs(logits, sp)
                toks = jax.vmap(sampling.sample_rows, in_axes=(1, 1), out_axes=1)(
                    node_keys[:, jnp.asarray(at)], q)
            for j, i in enumerate(at):
                tokens[i], probs[i] = toks[:, j].astype(jnp.int32), q[:, j]
        par = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
        num = jnp.full((b,), n, jnp.int32)
        return Proposal(jnp.stack(tokens, 1), jnp.stack(probs, 1), num, par)

    def advance(self, dparams, tparams, state: DFlashState, ctx: DraftContext) -> DFlashState:
        """Nothing to update without drafting: the state changes only when features commit
        (prompt lookup first then skips the block forward when every row found a match)."""
        return state

    def commit(self, dparams, tparams, state: DFlashState, ctx: CommitContext) -> DFlashState:
        """Context entries of the path (root x_{L-1}, then the accepted nodes) at slots
        prev_lengths - 1 ..; those past num_accepted lie beyond the committed context."""
        return self._write(dparams, state, ctx.hidden, ctx.prev_lengths - 1)

    def commit_plain(self, dparams, tparams, state: DFlashState, ctx: CommitContext):
        """A plain run's roots (adaptive speculation): their entries, as commit writes a root."""
        return self._write(dparams, state, ctx.hidden, ctx.prev_lengths - 1)


def top_indices(x, k: int) -> jax.Array:
    """int32[..., k]: lax.top_k(x, k)'s indices (descending, ties to the lower index) as k
    max-reductions. Inside the decode loop XLA:CPU turns lax.top_k over [B, G, V] into a sort of
    the whole vocabulary; k passes over it are far cheaper for small k."""
    iota = jnp.arange(x.shape[-1], dtype=jnp.int32)
    taken = jnp.zeros(x.shape, bool)
    out = []
    for _ in range(k):
        m = jnp.max(jnp.where(taken, -jnp.inf, x), axis=-1, keepdims=True)
        i = jnp.min(jnp.where((x == m) & ~taken, iota, x.shape[-1]), axis=-1)  # [...]
        taken = taken | (iota == i[..., None])
        out.append(i)
    return jnp.stack(out, axis=-1)


# ---- method "dflash" --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashOptions(trained.WindowOptions):
    """speculative.dflash: a DFlash / DFlash 2 head in the authors' layout (config.json with
    architectures [DFlashDraftModel | DFlash2DraftModel]). γ (num_speculative_tokens) is at most
    block_size - 1; a static tree (speculative.tree.kind=static) takes its paths of per-position
    ranks from speculative.tree.choices, a dynamic one (kind=dynamic) its top_k, depth (at most
    block_size - 1), budget and children from speculative.tree."""

    SECTION: ClassVar[str] = "speculative.dflash"
    tree_children: Literal["top_k", "sampled"] = "top_k"

    def _validate(self):
        super()._validate()
        if self.tree_children not in TREE_CHILDREN:
            self._fail("tree_children", f"use one of {', '.join(TREE_CHILDREN)}")

    def check(self, spec):
        if spec.tree.kind == "static" and spec.tree.choices is None:
            raise JaxspecError(
                "speculative.tree.kind=static with dflash needs speculative.tree.choices, "
                "e.g. [[0], [1], [0, 0], [0, 0, 0]]"
            )


def build(options: DFlashOptions, ctx: BuildContext):
    drafter, dparams = trained.load("dflash", options, ctx)
    if kernels.available() and base.uses_cpu_kernels(ctx.target.target, ctx.target.params):
        dparams = net.pack_for_cpu(dparams)  # the target's packed layout: the head's too
    if ctx.spec.tree.kind == "static":
        choices = tuple(tuple(p) for p in ctx.spec.tree.choices)
        drafter = dataclasses.replace(
            drafter, tree_choices=choices, tree_children=options.tree_children
        )
    if ctx.spec.tree.kind == "dynamic":
        drafter = dataclasses.replace(drafter, **tree.dynamic_fields(ctx.spec.tree))
    return drafter, dparams


register_drafter(
    "dflash", build, train="jaxspec.train.dflash:DFlash", formats=("jaxspec", "dflash"),
    options=DFlashOptions, tree_kinds=("static", "dynamic"), summary=(
    "DFlash / DFlash 2 block diffusion drafting: one drafter forward over [last token, mask x γ] "
    "reading the target's fused hidden states; the authors' published heads load"))
