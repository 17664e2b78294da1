"""Model drafters: a separate small model (`draft_model`, any `models.base.Target`, usually a
small Llama), or the target's own first N layers + final norm + LM head (`layer_skip`,
self-speculation sharing the target's weights: the target protocol's `prefix` trait).

The drafter keeps its own KV cache; its validity is implied by the committed length L, so commit
has nothing to do: every proposal starts with a 2-token window [tokens[L-2], tokens[L-1]] that
(re)writes the two newest committed slots — enough to catch up after any accepted count, bonus
included — then γ-1 single-token steps on its own samples (lax.scan); with
`DraftContext.max_nodes` (adaptive speculation) only as many as the longest row may verify (a
while loop, same keys, same drafts).

Dynamic tree (EAGLE-2, `tree_top_k` > 0; built by `jaxspec.decode.tree.grow`, shared with eagle): after
the same 2-token catch-up, each level runs the draft over every node expanded so far (depth d at
position L - 1 + d) with the ancestor mask, reading the committed prefix of its cache and writing
nothing (`forward(write_cache=False, window_mask=...)`): no scratch slots, nothing to roll back.
A level recomputes the earlier levels' nodes (k, 2k, ... rows): cheap next to the weight reads of
one forward on a CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode import sampling, tree
from jaxspec.drafters import trained
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal, Traits
from jaxspec.drafters.draft_vocab import scatter_to_target
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.errors import JaxspecError
from jaxspec.models import base, decoder


def check_vocab(draft_vocab: int, target_vocab: int, draft_tokenizer=None, target_tokenizer=None):
    """A draft may use a prefix of the target's vocabulary (padding rows aside); anything else
    would propose tokens the target reads differently."""
    if draft_tokenizer is not None and target_tokenizer is not None:
        d, t = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        small, large = (d, t) if len(d) <= len(t) else (t, d)
        if any(large.get(piece) != idx for piece, idx in small.items()):
            raise JaxspecError(
                f"draft vocabulary ({draft_vocab} tokens) does not match the target's "
                f"({target_vocab} tokens): use a draft model with the target's tokenizer"
            )
    elif draft_vocab != target_vocab:
        raise JaxspecError(
            f"draft vocabulary has {draft_vocab} tokens but the target has {target_vocab}: "
            "use a draft model with the target's tokenizer"
        )


@dataclasses.dataclass(frozen=True)
class ModelDrafter(tree.DynamicTreeDrafter):
    model: Any  # the draft network (a models.base.Target); None: layer_skip (the target's prefix)
    target_vocab: int
    name: str = "draft_model"
    shared_layers: int = 0  # > 0: layer_skip, the draft IS the target's first `shared_layers` layers
    hidden_layers: tuple[int, ...] = ()
    variable_length: bool = False
    # tree_top_k, tree_levels, tree_budget, tree_children: tree.DynamicTreeDrafter

    @property
    def traits(self) -> Traits:  # the protocol's optional behaviour (decode/drafter.py)
        return Traits(tree_nodes=self.tree_nodes, tree_depth=self.tree_depth,
                      max_context=self.max_context, model=self.model,
                      target_needs=self.target_needs)

    @property
    def max_context(self) -> int | None:
        return None if self.model is None else self.model.max_position_embeddings

    def target_needs(self, dparams) -> tuple[str, ...]:
        return ("prefix",) if self.shared_layers else ()

    def net(self, dparams, tparams):
        """(the network that drafts, its params): the draft model, or (layer_skip) the target's
        first `shared_layers` layers over the target's own params (nothing sliced or copied)."""
        if not self.shared_layers:
            return self.model, dparams
        prefix = base.require(tparams.target, "prefix", "layer_skip")
        return prefix(self.shared_layers), tparams.params

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        net, params = self.net(dparams, tparams)
        cache = net.init_cache(params, prompt_tokens.shape[0], capacity)
        return base.forward_prompt(net, params, prompt_tokens, cache, prompt_lengths).cache

    def _logits(self, run, hidden):
        """hidden [..., D] -> (draft logits f32[..., Nd], target ids int32[Nd] of the draft
        entries, or None when Nd is the target vocabulary)."""
        net, params = run
        if isinstance(params, dict) and "draft_head" in params:  # reduced draft vocabulary
            # (distilled drafts): N head rows + their target ids
            logits = decoder.linear(hidden, params["draft_head"]).astype(jnp.float32)
            return logits, params["draft_ids"]
        logits = net.logits(params, hidden)
        v, vd = self.target_vocab, logits.shape[-1]
        if vd > v:  # draft padding rows: never proposed
            logits = logits[..., :v]
        elif vd < v:  # draft vocab is a prefix of the target's
            pad = [(0, 0)] * (logits.ndim - 1) + [(0, v - vd)]
            logits = jnp.pad(logits, pad, constant_values=-jnp.inf)
        return logits, None

    def _probs(self, run, hidden, sp):  # [B, D] -> f32[B, V_target]
        logits, ids = self._logits(run, hidden)  # zeros outside the draft vocabulary: never drawn
        return scatter_to_target(sampling.logits_to_probs(logits, sp), ids, self.target_vocab)

    def _catch_up(self, run, state, ctx: DraftContext):
        """(Re)write the two newest committed slots -> (hidden at L - 1 [B, 1, D], cache)."""
        net, params = run
        start = jnp.maximum(ctx.lengths - 2, 0)  # [B]
        pos = start[:, None] + jnp.arange(2)[None]  # [B, 2]
        window = jnp.take_along_axis(ctx.tokens, pos, axis=1)
        out = net.forward(params, window, state.with_lengths(start))
        last = jnp.take_along_axis(out.hidden, (ctx.lengths - 1 - start)[:, None, None], axis=1)
        return last, out.cache

    def propose(self, dparams, tparams, state, ctx: DraftContext, num_tokens, sp, keys):
        run = self.net(dparams, tparams)  # (the drafting network, its params)
        net, net_params = run
        b = ctx.lengths.shape[0]
        last, cache = self._catch_up(run, state, ctx)
        if self.tree_top_k:
            return self._propose_tree(run, cache, last, ctx, sp, keys)
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, G]
        probs = self._probs(run, last[:, 0], sp)
        token = sampling.sample_rows(step_keys[:, 0], probs)
        if ctx.max_nodes is not None:  # adaptive speculation: stop once no row wants more
            return self._propose_up_to(run, ctx, num_tokens, sp, step_keys, cache, token, probs)

        def step(carry, key_col):
            cache, token, position = carry
            out = net.forward(net_params, token[:, None], cache.with_lengths(position))
            probs = self._probs(run, out.hidden[:, 0], sp)
            nxt = sampling.sample_rows(key_col, probs)
            return (out.cache, nxt, position + 1), (nxt, probs)

        carry = (cache, token, ctx.lengths)
        (cache, _, _), (tokens, all_probs) = jax.lax.scan(
            step, carry, jnp.swapaxes(step_keys[:, 1:], 0, 1)
        )
        drafts = jnp.concatenate([token[:, None], jnp.swapaxes(tokens, 0, 1)], axis=1)  # [B, G]
        q = jnp.concatenate([probs[:, None], jnp.swapaxes(all_probs, 0, 1)], axis=1)  # [B, G, V]
        num = jnp.full((b,), num_tokens, jnp.int32)
        return Proposal(drafts, q, num), cache

    def _propose_up_to(self, run, ctx, num_tokens, sp, step_keys, cache, token, probs):
        """The scan's drafts, but only max(ctx.max_nodes) of them (same keys, so the same
        tokens): a while loop. Cache entries are written for the nodes it runs through, which
        covers every node a row may keep (<= its max_nodes); the next proposal rewrites the
        two newest committed slots as always."""
        b, vocab = probs.shape
        net, net_params = run
        want = jnp.max(jnp.where(ctx.active, jnp.minimum(ctx.max_nodes, num_tokens), 0))
        drafts = jnp.zeros((b, num_tokens), jnp.int32).at[:, 0].set(token)
        q = jnp.zeros((b, num_tokens, vocab), jnp.float32).at[:, 0].set(probs)

        def body(c):
            i, cache, token, drafts, q = c
            position = ctx.lengths + i - 1
            out = net.forward(net_params, token[:, None], cache.with_lengths(position))
            p = self._probs(run, out.hidden[:, 0], sp)
            key_col = jax.lax.dynamic_index_in_dim(step_keys, i, axis=1, keepdims=False)
            nxt = sampling.sample_rows(key_col, p)
            drafts = jax.lax.dynamic_update_index_in_dim(drafts, nxt, i, axis=1)
            q = jax.lax.dynamic_update_index_in_dim(q, p, i, axis=1)
            return i + 1, out.cache, nxt, drafts, q

        c0 = (jnp.int32(1), cache, token, drafts, q)
        _, cache, _, drafts, q = jax.lax.while_loop(lambda c: c[0] < want, body, c0)
        num = jnp.clip(ctx.max_nodes, 0, num_tokens).astype(jnp.int32)
        return Proposal(drafts, q, num), cache

    def _propose_tree(self, run, cache, last, ctx: DraftContext, sp, keys):
        """EAGLE-2 dynamic tree (jaxspec.decode.tree.grow): level l runs the window of every node
        expanded so far, k per level, at positions L + its level under the ancestor mask."""
        k, levels = self.tree_top_k, self.tree_levels
        b = ctx.lengths.shape[0]
        net, net_params = run
        root_logits, ids = self._logits(run, last[:, 0])
        to_target = (lambda i: i) if ids is None else (lambda i: ids[i])

        def expand(carry, level, front: tree.Frontier):
            win_tokens, win_parents = carry  # [B, level*k] expanded so far, their window parents
            offset = (level - 1) * k  # window index of the previous frontier's first node
            parent = jnp.where(front.parent < 0, -1, front.parent + offset).astype(jnp.int32)
            win_tokens = jnp.concatenate([win_tokens, to_target(front.ids)], axis=1)
            win_parents = jnp.concatenate([win_parents, parent], axis=1)
            t = win_tokens.shape[1]
            mask = tree.ancestors(win_parents, jnp.full((b,), t, jnp.int32))[:, 1:, 1:]
            depth = jnp.asarray(np.repeat(np.arange(level + 1, dtype=np.int32), k))
            positions = ctx.lengths[:, None] + depth[None]  # depth-1 nodes at L
            out = net.forward(net_params, win_tokens, cache.with_lengths(ctx.lengths),
                              positions=positions, window_mask=mask, write_cache=False)
            logits, _ = self._logits(run, out.hidden[:, -k:])  # [B, K, Nd]
            return (win_tokens, win_parents), logits

        empty = jnp.zeros((b, 0), jnp.int32)
        grown, _ = tree.grow(
            expand, (empty, empty), root_logits, sp, keys, top_k=k, levels=levels,
            budget=self.tree_budget, children=self.tree_children,
        )
        probs = scatter_to_target(grown.q, ids, self.target_vocab)
        num = jnp.full((b,), self.tree_budget, jnp.int32)
        return Proposal(to_target(grown.ids), probs, num, grown.parents), cache

    def commit(self, dparams, tparams, state, ctx: CommitContext):
        return state


