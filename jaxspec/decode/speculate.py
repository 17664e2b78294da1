"""Prefill and the jitted decode loop: draft -> verify -> accept -> commit, per row, all on device.

One step is data flowing one way (docs/architecture.md):

    plan = plan_step(...)                       # adaptive: nodes per row, from past steps only
    proposal, dstate = drafter.propose(...)     # nodes: tokens, parents, q, num_nodes
      processors.propose                        #   extras' hook (the grammar masks the drafts)
    window = tree.build_window(...)             # tokens, positions, ancestor mask (T = 1 + N)
    p, hidden, window_kv = verify(...)          # one target forward; the cache is only read
      processors.adjust / read                  #   each entry's logits, before sampling
    path, n, next_token = acceptance.accept_tree(...)
    commit: the path's tokens, its k/v compacted into slots L-1..L-1+n, its hidden states
      processors.commit, drafter.commit         #   extras' carries, the drafter's state
    adaptive: controller.observe(plan, outcome) # what later plans learn from

The extras a request may ask for (penalties and logit_bias, a grammar, the logprob record) are
logits processors (decode/processors/): each a pure function of its own carry in the state,
applied by the step at those three places only; with none on the step is the one without them.

A chain is the tree with parents i - 1; plain decoding is the empty proposal (N = 0); fixed-γ
speculation is the trivial plan (no controller: every row drafts γ). With a controller
(`LoopSpec.adaptive`, jaxspec/decode/adaptive.py) a plan with no node anywhere runs the one-token
step instead (`plain_step`: plain decoding's own, the entry written in place).

Invariants (row b):
  tokens[b, :lengths[b]]   committed tokens (prompt + generated); the last was sampled from the
                           target but not yet run through it.
  cache.lengths[b]         = lengths[b] - 1: target k/v valid for slots below it.
  A step runs the target over [tokens[L-1], node_1..node_N] at positions L-1+depth, keeps a path
  of `n` nodes and one target token, and advances L by (n + 1) (fewer at EOS / max_new).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.decode import acceptance, adaptive, processors, sampling, tree
from jaxspec.decode.adaptive import loop as adaptive_loop
from jaxspec.decode.adaptive.loop import controller, plan_step
from jaxspec.decode.drafter import CommitContext, DraftContext, Proposal, traits
from jaxspec.decode.prefill import prefill, score_logits  # noqa: F401 (re-exported)
from jaxspec.decode.state import DecodeState, LoopSpec, place  # noqa: F401 (re-exported)
from jaxspec.decode.verify import (  # noqa: F401 (verify re-exported: calibration's)
    chain_in_place, commit_kv, verify, verify_any_width, writes_chains)
from jaxspec.models import attention_kernels, base, moe_shards
from jaxspec.decode.sampling import SamplingParams


def _emit(spec: LoopSpec, state: DecodeState, drafts, num_accepted, next_token):
    """Write the accepted path's tokens + one target token; truncate at EOS and max length."""
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


def empty_proposal(batch: int, vocab: int) -> Proposal:
    """Plain decoding: no nodes; the step verifies the last committed token alone."""
    z = jnp.zeros((batch, 0), jnp.int32)
    return Proposal(z, jnp.zeros((batch, 0, vocab), jnp.float32), jnp.zeros((batch,), jnp.int32), z)


class _StepOut(NamedTuple):
    """What one step leaves, per row (either branch of an adaptive step returns one). The target
    cache is written after the branches (commit_kv of `window_kv` along `path`), never inside
    one: XLA:CPU copies a whole cache that a lax.cond branch updates, every step."""

    tokens: jax.Array  # int32[B, W]
    lengths: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    cache: Any  # KVCache written in place (plain decoding's 1-entry verify), else None
    window_kv: Any  # the window's k/v (None when written in place)
    path: jax.Array  # int32[B, D+1] window entries kept
    drafter_state: Any
    num_nodes: jax.Array  # int32[B] nodes verified
    num_accepted: jax.Array  # int32[B]
    root_hidden: Any = None  # [nl, B, D] the root's target features (one-token steps only)
    depth: Any = None  # int32[B] the deepest node verified (a chain: num_nodes)
    extras: Any = None  # processors.Carries after the step (the processors on: their carries)


