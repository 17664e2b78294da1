"""Prefill and the jitted decode loop: draft -> verify -> accept -> commit, per row, all on device.

Plain decoding is the same loop with no drafter (γ = 0): one target forward per token.

Invariants (row b):
  tokens[b, :lengths[b]]   committed tokens (prompt + generated); the last was sampled from the
                           target but not yet run through it.
  cache.lengths[b]         = lengths[b] - 1: target k/v valid for slots below it.
  A step runs the target over [tokens[L-1], draft_1..draft_G] at positions L-1..L-1+G, keeps
  `n` drafts and one target token, and advances L by (n + 1) (fewer at EOS / max_new).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import acceptance, sampling
from jaxspec.cache import KVCache, init_cache
from jaxspec.drafters.base import CommitContext, DraftContext, Drafter
from jaxspec.models import llama
from jaxspec.sampling import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    tokens: jax.Array  # int32[B, W]
    lengths: jax.Array  # int32[B] committed tokens
    max_lengths: jax.Array  # int32[B] prompt length + max_new_tokens
    done: jax.Array  # bool[B]
    cache: KVCache  # target cache; lengths == self.lengths - 1
    drafter_state: Any
    key: jax.Array  # base PRNG key
    row_ids: jax.Array  # int32[B] request ids: a row's randomness depends on its id only
    row_steps: jax.Array  # int32[B] target forwards this row took part in (also its key counter)
    # metrics, per row
    num_draft: jax.Array  # int32[B] draft tokens proposed
    num_accepted: jax.Array  # int32[B] draft tokens accepted
    accepted_per_position: jax.Array  # int32[B, max(G, 1)] steps where draft position i was accepted


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Everything static about a decode program (hashable: part of the jit cache key)."""

    cfg: llama.ModelConfig
    drafter: Drafter | None
    num_speculative_tokens: int  # γ (the static maximum); 0 for plain decoding
    eos_ids: tuple[int, ...]
    # Verify windows the loop may pick from (each compiled once); a variable-length drafter whose
    # rows all proposed fewer tokens verifies the smallest window that fits.
    windows: tuple[int, ...] = ()
    # A sharding.MeshPlan (or None): the state is constrained to it at prefill and every step,
    # so params, cache, tokens and drafter state stay sharded through the loop.
    mesh: Any = None

    def verify_windows(self) -> tuple[int, ...]:
        g1 = self.num_speculative_tokens + 1
        if self.drafter is None or not self.drafter.variable_length:
            return (g1,)
        return tuple(sorted({w for w in self.windows if w < g1} | {1, g1}))


def _place(spec: LoopSpec, state: DecodeState) -> DecodeState:
    """Constrain the state to the mesh plan: target rules, the drafter state by the drafter's."""
    if spec.mesh is None:
        return state
    b = state.lengths.shape[0]
    dstate = spec.mesh.constrain(state.drafter_state, b, drafter=True)
    state = spec.mesh.constrain(dataclasses.replace(state, drafter_state=None), b)
    return dataclasses.replace(state, drafter_state=dstate)


def _row_keys(state_key, row_ids, row_steps):  # [B] keys
    return jax.vmap(lambda r, s: jax.random.fold_in(jax.random.fold_in(state_key, r), s))(
        row_ids, row_steps
    )


