"""Step-cost calibration: how long one step's target forward takes for a batch of B rows
verifying a window of 1..γ+1 entries, and how long the drafter's work of one step takes with
0..γ nodes, on this machine, for this model and drafter. Adaptive speculation (controller.py)
divides expected tokens by these costs: what a window costs relative to a plain step depends on
the machine, the batch size and the context, so it is measured, not assumed.

    costs = loop_costs(model, spec, dparams, batch=8)  # {fill: [γ+1]} in plain steps: the
    # adaptive loop's whole step with 0..γ nodes (what the engine measures by default)
    costs = step_costs(model, batch=8, gamma=4)  # {fill: [γ+1]} the verify alone (1 entry: ~1)
    draft = draft_costs(model, drafter, dparams, batch=8, gamma=4)  # the drafter's work alone

`loop_costs` times speculate.decode itself through its public API -- the engine's LoopSpec with
its controller fixed to plan k nodes for every row (`adaptive.Controller.fixed`) -- against plain
decoding's loop (`measure_loop`); the verify and draft curves are the pieces, used where the
user gives a verify curve or a per-node draft cost instead. Calibration is an explicit step of
the engine (`Engine.calibrate`, announced by a progress line), never a side effect.

Each curve is measured at every context length in `fills` (committed tokens per row; default
FILLS, `speculative.adaptive.context_lengths` sets others, e.g. 1k, 4k, 8k, 32k): attention reads
each row's valid prefix, so a window's cost relative to a plain step grows with the context
(controller.py interpolates between the fills in the loop). The lengths are data: one compile per
width serves every fill up to max(FILLS) (the cache holds max(FILLS) + 64 slots); a longer fill
gets a cache of its own length (`capacity_for`), one compile each.

Verify: `speculate.verify` (the loop's own verify, same kernels) over a chain window on a cache
holding `fill` tokens, next to plain's in-place step (the reference: cost 1 at that fill, and
what speculate.decode's plain loop runs for a drafter with `commit_plain`). Width 0 ("w1"): one
entry through the window path, the 0-node step of a drafter without commit_plain (or of prompt
lookup without a match), inside a lax.cond branch that only reads the cache. Draft: the
drafter's `propose` with `max_nodes` = k (EAGLE's early-stopping loop then runs k drafter steps;
a drafter that ignores it drafts γ whatever k) followed by its `commit`; for k = 0 a drafter with
`commit_plain` runs only that, over a full plain run of `loop.MAX_PLAIN_RUN` roots,
divided by their number (decode's plain loop enters a run in one pass), one without runs propose
(0 nodes) + commit. On a state whose rows hold `fill` tokens, timed in the same rounds as a plain
1-entry verify. Each round times every name once after the reference (the plain step); a name's
cost is the median over rounds of its time / the reference's time in that round -- load on a
shared machine comes and goes between rounds, and a ratio taken within one round sees it on both
(a minimum per name would pair a quiet run of one with a quiet run of another). Measured once
per key and batch size and
kept as JSON under <jaxspec cache>/calibration/<key hash>.json; the key holds the model, dtype,
layout, device kind and kernel switches (draft: also the drafter's settings and its parameters'
shapes, and γ). A changed key is a different file, so a new model, drafter or device measures
afresh; `recalibrate=True` (the CLI's --recalibrate) measures again and overwrites, and so does
the engine when the plain step has drifted more than DRIFT from the cached one (`drifted`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import paths, progress
from jaxspec.decode import speculate, tree
from jaxspec.decode.adaptive import loop
from jaxspec.decode.drafter import CommitContext, DraftContext, traits
from jaxspec.models import base
from jaxspec.decode.sampling import SamplingParams

FILLS = (128, 1024)  # committed tokens per row the costs are measured at (prompt buckets)
REPS = 7  # timed rounds over all names; each keeps the median of its per-round ratio
DRIFT = 0.2  # a plain step this far (relative) from the cached one: the file is measured again

Measure = Callable[[Any, int, list[int]], list[float]]  # (model, batch, widths) -> seconds each


def capacity_for(fill: int) -> int:
    """Cache slots (before a measurement's margin) for rows holding `fill` tokens: max(FILLS)
    for every default fill (one compile serves them all), the fill itself past it."""
    return max(max(FILLS), int(fill))


def calibration_key(model, fills=None) -> dict[str, Any]:
    """What a measured cost depends on. A field that changes gives a different cache file."""
    return {
        "model": str(getattr(model, "name", "")),
        "source": str(getattr(model, "source_path", "") or ""),
        "config": repr(model.target),  # architecture, shapes and dtypes
        "layout": base.layout(model.target, model.params),
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "kernels": [
            os.environ.get("JAXSPEC_CPU_KERNELS", ""),
            os.environ.get("JAXSPEC_CPU_ATTENTION", ""),
        ],
        "fills": list(fills or FILLS),
        "estimate": "median-ratio",
    }


def draft_key(model, drafter, dparams, gamma: int, fills=None) -> dict[str, Any]:
    """The target's key plus what the drafter's step time depends on."""
    leaves = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(dparams)]
    shapes = hashlib.sha256(repr((jax.tree.structure(dparams), leaves)).encode()).hexdigest()
    # what k = 0 runs: a plain run's catch-up (per step of a full run), or propose + commit
    run = f"commit_plain/{loop.MAX_PLAIN_RUN}"
    k0 = run if _plain_commit_only(drafter) else "propose+commit"
    return calibration_key(model, fills) | {
        "drafter": repr(drafter), "dparams": shapes, "gamma": gamma, "k0": k0
    }


def loop_key(model, spec, dparams, fills=None) -> dict[str, Any]:
    """The drafter's key plus what the loop's step adds: the decode step timed whole, a plain
    run's length (what k = 0's catch-up is divided by) and the tree, if any."""
    run = loop.plain_run_length(spec) if traits(spec.drafter).commit_plain else 0
    return draft_key(model, spec.drafter, dparams, spec.num_speculative_tokens, fills) | {
        "step": f"decode x{loop_steps(spec)}, fixed plan", "nodes": spec.num_nodes,
        "k0": f"plain run of {run} + catch-up" if run else "decode_step, 0 nodes",
    }


def cache_file(model, key: dict | None = None) -> Path:
    key = json.dumps(key or calibration_key(model), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return paths.cache_root() / "calibration" / f"{digest}.json"


def _cached(key: dict, batch: int, names: list[str], measure, recalibrate: bool) -> dict:
    """Seconds for each name ("what@fill", one fill) at this batch size: from the cache file of
    `key`, or measured (and written) all together when any is missing or with recalibrate.
    measure(names) -> seconds each; its first name is the reference (the plain step), so the
    ratios to it come from one sitting."""
    path = cache_file(None, key)
    data = _read(path)
    if data.get("key") != key:
        data = {"key": key, "batches": {}}
    times = dict(data["batches"].get(str(batch), {}))
    if recalibrate or any(n not in times for n in names):  # every name of this fill in one
        fill = names[0].split("@")[-1]  # sitting (ratios to one reference); other fills stay
        times = {n: t for n, t in times.items() if n.split("@")[-1] != fill}
        with progress.step(f"calibrating step costs at batch {batch} (once; cached afterwards)"):
            times |= dict(zip(names, measure(names)))
    data["batches"][str(batch)] = times
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return times


def drifted(model, batch: int, *, measure: Measure | None = None, fills=None) -> bool:
    """Whether this machine's plain step at this batch size (FILLS[0]) now takes more than
    DRIFT away from what the cached verify calibration measured: load on a shared machine
    changes the cost ratios along with the plain step's time, so such a file is measured
    again. No cached file for this batch size: False (it will be measured anyway)."""
    first = (fills or FILLS)[0]
    now = lambda: (measure or measure_verify)(model, batch, [1], first)[0]
    return _drifted(calibration_key(model, fills), batch, f"1@{first}", now)


def loop_drifted(model, spec, dparams, batch: int, *, measure=None, fills=None) -> bool:
    """`drifted` for the file of `loop_costs`: its plain decode step re-timed."""
    first = (fills or FILLS)[0]
    now = lambda: (measure or measure_loop)(model, spec, dparams, batch, [], first)[0]
    return _drifted(loop_key(model, spec, dparams, fills), batch, f"plain@{first}", now)


def _drifted(key: dict, batch: int, ref: str, now: Callable[[], float]) -> bool:
    times = _read(cache_file(None, key))["batches"].get(str(batch), {})
    cached = times.get(ref) if isinstance(times, dict) else None
    return bool(cached) and abs(now() / cached - 1.0) > DRIFT


def step_costs(
    model, batch: int, gamma: int, *, recalibrate: bool = False, measure: Measure | None = None,
    fills=None,
) -> dict[int, list[float]]:
    """Relative verify cost for k = 0..γ draft nodes at this batch size, per fill: time(window
    of 1 + k entries) / time(the plain program's 1-entry forward, which writes the cache in
    place), rows holding `fill` tokens. k = 0 is the adaptive loop's own 1-entry step, one entry
    through the window path (width 0 below). Reads the cache; measures (and writes it) what it
    lacks, or all with recalibrate. measure(model, batch, widths, fill) -> seconds each (the
    first width is the reference)."""
    measure = measure or measure_verify
    widths = lambda todo: [0 if n.startswith("w1@") else int(n.split("@")[0]) for n in todo]
    out = {}
    for fill in fills or FILLS:
        names = [f"{n}@{fill}" for n in ["1", "w1", *map(str, range(2, gamma + 2))]]
        run = lambda todo, fill=fill: measure(model, batch, widths(todo), fill)
        times = _cached(calibration_key(model, fills), batch, names, run, recalibrate)
        out[fill] = [times[n] / times[names[0]] for n in names[1:]]
    return out


def draft_costs(
    model, drafter, dparams, batch: int, gamma: int, *, recalibrate: bool = False, measure=None,
    fills=None,
) -> dict[int, list[float]]:
    """The drafter's work per step with k = 0..γ nodes (propose + commit), in plain steps (a
    1-entry verify at this batch size and fill, timed in the same rounds), per fill.
    measure(model, drafter, dparams, batch, gamma, ks, fill) -> (plain seconds, [seconds per
    k]); default `measure_draft`."""
    measure = measure or measure_draft
    run = lambda ks, fill: measure(model, drafter, dparams, batch, gamma, ks, fill)
    key = draft_key(model, drafter, dparams, gamma, fills)
    return _curves(key, batch, gamma, run, recalibrate, fills)


def loop_costs(
    model, spec, dparams, batch: int, *, recalibrate: bool = False, measure=None, fills=None
) -> dict[int, list[float]]:
    """The adaptive loop's whole step with k = 0..γ nodes, in plain decoding's steps, per fill:
    what controller.py divides expected tokens by when the drafter's work is measured ("auto").
    Timed as speculate.decode runs it (`measure_loop`), not summed from a verify and a drafter
    timed apart (which misses what the loop adds around them and under-prices wide steps).
    measure(model, spec, dparams, batch, ks, fill) -> (plain seconds, [seconds per k]); default
    `measure_loop`."""
    measure = measure or measure_loop
    run = lambda ks, fill: measure(model, spec, dparams, batch, ks, fill)
    key = loop_key(model, spec, dparams, fills)
    return _curves(key, batch, spec.adaptive.gamma, run, recalibrate, fills)  # a tree: depth


def _curves(key: dict, batch: int, gamma: int, measure_fill, recalibrate: bool, fills=None):
    """{fill: [cost of k = 0..γ]} from the cache file of `key` (names "plain@fill", "k@fill"),
    measuring a fill's missing names by measure_fill(ks, fill) -> (plain seconds, [seconds])."""
    out = {}
    for fill in fills or FILLS:

        def run(todo, fill=fill):
            plain, each = measure_fill([int(n.split("@")[0]) for n in todo[1:]], fill)
            return [plain, *each]

        names = [f"plain@{fill}"] + [f"{k}@{fill}" for k in range(gamma + 1)]
        times = _cached(key, batch, names, run, recalibrate)
        out[fill] = [times[f"{k}@{fill}"] / times[names[0]] for k in range(gamma + 1)]
    return out


