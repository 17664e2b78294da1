"""Adaptive speculation's side of the decode loop: the plan of each step (`plan_step`, asked of
the controller, jaxspec/decode/adaptive/controller.py), plain runs with the drafter left behind and its
catch-up in one pass, the hand-off of a lockstep batch to plain decoding's step, and the loop
that strings them together. The fixed-plan loop (speculate.py) passes its step functions in
(`Steps`), so this module sits below it and never imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.decode.adaptive.controller import (
    PER_REQUEST_MAX_BATCH, Controller, Plan, proposal_depth,
)
from jaxspec.decode.drafter import CommitContext, DraftContext, traits
from jaxspec.decode.state import DecodeState, LoopSpec
from jaxspec.models import base


class Steps(NamedTuple):
    """The fixed-plan loop's steps, as the adaptive loop runs them (mesh placement included)."""

    drafted: Callable  # (state, plan) -> state: decode_step on the plan
    plain: Callable  # (state, plan) -> (state, root features | None): plain decoding's step


def controller(spec: LoopSpec) -> Controller | None:
    return spec.adaptive if spec.drafter is not None else None


def may_hand_off(spec: LoopSpec, batch: int) -> bool:
    """A lockstep batch (B > PER_REQUEST_MAX_BATCH) may be handed off to plain
    decoding's step; not prompt lookup, whose one-token steps carry no bookkeeping."""
    lockstep = batch > PER_REQUEST_MAX_BATCH
    ctl = controller(spec)
    return (lockstep and ctl.settings.handoff_after > 0
            and not traits(spec.drafter).drafts_from_tokens)


def plan_step(spec: LoopSpec, tparams, dparams, state: DecodeState, sp) -> Plan | None:
    """The controller's plan for the next step of `state`, from past statistics and committed
    history only (None without a controller: every row drafts γ). Prompt lookup
    (`drafts_from_tokens`: its proposal is a function of the committed tokens, no draw): a row
    can use at most the nodes its match has (`useful`; a row without one gains nothing from a
    window its batch mates' matches would fill, and still pays for it), and no match anywhere
    leaves nothing to verify."""
    ctl = controller(spec)
    if ctl is None:
        return None
    room = state.max_lengths - state.lengths  # tokens each row may still emit
    useful = jnp.clip(room - 1, 0, ctl.gamma).astype(jnp.int32)
    b = state.lengths.shape[0]
    if traits(spec.drafter).drafts_from_tokens:
        full = jnp.full((b,), spec.num_nodes, jnp.int32)
        ctx = DraftContext(state.tokens, state.lengths, ~state.done, full)
        keys = jax.random.split(jax.random.key(0), b)  # unused: no draws
        p, _ = spec.drafter.propose(
            dparams, base.bind(spec.target, tparams), state.drafter_state, ctx, spec.num_nodes,
            sp, keys,
        )
        useful = jnp.minimum(useful, proposal_depth(p))  # <= its match's depth
    return ctl.plan(
        state.adaptive, state.row_steps, ~state.done, room, state.lengths, useful,
        may_hand_off=may_hand_off(spec, b),
    )


class PlainRun(NamedTuple):
    """The one-token steps since the drafter was last current (a drafter with `commit_plain`):
    the drafter is left behind during the run and enters all of it in one pass afterwards
    (`_catch_up`), so a plain step costs what the plain program's does. Rows advance one token
    per step while active, so slot i holds each row's step i."""

    hidden: jax.Array | None  # [nl, B, M, D] target features of each step's root; None: no taps
    start: jax.Array  # int32[B] committed lengths when the run began
    count: jax.Array  # int32[] steps recorded (<= M)


MAX_PLAIN_RUN = 16  # plain steps a run may hold (the drafter's catch-up window)


def plain_run_length(spec: LoopSpec) -> int:
    """M: steps a plain run holds before the drafter catches up -- one probe interval (a probe
    ends a run anyway), at most MAX_PLAIN_RUN."""
    every = spec.adaptive.settings.probe_every
    return every if 0 < every <= MAX_PLAIN_RUN else MAX_PLAIN_RUN