def prefill(
    spec: LoopSpec,
    tparams,
    dparams,
    prompt_tokens: jax.Array,  # int32[B, P] right-padded
    prompt_lengths: jax.Array,  # int32[B]
    max_new_tokens: jax.Array,  # int32[B]
    sp: SamplingParams,
    key: jax.Array,
    row_ids: jax.Array,  # int32[B]
    capacity: int,
) -> DecodeState:
    """Run the prompt through the target, sample the first token, set up the drafter."""
    cfg = spec.cfg
    b, p = prompt_tokens.shape
    g = max(spec.num_speculative_tokens, 1)
    hidden_layers = spec.drafter.hidden_layers if spec.drafter is not None else ()
    stacked = isinstance(tparams["layers"], dict)
    cache = init_cache(
        cfg.num_layers, b, capacity, cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype, stacked
    )
    if spec.mesh is not None:  # allocated sharded, not allocated whole and then split
        cache = spec.mesh.constrain(cache, b)
    out = llama.forward(tparams, prompt_tokens, cache, cfg, hidden_layers)
    last = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    probs = sampling.logits_to_probs(llama.lm_head(tparams, last), sp)  # [B, V]
    row_steps = jnp.zeros((b,), jnp.int32)
    first = sampling.sample_rows(_row_keys(key, row_ids, row_steps), probs)  # [B]
    tokens = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompt_tokens)
    tokens = tokens.at[jnp.arange(b), prompt_lengths].set(first)
    done = jnp.isin(first, jnp.asarray(spec.eos_ids, jnp.int32)) | (max_new_tokens <= 1)
    dstate = None
    if spec.drafter is not None:
        dstate = spec.drafter.init(
            dparams, tparams, prompt_tokens, prompt_lengths, out.layer_hidden, capacity
        )
    zeros = jnp.zeros((b,), jnp.int32)
    state = DecodeState(
        tokens=tokens,
        lengths=prompt_lengths + 1,
        max_lengths=prompt_lengths + max_new_tokens,
        done=done,
        cache=out.cache.with_lengths(prompt_lengths),
        drafter_state=dstate,
        key=key,
        row_ids=row_ids,
        row_steps=row_steps + 1,
        num_draft=zeros,
        num_accepted=zeros,
        accepted_per_position=jnp.zeros((b, g), jnp.int32),
    )
    return _place(spec, state)


def _verify(spec: LoopSpec, tparams, window: jax.Array, cache: KVCache, sp, width: int, write=True):
    """Target over the first `width` window tokens; outputs padded back to G+1 positions.

    write=False (inside the width switch): the cache is only read; the window's k/v come back
    padded to G+1 positions for `llama.write_window` (slots past `width` get zeros, which lie past
    every row's new length and are never read)."""
    g1 = window.shape[1]
    hidden_layers = spec.drafter.hidden_layers if spec.drafter is not None else ()
    out = llama.forward(tparams, window[:, :width], cache, spec.cfg, hidden_layers, write)
    probs = sampling.logits_to_probs(llama.lm_head(tparams, out.hidden), sp)  # [B, width, V]
    pad = [(0, 0), (0, g1 - width), (0, 0)]
    probs = jnp.pad(probs, pad)
    layer_hidden = out.layer_hidden
    if layer_hidden is not None:
        layer_hidden = jnp.pad(layer_hidden, [(0, 0), *pad])
    if write:
        return probs, layer_hidden, out.cache
    pad_kv = lambda w: jnp.pad(w, [(0, 0)] * (w.ndim - 3) + [(0, g1 - width), (0, 0), (0, 0)])
    return probs, layer_hidden, jax.tree.map(pad_kv, out.window_kv)


def _emit(spec: LoopSpec, state: DecodeState, drafts, num_accepted, next_token):
    """Write the accepted drafts + one target token; truncate at EOS and max length."""
    b, g = drafts.shape
    idx = jnp.arange(g + 1)
    emitted = jnp.concatenate([drafts, next_token[:, None]], axis=1)  # [B, G+1]
    emitted = jnp.where(idx[None] < num_accepted[:, None], emitted, next_token[:, None])
    emitted = jnp.where(idx[None] <= num_accepted[:, None], emitted, 0)
    valid = idx[None] <= num_accepted[:, None]  # [B, G+1]
    is_eos = jnp.isin(emitted, jnp.asarray(spec.eos_ids, jnp.int32)) & valid
    hit_eos = is_eos.any(axis=1)
    count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, num_accepted + 1)
    count = jnp.minimum(count, state.max_lengths - state.lengths)
    count = jnp.where(state.done, 0, count).astype(jnp.int32)
    write_pos = state.lengths[:, None] + idx[None]  # [B, G+1]
    write_pos = jnp.where(idx[None] < count[:, None], write_pos, state.tokens.shape[1])  # dropped
    tokens = state.tokens.at[jnp.arange(b)[:, None], write_pos].set(emitted, mode="drop")
    lengths = state.lengths + count
    done = state.done | hit_eos | (lengths >= state.max_lengths)
    return tokens, lengths, count, done


