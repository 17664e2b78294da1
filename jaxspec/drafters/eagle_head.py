"""jaxspec's own EAGLE-style head (method `eagle`): one decoder layer over the target's own
features, fused from three taps as EAGLE-3 does (the published EAGLE-3 layout: drafters/eagle3.py).

Network (params `dparams`, torch `[out, in]` layout like `jaxspec.models.llama`):
  fuse     [D, 3D]   low/mid/high target features (each RMS-normalised) -> one feature f
  in_proj  [D, 2D]   [rms(embed(token)), rms(feature)] -> the layer input
  layer    one Llama decoder layer (attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down)
  norm     [D]       final RMS norm before the head
  head     [N, D]    the target's frozen LM-head rows for the draft vocabulary (not shipped:
                     gathered from the target at load time)
  d2t      int32[N]  draft index -> target token id (the N most frequent target tokens)

Sequence pairing: drafter position j takes (feature f_{j-1}, token x_j) and its output h_j predicts
x_{j+1}; position 0 takes a zero feature. While drafting, step 1 at position L-1 uses the target
feature f_{L-2}; step i > 1 feeds the drafter's own output h as the next feature (EAGLE-3's
"training-time test" trains exactly this). The drafter keeps a one-layer KV cache: step 1 writes
a real entry; later steps write provisional entries that commit() overwrites with real ones from
the verify window's target features (positions past the accepted count are masked garbage, the
same masked rollback as the target cache).

Lossless over the full vocabulary: draft probs come from `logits_to_probs` over the N draft logits
and are scattered to the target vocabulary (zeros elsewhere); the draft token is sampled from
exactly that distribution.

Dynamic tree (EAGLE-2, `tree_top_k` > 0; built by `jaxspec.decode.tree.grow`, shared with draft_model):
depth 1 holds top-k children of the root; at each further depth the top-k nodes of the newest
level by score are expanded, each into top-k children; the best `tree_budget` nodes form the
tree. Children are the top-k tokens (one-hot q, the default) or sampled from the draft
distribution, i.i.d. or without replacement (`tree_children`; lossless, see jaxspec.decode.tree).
Expanded nodes write provisional k/v past the committed prefix (slot L + level * k + i, see
init's scratch) and attend the prefix plus their own ancestors; commit() writes the real entries
of the accepted path as for a chain.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.decode import sampling, tree
from jaxspec.drafters import trained
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal
from jaxspec.drafters.draft_vocab import scatter_to_target
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.errors import JaxspecError
from jaxspec.models import attention, base, decoder, llama


def rms(x, eps=1e-6):  # weightless RMS normalisation in f32
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def fuse(dparams, feats):  # [nl, ..., D] target features -> [..., D]
    x = jnp.concatenate([rms(f) for f in feats], axis=-1)
    return decoder.linear(x, dparams["fuse"])


def layer_input(dparams, emb, feature):  # embedded tokens [..., D], [..., D] -> [..., D]
    return decoder.linear(jnp.concatenate([rms(emb), rms(feature)], axis=-1), dparams["in_proj"])


def _qkv(cfg, lp, x, positions, inv_freq):
    b, t, _ = x.shape
    y = llama.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = decoder.linear(y, lp["wq"]).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = decoder.linear(y, lp["wk"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = decoder.linear(y, lp["wv"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def apply_rope(x, positions, inv_freq):
    return llama.apply_rope(x, positions, inv_freq)


def _finish(cfg, lp, x, attn):
    x = x + decoder.linear(attn, lp["wo"])
    y = llama.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    y = jax.nn.silu(decoder.linear(y, lp["w_gate"])) * decoder.linear(y, lp["w_up"])
    return x + decoder.linear(y, lp["w_down"])


def head_logits(dparams, h):  # [..., D] -> f32[..., N] draft-vocabulary logits
    return decoder.linear(rms(h) * dparams["norm"], dparams["head"]).astype(jnp.float32)


MATMUL_KEYS = ("fuse", "in_proj", "head")  # + every 2-D weight of "layer"


def pack_for_cpu(dparams):
    """The drafter's matmul weights as CPU-kernel panels (`kernels.PackedWeight`, read by
    `decoder.linear`): a tree level runs the layer over top_k nodes at once, where XLA:CPU's
    multi-row matmul first copies each weight (the target's packed layout avoids the same)."""
    layer = {k: kernels.pack(w) if w.ndim == 2 else w for k, w in dparams["layer"].items()}
    packed = {k: kernels.pack(dparams[k]) for k in MATMUL_KEYS}
    return {**dparams, **packed, "layer": layer}


class EagleState(NamedTuple):
    k: jax.Array  # [B, K, S, H] the drafter layer's cache
    v: jax.Array  # [B, K, S, H]
    feature: jax.Array  # [B, D] fused target feature f_{L-2} for the next proposal


def train_layer(cfg, lp, x, positions, mask, k_ctx=None, v_ctx=None, ctx_mask=None):
    """Training form: x [B, T, D] at positions [B, T]; attends its own keys under `mask`
    [B, T, T] plus optional extra keys `k_ctx/v_ctx` [B, S, K, H] under `ctx_mask` [B, T, S].
    Returns (h, k, v) with this call's keys/values [B, T, K, H] (for later TTT steps)."""
    inv_freq = llama.rope_frequencies(cfg)
    q, k, v = _qkv(cfg, lp, x, positions, inv_freq)
    ks, vs, m = k, v, mask
    if k_ctx is not None:
        ks = jnp.concatenate([k_ctx, k], axis=1)
        vs = jnp.concatenate([v_ctx, v], axis=1)
        m = jnp.concatenate([ctx_mask, mask], axis=2)
    heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # [B, S, K, H] -> [B, K, S, H]
    attn = llama.masked_attention(q, heads_first(ks), heads_first(vs), m)
    return _finish(cfg, lp, x, attn), k, v


@dataclasses.dataclass(frozen=True)
class EagleDrafter(tree.DynamicTreeDrafter):
    cfg: llama.ModelConfig  # the drafter layer's shape (num_layers=1), dims of the target
    target_vocab: int
    hidden_layers: tuple[int, ...] = ()  # the fused target layers (methods.Eagle.taps)
    name: str = "eagle"
    variable_length: bool = False  # True with min_confidence > 0
    # Dynamic draft length: keep drafting while the drafter's estimate that its draft is accepted
    # (see _gate) stays >= min_confidence; 0: always γ drafts.
    min_confidence: float = 0.0
    # tree_top_k, tree_levels, tree_budget, tree_children: tree.DynamicTreeDrafter

    def target_needs(self, dparams) -> tuple[str, ...]:
        return ("embed",)  # its layer input is the target's token embedding

    def _step(self, dparams, x, k_cache, v_cache, positions, kernel: bool):
        """x [B, T, D] at positions [B, T] = start + arange(T): write the window's k/v there,
        then attend the cache's slots below start and the window causally -- the target's
        layer, valid slots only (`attention.attend`; a mask over the whole capacity, as before,
        made XLA copy the drafter's cache 16 times a step at batch 1).
        kernel: the CPU prefix-attention kernel (when the target uses CPU kernels)."""
        cfg = self.cfg
        inv_freq = llama.rope_frequencies(cfg)
        q, k, v = _qkv(cfg, dparams["layer"], x, positions, inv_freq)
        k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
        start = positions[:, 0]
        k_cache = decoder.write_kv(k_cache, k, positions)
        v_cache = decoder.write_kv(v_cache, v, positions)
        if kernel and decoder.attention_kernel_on(q):
            attn = kernels.prefix_attention(q, k_cache, v_cache, k, v, start, cfg.head_dim**-0.5)
            attn = attn.reshape(*q.shape[:2], -1)
        else:
            attn = attention.attend(q, k_cache, v_cache, k, v, start)
        return _finish(cfg, dparams["layer"], x, attn.astype(x.dtype)), k_cache, v_cache

    def _run(self, dparams, tparams, tokens, features, k_cache, v_cache, start):
        """Real (step-0) entries: tokens [B, T] with features [B, T, D] at start[B] + arange(T)."""
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = layer_input(dparams, tparams.embed(tokens), features).astype(self.cfg.compute_dtype)
        kernel = tparams.uses_cpu_kernels
        return self._step(dparams, x, k_cache, v_cache, positions, kernel)

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        c = self.cfg
        b, p = prompt_tokens.shape
        scratch = self.tree_levels * self.tree_top_k if self.tree_top_k else 0
        shape = (b, c.num_kv_heads, capacity + scratch, c.head_dim)
        k = jnp.zeros(shape, c.compute_dtype)
        v = jnp.zeros(shape, c.compute_dtype)
        f = fuse(dparams, prompt_hidden)  # [B, P, D]; f_t follows token t
        prev = jnp.pad(f, [(0, 0), (1, 0), (0, 0)])[:, :p]  # position j gets f_{j-1}, zeros at 0
        _, k, v = self._run(dparams, tparams, prompt_tokens, prev, k, v, jnp.zeros((b,), jnp.int32))
        last = jnp.take_along_axis(f, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
        return EagleState(k, v, last)

    def _sample(self, dparams, logits, sp, keys):
        """Draft-vocab logits [B, N] -> (draft index [B], full-vocab probs [B, V])."""
        probs_n = sampling.logits_to_probs(logits, sp)  # [B, N]
        idx = sampling.sample_rows(keys, probs_n)
        return idx, scatter_to_target(probs_n, dparams["d2t"], self.target_vocab)

    def _probs(self, dparams, h, sp, keys):
        """h [B, D] -> (target token [B], full-vocab probs [B, V]) sampled from the draft vocab."""
        idx, probs = self._sample(dparams, head_logits(dparams, h), sp, keys)
        return dparams["d2t"][idx], probs

    def _enter_last(self, dparams, tparams, state: EagleState, ctx: DraftContext):
        """The last committed token (with the target feature before it) into the drafter's cache
        at lengths - 1 -> (h [B, 1, D], k, v): the first step of every proposal."""
        last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)  # [B, 1]
        return self._run(dparams, tparams, last, state.feature[:, None], state.k, state.v, ctx.lengths - 1)

    def advance(self, dparams, tparams, state: EagleState, ctx: DraftContext) -> EagleState:
        """The state `propose` would leave for the committed text, drafting nothing (a step whose
        drafts come from elsewhere, see drafters/prompt_lookup_first.py)."""
        _, k, v = self._enter_last(dparams, tparams, state, ctx)
        return state._replace(k=k, v=v)

    def propose(self, dparams, tparams, state: EagleState, ctx: DraftContext, num_tokens, sp, keys):
        if self.tree_top_k:
            return self._propose_tree(dparams, tparams, state, ctx, sp, keys)
        b = ctx.lengths.shape[0]
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, G]
        h, k, v = self._enter_last(dparams, tparams, state, ctx)
        if self.min_confidence > 0 or ctx.max_nodes is not None:  # gated or adaptive length
            return self._propose_until_unsure(
                dparams, tparams, state, ctx, num_tokens, sp, step_keys, (k, v, h)
            )
        token, probs = self._probs(dparams, h[:, 0], sp, step_keys[:, 0])

        def step(carry, key_col):
            k, v, token, h, pos = carry
            emb = tparams.embed(token[:, None])
            x = layer_input(dparams, emb, h).astype(self.cfg.compute_dtype)
            h, k, v = self._step(dparams, x, k, v, pos[:, None], tparams.uses_cpu_kernels)
            nxt, p = self._probs(dparams, h[:, 0], sp, key_col)
            return (k, v, nxt, h, pos + 1), (nxt, p)

        carry = (k, v, token, h, ctx.lengths)
        (k, v, _, _, _), (tokens, all_probs) = jax.lax.scan(
            step, carry, jnp.swapaxes(step_keys[:, 1:], 0, 1)
        )
        drafts = jnp.concatenate([token[:, None], jnp.swapaxes(tokens, 0, 1)], axis=1)  # [B, G]
        q = jnp.concatenate([probs[:, None], jnp.swapaxes(all_probs, 0, 1)], axis=1)  # [B, G, V]
        num = jnp.full((b,), num_tokens, jnp.int32)
        return Proposal(drafts, q, num), state._replace(k=k, v=v)

    def _draft_token(self, dparams, h, sp, keys):
        """h [B, D] -> (token [B], full-vocab probs [B, V], top [B], own [B]): top and own are the
        drafter's untempered probabilities of its likeliest token and of the token it drew."""
        logits = head_logits(dparams, h)  # [B, N]
        idx, probs = self._sample(dparams, logits, sp, keys)
        soft = jax.nn.softmax(logits, axis=-1)
        own = jnp.take_along_axis(soft, idx[:, None], axis=1)[:, 0]
        return dparams["d2t"][idx], probs, jnp.max(soft, axis=-1), own

    @staticmethod
    def _gate(confidence, top, own):
        """Whether to propose the token just drawn may depend on what came before it (confidence:
        product of `own` over the earlier drafts) and on its distribution (top), never on the
        draw itself: conditioning a draft on its own value would bias the acceptance rule."""
        del own
        return confidence * top

    def _propose_until_unsure(self, dparams, tparams, state, ctx, num_tokens, sp, step_keys, h0):
        """Draft while some row's gate (confidence that the draft so far is accepted, times the
        next token's top probability) is >= min_confidence; a row proposes its leading gated
        drafts only. Stops early (fewer drafter steps) once no row passes: the loop then
        verifies a shorter window."""
        k, v, h = h0
        token, probs, top, own = self._draft_token(dparams, h[:, 0], sp, step_keys[:, 0])
        b, vocab = probs.shape
        # ctx.max_nodes (adaptive speculation): fixed before this step's draws, like the gate
        limit = jnp.full((b,), num_tokens, jnp.int32) if ctx.max_nodes is None else ctx.max_nodes
        alive = (self._gate(jnp.ones_like(top), top, own) >= self.min_confidence) & (limit > 0)
        drafts = jnp.zeros((b, num_tokens), jnp.int32).at[:, 0].set(token)
        q = jnp.zeros((b, num_tokens, vocab), jnp.float32).at[:, 0].set(probs)
        kernel = tparams.uses_cpu_kernels

        def cond(c):  # some row still drafting and wanting draft i: a row past its limit
            i, alive = c[0], c[6]  # never pays for another drafter step
            return (i < num_tokens) & jnp.any(alive & (i < limit))

        def body(c):
            i, k, v, token, h, conf, alive, num, drafts, q = c
            emb = tparams.embed(token[:, None])
            x = layer_input(dparams, emb, h).astype(self.cfg.compute_dtype)
            h, k, v = self._step(dparams, x, k, v, (ctx.lengths + i - 1)[:, None], kernel)
            key_col = jax.lax.dynamic_index_in_dim(step_keys, i, axis=1, keepdims=False)
            nxt, p, top, own = self._draft_token(dparams, h[:, 0], sp, key_col)
            alive = alive & (self._gate(conf, top, own) >= self.min_confidence) & (i < limit)
            drafts = jax.lax.dynamic_update_index_in_dim(drafts, nxt, i, axis=1)
            q = jax.lax.dynamic_update_index_in_dim(q, p, i, axis=1)
            return i + 1, k, v, nxt, h, conf * own, alive, num + alive.astype(jnp.int32), drafts, q

        c0 = (jnp.int32(1), k, v, token, h, own, alive, alive.astype(jnp.int32), drafts, q)
        _, k, v, _, _, _, _, num, drafts, q = jax.lax.while_loop(cond, body, c0)
        drafts = jnp.where(jnp.arange(num_tokens)[None] < num[:, None], drafts, 0)
        return Proposal(drafts, q, num), state._replace(k=k, v=v)

    def _propose_tree(self, dparams, tparams, state: EagleState, ctx: DraftContext, sp, keys):
        """EAGLE-2 dynamic tree (jaxspec.decode.tree.grow): a frontier node takes its parent's h as its
        feature, writes provisional k/v at scratch slot L + level * k + i and attends the
        committed prefix plus its ancestors' scratch slots."""
        k, levels = self.tree_top_k, self.tree_levels
        cfg = self.cfg
        h, kc, vc = self._enter_last(dparams, tparams, state, ctx)  # h [B, 1, D]
        b = h.shape[0]
        m_slots = levels * k
        inv_freq = llama.rope_frequencies(cfg)
        slots = jnp.arange(kc.shape[2])
        d2t = dparams["d2t"]

        def expand(carry, level, front: tree.Frontier):
            kc, vc, prev_h, prev_anc = carry  # prev_*: the previous frontier's h [B, K, D], slots
            if level == 0:
                front_h = jnp.broadcast_to(h, (b, k, h.shape[-1]))
                front_anc = jnp.zeros((b, k, m_slots), bool)
            else:
                front_h = jnp.take_along_axis(prev_h, front.parent[..., None], axis=1)
                front_anc = jnp.take_along_axis(prev_anc, front.parent[..., None], axis=1)
            emb = tparams.embed(d2t[front.ids])
            x = layer_input(dparams, emb, front_h).astype(cfg.compute_dtype)
            pos = jnp.broadcast_to((ctx.lengths + level)[:, None], (b, k))  # depth level + 1
            own = level * k + jnp.arange(k)  # scratch slot of each frontier node
            anc = front_anc | jax.nn.one_hot(own, m_slots, dtype=bool)[None]  # [B, K, M]
            q, kk, vv = _qkv(cfg, dparams["layer"], x, pos, inv_freq)
            write_at = (ctx.lengths[:, None] + own[None]).astype(jnp.int32)  # [B, K]
            kc = decoder.write_kv(kc, kk, write_at)
            vc = decoder.write_kv(vc, vv, write_at)
            rel = slots[None, None, :] - ctx.lengths[:, None, None]  # [B, 1, S]
            in_scratch = (rel >= 0) & (rel < m_slots)
            mask = (rel < 0) | (in_scratch & jnp.take_along_axis(
                anc, jnp.clip(rel, 0, m_slots - 1).astype(jnp.int32).repeat(k, axis=1), axis=2
            ))  # [B, K, S]
            attn = llama.masked_attention(q, kc, vc, mask)
            h_new = _finish(cfg, dparams["layer"], x, attn)  # [B, K, D]
            return (kc, vc, h_new, anc), head_logits(dparams, h_new)

        carry = (kc, vc, jnp.zeros((b, k, h.shape[-1]), h.dtype), jnp.zeros((b, k, m_slots), bool))
        grown, (kc, vc, _, _) = tree.grow(
            expand, carry, head_logits(dparams, h[:, 0]), sp, keys, top_k=k, levels=levels,
            budget=self.tree_budget, children=self.tree_children,
        )
        probs = scatter_to_target(grown.q, d2t, self.target_vocab)
        num = jnp.full((b,), self.tree_budget, jnp.int32)
        return Proposal(d2t[grown.ids], probs, num, grown.parents), state._replace(k=kc, v=vc)

    def commit(self, dparams, tparams, state: EagleState, ctx: CommitContext):
        """Real entries for window positions 1..G (x_L.. with target features f_{L-1}..); entries
        past the accepted count are garbage beyond the committed length, overwritten later."""
        f = fuse(dparams, ctx.hidden)  # [B, G+1, D]; f[:, i] follows window token i
        _, k, v = self._run(
            dparams, tparams, ctx.window[:, 1:], f[:, :-1], state.k, state.v, ctx.prev_lengths
        )
        feature = jnp.take_along_axis(f, ctx.num_accepted[:, None, None], axis=1)[:, 0]
        return EagleState(k, v, feature)

    def commit_plain(self, dparams, tparams, state: EagleState, ctx: CommitContext):
        """A plain run (adaptive speculation: n = lengths - prev_lengths steps that each verified
        the root alone, n <= M): its roots ctx.window [B, M] (the tokens at prev_lengths - 1..)
        with their target features ctx.hidden [nl, B, M, D], in one pass -- the entries
        propose's first step would have written for each root (root i with the feature before
        it: the state's for i = 0, root i-1's after), and the last root's feature for the next
        proposal. What propose + commit leave for n steps that accepted nothing, at one layer
        over M tokens; entries past the n-th are garbage beyond the committed length."""
        f = fuse(dparams, ctx.hidden)  # [B, M, D]; f[:, i] follows root i
        before = jnp.concatenate([state.feature[:, None].astype(f.dtype), f[:, :-1]], axis=1)
        _, k, v = self._run(
            dparams, tparams, ctx.window, before, state.k, state.v, ctx.prev_lengths - 1
        )
        n = ctx.lengths - ctx.prev_lengths  # [B] steps in the run
        last = jnp.take_along_axis(f, jnp.clip(n - 1, 0, None)[:, None, None], axis=1)[:, 0]
        return EagleState(k, v, jnp.where((n > 0)[:, None], last, state.feature))