def new_plain_run(spec: LoopSpec, state: DecodeState) -> PlainRun:
    b, nl = state.lengths.shape[0], len(spec.drafter.hidden_layers)
    hidden = None
    if nl:
        shape = (nl, b, plain_run_length(spec), spec.target.hidden_size)
        hidden = jnp.zeros(shape, base.compute_dtype(spec.target))
    return PlainRun(hidden, state.lengths, jnp.zeros((), jnp.int32))


def record(run: PlainRun, root_hidden) -> PlainRun:
    """The run with one more step: its root's features [nl, B, D] into slot `count`."""
    hidden = run.hidden
    if hidden is not None:
        hidden = jax.lax.dynamic_update_index_in_dim(
            hidden, root_hidden.astype(hidden.dtype), run.count, axis=2
        )
    return run._replace(hidden=hidden, count=run.count + 1)


def catch_up(spec: LoopSpec, tparams, dparams, state: DecodeState, run: PlainRun) -> DecodeState:
    """The drafter's state after the run's steps, entered in one pass (its commit_plain over the
    run's roots): what drafting nothing and committing each step's root would have left."""
    b = state.lengths.shape[0]
    m = plain_run_length(spec)
    slots = jnp.clip(run.start[:, None] - 1 + jnp.arange(m), 0, state.tokens.shape[1] - 1)
    ctx = CommitContext(
        tokens=state.tokens,
        lengths=state.lengths,
        prev_lengths=run.start,
        window=jnp.take_along_axis(state.tokens, slots, axis=1),  # [B, M] the run's roots
        num_accepted=jnp.zeros((b,), jnp.int32),
        hidden=run.hidden,
        path=jnp.zeros((b, m), jnp.int32),
    )
    tv = base.bind(spec.target, tparams)
    dstate = traits(spec.drafter).commit_plain(dparams, tv, state.drafter_state, ctx)
    return dataclasses.replace(state, drafter_state=dstate)


def decode(spec: LoopSpec, tparams, dparams, state: DecodeState, sp, max_steps, cond,
           steps: Steps) -> DecodeState:
    """The loop with a controller (speculate.decode's, which passes its step functions): it
    carries the next step's plan (`plan_step`: past steps only), computed once after each step,
    and each step runs in the loop its plan selects. A drafter with `commit_plain`: while the
    plan has no node, a plain run (`steps.plain`, no lax.cond around the cache, which XLA:CPU
    would copy whole every step; the drafter catches up after the run, at most
    `plain_run_length` steps), then drafted steps while it has. Once a plan hands the batch off
    (lockstep batches, `Controller.hands_off`), a last loop runs the rest on `steps.plain`, the
    drafter untouched; the hand-off is kept in the state (`handoff_at`), so a later call
    (streaming's chunks) resumes there. cond: (carry) -> whether the loop goes on."""
    plan_for = lambda s: plan_step(spec, tparams, dparams, s, sp)

    def drafted(carry):  # (state, steps, the state's plan)
        s, i, plan = carry
        s = steps.drafted(s, plan)
        return s, i + 1, plan_for(s)

    carry = (state, jnp.zeros((), jnp.int32), plan_for(state))
    handoff = may_hand_off(spec, state.lengths.shape[0])
    go_on = (lambda c: cond(c) & ~c[2].hand_off) if handoff else cond
    if traits(spec.drafter).commit_plain is None:
        carry = jax.lax.while_loop(go_on, drafted, carry)
    else:
        m = plain_run_length(spec)

        def plain(c):
            (s, i, plan), run = c
            s, root_hidden = steps.plain(s, plan)
            return (s, i + 1, plan_for(s)), record(run, root_hidden)

        plain_cond = lambda c: go_on(c[0]) & ~c[0][2].drafts() & (c[1].count < m)
        drafted_cond = lambda c: go_on(c) & c[2].drafts()

        def segment(c):  # a plain run while no node is planned, the catch-up, drafted steps
            c, run = jax.lax.while_loop(plain_cond, plain, (c, new_plain_run(spec, c[0])))
            c = (catch_up(spec, tparams, dparams, c[0], run), *c[1:])
            return jax.lax.while_loop(drafted_cond, drafted, c)

        carry = jax.lax.while_loop(go_on, segment, carry)
    if handoff:  # runs only where the loops above stopped at the hand-off

        def handed_off(c):
            s, i, plan = c
            return steps.plain(s, plan)[0], i + 1, plan

        carry = jax.lax.while_loop(cond, handed_off, carry)
    return carry[0]