def decode_step(spec: LoopSpec, tparams, dparams, state: DecodeState, sp: SamplingParams):
    g = spec.num_speculative_tokens
    b = state.lengths.shape[0]
    active = ~state.done
    keys = _row_keys(state.key, state.row_ids, state.row_steps)
    k_draft, k_accept = jax.vmap(jax.random.split, out_axes=1)(keys)
    last = jnp.take_along_axis(state.tokens, (state.lengths - 1)[:, None], axis=1)  # [B, 1]
    dstate = state.drafter_state
    if g == 0:
        drafts = jnp.zeros((b, 0), jnp.int32)
        num_proposed = jnp.zeros((b,), jnp.int32)
        out = llama.forward(tparams, last, state.cache, spec.cfg)
        p = sampling.logits_to_probs(llama.lm_head(tparams, out.hidden[:, 0]), sp)  # [B, V]
        next_token = sampling.sample_rows(k_accept, p)
        num_acc = jnp.zeros((b,), jnp.int32)
        cache, hidden = out.cache, None
    else:
        ctx = DraftContext(tokens=state.tokens, lengths=state.lengths, active=active)
        proposal, dstate = spec.drafter.propose(dparams, tparams, dstate, ctx, g, sp, k_draft)
        drafts = proposal.tokens
        num_proposed = jnp.where(active, proposal.num_proposed, 0)
        window = jnp.concatenate([last, drafts], axis=1)  # [B, G+1]
        widths = spec.verify_windows()
        if len(widths) == 1:
            p, hidden, cache = _verify(spec, tparams, window, state.cache, sp, widths[0])
        else:
            need = jnp.max(num_proposed) + 1
            branch = jnp.sum(jnp.asarray(widths)[:-1] < need)
            p, hidden, window_kv = jax.lax.switch(  # branches read the cache; written after
                branch,
                [lambda c, w=w: _verify(spec, tparams, window, c, sp, w, write=False) for w in widths],
                state.cache,
            )
            if spec.mesh is not None:  # k/v laid out as the cache (else GSPMD may gather it)
                window_kv = spec.mesh.constrain_window_kv(window_kv)
            cache = llama.write_window(state.cache, window_kv, state.cache.positions(g + 1))
        num_acc, next_token = acceptance.accept(drafts, proposal.probs, p, num_proposed, k_accept)
    tokens, lengths, count, done = _emit(spec, state, drafts, num_acc, next_token)
    if g > 0:
        commit_ctx = CommitContext(
            tokens=tokens,
            lengths=lengths,
            prev_lengths=state.lengths,
            window=window,
            num_accepted=num_acc,
            hidden=hidden,
        )
        dstate = spec.drafter.commit(dparams, tparams, dstate, commit_ctx)
    pos_accepted = jnp.arange(max(g, 1))[None] < num_acc[:, None]  # [B, max(G,1)]
    act = active.astype(jnp.int32)
    state = dataclasses.replace(
        state,
        tokens=tokens,
        lengths=lengths,
        done=done,
        cache=cache.with_lengths(lengths - 1),
        drafter_state=dstate,
        row_steps=state.row_steps + act,
        num_draft=state.num_draft + num_proposed * act,
        num_accepted=state.num_accepted + num_acc * act,
        accepted_per_position=state.accepted_per_position + pos_accepted * act[:, None],
    )
    return _place(spec, state)


def decode(spec: LoopSpec, tparams, dparams, state: DecodeState, sp: SamplingParams, max_steps):
    """Run up to `max_steps` (an int32 array: no recompiles) steps, or until every row is done."""

    def cond(carry):
        s, i = carry
        return (i < max_steps) & ~jnp.all(s.done)

    def body(carry):
        s, i = carry
        return decode_step(spec, tparams, dparams, _place(spec, s), sp), i + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))
    return state


prefill_jit = jax.jit(prefill, static_argnames=("spec", "capacity"))
decode_jit = jax.jit(decode, static_argnames=("spec",), donate_argnames=("state",))