def decode_step(
    spec: LoopSpec, tparams, dparams, state: DecodeState, sp: SamplingParams,
    plan: adaptive.Plan | None = None,
):
    """One draft -> verify -> accept -> commit step on `plan` (with a controller and no plan:
    `plan_step`'s, computed here).

    With a controller, a step with nothing to verify -- the plan allows no node and the drafter
    has no `commit_plain` (else the loop runs `plain_step` instead), or prompt lookup found no
    match -- takes a one-token branch: the target over the last token alone, no acceptance over
    γ nodes; the drafter runs propose (0 nodes) + commit. That branch draws the very token the
    window step would (same uniform, `acceptance.root_token`): it is the same step, computed the
    cheap way, and its choice reads only the plan and the proposal's size. Both branches only
    read the target cache; its write (the accepted path) follows the branches."""
    if controller(spec) is not None and plan is None:
        plan = plan_step(spec, tparams, dparams, state, sp)
    k_draft, k_accept = _step_keys(state)
    lengths = None if plan is None else plan.lengths
    out = drafted_step(spec, tparams, dparams, state, sp, k_draft, k_accept, lengths)
    return _advance(spec, state, out, plan)


def plain_step(spec: LoopSpec, tparams, dparams, state: DecodeState, sp, plan: adaptive.Plan):
    """The step of a plan without nodes, as plain decoding runs it: the target over the last
    token, its entry written in place, no lax.cond anywhere (the step costs what a plain step
    costs). The drafter is left behind: a plain run's catch-up enters the step later
    (`decode`), a handed-off batch never reads its state again. -> (state, the root's target
    features [nl, B, D], None without taps)."""
    _, k_accept = _step_keys(state)
    out = _one_token_step(spec, tparams, dparams, state, sp, k_accept, None, in_place=True)
    return _advance(spec, state, out, plan), out.root_hidden


def _step_keys(state: DecodeState):
    keys = sampling.row_keys(state.key, state.row_ids, state.row_steps)
    return jax.vmap(jax.random.split, out_axes=1)(keys)  # (draft keys, acceptance keys)


def _advance(spec: LoopSpec, state: DecodeState, out: _StepOut, plan) -> DecodeState:
    """The state after a step: the target cache written (`commit_kv`), the metrics, and the
    outcome told to the controller (`Controller.observe`)."""
    active = ~state.done
    cache = state.cache if out.cache is None else out.cache
    cache = commit_kv(spec.target, cache, out.window_kv, out.path)
    pos_accepted = jnp.arange(max(spec.depth, 1))[None] < out.num_accepted[:, None]  # [B, max(D,1)]
    act = active.astype(jnp.int32)
    astate = state.adaptive
    if plan is not None:
        outcome = adaptive.Outcome(
            out.depth, out.num_accepted, active, state.lengths, jnp.max(state.row_steps)
        )
        astate = spec.adaptive.observe(astate, plan, outcome)
    state = dataclasses.replace(
        state,
        adaptive=astate,
        tokens=out.tokens,
        lengths=out.lengths,
        done=out.done,
        cache=cache.with_lengths(out.lengths - 1),
        drafter_state=out.drafter_state,
        row_steps=state.row_steps + act,
        num_draft=state.num_draft + out.num_nodes * act,
        num_accepted=state.num_accepted + out.num_accepted * act,
        accepted_per_position=state.accepted_per_position + pos_accepted * act[:, None],
        **(out.extras or {}),
    )
    return place(spec, state)


def _last_token(state: DecodeState) -> jax.Array:  # int32[B] the last committed token
    return jnp.take_along_axis(state.tokens, (state.lengths - 1)[:, None], axis=1)[:, 0]


