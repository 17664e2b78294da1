"""Parallel block drafter (DFlash / PARD style): a whole block of γ drafts in ONE drafter forward.

The drafter is a small causal transformer over *context entries*, one per committed token, plus a
block of *mask entries* appended when it drafts:

  context entry j   c_j = in_proj([rms(embed(x_j)), rms(f_{j-1})]), f = fuse(low, mid, high
                    target features) (EAGLE-3's fused taps; f_{-1} = 0). Every drafter layer l
                    reads the context through its own k/v projections of c_j (DFlash injects the
                    target's fused features into every draft layer's keys and values): the cache
                    holds, per layer, k_l(c_j), v_l(c_j) at slot j; no layer runs over the
                    context otherwise.
  block             slot 0 = c_{L-1} (the last committed token, whose own target feature does not
                    exist yet, with f_{L-2}); slots 1..γ-1 = learned mask vectors mask_in[i-1].
                    Slot i sits at position L-1+i, attends the context slots < L-1 and the block
                    slots <= i (causal inside the block, so a block cut to γ' < γ slots computes
                    exactly what the first γ' slots of a longer one compute), and its output
                    predicts x_{L+i}.

So one forward of the block layers over γ positions gives γ next-token distributions q_1..q_γ,
instead of γ sequential drafter steps. Layer 0 over slot 0 is exactly EAGLE's first step
(drafters/eagle_head.py), so an EAGLE head can seed it (train/block.py).

Params `dparams` (torch `[out, in]` layout):
  fuse [D, 3D], in_proj [D, 2D]     as drafters/eagle_head.py
  block {"l0": layer, "l1": ...}    Llama decoder layers (attn_norm, wq, wk, wv, wo, mlp_norm,
                                    w_gate, w_up, w_down; each layer's MLP width is its own)
  mask_in [γmax-1, D]               the mask entries of block slots 1..γmax-1
  norm [D], head [N, D], d2t [N]    final norm, the target's frozen LM-head rows of the N-token
                                    draft vocabulary and their target ids (as drafters/eagle_head.py)

Why sampling stays lossless (jaxspec.decode.acceptance needs each proposed token distributed exactly as
the q reported for it, given everything the verification walk has seen before it):
  chain   position i's distribution q_i is a function of the committed context only: the block's
          inputs are the context and fixed mask vectors, never a drafted token. Token i is one
          draw from q_i (its own key), after the same logits transform as the target's, and q_i
          is what is reported for it. Given the earlier drafts x_1..x_{i-1}, x_i is still
          distributed as q_i (it never saw them): the conditional the rule divides by is q_i.
  tree    a static tree of ranks (Medusa-style choices, jaxspec.decode.tree.check_choices): node
          [r_1..r_d] sits at block position d. tree_children="top_k": its token is the rank-r_d
          token of q_d, a deterministic function of the context, reported with a one-hot q (the
          rule's one-hot case). "sampled": every node draws its token from q_d with its own key
          and reports q_d -- siblings are i.i.d. draws from q_d (SpecInfer), independent of the
          path above them and of each other, so each child's q is the distribution it was drawn
          from. Which nodes exist is fixed by the layout, never by a token.

State: per-layer context caches [B, K, S, Hd] and the fused feature f_{L-2} for slot 0. commit()
writes the entries of the accepted path (root first: the root's entry uses the state's feature),
one k/v projection per layer and no MLP; entries past the committed length are masked garbage,
overwritten later (the target cache's masked rollback). propose() writes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.decode import sampling, tree
from jaxspec.drafters import trained
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal
from jaxspec.drafters.draft_vocab import scatter_to_target
from jaxspec.drafters.eagle_head import fuse, head_logits, rms
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, llama

TREE_CHILDREN = ("top_k", "sampled")


def entry_inputs(dparams, emb, feature_before):
    """Context entries: token embeddings [..., D] with the fused feature before each [..., D]."""
    x = jnp.concatenate([rms(emb), rms(feature_before)], axis=-1)
    return decoder.linear(x, dparams["in_proj"])


def layer_names(dparams) -> list[str]:
    return [f"l{i}" for i in range(len(dparams["block"]))]


def _qkv(cfg, lp, x, positions):
    """x [..., T, D] at positions [..., T] -> q [..., T, N, Hd], k, v [..., T, K, Hd] (roped)."""
    inv_freq = llama.rope_frequencies(cfg)
    y = llama.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    lead = x.shape[:-1]
    q = decoder.linear(y, lp["wq"]).reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = decoder.linear(y, lp["wk"]).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = decoder.linear(y, lp["wv"]).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    flat = lambda a: a.reshape(-1, *a.shape[-3:])  # noqa: E731  rope takes [B, T, heads, Hd]
    pos = positions.reshape(-1, positions.shape[-1])
    rope = lambda a: llama.apply_rope(flat(a), pos, inv_freq).reshape(a.shape)  # noqa: E731
    return rope(q), rope(k), v


def context_kv(cfg, lp, c, positions):
    """One layer's keys/values of context entries c [B, T, D] at positions [B, T], in the cache
    layout [B, K, T, Hd]."""
    _, k, v = _qkv(cfg, lp, c, positions)
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def block_attention(q, blk_k, blk_v, ctx_k, ctx_v, ctx_mask):
    """q [B, A, G, N, Hd] (A blocks of G slots) attends its context ctx_k/v [B, K, S, Hd] under
    ctx_mask bool[B, A, G, S] and its own block's slots blk_k/v [B, A, G, K, Hd] causally ->
    [B, A, G, N*Hd] (one softmax over both, f32)."""
    b, a, g, n, hd = q.shape
    kv = ctx_k.shape[1]
    qg = q.reshape(b, a, g, kv, n // kv, hd)
    f32 = jnp.float32
    s_ctx = jnp.einsum("bagkrh,bksh->bkrags", qg, ctx_k, preferred_element_type=f32)
    s_blk = jnp.einsum("bagkrh,bajkh->bkragj", qg, blk_k, preferred_element_type=f32)
    causal = jnp.arange(g)[None, :] <= jnp.arange(g)[:, None]  # [G, G]
    neg = jnp.finfo(f32).min
    s_ctx = jnp.where(ctx_mask[:, None, None], s_ctx, neg)
    s_blk = jnp.where(causal, s_blk, neg)
    w = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1) * hd**-0.5, axis=-1)
    s = ctx_k.shape[2]
    w_ctx, w_blk = w[..., :s].astype(ctx_v.dtype), w[..., s:].astype(blk_v.dtype)
    out = jnp.einsum("bkrags,bksh->bagkrh", w_ctx, ctx_v) + jnp.einsum(
        "bkragj,bajkh->bagkrh", w_blk, blk_v
    )
    return out.reshape(b, a, g, n * hd)


def _finish(cfg, lp, x, attn):
    x = x + decoder.linear(attn, lp["wo"])
    y = llama.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    y = jax.nn.silu(decoder.linear(y, lp["w_gate"])) * decoder.linear(y, lp["w_up"])
    return x + decoder.linear(y, lp["w_down"])


def block_forward(cfg, dparams, x, positions, contexts, ctx_mask):
    """The block layers: x [B, A, G, D] at positions [B, A, G]; contexts: per layer (k, v)
    [B, K, S, Hd]; ctx_mask bool[B, A, G, S] -> h [B, A, G, D] (before the final norm)."""
    for name, (ck, cv) in zip(layer_names(dparams), contexts):
        lp = dparams["block"][name]
        q, k, v = _qkv(cfg, lp, x, positions)
        attn = block_attention(q, k, v, ck, cv, ctx_mask)
        x = _finish(cfg, lp, x, attn.astype(x.dtype))
    return x


def block_inputs(dparams, slot0, num_slots: int):
    """slot0 [B, A, D] (context entries of the blocks' last committed tokens) -> the block's
    inputs [B, A, G, D]: slot0, then the mask vectors of slots 1..G-1."""
    b, a, d = slot0.shape
    masks = jnp.broadcast_to(dparams["mask_in"][: num_slots - 1].astype(slot0.dtype),
                             (b, a, num_slots - 1, d))
    return jnp.concatenate([slot0[:, :, None], masks], axis=2)


class BlockState(NamedTuple):
    k: tuple  # per layer [B, K, S, Hd]: context keys k_l(c_j) at slot j
    v: tuple  # per layer [B, K, S, Hd]
    feature: jax.Array  # [B, D] fused target feature f_{L-2} (slot 0's)


@dataclasses.dataclass(frozen=True)
class BlockDrafter:
    cfg: llama.ModelConfig  # the block layers' attention shape, rope and eps (dims of the target)
    target_vocab: int
    hidden_layers: tuple[int, ...]  # the fused target taps (low, mid, high; HF indexing)
    block_size: int  # slots of mask_in + 1: the most drafts one block holds
    name: str = "block"
    variable_length: bool = False
    tree_choices: tuple[tuple[int, ...], ...] | None = None  # None: a chain of γ drafts
    tree_children: Literal["top_k", "sampled"] = "top_k"

    def __post_init__(self):
        if self.tree_children not in TREE_CHILDREN:
            raise JaxspecError(
                f"speculative.block.tree_children={self.tree_children!r} is invalid: use one of "
                f"{', '.join(TREE_CHILDREN)}"
            )
        if self.tree_choices is not None:
            choices = tree.check_choices(self.tree_choices)
            depth = max(map(len, choices))
            if depth > self.block_size:
                raise JaxspecError(
                    f"tree choices reach depth {depth} but this block drafter drafts at most "
                    f"{self.block_size} positions: use paths of at most {self.block_size} ranks"
                )
            object.__setattr__(self, "tree_choices", choices)

    @property
    def tree_nodes(self) -> int | None:
        return None if self.tree_choices is None else len(self.tree_choices)

    @property
    def tree_depth(self) -> int | None:
        return None if self.tree_choices is None else max(map(len, self.tree_choices))

    def target_needs(self, dparams) -> tuple[str, ...]:
        return ("embed",)  # context entries and slot 0 read the target's token embedding

    # ---- pieces -------------------------------------------------------------------------------
    def _write(self, dparams, tparams, state_kv, tokens, before, start):
        """Context entries of tokens [B, T] with the fused features before them [B, T, D], at
        slots start[B] + arange(T), into every layer's cache."""
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        dt = self.cfg.compute_dtype
        c = entry_inputs(dparams, tparams.embed(tokens), before).astype(dt)
        ks, vs = [], []
        for name, kc, vc in zip(layer_names(dparams), *state_kv):
            _, k, v = _qkv(self.cfg, dparams["block"][name], c, positions)
            ks.append(decoder.write_kv(kc, k.astype(kc.dtype), positions))
            vs.append(decoder.write_kv(vc, v.astype(vc.dtype), positions))
        return tuple(ks), tuple(vs)

    def block_logits(self, dparams, tparams, state: BlockState, ctx: DraftContext, num_slots):
        """One forward of the block -> draft-vocabulary logits f32[B, G, N] for x_L..x_{L+G-1}."""
        last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)  # [B, 1]
        dt = self.cfg.compute_dtype
        slot0 = entry_inputs(dparams, tparams.embed(last), state.feature[:, None]).astype(dt)
        x = block_inputs(dparams, slot0, num_slots)  # [B, 1, G, D]
        positions = (ctx.lengths - 1)[:, None, None] + jnp.arange(num_slots, dtype=jnp.int32)
        s = state.k[0].shape[2]
        ctx_mask = jnp.arange(s)[None, None, None, :] < (ctx.lengths - 1)[:, None, None, None]
        ctx_mask = jnp.broadcast_to(ctx_mask, (*positions.shape, s))
        h = block_forward(self.cfg, dparams, x, positions, zip(state.k, state.v), ctx_mask)
        return head_logits(dparams, h[:, 0])

    # ---- protocol -----------------------------------------------------------------------------
    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        c = self.cfg
        b, p = prompt_tokens.shape
        shape = (b, c.num_kv_heads, capacity, c.head_dim)
        n = len(dparams["block"])
        zeros = tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(n))
        f = fuse(dparams, prompt_hidden)  # [B, P, D]; f_t follows token t
        before = jnp.pad(f, [(0, 0), (1, 0), (0, 0)])[:, :p]  # entry j takes f_{j-1}, 0 at j = 0
        k, v = self._write(dparams, tparams, (zeros, zeros), prompt_tokens, before,
                           jnp.zeros((b,), jnp.int32))
        last = jnp.take_along_axis(f, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
        return BlockState(k, v, last)

    def propose(self, dparams, tparams, state: BlockState, ctx: DraftContext, num_tokens, sp, keys):
        b = ctx.lengths.shape[0]
        d2t = dparams["d2t"]
        if self.tree_choices is not None:
            parents, depth, rank = tree.static_layout(self.tree_choices)
            logits = self.block_logits(dparams, tparams, state, ctx, max(depth))  # [B, G, N]
            at = jnp.asarray(depth) - 1  # [Nn] block position of each node
            if self.tree_children == "top_k":  # deterministic: the rank-r token of q_d, one-hot q
                top = jax.lax.top_k(logits, max(rank) + 1)[1]  # [B, G, R]
                idx = top[:, at, jnp.asarray(rank)]  # [B, Nn]
                tokens = d2t[idx]
                probs = jax.nn.one_hot(tokens, self.target_vocab, dtype=jnp.float32)
            else:  # sampled: node n draws from q_{depth(n)} with its own key and reports it
                q_pos = sampling.logits_to_probs(logits, sp)  # [B, G, N]
                q_nodes = q_pos[:, at]  # [B, Nn, N]
                node_keys = jax.vmap(lambda k: jax.random.split(k, len(parents)))(keys)
                idx = jax.vmap(sampling.sample_rows, in_axes=(1, 1), out_axes=1)(node_keys, q_nodes)
                tokens = d2t[idx]
                probs = scatter_to_target(q_nodes, d2t, self.target_vocab)
            n = len(parents)
            par = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
            return Proposal(tokens, probs, jnp.full((b,), n, jnp.int32), par), state
        if num_tokens > self.block_size:
            raise JaxspecError(
                f"num_speculative_tokens={num_tokens} exceeds this block drafter's block of "
                f"{self.block_size}: use num_speculative_tokens <= {self.block_size}"
            )
        logits = self.block_logits(dparams, tparams, state, ctx, num_tokens)  # [B, G, N]
        q_n = sampling.logits_to_probs(logits, sp)  # [B, G, N]: q_i from the context alone
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, G]
        idx = jax.vmap(sampling.sample_rows, in_axes=(1, 1), out_axes=1)(step_keys, q_n)
        probs = scatter_to_target(q_n, d2t, self.target_vocab)  # token i was drawn from q_i
        return Proposal(d2t[idx], probs, jnp.full((b,), num_tokens, jnp.int32)), state

    def commit(self, dparams, tparams, state: BlockState, ctx: CommitContext):
        """Entries of the path: root x_{L-1} (with the state's f_{L-2}), then the accepted nodes
        (each with the target feature after the token before it), at slots prev_lengths - 1..;
        entries past num_accepted lie beyond the committed length (masked, rewritten later)."""
        f = fuse(dparams, ctx.hidden)  # [B, P, D]; f[:, i] follows path token i
        before = jnp.concatenate([state.feature[:, None].astype(f.dtype), f[:, :-1]], axis=1)
        k, v = self._write(dparams, tparams, (state.k, state.v), ctx.window, before,
                           ctx.prev_lengths - 1)
        feature = jnp.take_along_axis(f, ctx.num_accepted[:, None, None], axis=1)[:, 0]
        return BlockState(k, v, feature)

    def commit_plain(self, dparams, tparams, state: BlockState, ctx: CommitContext):
        """A plain run of n = lengths - prev_lengths steps (adaptive speculation): its roots
        ctx.window [B, M] are entries exactly as commit writes a path's root, in one pass."""
        f = fuse(dparams, ctx.hidden)  # [B, M, D]; f[:, i] follows root i
        before = jnp.concatenate([state.feature[:, None].astype(f.dtype), f[:, :-1]], axis=1)
        k, v = self._write(dparams, tparams, (state.k, state.v), ctx.window, before,
                           ctx.prev_lengths - 1)
        n = ctx.lengths - ctx.prev_lengths
        last = jnp.take_along_axis(f, jnp.clip(n - 1, 0, None)[:, None, None], axis=1)[:, 0]
        return BlockState(k, v, jnp.where((n > 0)[:, None], last, state.feature))


