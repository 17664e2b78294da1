"""`speculative.method: dflash`: the published DFlash / DFlash 2 drafters (drafters/dflash_net.py
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
  tree            a static tree of ranks (jaxspec.decode.tree.check_choices): node [r_1..r_d]
                  sits at block position d. tree_children "top_k": the rank-r_d token of q_d,
                  reported one-hot (deterministic given the context); "sampled": each node is
                  its own draw from q_d and reports q_d (i.i.d. siblings, SpecInfer).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.decode import sampling, tree
from jaxspec.drafters import dflash_net as net
from jaxspec.drafters import trained
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.errors import JaxspecError
from jaxspec.models import base, decoder

TREE_CHILDREN = ("top_k", "sampled")


class DFlashState(NamedTuple):
    k: tuple  # per draft layer [B, K, S, Hd]: context keys at slot = position
    v: tuple  # per draft layer [B, K, S, Hd]


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    spec: net.DFlashSpec
    target_vocab: int
    name: str = "dflash"
    variable_length: bool = False
    tree_choices: tuple[tuple[int, ...], ...] | None = None  # None: a chain of γ drafts
    tree_children: Literal["top_k", "sampled"] = "top_k"
    causal_override: bool | None = None  # tests only: force every layer's block mask

    def __post_init__(self):
        if self.tree_children not in TREE_CHILDREN:
            raise JaxspecError(
                f"speculative.dflash.tree_children={self.tree_children!r} is invalid: use one "
                f"of {', '.join(TREE_CHILDREN)}"
            )
        if self.tree_choices is not None:
            if self.spec.version == 2:
                raise JaxspecError(
                    "DFlash 2 heads draft a chain (the selector walks the block in order): use "
                    "speculative.tree.kind=chain with this checkpoint"
                )
            choices = tree.check_choices(self.tree_choices)
            depth = max(map(len, choices))
            if depth > self.max_drafts:
                raise JaxspecError(
                    f"tree choices reach depth {depth} but this DFlash head drafts at most "
                    f"{self.max_drafts} positions (block_size {self.spec.block_size}): use paths "
                    f"of at most {self.max_drafts} ranks"
                )
            object.__setattr__(self, "tree_choices", choices)

    @property
    def hidden_layers(self) -> tuple[int, ...]:  # jaxspec taps: input of layer i = HF i
        return tuple(i + 1 for i in self.spec.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        return self.spec.block_size - 1

    @property
    def tree_nodes(self) -> int | None:
        return None if self.tree_choices is None else len(self.tree_choices)

    @property
    def tree_depth(self) -> int | None:
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
        return h[:, 1:]

    def draft_logits(self, dparams, tparams, state, ctx, drafts: int) -> jax.Array:
        """f32[B, drafts, V]: the distributions of tokens L .. L+drafts-1 (before sampling)."""
        return self.head_logits(tparams, self.block_hidden(dparams, tparams, state, ctx, drafts))

    def head_logits(self, tparams, h) -> jax.Array:
        head = base.require(tparams.target, "head_table", "drafter 'dflash'")(tparams.params)
        return net.logits(self.spec, head, h)

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
        if self.tree_choices is not None:
            return self._propose_tree(dparams, tparams, state, ctx, sp, keys), state
        if num_tokens > self.max_drafts:
            raise JaxspecError(
                f"num_speculative_tokens={num_tokens} exceeds this DFlash head's block "
                f"(block_size {self.spec.block_size}: {self.max_drafts} drafts): use "
                f"num_speculative_tokens <= {self.max_drafts}"
            )
        h = self.block_hidden(dparams, tparams, state, ctx, num_tokens)  # [B, G, D]
        logits = self.head_logits(tparams, h)  # [B, G, V]
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, G]
        if self.spec.version == 2:
            last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)[:, 0]
            tokens, q = self._select(dparams, h, logits, last, sp, step_keys)
        else:
            q = sampling.logits_to_probs(logits, sp)  # [B, G, V]: q_i from the context alone
            tokens = jax.vmap(sampling.sample_rows, in_axes=(1, 1), out_axes=1)(step_keys, q)
        return Proposal(tokens, q, jnp.full((b,), num_tokens, jnp.int32)), state

    def _select(self, dparams, h, logits, anchor, sp, step_keys):
        """DFlash 2's candidate selector, in block order: (tokens int32[B, G], q f32[B, G, V])."""
        kc = self.spec.selector_top_k
        unary, cands = jax.lax.top_k(logits, kc)  # [B, G, Kc]
        hp = decoder.linear(h, dparams["selector"]["proj"])  # [B, G, R]
        v = logits.shape[-1]
        rows = jnp.arange(logits.shape[0])[:, None]

        def step(prev, xs):
            hp_i, un_i, c_i, k_i = xs  # [B, R], [B, Kc], [B, Kc], [B]
            scores = net.selector_scores(dparams, hp_i, un_i, c_i, prev)  # [B, Kc]
            full = jnp.full((scores.shape[0], v), -jnp.inf, jnp.float32)
            q = sampling.logits_to_probs(full.at[rows, c_i].set(scores), sp)  # [B, V]
            tok = sampling.sample_rows(k_i, q)
            return tok, (tok, q)

        sw = lambda a: jnp.swapaxes(a, 0, 1)  # noqa: E731  scan over block positions
        _, (toks, qs) = jax.lax.scan(step, anchor.astype(jnp.int32),
                                     (sw(hp), sw(unary), sw(cands), sw(step_keys)))
        return sw(toks), sw(qs)

    def _propose_tree(self, dparams, tparams, state, ctx, sp, keys) -> Proposal:
        b = ctx.lengths.shape[0]
        parents, depth, rank = tree.static_layout(self.tree_choices)
        logits = self.draft_logits(dparams, tparams, state, ctx, max(depth))  # [B, G, V]
        at = jnp.asarray(depth) - 1  # [Nn] block position of each node
        if self.tree_children == "top_k":  # the rank-r token of q_d, one-hot q
            top = jax.lax.top_k(logits, max(rank) + 1)[1]  # [B, G, R]
            tokens = top[:, at, jnp.asarray(rank)]  # [B, Nn]
            probs = jax.nn.one_hot(tokens, self.target_vocab, dtype=jnp.float32)
        else:  # each node its own draw from q_{depth(n)}, reporting it
            q_nodes = sampling.logits_to_probs(logits, sp)[:, at]  # [B, Nn, V]
            node_keys = jax.vmap(lambda k: jax.random.split(k, len(parents)))(keys)
            tokens = jax.vmap(sampling.sample_rows, in_axes=(1, 1), out_axes=1)(node_keys, q_nodes)
            probs = q_nodes
        n = len(parents)
        par = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
        return Proposal(tokens, probs, jnp.full((b,), n, jnp.int32), par)

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


# ---- method "dflash" --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashOptions(trained.CheckpointOptions):
    """speculative.dflash: a DFlash / DFlash 2 head in the authors' layout (config.json with
    architectures [DFlashDraftModel | DFlash2DraftModel]). γ (num_speculative_tokens) is at most
    block_size - 1; a static tree (speculative.tree.kind=static) takes its paths of per-position
    ranks from speculative.tree.choices."""

    SECTION: ClassVar[str] = "speculative.dflash"
    tree_children: Literal["top_k", "sampled"] = "top_k"

    def _validate(self):
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
    if ctx.spec.tree.kind == "static":
        choices = tuple(tuple(p) for p in ctx.spec.tree.choices)
        drafter = dataclasses.replace(
            drafter, tree_choices=choices, tree_children=options.tree_children
        )
    return drafter, dparams


register_drafter(
    "dflash", build, train="jaxspec.train.dflash:DFlash", formats=("jaxspec", "dflash"),
    options=DFlashOptions, tree_kinds=("static",), summary=(
    "DFlash / DFlash 2 block diffusion drafting: one drafter forward over [last token, mask x γ] "
    "reading the target's fused hidden states; the authors' published heads load"))