def drafted_step(spec, tparams, dparams, state, sp, k_draft, k_accept, lengths) -> _StepOut:
    """Propose (cut to the plan's `lengths`, None: γ), then the window step -- or, with a
    controller, the one-token branch where no row has a node to verify."""
    b = state.lengths.shape[0]
    active = ~state.done
    dstate = state.drafter_state
    extras = processors.carries(state)
    ctl = controller(spec)
    if spec.drafter is None:
        proposal = empty_proposal(b, spec.target.vocab_size)
    else:
        ctx = DraftContext(tokens=state.tokens, lengths=state.lengths, active=active, max_nodes=lengths)
        proposal, dstate = spec.drafter.propose(
            dparams, base.bind(spec.target, tparams), dstate, ctx, spec.num_nodes, sp, k_draft
        )
        if lengths is not None:
            proposal = adaptive.cut(proposal, lengths)
        if extras:  # e.g. the grammar's: each node under its path's state (constrain/draft.py)
            proposal, extras = processors.propose(extras, proposal, k_draft, active)
    num_nodes = jnp.where(active, proposal.num_proposed, 0)
    window_step = lambda in_place=False: _window_step(
        spec, tparams, dparams, state, sp, k_accept, proposal, dstate, num_nodes, extras,
        in_place)
    if ctl is not None and (spec.drafter.variable_length or not traits(spec.drafter).commit_plain):
        # nothing to verify (no match, or c* = 0 for a drafter without commit_plain): plain step
        # the root's features are read by a plain run's catch-up only, never after this branch
        plain = lambda: _one_token_step(spec, tparams, dparams, state, sp, k_accept, dstate,
                                        extras=extras)._replace(root_hidden=None)
        return jax.lax.cond(jnp.max(num_nodes) == 0, plain, window_step)
    return window_step(in_place=True)


def _window_step(spec, tparams, dparams, state, sp, k_accept, proposal, dstate, num_nodes,
                 extras, in_place=False):
    """Draft -> window -> verify -> accept -> commit: verify the proposal's window (each
    entry's logits through the processors on, `extras`), accept a path, emit it, commit the
    processors and the drafter; the kept k/v are compacted after the step (`_advance`).
    in_place (outside any lax.cond only): a chain's window is written into the cache by the
    verify itself (`chain_in_place`, where `writes_chains`), nothing compacted after."""
    b = state.lengths.shape[0]
    parents = proposal.parents
    if parents is None:
        parents = tree.chain_parents(b, proposal.tokens.shape[1])
    window = tree.build_window(
        _last_token(state), state.cache.lengths, proposal.tokens, parents, num_nodes
    )
    aux = processors.prepare(extras, proposal.tokens, parents)
    if in_place and proposal.parents is None and writes_chains(spec, state.cache):  # a chain
        p, hidden, cache, window_kv, reads = chain_in_place(
            spec, tparams, state.cache, window, sp, extras, aux)
    else:
        p, hidden, cache, window_kv, reads = verify_any_width(
            spec, tparams, state.cache, window, sp, num_nodes, extras, aux
        )
    if sp.mode == "greedy":  # p: the target's argmax tokens
        path, num_acc, next_token = acceptance.accept_tree_greedy(
            proposal.tokens, parents, p, num_nodes, spec.depth + 1)
    else:
        path, num_acc, next_token = acceptance.accept_tree(
            proposal.tokens, parents, proposal.probs, p, num_nodes, k_accept, spec.depth + 1
        )
    path_tokens = jnp.take_along_axis(window.tokens, path, axis=1)  # [B, D+1]
    tokens, lengths, count, done = _emit(spec, state, path_tokens[:, 1:], num_acc, next_token)
    step = processors.Committed(tokens, state.lengths, lengths, count, path, path_tokens,
                                num_acc, next_token)
    extras = processors.commit(spec, sp, extras, aux, reads, step)
    cache = cache if window_kv is None else None  # read-only: _advance commits window_kv
    dstate = _commit_drafter(spec, tparams, dparams, dstate, step, hidden)
    verified = jnp.arange(window.depth.shape[1])[None] <= num_nodes[:, None]  # [B, T]
    depth = jnp.max(jnp.where(verified, window.depth, 0), axis=1)
    return _StepOut(
        tokens, lengths, done, cache, window_kv, path, dstate, num_nodes, num_acc, depth=depth,
        extras=extras,
    )


def _commit_drafter(spec, tparams, dparams, dstate, step: processors.Committed, hidden):
    """The drafter's state after the step's accepted path (`Drafter.commit`)."""
    if spec.drafter is None:
        return dstate
    ctx = CommitContext(
        tokens=step.tokens, lengths=step.lengths, prev_lengths=step.prev_lengths,
        window=step.path_tokens, num_accepted=step.num_accepted,
        hidden=None if hidden is None else tree.gather_path(hidden, step.path, axis=2),
        path=step.path,
    )
    return spec.drafter.commit(dparams, base.bind(spec.target, tparams), dstate, ctx)