# ---- method "eagle" ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleOptions(trained.Eagle3LayoutOptions):
    """speculative.eagle: jaxspec's EAGLE checkpoints, or published EAGLE-3 / speculators ones."""

    SECTION: ClassVar[str] = "speculative.eagle"
    # dynamic draft length: stop drafting once the drafter's confidence that its draft is accepted
    # (product of its probabilities of the tokens drafted so far, times the next one's top
    # probability) falls below this; 0: always γ drafts. jaxspec's own EAGLE checkpoints only.
    draft_confidence: float = 0.0

    def _validate(self):
        if not 0.0 <= self.draft_confidence < 1.0:
            self._fail("draft_confidence", "use a number in [0, 1); 0 drafts γ tokens always")

    def check(self, spec):
        if self.draft_confidence and spec.tree.kind != "chain":
            raise JaxspecError(
                f"speculative.tree.kind={spec.tree.kind} does not combine with "
                "speculative.eagle.draft_confidence: set it to 0 or use speculative.tree.kind=chain"
            )


def in_dtype(drafter: EagleDrafter, dparams, dtype: str):
    """The drafter's decoder layer in `dtype` (the target's): its weights cast once here and its
    cache and activations in that dtype, so a bfloat16 target's drafter attends on the same
    kernels as the target (a float32 cache keeps the exact XLA path). The fusion, input
    projection and head stay as trained (float32: features and logits keep their precision)."""
    cfg = dataclasses.replace(drafter.cfg, dtype=dtype)
    want = cfg.compute_dtype

    def cast(w):  # float arrays only (a packed CPU-kernel weight stays as it is)
        floating = isinstance(w, jax.Array) and jnp.issubdtype(w.dtype, jnp.floating)
        return w.astype(want) if floating and w.dtype != want else w

    layer = {k: cast(w) for k, w in dparams["layer"].items()}
    return dataclasses.replace(drafter, cfg=cfg), {**dparams, "layer": layer}