def _read(path: Path) -> dict:
    """The cache file's contents; {"batches": {}} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    good = isinstance(data, dict) and isinstance(data.get("batches"), dict)
    return data if good else {"batches": {}}


@functools.partial(jax.jit, static_argnames=("spec", "width"), donate_argnums=0)
def _verify(cache, tparams, window, sp, spec, width):
    """-> (cache, (probs, window k/v)). The cache is donated and handed back (`_carried`): a
    1-entry window writes it in place, as the decode loop does; undonated, every call would copy
    the whole cache first, inflating the plain reference and so lowering every ratio to it."""
    probs, _, cache, window_kv = speculate.verify(spec, tparams, cache, window, sp, width)
    return cache, (probs, window_kv)


@functools.partial(jax.jit, static_argnames=("spec", "width"))
def _verify_read(cache, tparams, window, sp, spec, width):
    """A window with nodes (or width 0's 2-entry window): the cache is only read, so every such
    width shares one cache, undonated (at batch 64 and 1088 slots a cache is ~3 GB)."""
    probs, _, _, window_kv = speculate.verify(spec, tparams, cache, window, sp, width)
    return probs, window_kv


def _carried(fn, state, *args, own: bool = False, held: list | None = None, **static):
    """A zero-argument run of fn(state, *args, **static) -> (state, out) that hands the state it
    returns to its next call (fn donates it), on a copy of `state` of its own unless `own` (the
    caller hands `state` over and never uses it again) or `held` (a one-item list holding the
    state, shared by runs whose fn hands it back as it came: one buffer for them all)."""
    if held is None:
        held = [state if own else jax.tree.map(jnp.copy, state)]

    def run():
        held[0], out = fn(held[0], *args, **static)
        return out, held[0]

    return run


def timed(runs: dict) -> dict:
    """{name: seconds} for {name: run}; the first name is the reference. Rounds of one run each,
    in order; a name's seconds = the median over rounds of its time / the reference's time in
    the same round, times the reference's fastest run (so ratios to the reference are the
    medians: load that comes and goes between rounds hits both sides of each ratio)."""
    names = list(runs)
    for run in runs.values():
        jax.block_until_ready(run())  # compile (and warm)
    rounds = []
    for _ in range(REPS):
        got = {}
        for n in names:
            t0 = time.perf_counter()
            jax.block_until_ready(runs[n]())
            got[n] = time.perf_counter() - t0
        rounds.append(got)
    ref = min(r[names[0]] for r in rounds)
    median = lambda xs: sorted(xs)[len(xs) // 2]
    return {n: ref * median([r[n] / r[names[0]] for r in rounds]) for n in names}


def measure_verify(model, batch: int, widths: list[int], fill: int = FILLS[0]) -> list[float]:
    """Seconds for one target forward over a chain window of each width at this batch size,
    rows holding `fill` tokens (width 1: plain's in-place forward; width 0: one entry through
    the window path, as the adaptive loop's 1-entry step runs it), by `timed` with the first
    width the reference."""
    target = model.target
    spec = speculate.LoopSpec(target=target, drafter=None, num_speculative_tokens=0, eos_ids=())
    # one capacity for every fill: the lengths are data, one compile
    cache = target.init_cache(model.params, batch, capacity_for(fill) + 64)
    cache = cache.with_lengths(jnp.full((batch,), fill, jnp.int32))
    sp = SamplingParams.make()
    runs = {}
    for width in widths:
        n = max(width - 1, 1 if width == 0 else 0)  # width 0: a 2-entry window, 1 verified
        window = tree.build_window(
            jnp.ones((batch,), jnp.int32),
            cache.lengths,
            draft_tokens(batch, n, target.vocab_size),
            tree.chain_parents(batch, n),
            jnp.full((batch,), n, jnp.int32),
        )
        if width == 1:  # plain's in-place step writes its (donated) copy
            runs[width] = _carried(_verify, cache, model.params, window, sp, spec=spec, width=1)
        else:
            runs[width] = functools.partial(
                _verify_read, cache, model.params, window, sp, spec=spec, width=max(width, 1)
            )
    best = timed(runs)
    return [best[w] for w in widths]


def draft_tokens(batch: int, n: int, vocab: int) -> jax.Array:  # int32[B, n]
    """Distinct tokens for the timed windows: an MoE target routes each entry on its own, so a
    window of one repeated token would wake the experts of one token and time too little."""
    ids = jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)
    return (1 + ids * 7919) % vocab


@functools.partial(jax.jit, static_argnames=("drafter", "gamma"), donate_argnums=0)
def _draft_step(dstate, dparams, tparams, ctx, sp, keys, commit_ctx, drafter, gamma):
    """-> (state, proposal's tokens): the state donated, updated in place as in the loop.
    tparams: bound to the target (models.base.Bound), as the loop hands them to drafters."""
    proposal, dstate = drafter.propose(dparams, tparams, dstate, ctx, gamma, sp, keys)
    return drafter.commit(dparams, tparams, dstate, commit_ctx), proposal.tokens


@functools.partial(jax.jit, static_argnames=("drafter",), donate_argnums=0)
def _plain_draft_step(dstate, dparams, tparams, commit_ctx, drafter):
    return traits(drafter).commit_plain(dparams, tparams, dstate, commit_ctx), None


def _plain_commit_only(drafter) -> bool:
    """What the drafter does in a plain step: commit_plain alone, or (prompt lookup: its match
    decides plain or drafted before the step, speculate.decode) propose + commit."""
    t = traits(drafter)
    return t.commit_plain is not None and not t.drafts_from_tokens


def measure_draft(
    model, drafter, dparams, batch: int, gamma: int, ks: list[int], fill: int = FILLS[0]
):
    """(seconds of a 1-entry verify, [seconds of the drafter's step with max_nodes = k for k in
    ks]): propose + commit (k = 0 with commit_plain: a full plain run's catch-up, per step) on
    a state whose rows hold `fill` tokens, by `timed` with the plain verify the reference."""
    target = model.target
    bound = base.bind(target, model.params)
    spec = speculate.LoopSpec(
        target=target, drafter=drafter, num_speculative_tokens=gamma, eos_ids=()
    )
    prompt = 16  # the drafter's init runs over a short prompt; the rows then claim `fill` tokens
    cap = capacity_for(fill) + 2 * gamma + 8  # every default fill in one capacity: one compile
    b = batch
    dstate = speculate.prefill_jit(
        spec, model.params, dparams, jnp.ones((b, prompt), jnp.int32),
        jnp.full((b,), prompt, jnp.int32), jnp.full((b,), cap, jnp.int32),
        SamplingParams.make(), jax.random.key(0), jnp.arange(b, dtype=jnp.int32), capacity=cap,
    ).drafter_state  # the target's cache it also fills: dropped at once (~3 GB at batch 64)
    tokens = (jnp.arange(cap, dtype=jnp.int32)[None] % 7 + 1) * jnp.ones((b, 1), jnp.int32)
    lengths = jnp.full((b,), fill, jnp.int32)
    d1 = max(spec.depth, 1) + 1
    nh = len(drafter.hidden_layers)
    dt = base.compute_dtype(target)
    hidden = jnp.zeros((nh, b, d1, target.hidden_size), dt) if nh else None
    commit_ctx = CommitContext(
        tokens=tokens, lengths=lengths + 1, prev_lengths=lengths, window=tokens[:, :d1],
        num_accepted=jnp.zeros((b,), jnp.int32), hidden=hidden,
        path=jnp.broadcast_to(jnp.arange(d1, dtype=jnp.int32), (b, d1)),
    )
    sp = SamplingParams.make()
    keys = jax.random.split(jax.random.key(1), b)
    runs = {}
    m = loop.MAX_PLAIN_RUN  # a full plain run: M roots, entered in one pass
    run_hidden = jnp.zeros((nh, b, m, target.hidden_size), dt) if nh else None
    run_ctx = commit_ctx._replace(
        lengths=lengths + m, window=tokens[:, :m], hidden=run_hidden,
        path=jnp.zeros((b, m), jnp.int32),
    )
    for k in ks:
        if k == 0 and _plain_commit_only(drafter):  # the adaptive loop's plain run
            runs[k] = _carried(
                _plain_draft_step, dstate, dparams, bound, run_ctx, drafter=drafter
            )
            continue
        ctx = DraftContext(tokens, lengths, jnp.ones((b,), bool), jnp.full((b,), k, jnp.int32))
        runs[k] = _carried(
            _draft_step, dstate, dparams, bound, ctx, sp, keys, commit_ctx,
            drafter=drafter, gamma=gamma,
        )
    verify_cache = target.init_cache(model.params, b, capacity_for(fill) + 64)
    verify_cache = verify_cache.with_lengths(lengths + 0)  # its own buffer: the cache is donated
    window = tree.build_window(
        jnp.ones((b,), jnp.int32), lengths, jnp.ones((b, 0), jnp.int32), tree.chain_parents(b, 0),
        jnp.zeros((b,), jnp.int32),
    )
    plain_spec = dataclasses.replace(spec, drafter=None, num_speculative_tokens=0)
    runs["plain"] = _carried(
        _verify, verify_cache, model.params, window, sp, own=True, spec=plain_spec, width=1
    )
    best = timed({"plain": runs.pop("plain")} | runs)
    per_step = lambda k: best[k] / m if k == 0 and _plain_commit_only(drafter) else best[k]
    return best["plain"], [per_step(k) for k in ks]


def loop_steps(spec) -> int:
    """Decode steps per timed call of the loop: one plain run (`loop.plain_run_length`),
    so a one-token step's share of the drafter's catch-up is in its time."""
    if spec.adaptive is None:
        return loop.MAX_PLAIN_RUN
    return loop.plain_run_length(spec)


@functools.partial(jax.jit, static_argnames=("spec", "steps"), donate_argnums=0)
def _decode_from(state, tparams, dparams, sp, spec, steps):
    """-> (state, None): `steps` steps of speculate.decode on a donated state (written in place,
    as in decode), handed back at the committed lengths it came with, so every call starts at
    the same fill over the same tokens."""
    out = speculate.decode(spec, tparams, dparams, state, sp, jnp.asarray(steps, jnp.int32))
    back = dataclasses.replace(
        out, lengths=state.lengths, done=state.done,
        cache=out.cache.with_lengths(state.cache.lengths),
    )
    return back, None


def _loop_state(model, spec, dparams, batch: int, fill: int, capacity: int):
    """A decode state whose rows hold `fill` committed tokens of a period-7 pattern (prompt
    lookup always has a match; the drafter's init ran over the first 16), nothing done, room
    for every call's steps."""
    b, prompt = batch, 16
    pattern = (jnp.arange(capacity, dtype=jnp.int32)[None] % 7 + 1) * jnp.ones((b, 1), jnp.int32)
    state = speculate.prefill_jit(
        spec, model.params, dparams, pattern[:, :prompt], jnp.full((b,), prompt, jnp.int32),
        jnp.full((b,), capacity, jnp.int32), SamplingParams.make(), jax.random.key(0),
        jnp.arange(b, dtype=jnp.int32), capacity=capacity,
    )
    lengths = jnp.full((b,), fill, jnp.int32)
    state = dataclasses.replace(
        state, tokens=pattern, lengths=lengths, max_lengths=jnp.full((b,), capacity, jnp.int32),
        done=jnp.zeros((b,), bool), cache=state.cache.with_lengths(lengths - 1),
    )
    if spec.adaptive is not None:  # the controller's state (its costs do not matter here)
        costs = [1.0] * (spec.adaptive.gamma + 1)
        state = dataclasses.replace(state, adaptive=spec.adaptive.init(b, costs))
    return state


def measure_loop(model, spec, dparams, batch: int, ks: list[int], fill: int = FILLS[0]):
    """(seconds of plain decoding's step, [seconds of the adaptive loop's step with k nodes for
    k in ks]) at this batch size, rows starting at `fill` committed tokens, by `timed` with
    plain's the reference. Each is speculate.decode itself, `loop_steps` steps a call, its
    controller fixed to plan k nodes for every row (`Controller(fixed=k)`): k >= 1 drafts k
    nodes, verifies a (k+1)-entry window, accepts and commits; k = 0 runs what the loop runs on
    a plan without nodes (a drafter with `commit_plain`: a plain run and its catch-up; else the
    one-token branch). spec: the engine's adaptive LoopSpec (its mesh and end tokens unused)."""
    spec = dataclasses.replace(spec, eos_ids=(), mesh=None)
    plain_spec = speculate.LoopSpec(
        target=model.target, drafter=None, num_speculative_tokens=0, eos_ids=()
    )
    steps = loop_steps(spec)
    cap = capacity_for(fill) + steps * (spec.depth + 1) + 64  # default fills: one compile
    sp, b = SamplingParams.make(), batch
    runs = {"plain": _carried(
        _decode_from, _loop_state(model, plain_spec, None, b, fill, cap), model.params, None, sp,
        own=True, spec=plain_spec, steps=steps,
    )}
    held = [_loop_state(model, spec, dparams, b, fill, cap)] if ks else []  # one state for
    for k in ks:  # every k (each call hands it back at `fill`): a single cache (~3 GB at 64)
        fixed = dataclasses.replace(spec, adaptive=dataclasses.replace(spec.adaptive, fixed=k))
        runs[k] = _carried(
            _decode_from, None, model.params, dparams, sp, held=held, spec=fixed, steps=steps
        )
    best = timed(runs)
    return best["plain"] / steps, [best[k] / steps for k in ks]