# ---- method "block" ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockOptions(trained.CheckpointOptions):
    """speculative.block: jaxspec's block drafter (python -m jaxspec.train, method: block). A
    static tree (speculative.tree.kind=static) takes its paths of per-position ranks from
    speculative.tree.choices."""

    SECTION: ClassVar[str] = "speculative.block"
    # tree nodes: the rank-r tokens of each position (one-hot q), or i.i.d. draws from it
    tree_children: Literal["top_k", "sampled"] = "top_k"

    def _validate(self):
        if self.tree_children not in TREE_CHILDREN:
            self._fail("tree_children", f"use one of {', '.join(TREE_CHILDREN)}")

    def check(self, spec):
        if spec.tree.kind == "static" and spec.tree.choices is None:
            raise JaxspecError(
                "speculative.tree.kind=static with block needs speculative.tree.choices, "
                "e.g. [[0], [1], [0, 0], [0, 0, 0]]"
            )


def build(options: BlockOptions, ctx: BuildContext):
    drafter, dparams = trained.load("block", options, ctx)
    if ctx.spec.tree.kind == "static":
        choices = tuple(tuple(p) for p in ctx.spec.tree.choices)
        drafter = dataclasses.replace(
            drafter, tree_choices=choices, tree_children=options.tree_children
        )
    return drafter, dparams


register_drafter(
    "block", build, train="jaxspec.train.block:Block",
    options=BlockOptions, tree_kinds=("static",), summary=(
    "all γ drafts in one drafter forward (DFlash / PARD style), a chain or a static tree"))