def layer_skip_drafter(target: base.Target, num_layers: int) -> ModelDrafter:
    """The target's first `num_layers` layers as its drafter (needs the `prefix` trait)."""
    base.require(target, "prefix", "speculative.method=layer_skip")
    if not 1 <= num_layers < target.num_layers:
        raise JaxspecError(
            f"speculative.layer_skip.layers={num_layers} is out of range: the target has "
            f"{target.num_layers} layers, use 1..{target.num_layers - 1}"
        )
    return ModelDrafter(
        model=None, target_vocab=target.vocab_size, name="layer_skip", shared_layers=num_layers
    )


def draft_model_drafter(draft, target) -> ModelDrafter:
    """draft, target: LoadedModel (or models.base.Model). Checks the vocabularies; a shorter
    draft context is not fatal (the engine checks each request against `max_context`)."""
    d, t = draft.target, target.target
    check_vocab(d.vocab_size, t.vocab_size, draft.tokenizer, target.tokenizer)
    return ModelDrafter(model=d, target_vocab=t.vocab_size)


# ---- method "draft_model" ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModelOptions(trained.CheckpointOptions):
    """speculative.draft_model: a distilled draft (checkpoint) or any model sharing the target's
    vocabulary (model: short name, HF dir or .gguf)."""

    SECTION: ClassVar[str] = "speculative.draft_model"
    model: str | None = None


def build(options: DraftModelOptions, ctx: BuildContext):
    drafter, dparams = _load(options, ctx)
    if ctx.spec.tree.kind == "dynamic":
        drafter = dataclasses.replace(drafter, **tree.dynamic_fields(ctx.spec.tree))
    return drafter, dparams


def _load(options: DraftModelOptions, ctx: BuildContext):
    if options.checkpoint is not None:
        return trained.load("draft_model", options, ctx)
    if options.model is None:
        raise JaxspecError(
            "speculative.method: draft_model needs speculative.draft_model.checkpoint (a distilled "
            "draft, e.g. checkpoints/smollm2-135m-draft) or speculative.draft_model.model (a model "
            "name or path)"
        )
    target = ctx.target
    draft = ctx.load_model(options.model, dtype=target.target.dtype, layout=target.layout)
    return draft_model_drafter(draft, target), draft.params


register_drafter(
    "draft_model", build, train="jaxspec.train.methods:Draft",
    options=DraftModelOptions, tree_kinds=("dynamic",),
    summary="a smaller model with the target's tokenizer, or the shipped distilled "
    "draft")