def build(options: EagleOptions, ctx: BuildContext):
    drafter, dparams = trained.load("eagle", options, ctx)
    own = isinstance(drafter, EagleDrafter)  # not a published EAGLE-3 head
    if own:  # trained in float32; runs in the target's dtype
        drafter, dparams = in_dtype(drafter, dparams, ctx.target.target.dtype)
    for wanted, setting in ((options.draft_confidence > 0, "eagle.draft_confidence"),
                            (ctx.spec.tree.kind == "dynamic", "tree.kind=dynamic")):
        if wanted and not own:
            raise JaxspecError(
                f"speculative.{setting} works with jaxspec's own EAGLE checkpoints only, not with "
                f"the {drafter.name} head in {options.checkpoint}: drop it"
            )
    if options.draft_confidence > 0:
        drafter = dataclasses.replace(
            drafter, min_confidence=options.draft_confidence, variable_length=True
        )
    if ctx.spec.tree.kind == "dynamic":  # its levels are multi-row matmuls: CPU panel kernel
        drafter = dataclasses.replace(drafter, **tree.dynamic_fields(ctx.spec.tree))
        if kernels.available() and base.uses_cpu_kernels(ctx.target.target, ctx.target.params):
            dparams = pack_for_cpu(dparams)
    return drafter, dparams


register_drafter(
    "eagle", build, train="jaxspec.train.methods:Eagle", formats=("jaxspec", "eagle3", "speculators"),
    options=EagleOptions, tree_kinds=("dynamic",), summary=(
    "jaxspec's own EAGLE-style head over low/mid/high target features, 8192-token draft "
    "vocabulary"))