def _one_token_step(spec, tparams, dparams, state, sp, k_accept, dstate, in_place=False,
                    extras=None) -> _StepOut:
    """A step without nodes: the target over the last token alone, no drafting. in_place:
    plain decoding's forward, the entry written into the cache (outside any lax.cond only:
    `plain_step`); else one entry of the window path (the cache is only read, `_advance`
    writes the entry after the branch). `dstate`: None when nothing was drafted (the drafter's
    state is left as it is), else the state after a 0-node propose (commit updates it, with the
    usual D+1-wide context: the root, then padding). The outcome carries the root's target
    features (`root_hidden`) for a plain run's catch-up."""
    b = state.lengths.shape[0]
    d, n = spec.depth, spec.num_nodes
    extras = processors.carries(state) if extras is None else extras
    m = 0 if in_place else n  # node slots, none real: a 1 + m window, 1 entry run
    window = tree.build_window(
        _last_token(state), state.cache.lengths, jnp.zeros((b, m), jnp.int32),
        tree.chain_parents(b, m), jnp.zeros((b,), jnp.int32),
    )
    none = jnp.zeros((b, 0), jnp.int32) if extras else None
    aux = processors.prepare(extras, none, none)  # the root's entry alone
    p, hidden, cache, window_kv, reads = verify(
        spec, tparams, state.cache, window, sp, 1, extras, aux)
    root_hidden = None if hidden is None else hidden[:, :, 0]  # [nl, B, D]
    if sp.mode == "greedy":  # p: the target's argmax tokens
        next_token = p[:, 0]
    else:
        next_token = acceptance.root_token(p[:, 0], k_accept, n)
    zeros = jnp.zeros((b,), jnp.int32)
    tokens, lengths, count, done = _emit(spec, state, jnp.zeros((b, d), jnp.int32), zeros, next_token)
    path = jnp.zeros((b, d + 1), jnp.int32)  # the root only (entries past it: masked garbage)
    root_path = None  # the root's token along the path, traced only where something reads it
    if extras or dstate is not None:
        root_path = jnp.take_along_axis(window.tokens, path, axis=1)
    step = processors.Committed(tokens, state.lengths, lengths, count, path, root_path, zeros,
                                next_token)
    extras = processors.commit(spec, sp, extras, aux, reads, step)
    if dstate is None:  # nothing drafted: the drafter catches up later (or never reads it)
        dstate = state.drafter_state
    else:
        dstate = _commit_drafter(spec, tparams, dparams, dstate, step, hidden)
    cache = cache if in_place else None
    return _StepOut(
        tokens, lengths, done, cache, window_kv, path, dstate, zeros, zeros, root_hidden, zeros,
        extras=extras,
    )


def decode(spec: LoopSpec, tparams, dparams, state: DecodeState, sp: SamplingParams, max_steps):
    """Run up to `max_steps` (an int32 array: no recompiles) steps, or until every row is done.
    Fixed γ (or plain decoding) is the trivial plan: every step drafts γ. With a controller the
    loop is adaptive speculation's (`adaptive_loop.decode`), on this module's steps."""

    def cond(carry):
        s, i = carry[:2]
        return (i < max_steps) & ~jnp.all(s.done)

    if controller(spec) is None:  # fixed γ (or plain decoding): the trivial plan
        body = lambda c: (decode_step(spec, tparams, dparams, place(spec, c[0]), sp), c[1] + 1)
        return jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))[0]
    steps = adaptive_loop.Steps(
        drafted=lambda s, plan: decode_step(spec, tparams, dparams, place(spec, s), sp, plan),
        plain=lambda s, plan: plain_step(spec, tparams, dparams, place(spec, s), sp, plan),
    )
    return adaptive_loop.decode(spec, tparams, dparams, state, sp, max_steps, cond, steps)


def _on_kernel_mesh(fn):
    """fn traced under its spec's mesh (attention_kernels.kernel_mesh): the attention kernels
    run per device on their own rows and kv heads (shard_map), not on gathered inputs."""

    @functools.wraps(fn)
    def traced(spec, *args, **kwargs):
        plan = spec.mesh
        with attention_kernels.kernel_mesh(None if plan is None else plan.mesh), \
                moe_shards.expert_placement(None if plan is None else plan.rules):
            return fn(spec, *args, **kwargs)

    return traced


prefill_jit = jax.jit(_on_kernel_mesh(prefill), static_argnames=("spec", "capacity", "chunk"))
decode_jit = jax.jit(_on_kernel_mesh(decode), static_argnames=("spec",),
                     donate_argnames=("state",))
