"""Adaptive speculation (jaxspec/decode/adaptive/: controller.py, calibration.py) on tiny random models:
greedy identity, the exact law with lengths that adapt (and a length that peeks at the current
draw failing it), one program for every length, the calibration cache, the switch-off."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiles import counting_lowerings
from distribution import FAIL_P, PASS_P, chi_square_pvalue, counts_of, exact_law
from tiny import eagle_like, motif_prompts, tiny_model

from jaxspec.decode import acceptance, adaptive, speculate, tree
from jaxspec.decode.adaptive import calibration
from jaxspec.decode.adaptive import loop as adaptive_loop
from jaxspec.decode.adaptive.host import AdaptiveHost
from jaxspec import hlo
from jaxspec.config import AdaptiveConfig, load_config
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal
from jaxspec.drafters.draft_model import ModelDrafter
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.models import base, llama
from jaxspec.decode.sampling import SamplingParams

# compile as the accelerator compilers fuse (tests/test_accelerator_path.py)
ACCEL_LIKE = {"xla_cpu_experimental_ynn_fusion_type": ""}
COSTS = [1.0, 1.2, 1.4, 1.6]  # γ = 3: a verify curve where 2 nodes pay best at the prior


def Options(**settings) -> AdaptiveConfig:  # noqa: N802 -- the settings, switched on
    return AdaptiveConfig(enabled=True, **settings)


def controller(gamma: int, **settings) -> adaptive.Controller:
    return adaptive.Controller(gamma, AdaptiveConfig(**settings))


@pytest.fixture(scope="module")
def prompts():
    return motif_prompts((5, 17, 9, 30, 12, 20, 7, 25))


@pytest.mark.parametrize("method,batch_size", [("ngram", 1), ("ngram", 8), ("eagle", 8)])
def test_adaptive_greedy_is_token_identical(target, prompts, method, batch_size):
    plain = Engine(target).generate(prompts, max_new_tokens=24, batch_size=batch_size)
    drafter, dparams = (
        eagle_like(target)
        if method == "eagle"
        else (NgramDrafter(64, min_ngram=1, max_ngram=3), None)
    )
    opts = Options(step_costs=COSTS, draft_cost=0.0, probe_every=4, decay=0.5)
    engine = Engine(target, drafter, dparams, num_speculative_tokens=3, adaptive=opts)
    results = engine.generate(prompts, max_new_tokens=24, batch_size=batch_size)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    hist = np.sum([r.metrics["adaptive_gamma_hist"] for r in results], axis=0)
    assert hist.sum() == sum(r.metrics["num_steps"] for r in results)
    assert hist[0] > 0 and hist[1:].sum() > 0  # plain and drafted steps
    if batch_size > 1 and method == "eagle":  # lengths beyond {plain, cap}: the cap follows
        assert (hist > 0).sum() >= 3  # the estimates, a row near its end verifies only what
        # it can commit (prompt lookup prices each row at its match: here a window pays only
        # where several rows match, and then 1 node)
    if batch_size == 1:  # lengths are data: other requests reuse the one program (at batch 1
        # only the cost curve can switch off: every request runs the adaptive program)
        assert not any(r.metrics["adaptive_switched_off"] for r in results)
        with counting_lowerings() as lowered:
            again = engine.generate(prompts[4:], max_new_tokens=24, batch_size=1)  # new requests
        assert lowered("decode") == 0
        assert [r.token_ids for r in again] == [r.token_ids for r in plain[4:]]


def tree_drafter(target, method):
    """A static prompt-lookup tree (3 branches x 3) or EAGLE's dynamic tree (top 2, 3 levels,
    5 nodes), depth 3, and its params."""
    if method == "ngram":
        return NgramDrafter(64, min_ngram=1, max_ngram=3, branches=3, depth=3), None
    drafter, dparams = eagle_like(target)
    return dataclasses.replace(drafter, tree_top_k=2, tree_levels=3, tree_budget=5), dparams


@pytest.mark.parametrize("method,batch_size", [("ngram", 1), ("eagle", 8)])
def test_adaptive_trees_are_token_identical(target, prompts, method, batch_size):
    """Adaptive depth on trees: each step's tree cut to the depth the controller picks (its
    levels are the lengths), greedy output == plain, several depths used, one program."""
    plain = Engine(target).generate(prompts, max_new_tokens=24, batch_size=batch_size)
    drafter, dparams = tree_drafter(target, method)
    opts = Options(step_costs=[1.0, 1.1, 1.25, 1.45], draft_cost=0.0, probe_every=4, decay=0.5)
    engine = Engine(target, drafter, dparams, num_speculative_tokens=3, adaptive=opts)
    assert engine.spec.num_nodes > engine.spec.adaptive.gamma == 3  # nodes > depth: a tree
    results = engine.generate(prompts, max_new_tokens=24, batch_size=batch_size)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    hist = np.sum([r.metrics["adaptive_gamma_hist"] for r in results], axis=0)
    assert len(hist) == 4 and (hist > 0).sum() >= 2 and hist[1:].sum() > 0
    assert sum(r.metrics["num_accepted_tokens"] for r in results) > 0


def test_a_tree_is_cut_to_whole_levels():
    """adaptive.cut on a tree: nodes deeper than the row's depth become padding (parent -2:
    never tried) and the window ends at the last node kept; padding stays padding."""
    parents = jnp.asarray([[-1, -1, 0, 1, 2], [-1, -2, 0, -2, 2]], jnp.int32)  # level by level
    proposal = Proposal(jnp.ones((2, 5), jnp.int32), jnp.zeros((2, 5, 8)),
                        jnp.asarray([5, 5], jnp.int32), parents)
    np.testing.assert_array_equal(adaptive.node_depths(proposal), [[1, 1, 2, 2, 3], [1, 0, 2, 0, 3]])
    for cap, num in ((0, [0, 0]), (1, [2, 1]), (2, [4, 3]), (3, [5, 5])):
        cut = adaptive.cut(proposal, jnp.full((2,), cap, jnp.int32))
        np.testing.assert_array_equal(cut.num_proposed, num)
        depth = np.asarray(adaptive.node_depths(proposal))
        want = np.where((depth > 0) & (depth <= cap), np.asarray(parents), -2)
        np.testing.assert_array_equal(cut.parents, want)
    # prompt lookup's tree is laid out level by level: a cut to depth c keeps a prefix
    ngram = NgramDrafter(16, min_ngram=1, max_ngram=1, branches=2, depth=3)
    tokens = jnp.asarray([[5, 1, 2, 3, 5, 6, 7, 8, 5, 0, 0, 0]], jnp.int32)  # 5 -> (6 7 8), (1 2 3)
    ctx = DraftContext(tokens, jnp.asarray([9]), jnp.ones((1,), bool), None)
    tree_prop, _ = ngram.propose(None, None, (), ctx, 6, SamplingParams.make(), None)
    np.testing.assert_array_equal(tree_prop.tokens, [[6, 1, 7, 2, 8, 3]])
    np.testing.assert_array_equal(tree_prop.parents, [[-1, -1, 0, 1, 2, 3]])
    np.testing.assert_array_equal(adaptive.proposal_depth(tree_prop), [3])
    np.testing.assert_array_equal(adaptive.cut(tree_prop, jnp.asarray([2])).num_proposed, [4])


@pytest.mark.parametrize("method,batch_size", [("eagle", 1), ("ngram", 2)])
def test_in_loop_plain_steps_are_plain_decoding(target, prompts, method, batch_size):
    """A cost curve where no node pays at the prior (0.6) but some would at 0.8: c* = 0 until a
    probe (every 3rd step) raises a row's estimate, so most steps run the plain loop (plain
    decoding's in-place step; the drafter's state kept by commit_plain, nothing proposed) --
    greedy-identical to the plain program, one program for all, and that program copies no
    cache-sized buffer (session 8's lax.cond around the plain step copied EAGLE's drafter cache
    4 times a step: the counter below sees those)."""
    plain = Engine(target).generate(prompts[:4], max_new_tokens=20, batch_size=batch_size)
    drafter, dparams = (
        eagle_like(target) if method == "eagle" else (NgramDrafter(64, min_ngram=1), None)
    )
    opts = Options(step_costs=[1.0, 1.7, 2.2, 2.5], draft_cost=0.0, probe_every=3, decay=0.5,
                   explore=0.0)  # plain until a probe
    engine = Engine(target, drafter, dparams, num_speculative_tokens=3, adaptive=opts)
    assert engine.spec_for(1) is engine.spec  # at 0.8 one node pays: 1.8 / 1.7 (a lockstep
    engine.spec_for = lambda *_: engine.spec  # batch starts from the prior: plain) -- no
    # host switch-off here
    results = engine.generate(prompts[:4], max_new_tokens=20, batch_size=batch_size)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    hist = np.sum([r.metrics["adaptive_gamma_hist"] for r in results], axis=0)
    assert hist[0] >= 20 and hist[1:].sum() > 0  # plain-branch steps, and the probes
    if method != "eagle":  # one compile suffices: both run decode's plain loop
        return
    assert cache_copies(engine, target, dparams, batch_size) == ((), ())
    # sampling: the plain branch draws the token the 0-node window step would (same uniform)
    p = jax.nn.softmax(jax.random.normal(jax.random.key(3), (5, 64)))
    keys = jax.random.split(jax.random.key(4), 5)
    empty = jnp.zeros((5, 3), jnp.int32)
    _, n, via_window = acceptance.accept_tree(
        empty, tree.chain_parents(5, 3), jnp.zeros((5, 3, 64)),
        jnp.concatenate([p[:, None], jnp.zeros((5, 3, 64))], axis=1), jnp.zeros((5,), jnp.int32),
        keys, 4,
    )
    np.testing.assert_array_equal(acceptance.root_token(p, keys, 3), via_window)
    assert not n.any()


def cache_copies(engine, target, dparams, b) -> tuple[tuple, tuple]:
    """(copies, zero-fills) of cache-sized buffers (the target's or EAGLE's) in the engine's
    compiled decode program at batch b, compiled as accelerators fuse."""
    cap, c = 200, target.cfg  # capacity 200: no other dim of the model
    args = (target.params, dparams, jnp.zeros((b, 32), jnp.int32), jnp.full((b,), 5, jnp.int32),
            jnp.full((b,), 8, jnp.int32), SamplingParams.make(), jax.random.key(0),
            jnp.arange(b, dtype=jnp.int32))
    state = jax.eval_shape(lambda *a: speculate.prefill(engine.spec, *a, capacity=cap), *args)
    lowered = speculate.decode_jit.lower(engine.spec, target.params, dparams,
                                         engine.with_adaptive(state), args[5], jnp.int32(1))
    text = lowered.compile(compiler_options=ACCEL_LIKE).as_text()
    traffic = hlo.cache_traffic(text, (b, c.num_kv_heads, cap, c.head_dim))
    return traffic.copies, traffic.zero_fills


def test_prompt_lookup_rows_are_priced_at_their_match(target):
    """Prompt lookup's proposal is a function of the committed tokens: the controller prices
    each row at the nodes its match has (a row without one gains nothing from a window its
    batch mate's match would pay for), and no match anywhere leaves nothing to verify."""
    def allowed(costs, motif_rows):
        engine = Engine(target, NgramDrafter(64, min_ngram=2, max_ngram=3), None,
                        num_speculative_tokens=3,
                        adaptive=Options(step_costs=costs, draft_cost=0.0, probe_every=0,
                                         explore=0.0))  # the estimates' own price
        engine.spec_for = lambda *_: engine.spec  # the adaptive program whatever the costs
        state = engine.prefill([[1, 2]] * 2, 32, SamplingParams.make(), 0, [0, 1], 2)
        motif, distinct = [5, 6, 7, 8] * 4, list(range(10, 26))
        rows = [motif if r < motif_rows else distinct for r in range(2)]
        tokens = state.tokens.at[:, :16].set(jnp.asarray(rows, jnp.int32))
        state = dataclasses.replace(state, tokens=tokens, lengths=jnp.full((2,), 16, jnp.int32))
        return speculate.plan_step(engine.spec, target.params, None, state, SamplingParams.make()).lengths

    cheap, dear = [1.0, 1.2, 1.4, 1.6], [1.0, 1.7, 2.2, 2.6]
    # one row matches: the other, with nothing to verify, still needs a step per token and
    # would pay every window's cost -- no window finishes the batch sooner
    np.testing.assert_array_equal(allowed(cheap, 1), [0, 0])
    np.testing.assert_array_equal(allowed(cheap, 2), [2, 2])  # both: 1.96 tokens for 1.4
    np.testing.assert_array_equal(allowed(dear, 2), [0, 0])  # 1.6 tokens for 1.7: plain
    np.testing.assert_array_equal(allowed(cheap, 0), [0, 0])  # no match: the plain loop


@pytest.mark.parametrize("steps", [1, 3, 0])
def test_eagle_catch_up_leaves_the_state_propose_and_commit_leave(target, steps):
    """commit_plain over a plain run of `steps` steps (M = 4 roots, one pass: the catch-up) ==
    propose with 0 nodes + commit of a step that accepted nothing, once per step, on every slot
    the next proposal reads (0 steps: the state as it was)."""
    drafter, dparams = eagle_like(target)
    b, length, g, m = 2, 9, 3, 4
    nl = len(drafter.hidden_layers)
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(1, 64, size=(b, length)), jnp.int32)
    cap = 32
    hidden_in = jax.random.normal(jax.random.key(2), (nl, b, length, 64))
    state = drafter.init(dparams, base.bind(target.target, target.params), prompt, jnp.full((b,), length), hidden_in, cap)
    tokens = jnp.zeros((b, cap), jnp.int32).at[:, :length].set(prompt)
    tokens = tokens.at[:, length : length + m].set(jnp.asarray(rng.integers(1, 64, (b, m))))
    roots_hidden = jax.random.normal(jax.random.key(3), (nl, b, m, 64))  # garbage past `steps`
    sp = SamplingParams.make()
    pad = lambda x, axis: jnp.pad(x, [(0, g if i == axis else 0) for i in range(x.ndim)])
    slow = state
    for i in range(steps):  # the step-by-step bookkeeping a plain run replaces
        lengths = jnp.full((b,), length + i)  # before the step: last committed at length + i - 1
        ctx = DraftContext(tokens, lengths, jnp.ones((b,), bool), jnp.zeros((b,), jnp.int32))
        proposal, after = drafter.propose(
            dparams, base.bind(target.target, target.params), slow, ctx, g, sp, jax.random.split(jax.random.key(4), b)
        )
        assert not proposal.num_proposed.any()
        root = tokens[:, length + i - 1 : length + i]
        slow = drafter.commit(dparams, base.bind(target.target, target.params), after, CommitContext(
            tokens, lengths + 1, lengths, pad(root, 1), jnp.zeros((b,), jnp.int32),
            pad(roots_hidden[:, :, i : i + 1], 2), jnp.zeros((b, g + 1), jnp.int32),
        ))
    start = jnp.full((b,), length)
    run = drafter.commit_plain(dparams, base.bind(target.target, target.params), state, CommitContext(
        tokens, start + steps, start, tokens[:, length - 1 : length - 1 + m],
        jnp.zeros((b,), jnp.int32), roots_hidden, jnp.zeros((b, m), jnp.int32),
    ))
    np.testing.assert_allclose(run.feature, slow.feature, rtol=1e-5, atol=1e-6)
    valid = length - 1 + steps  # slots below the new length - 1
    for a, c in ((run.k, slow.k), (run.v, slow.v)):
        np.testing.assert_allclose(a[:, :, :valid], c[:, :, :valid], rtol=1e-5, atol=1e-6)
    if steps:
        assert not np.allclose(state.k[:, :, length - 1], run.k[:, :, length - 1])  # written


@pytest.mark.parametrize("limit", [1, 2])
def test_eagle_drafts_no_further_than_the_rows_allow(target, limit):
    """propose with max_nodes = k runs k drafter steps, no more: its last step (drafter layer +
    head) writes the drafter cache at slot length + k - 2, nothing at length + k - 1. Session
    10's loop ran one step past every row's limit and threw the token away (EAGLE γ = 3 at one
    node: 1.24 plain steps where fixed γ = 1 took 1.14), which is what kept adaptive EAGLE below
    its best fixed γ."""
    drafter, dparams = eagle_like(target)
    b, length, g, cap = 2, 9, 3, 32
    prompt = jnp.asarray(np.random.default_rng(1).integers(1, 64, size=(b, length)), jnp.int32)
    hidden_in = jax.random.normal(jax.random.key(2), (len(drafter.hidden_layers), b, length, 64))
    state = drafter.init(dparams, base.bind(target.target, target.params), prompt, jnp.full((b,), length), hidden_in, cap)
    tokens = jnp.zeros((b, cap), jnp.int32).at[:, :length].set(prompt)
    ctx = DraftContext(tokens, jnp.full((b,), length), jnp.ones((b,), bool),
                       jnp.full((b,), limit, jnp.int32))
    keys = jax.random.split(jax.random.key(4), b)
    proposal, after = drafter.propose(dparams, base.bind(target.target, target.params), state, ctx, g, SamplingParams.make(), keys)
    np.testing.assert_array_equal(proposal.num_proposed, [limit] * b)
    written = lambda slot: not np.allclose(after.k[:, :, slot], state.k[:, :, slot])
    assert written(length - 1) and written(length + limit - 2)  # the root, the last draft's input
    assert not written(length + limit - 1)  # no step past the limit


# ---- the exact law, with lengths that adapt -----------------------------------------------

V, NUM_ROWS, PROMPT = 6, 12000, [1, 2, 3, 4, 5]


def peeking_cut(proposal, lengths):
    """Broken on purpose: also cuts a row's chain before its first node that is not the draft's
    likeliest token (a tree: to as many levels as its leading such nodes) -- the length then
    depends on this step's draw (biased)."""
    top = jnp.argmax(proposal.probs, axis=-1) == proposal.tokens  # [B, N]
    keep = jnp.sum(jnp.cumprod(top, axis=1), axis=1).astype(jnp.int32)
    return REAL_CUT(proposal, jnp.minimum(lengths, keep))


REAL_CUT = adaptive.cut


@pytest.fixture(scope="module")
def small_vocab():
    target = tiny_model(seed=5, scale=0.6, vocab=V, layers=2, hidden=32, eos=(-1,))
    leaves, treedef = jax.tree.flatten(target.params)
    keys = jax.random.split(jax.random.key(6), len(leaves))
    dparams = jax.tree.unflatten(
        treedef, [w + 0.3 * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
    )
    return target, dparams


def adaptive_pvalue(target, dparams, shape="chain"):
    """shape "tree": a dynamic tree of sampled children (top 2, 2 levels, 3 nodes) cut to the
    chosen depth."""
    sp = SamplingParams.make(temperature=0.9)
    # decay 0: a row's estimate is its last step's outcome, so step 2's length (0, 1 or 2 nodes)
    # is decided by step 1's draws
    opts = Options(step_costs=[1.0, 1.2, 1.3], draft_cost=0.0, decay=0.0, probe_every=0)
    drafter = ModelDrafter(model=llama.LlamaTarget(target.cfg), target_vocab=V)
    if shape == "tree":
        drafter = dataclasses.replace(
            drafter, tree_top_k=2, tree_levels=2, tree_budget=3, tree_children="sampled"
        )
    engine = Engine(target, drafter, dparams, num_speculative_tokens=2, adaptive=opts)
    results = engine.generate(
        [PROMPT] * NUM_ROWS, max_new_tokens=3, sampling=sp, seed=11, batch_size=NUM_ROWS
    )
    counts = counts_of([r.token_ids for r in results], V, 3)
    return chi_square_pvalue(counts, exact_law(target, PROMPT, sp, 3)), results


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_adaptive_sampling_has_the_target_distribution(small_vocab, shape):
    p, results = adaptive_pvalue(*small_vocab, shape)
    hist = np.sum([r.metrics["adaptive_gamma_hist"] for r in results], axis=0)
    assert (hist > 100).sum() >= 2  # rows verified different lengths after their first step
    # among them 0 nodes: a row with one token left steps through the plain-step branch (a
    # room of 1 leaves no node for any row), drawing its token as the 0-node window would
    assert hist[0] > 100
    assert p > PASS_P


# ---- the controller's choice, calibration, switch-off -------------------------------------


def test_controller_picks_the_length_that_pays_and_probes():
    ctl = controller(3, probe_every=4, explore=0.0)  # the estimates' own choice
    st = ctl.init(3, [1.0, 1.2, 1.4, 1.6])
    alpha = jnp.asarray([[0.95, 0.95, 0.95], [0.1, 0.1, 0.1], [0.6, 0.6, 0.6]])
    st = dataclasses.replace(st, alpha=alpha)
    active = jnp.ones((3,), bool)
    room = jnp.full((3,), 20)
    steps = jnp.full((3,), 5)
    ctx = jnp.full((3,), 40)  # committed tokens (one curve: every context)
    # the batch ends with its slowest row: row 1 (0.1) gains nothing from a window, so none pays
    # although row 0 alone would verify 3 (the summed-tokens rule took 3 here)
    np.testing.assert_array_equal(ctl.choose(st, steps, active, room, ctx), [0, 0, 0])
    # row 1 done: row 2 (0.6) is the slowest; 2 nodes finish it soonest (20 / 1.96 * 1.4)
    np.testing.assert_array_equal(
        ctl.choose(st, steps, jnp.asarray([True, False, True]), room, ctx), [2, 0, 2]
    )
    # rows near their end do not hold the batch: row 0 sets its time, and a row with 2 tokens
    # left verifies 1 node (more could never be committed), one with 1 left none
    near_end = jnp.asarray([20, 2, 1])
    np.testing.assert_array_equal(ctl.choose(st, steps, active, near_end, ctx), [3, 1, 0])
    # a measured draft cost that grows with the nodes makes the 3rd not worth it: cap 2
    drafty = dataclasses.replace(st, costs=jnp.asarray([[1.0, 1.3, 1.6, 2.4]]))
    np.testing.assert_array_equal(ctl.choose(drafty, steps, active, near_end, ctx), [2, 1, 0])
    even = dataclasses.replace(st, alpha=jnp.full((3, 3), 0.6))
    slow = dataclasses.replace(even, costs=jnp.asarray([[1.0, 1.9, 2.9, 3.9]]))  # loaded batch
    np.testing.assert_array_equal(ctl.choose(even, steps, active, room, ctx), [2, 2, 2])
    np.testing.assert_array_equal(ctl.choose(slow, steps, active, room, ctx), [0, 0, 0])
    np.testing.assert_array_equal(ctl.choose(slow, steps + 3, active, room, ctx), [1, 1, 1])
    assert adaptive.best_gain([1.0, 1.9, 2.9, 3.9], 0.8) <= 1.0 < adaptive.best_gain(COSTS, 0.8)
    # after a step: row 0 accepted 2 of 3, row 1 was allowed 3 but its drafter proposed none and
    # row 2 was allowed none (no evidence: unchanged)
    after = ctl.update(st, jnp.asarray([3, 3, 0]), jnp.asarray([3, 0, 0]), jnp.asarray([2, 0, 0]),
                       active, ctx)
    d = 1 / (ctl.settings.decay * ctl.settings.prior_weight + 1)  # the prior is worth prior_weight outcomes
    np.testing.assert_allclose(after.alpha[0], [0.95 + d * 0.05, 0.95 + d * 0.05, 0.95 * (1 - d)])
    np.testing.assert_allclose(after.weight[0], ctl.settings.decay * ctl.settings.prior_weight + 1)
    np.testing.assert_allclose(after.alpha[1], alpha[1])
    np.testing.assert_allclose(after.alpha[2], alpha[2])
    np.testing.assert_array_equal(after.length_hist, [[0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(after.reached, [[1, 1, 1], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(after.hits, [[1, 1, 0], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(after.window_hist, [0, 0, 0, 1])  # the batch verified 3
    assert float(after.spent) == pytest.approx(1.6)  # priced at its context: cost[3]
    # by the cost model: 10 one-entry steps at 1.1 for 10 tokens lose to plain, 5 at 1.3 win
    assert adaptive.realized_gain([1.1, 1.3], [10, 0], [10, 7]) < 1.0
    assert adaptive.realized_gain([1.1, 1.3], [0, 5], [10, 7]) == pytest.approx(10 / 6.5)


def test_a_row_on_plain_tries_a_node_while_its_estimate_is_uncertain():
    """c* = 0 at the estimate, but one node pays at alpha + 1 standard error: the row verifies
    one node (explore), not only every probe_every-th step; an estimate that many outcomes put
    near 0 stays plain, and explore = 0 keeps the estimate's own choice. (A 1091-token
    summarization prompt: EAGLE's row, its first drafts missed, ran 91% plain at 0.99x where
    fixed γ = 1 accepted 40% at 1.17x.)"""
    ctl = controller(3, probe_every=0)
    st = ctl.init(1, [1.0, 1.17, 1.4, 1.6])
    doubt = dataclasses.replace(st, alpha=jnp.full((1, 3), 0.13), weight=jnp.full((1, 3), 3.0))
    args = (jnp.full((1,), 5), jnp.ones((1,), bool), jnp.full((1,), 50), jnp.full((1,), 100))
    np.testing.assert_array_equal(ctl.choose(doubt, *args), [1])
    np.testing.assert_array_equal(controller(3, probe_every=0, explore=0.0).choose(doubt, *args), [0])
    assert float(adaptive.optimistic(doubt, 1.0)[0, 0]) == pytest.approx(0.13 + (0.1131 / 3) ** 0.5)
    settled = dataclasses.replace(st, alpha=jnp.full((1, 3), 0.02), weight=jnp.full((1, 3), 10.0))
    np.testing.assert_array_equal(ctl.choose(settled, *args), [0])  # 0.02 + 0.07: still a loss
    good = dataclasses.replace(st, alpha=jnp.full((1, 3), 0.6))  # c* > 0: the estimate decides
    np.testing.assert_array_equal(ctl.choose(good, *args),
                                  controller(3, probe_every=0, explore=0.0).choose(good, *args))
    with pytest.raises(JaxspecError, match="speculative.adaptive.explore"):
        load_config(None, ["speculative.adaptive.explore=-1"])


def test_estimates_start_fast_and_settle_to_the_exponential_average():
    """The prior is worth prior_weight outcomes: after 4 misses from 0.6 the estimate is under
    0.2 (the exponential average alone, prior_weight = 1 / (1 - decay), is still at 0.39),
    and in the long run each outcome moves it by 1 - decay either way."""
    active, ctx = jnp.ones((1,), bool), jnp.full((1,), 40)
    one, miss = jnp.asarray([1]), jnp.asarray([0])
    for weight, after_four in ((2.0, 0.2), (10.0, 0.6 * 0.9**4)):
        ctl = controller(1, prior=0.6, decay=0.9, prior_weight=weight)
        st = ctl.init(1, [1.0, 1.2])
        for _ in range(4):
            st = ctl.update(st, one, one, miss, active, ctx)
        if weight == 10.0:
            assert float(st.alpha[0, 0]) == pytest.approx(after_four)
        else:
            assert float(st.alpha[0, 0]) < after_four
        for _ in range(200):
            st = ctl.update(st, one, one, miss, active, ctx)
        before = float(st.alpha[0, 0])
        st = ctl.update(st, one, one, one, active, ctx)
        assert float(st.alpha[0, 0]) - before == pytest.approx(0.1 * (1 - before), rel=1e-3)


def test_controller_hands_a_losing_lockstep_batch_off():
    """hands_off: only from the batch's handoff_after-th step, and only where no window is
    expected to finish the batch sooner than the plain program (1 token per row and step)."""
    ctl = controller(2, handoff_after=3)
    st = ctl.init(2, [1.05, 1.3, 1.5])
    active, room, ctx = jnp.ones((2,), bool), jnp.full((2,), 20), jnp.full((2,), 40)
    steps = jnp.full((2,), 3)
    low = dataclasses.replace(st, alpha=jnp.full((2, 2), 0.2))
    assert bool(ctl.hands_off(low, steps, active, room, ctx))  # 1.2 / 1.3 < 1, 1.24 / 1.5 < 1
    assert not bool(ctl.hands_off(dataclasses.replace(low, alpha=jnp.full((2, 2), 0.5)),
                                  steps, active, room, ctx))  # 1.5 / 1.3 > 1
    assert not bool(ctl.hands_off(low, steps - 1, active, room, ctx))  # too early
    assert bool(ctl.hands_off(low, jnp.asarray([3, 9]), jnp.asarray([True, False]), room, ctx))
    # the slowest row sets the batch's time: a fast batch mate does not keep the window ...
    mixed = dataclasses.replace(st, alpha=jnp.asarray([[0.2, 0.2], [0.9, 0.9]]))
    assert bool(ctl.hands_off(mixed, steps, active, room, ctx))
    # ... unless the slow row is near its end (1 token left): the fast row's 20 take longer
    assert not bool(ctl.hands_off(mixed, steps, active, jnp.asarray([1, 20]), ctx))
    never = controller(2, handoff_after=0)
    assert not bool(never.hands_off(low, steps, active, room, ctx))
    off = adaptive.Plan(jnp.zeros((2,), jnp.int32), jnp.ones((), bool))  # a handed-off step
    zeros, one_row = jnp.zeros((2,), jnp.int32), jnp.asarray([True, False])
    st = ctl.observe(low, off, adaptive.Outcome(zeros, zeros, one_row, ctx, jnp.int32(7)))
    st = ctl.observe(st, off, adaptive.Outcome(zeros, zeros, one_row, ctx, jnp.int32(8)))
    assert int(st.handoff_at) == 7 and float(st.spent) == pytest.approx(2.0)
    np.testing.assert_array_equal(st.plain_steps, [2, 0])
    np.testing.assert_array_equal(st.window_hist, [2, 0, 0])
    np.testing.assert_array_equal(st.alpha, low.alpha)  # no evidence


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lockstep_hand_off_is_plain_decoding(target, prompts, batch_size):
    """An untrained EAGLE drafter on a lockstep batch: from its 2nd step, once the estimates say
    no window pays, the rest of the batch is plain decoding's step with the
    drafter untouched -- greedy-identical to plain, one program. Batch 1 (a request) never hands
    off: it keeps its plain loop with probes."""
    plain = Engine(target).generate(prompts[:4], max_new_tokens=24, batch_size=batch_size)
    drafter, dparams = eagle_like(target)
    opts = Options(step_costs=[1.1, 1.3, 1.5, 1.7], draft_cost=0.0, handoff_after=2,
                   prior_weight=1.0, probe_every=4)
    engine = Engine(target, drafter, dparams, num_speculative_tokens=3, adaptive=opts)
    engine.spec_for = lambda *_: engine.spec  # the adaptive program at every size
    results = engine.generate(prompts[:4], max_new_tokens=24, batch_size=batch_size)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    handoff = [r.metrics["adaptive_handoff_step"] for r in results]
    if batch_size == 1:
        assert handoff == [-1] * 4
        return
    assert 2 <= handoff[0] < 12  # after the evidence, well before the end
    m = results[0].metrics
    assert m["adaptive_plain_fraction"] > 0.5 and m["num_steps"] > 20
    assert cache_copies(engine, target, dparams, batch_size) == ((), ())  # the third loop too
    engine.spec = dataclasses.replace(  # never hands off: same tokens, far fewer plain steps
        engine.spec, adaptive=adaptive.Controller(3, dataclasses.replace(opts, handoff_after=0))
    )
    kept = engine.generate(prompts[:4], max_new_tokens=24, batch_size=batch_size)
    assert [r.token_ids for r in kept] == [r.token_ids for r in plain]
    assert kept[0].metrics["adaptive_handoff_step"] == -1


def fake_verify(calls):
    """A verify-step measurement: a window entry costs more at a longer context."""
    def measure(model, batch, widths, fill):
        calls.extend((model.name, batch, w, fill) for w in widths)
        per = 0.25 * fill / 128
        return [0.01 * (1.1 if w == 0 else 1 + per * (w - 1)) for w in widths]
    return measure


@pytest.fixture
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "REPS", 2)  # the real measurements: that they run
    return tmp_path


def test_step_costs_are_cached_per_model_and_width(target, calibration_dir):
    calls = []
    fake = fake_verify(calls)
    # per fill; k = 0: the loop's 1-entry step (window path, width 0), next to plain's in place
    want = {128: [1.1, 1.25, 1.5], 1024: [1.1, 3.0, 5.0]}
    assert calibration.FILLS == (128, 1024)
    got = calibration.step_costs(target, 2, 2, measure=fake)
    assert list(got) == [128, 1024] and all(got[f] == pytest.approx(want[f]) for f in want)
    assert len(calls) == 8
    got = calibration.step_costs(target, 2, 2, measure=fake)
    assert len(calls) == 8 and got[1024] == pytest.approx(want[1024])  # reused from the file
    calibration.step_costs(target, 2, 3, measure=fake)  # a missing width: its fill's whole
    assert calls[8:] == [("tiny", 2, w, f) for f in (128, 1024) for w in (1, 0, 2, 3, 4)]
    # curve again, one sitting for the ratios to one reference
    other = dataclasses.replace(target, name="tiny-2")  # a different key: measured afresh
    assert cache_file_differs(target, other)
    assert not calibration.drifted(other, 2, measure=fake)  # no file yet: nothing to compare
    calibration.step_costs(other, 2, 2, measure=fake)
    assert len(calls) == 26
    calibration.step_costs(target, 2, 3, measure=fake, recalibrate=True)
    assert len(calls) == 36
    calibration.step_costs(target, 2, 3, measure=fake)  # every fill kept by the recalibration
    assert len(calls) == 36
    assert "fills" in calibration.calibration_key(target)  # session 8's files (one fill): not read


def test_step_costs_at_the_context_lengths_asked(target, calibration_dir):
    """`speculative.adaptive.context_lengths`: the curves are measured at those fills (a file of
    their own), the host passes them on, and a length past the default fills gets a cache that
    holds it (`capacity_for`)."""
    calls = []
    got = calibration.step_costs(target, 1, 2, measure=fake_verify(calls), fills=(4096, 512))
    assert list(got) == [4096, 512] and got[4096][1] > got[512][1]  # a longer prefix costs more
    assert sorted({c[3] for c in calls}) == [512, 4096]
    assert calibration.cache_file(None, calibration.calibration_key(target, (4096, 512))) != \
        calibration.cache_file(target)
    assert calibration.capacity_for(128) == 1024 and calibration.capacity_for(8192) == 8192
    host = AdaptiveHost(Options(context_lengths=[8192, 1024], step_costs={1024: [1.0, 1.5, 2.0],
                        8192: [1.0, 3.0, 5.0]}, draft_cost=0.0), target, None, NgramDrafter(8))
    assert host.fills == (1024, 8192)
    assert Options(context_lengths="[1024, 8192]").context_lengths == [1024, 8192]  # the CLI's
    for bad in ([], [0], "4k"):
        with pytest.raises(JaxspecError, match="context_lengths"):
            Options(context_lengths=bad)


def test_drift_is_the_plain_step_retimed_against_the_cached_one(target, calibration_dir):
    calls = []
    fake = fake_verify(calls)
    calibration.step_costs(target, 2, 2, measure=fake)  # 0.01 s at 128 cached
    speed = [1.0]
    slower = lambda model, batch, widths, fill: [t * speed[0] for t in fake(model, batch, widths, fill)]
    assert not calibration.drifted(target, 2, measure=slower)
    assert not calibration.drifted(target, 4, measure=slower)  # nothing cached: nothing to compare
    speed[0] = 1.3  # outside DRIFT either way
    assert calibration.drifted(target, 2, measure=slower)
    speed[0] = 0.7
    assert calibration.drifted(target, 2, measure=slower)


def test_draft_costs_are_cached_per_drafter_settings(target, calibration_dir):
    drafts = []

    def fake_draft(model, drafter, dparams, batch, gamma, ks, fill):
        drafts.append((drafter.max_ngram, batch, tuple(ks), fill))
        return 0.01, [0.001 * (k + 1) * fill / 128 for k in ks]

    ngram = NgramDrafter(64, min_ngram=1, max_ngram=3)
    got = calibration.draft_costs(target, ngram, None, 2, 2, measure=fake_draft)
    assert got[128] == pytest.approx([0.1, 0.2, 0.3]) and got[1024] == pytest.approx([0.8, 1.6, 2.4])
    assert drafts == [(3, 2, (0, 1, 2), 128), (3, 2, (0, 1, 2), 1024)]
    calibration.draft_costs(target, ngram, None, 2, 2, measure=fake_draft)
    assert len(drafts) == 2  # reused
    calibration.draft_costs(target, NgramDrafter(64, max_ngram=2), None, 2, 2, measure=fake_draft)
    assert len(drafts) == 4  # another drafter: another key
    drafters = (eagle_like(target)[0], ngram,
                ModelDrafter(model=llama.LlamaTarget(target.cfg), target_vocab=64))
    k0 = [calibration.draft_key(target, d, None, 2)["k0"] for d in drafters]
    run = f"commit_plain/{adaptive_loop.MAX_PLAIN_RUN}"  # in the key: what k = 0 measured
    assert k0 == [run] + ["propose+commit"] * 2


def test_loop_costs_are_cached_per_loop_and_drift_retimes_plain(target, calibration_dir):
    loops = []

    def fake_loop(model, spec, dparams, batch, ks, fill):
        loops.append((spec.num_speculative_tokens, batch, tuple(ks), fill))
        return 0.01, [0.01 * (1 + 0.1 * k) for k in ks]

    ngram = NgramDrafter(64, min_ngram=1, max_ngram=3)
    spec = lambda g, **kw: Engine(target, ngram, None, num_speculative_tokens=g,
                                  adaptive=Options(**kw)).spec
    got = calibration.loop_costs(target, spec(2), None, 2, measure=fake_loop)
    assert got == {f: pytest.approx([1.0, 1.1, 1.2]) for f in (128, 1024)}
    assert loops == [(2, 2, (0, 1, 2), 128), (2, 2, (0, 1, 2), 1024)]
    calibration.loop_costs(target, spec(2), None, 2, measure=fake_loop)
    assert len(loops) == 2  # reused
    assert not calibration.loop_drifted(target, spec(2), None, 2, measure=fake_loop)
    assert loops[2] == (2, 2, (), 128)  # the drift check times plain's step alone
    slow_loop = lambda *a: (0.02, [])  # the plain step twice as slow
    assert calibration.loop_drifted(target, spec(2), None, 2, measure=slow_loop)
    calibration.loop_costs(target, spec(3), None, 2, measure=fake_loop)  # another γ, another
    calibration.loop_costs(target, spec(2, probe_every=4), None, 2, measure=fake_loop)  # run
    assert len(loops) == 7


def test_the_real_measurements_time_one_step_per_width_asked(target, calibration_dir):
    """The measurements the fakes above stand for run on the real programs and give one time
    per width asked: verify at two fills (one compile for both), EAGLE's draft (k = 0: its
    commit_plain catch-up; k = 3: its max_nodes loop + commit) and whole loop steps."""
    long, short = (calibration.measure_verify(target, 1, [1, 0, 2], f) for f in (1024, 128))
    assert len(long) == len(short) == 3 and all(np.isfinite(long + short))
    plain_s, each = calibration.measure_draft(target, *eagle_like(target), 2, 3, [0, 3])
    assert np.isfinite(plain_s) and len(each) == 2 and all(np.isfinite(each))
    eagle, eparams = eagle_like(target)
    espec = Engine(target, eagle, eparams, num_speculative_tokens=3, adaptive=Options()).spec
    nspec = Engine(target, NgramDrafter(64, min_ngram=1, max_ngram=3), None,
                   num_speculative_tokens=3, adaptive=Options()).spec
    # EAGLE-3 has no plain-run catch-up: its k = 0 plan is the one-token branch of the step's
    # cond, which must leave what the window branch leaves (it once also left the root's features)
    from jaxspec.train import methods  # training code: only the tests that need it import it

    m3 = methods.Eagle3(hidden_layers=(1, 2, 2))
    e3params, frozen = m3.init(target, np.arange(0, 64, 2, dtype=np.int32), jax.random.key(7))
    e3params = m3.runtime(e3params, frozen)
    e3spec = Engine(target, m3.drafter(target.target), e3params, num_speculative_tokens=3,
                    adaptive=Options()).spec
    for s, p in ((espec, eparams), (nspec, None), (e3spec, e3params)):
        plain_s, each = calibration.measure_loop(target, s, p, 2, [0, 1, 3], 1024)
        assert np.isfinite(plain_s) and len(each) == 3 and all(np.isfinite(each))


def test_calibration_ratios_are_per_round_medians(monkeypatch):
    """Load that hits one round hits the reference and the window in it alike: a name's cost is
    the median of its per-round ratios to the reference (a minimum per name pairs a quiet run of
    one with a quiet run of the other: here 12 / 10 instead of 1.3)."""
    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(calibration, "REPS", 3)

    def run(durations):  # the first call compiles (untimed)
        it = iter(durations)
        return lambda: clock.__setitem__(0, clock[0] + next(it))

    got = calibration.timed({"ref": run([9, 10, 20, 20]), "w": run([9, 13, 26, 12])})
    assert got["ref"] == pytest.approx(10) and got["w"] / got["ref"] == pytest.approx(1.3)


def test_the_cost_curve_follows_the_context():
    """Costs measured at two fills: the step reads the curve at the active rows' mean committed
    length, linear in between, clamped outside -- 3 nodes pay at 128 cached tokens, nothing at
    1024 (a window reads the long prefix once per entry), one node around 576. The step's cost
    is priced at its context (`spent`, the realized gain's denominator)."""
    ctl = controller(3, probe_every=0, explore=0.0)
    st = ctl.init(2, {1024: [1.0, 1.9, 2.9, 3.9], 128: [1.0, 1.2, 1.4, 1.6]})
    np.testing.assert_array_equal(st.fills, [128, 1024])
    st = dataclasses.replace(st, alpha=jnp.full((2, 3), 0.8))
    pick = lambda *lengths, active=(True, True): ctl.choose(
        st, jnp.full((2,), 5), jnp.asarray(active), jnp.full((2,), 50), jnp.asarray(lengths)
    )
    np.testing.assert_array_equal(pick(100, 100), [3, 3])  # below the first fill: its curve
    np.testing.assert_array_equal(pick(1000, 1200), [0, 0])  # past the last: its curve
    np.testing.assert_array_equal(pick(700, 452), [1, 1])  # mean 576: (1.55, 2.15, 2.75)
    np.testing.assert_array_equal(pick(100, 2000, active=(True, False)), [3, 0])  # active only
    np.testing.assert_allclose(
        adaptive.step_cost(st, jnp.asarray([700, 452]), jnp.ones((2,), bool)),
        [1.0, 1.55, 2.15, 2.75], rtol=1e-6,
    )
    after = ctl.update(st, jnp.asarray([1, 1]), jnp.asarray([1, 1]), jnp.asarray([1, 0]),
                       jnp.ones((2,), bool), jnp.asarray([700, 452]))
    assert float(after.spent) == pytest.approx(1.55)


def test_each_row_says_why_it_verifies_what_it_does():
    """The plan's reasons (adaptive.REASONS, per row): at a long context where the same estimates
    would draft at the shortest calibrated one, "context"; where no window pays even there,
    "acceptance"; a row whose room is shorter than the cap, "room"; a probe, "probe". Counted per
    active row by `observe` and reported by `summarize`."""
    ctl = controller(3, probe_every=4, explore=0.0)
    st = ctl.init(3, {1024: [1.0, 1.9, 2.9, 3.9], 128: [1.0, 1.2, 1.4, 1.6]})
    st = dataclasses.replace(st, alpha=jnp.full((3, 3), 0.8))
    on = jnp.ones((3,), bool)
    decide = lambda st, context, room=(50, 50, 50), step=5: ctl.decide(
        st, jnp.full((3,), step), on, jnp.asarray(room), jnp.asarray(context))
    why = lambda r: [adaptive.REASONS[int(i)] for i in r[1]]
    assert why(decide(st, (100, 100, 100), room=(50, 2, 50))) == ["drafts", "room", "drafts"]
    assert why(decide(st, (1000, 1100, 1200))) == ["context"] * 3  # pays at 128, not here
    weak = dataclasses.replace(st, alpha=jnp.full((3, 3), 0.05))
    assert why(decide(weak, (100, 100, 100))) == ["acceptance"] * 3
    lengths, reasons = decide(st, (1000, 1100, 1200), step=8)  # a probe step
    assert lengths.tolist() == [1, 1, 1] and why((lengths, reasons)) == ["probe"] * 3
    plan = adaptive.Plan(lengths, jnp.zeros((), bool), reasons)
    out = adaptive.Outcome(lengths, jnp.asarray([1, 0, 1]), jnp.asarray([True, True, False]),
                           jnp.asarray([1000, 1100, 1200]), jnp.asarray(8))
    after = ctl.observe(st, plan, out)
    metrics = adaptive.summarize(after.length_hist[0], after.plain_steps[0], 1,
                                 after.reason_hist[0])
    assert metrics["adaptive_reasons"] == {"probe": 1}
    assert after.reason_hist[2].tolist() == [0] * len(adaptive.REASONS)  # inactive: not counted


def test_speculation_switches_off_at_a_long_context(target):
    """A drafter that pays at a short context but not at a long one (verify cost per fill, as
    calibration measures it: attention over the context grows with it): at batch 1 the request's
    own length decides, so the same repetitive text speculates after a 24-token prompt and runs
    the plain program after a 400-token one, each result saying why (`adaptive_host_reason`),
    greedy output identical to plain decoding's. A decision that ignored the context (any
    fill's curve, or the shortest) would speculate at both lengths and fail here."""
    costs = {64: [1.0, 1.05, 1.1, 1.15], 384: [1.0, 2.2, 3.4, 4.6]}  # no window pays at 384
    engine = Engine(target, NgramDrafter(64, min_ngram=1, max_ngram=3), None,
                    num_speculative_tokens=3,
                    adaptive=Options(step_costs=costs, draft_cost=0.0, probe_every=0, explore=0.0))
    assert engine.spec_for(1, [24]) is engine.spec and engine.spec_for(1, [400]) is engine.plain_spec
    motif = [5, 9, 13, 17, 21, 25]
    short, long = (motif * 70)[:24], (motif * 70)[:400]
    plain = Engine(target).generate([short, long], max_new_tokens=16)
    got = engine.generate([short, long], max_new_tokens=16)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    at_short, at_long = (r.metrics for r in got)
    assert at_short["num_draft_tokens"] > 0 and sum(at_short["adaptive_gamma_hist"][1:]) > 0
    assert not at_short["adaptive_switched_off"] and at_short["adaptive_host_reason"] == "pays"
    assert at_short["adaptive_reasons"].get("drafts", 0) > 0
    assert at_long["adaptive_switched_off"] and at_long["adaptive_host_reason"] == "context"
    assert at_long["adaptive_plain_fraction"] == 1.0 and at_long["num_draft_tokens"] == 0


def test_batch_one_learns_acceptance_per_context(target):
    """A trained drafter whose acceptance falls with the context (a head trained short): the
    acceptance requests saw at about this length decides the next one there (the curve pays at
    both lengths at 0.8), so the long bucket goes plain ("acceptance" where it would not pay
    even at the shortest context, "context" where it would), the short one keeps speculating,
    a long bucket not yet seen reads the nearest shorter one's, and every REPROBE_BATCHES-th
    request of a bucket kept plain re-measures."""
    from jaxspec.decode.adaptive.host import REPROBE_BATCHES

    drafter, _ = eagle_like(target)
    costs = {64: [1.0, 1.1, 1.2, 1.3], 1024: [1.0, 1.3, 1.6, 1.9]}
    engine = Engine(target, drafter, None, num_speculative_tokens=3,
                    adaptive=Options(step_costs=costs, draft_cost=0.0))
    h = engine.policy
    assert h.decide(1, [60]) == (True, "pays") and h.decide(1, [1000]) == (True, "pays")

    def seen(context, hits, reached):  # what a finished request at that length leaves
        st = types.SimpleNamespace(reached=np.asarray([reached]), hits=np.asarray([hits]),
                                   window_hist=np.asarray([0, 10, 0, 0]), spent=13.0)
        h.record(st, rows=1, batch=1, tokens=[12], contexts=[context])

    seen(60, [6, 3, 1], [10, 6, 3])  # ~0.6 at the short context: pays there and at 1000
    assert h.decide(1, [1000]) == (True, "pays")  # unseen: the nearest shorter bucket's
    seen(1000, [1, 0, 0], [30, 1, 0])  # ~0.08 at the long one
    assert h.decide(1, [900]) == (False, "acceptance") and h.decide(1, [60]) == (True, "pays")
    seen(1000, [4, 1, 0], [10, 4, 1])  # 0.25-0.35: would pay at the short context's curve
    assert h.decide(1, [900]) == (False, "context")
    assert engine.spec_for(1, [900]) is engine.plain_spec and engine.spec_for(1, [60]) is engine.spec
    picks = []
    for _ in range(REPROBE_BATCHES):
        picks.append(h.decide(1, [900]))
        if not picks[-1][0]:
            h.record(None, rows=1, batch=1, tokens=[12], contexts=[900])
    assert picks == [(False, "context")] * (REPROBE_BATCHES - 1) + [(True, "reprobe")]


def cache_file_differs(a, b) -> bool:
    return calibration.cache_file(a) != calibration.cache_file(b)


def test_switch_off_runs_the_plain_program_where_verify_does_not_pay(target, prompts):
    costs = lambda b: COSTS if b == 1 else [1.0, 1.9, 2.9, 3.9]  # verify loses at batch 4
    engine = Engine(
        target,
        NgramDrafter(64, min_ngram=1, max_ngram=3),
        None,
        num_speculative_tokens=3,
        adaptive=Options(step_costs=costs, draft_cost=0.0),
    )
    assert engine.spec_for(1) is engine.spec
    assert engine.spec_for(4).drafter is None and engine.spec_for(4).num_nodes == 0
    plain = Engine(target).generate(prompts[:4], max_new_tokens=24, batch_size=4)
    results = engine.generate(prompts[:4], max_new_tokens=24, batch_size=4)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    m = results[0].metrics
    assert m["adaptive_switched_off"] and m["adaptive_plain_fraction"] == 1.0
    assert m["num_draft_tokens"] == 0 and m["adaptive_gamma_mean"] == 0.0
    # rows that ended a batch accepting little switch the next batches off; every 8th re-probes
    engine = Engine(target, NgramDrafter(64, min_ngram=1, max_ngram=3), None,
                    num_speculative_tokens=3,
                    adaptive=Options(step_costs=[1.0, 1.3, 1.6, 1.9], draft_cost=0.0))
    assert engine.spec_for(4) is engine.spec  # prior 0.8 pays
    engine.generate(prompts[:4], max_new_tokens=24, batch_size=4)
    assert len(engine.policy.observed_acceptance) == 3
    engine.policy.observed_acceptance = [0.2, 0.2, 0.2]
    picks = []
    for _ in range(8):
        picks.append(engine.spec_for(4) is engine.spec)
        engine.policy.off_batches += not picks[-1]  # what a run of the plain program records
    assert picks == [False] * 7 + [True]
    # the re-probe runs (and does not pay): the next 7 run plain again, not every one after it
    engine.generate(prompts[:4], max_new_tokens=24, batch_size=4)
    engine.policy.observed_acceptance = [0.2, 0.2, 0.2]
    assert engine.policy.off_batches == 0 and engine.spec_for(4) is not engine.spec
    # a batch size whose last adaptive batch did not beat plain by the cost model: off too
    # (before one of that size: the last of any size, priced with this size's costs)
    engine.policy.observed_acceptance, engine.policy.off_batches = None, 0
    engine.policy.last_runs = {4: ([10, 0, 0, 0], [10], 10.0), "any": ([0, 10, 0, 0], [16], 13.0)}
    assert engine.realized_gain(4) == pytest.approx(10 / 10)
    assert engine.spec_for(4) is not engine.spec and engine.spec_for(2) is engine.spec
    assert engine.realized_gain(2) == pytest.approx(16 / 13)
    engine.policy.last_runs = {"any": ([0, 10, 0, 0], [12], 13.0)}
    assert engine.spec_for(2) is not engine.spec  # 12 tokens for 10 steps of 1.3: a loss


def test_batch_one_decides_per_request(target, prompts):
    """At batch 1 the row is the request: an earlier request that did not pay (low acceptance,
    realized gain < 1) switches the next batches of size 4 off, never the next request at
    batch 1 -- it runs the adaptive program and speculates from its own statistics. Only the
    cost curve (no gain even at switch_off_acceptance) switches batch 1 off."""
    costs = lambda b: [1.0, 1.3, 1.6, 1.9] if b < 8 else [1.0, 1.9, 2.9, 3.9]
    engine = Engine(target, NgramDrafter(64, min_ngram=1, max_ngram=3), None,
                    num_speculative_tokens=3, adaptive=Options(step_costs=costs, draft_cost=0.0))
    random_prompt = [int(t) for t in np.random.default_rng(5).permutation(np.arange(1, 64))[:30]]
    first = engine.generate([random_prompt], max_new_tokens=12, batch_size=1)[0]
    assert not first.metrics["adaptive_switched_off"]
    engine.policy.observed_acceptance = [0.05, 0.05, 0.05]  # what a losing request leaves
    engine.policy.last_runs = {1: ([30, 0, 0, 0], [12], 30.0), "any": ([30, 0, 0, 0], [12], 30.0)}
    assert engine.realized_gain(1) < 1.0 and engine.realized_gain(4) < 1.0
    assert engine.spec_for(4) is engine.plain_spec  # lockstep batches: history decides
    assert engine.spec_for(1) is engine.spec  # a request: its own statistics decide
    motif = prompts[3]  # a repeated motif: prompt lookup matches
    again = engine.generate([motif], max_new_tokens=16, batch_size=1)[0]
    assert not again.metrics["adaptive_switched_off"]
    assert sum(again.metrics["adaptive_gamma_hist"][1:]) > 0 and again.metrics["num_accepted_tokens"] > 0
    assert engine.spec_for(8) is engine.plain_spec  # the cost curve rules 8 out at 0.8
    # a size with no history whose curve pays at 0.8 but not at the prior (0.6), where the
    # loop's estimates start: batch 1 (a request) tries it, a lockstep batch runs plain
    fresh = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3,
                   adaptive=Options(step_costs=[1.0, 1.7, 2.2, 2.5], draft_cost=0.0))
    assert fresh.spec_for(1) is fresh.spec and fresh.spec_for(4) is fresh.plain_spec
    one_off = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3,
                     adaptive=Options(step_costs=[1.0, 1.9, 2.9, 3.9], draft_cost=0.0))
    assert one_off.spec_for(1) is one_off.plain_spec  # ... and batch 1 where it says so


def test_adaptive_config(target, tmp_path, monkeypatch):
    config = load_config("configs/smollm2-135m-ngram-adaptive.yaml")
    assert config.speculative.adaptive.enabled and config.speculative.method == "ngram"
    assert load_config("configs/smollm2-135m-eagle-adaptive.yaml").speculative.adaptive.enabled
    assert load_config("configs/smollm2-135m-eagle-tree-adaptive.yaml").speculative.adaptive.enabled
    for overrides, word in [
        (["speculative.adaptive.decay=1.5"], "speculative.adaptive.decay"),
        (["speculative.adaptive.probe_length=0"], "speculative.adaptive.probe_length"),
        (["speculative.adaptive.enabled=true"], "speculative.method"),
        (["adaptive.enabled=true"], "moved to speculative.adaptive.enabled"),
    ]:
        with pytest.raises(JaxspecError, match=word) as e:
            load_config(None, overrides)
        assert "\n" not in str(e.value)
    tree = load_config(None, ["speculative.method=ngram", "speculative.adaptive.enabled=true",
                              "speculative.tree.kind=static"]).speculative  # adaptive depth
    assert tree.adaptive.enabled and tree.tree.kind == "static"
    with pytest.raises(JaxspecError, match="positive numbers"):
        Engine(
            target,
            NgramDrafter(64),
            None,
            num_speculative_tokens=3,
            adaptive=Options(step_costs=[1.0, 2.0], draft_cost=0.0),
        ).step_costs(1)
    # draft_cost "auto": the measured drafter step (here faked) is added to the verify cost
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "measure_draft",
                        lambda m, d, p, b, g, ks, f: (1.0, [0.1 * f / 128] * len(ks)))
    auto = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3,
                  adaptive=Options(step_costs={128: COSTS, 1024: COSTS}))
    got = auto.step_costs(1)
    assert got[128] == pytest.approx([c + 0.1 for c in COSTS])
    assert got[1024] == pytest.approx([c + 0.8 for c in COSTS])
    one = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3,
                 adaptive=Options(step_costs=COSTS))  # one curve: the drafter's at fill 0
    assert one.step_costs(1) == {0: pytest.approx([c + 0.1 for c in COSTS])}
    with pytest.raises(JaxspecError, match=r"speculative\.adaptive\.draft_cost=-1.* is invalid"):
        load_config(None, ["speculative.adaptive.draft_cost=-1"])
    got = load_config(None, ["speculative.adaptive.draft_cost=0.2"]).speculative.adaptive
    assert got.draft_cost == 0.2


@pytest.mark.parametrize("drift", [False, True])
def test_engine_measures_a_drifted_calibration_again(target, monkeypatch, drift):
    """A cached calibration this machine has drifted away from (calibration.loop_drifted) is
    measured again; else it is read from the cache. Measured costs never fall with more nodes."""
    seen = []
    monkeypatch.setattr(calibration, "loop_drifted", lambda model, spec, dparams, batch: drift)
    monkeypatch.setattr(calibration, "loop_costs", lambda m, s, p, b, recalibrate: seen.append(
        (s.num_speculative_tokens, recalibrate)) or {128: [1.0, 1.3, 1.2, 1.6]})
    engine = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3, adaptive=Options())
    assert engine.step_costs(1) == {128: pytest.approx([1.0, 1.3, 1.3, 1.6])}
    assert seen == [(3, drift)]


def test_engine_calibrates_on_a_fresh_cache_then_reads_it(target, prompts, tmp_path, monkeypatch):
    """End to end, nothing faked: the first adaptive engine on an empty cache directory measures
    its loop's steps (session 10's drift check crashed on the missing file), a second one reads
    the file (re-timing only the plain step), and generation stays greedy-identical."""
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "REPS", 2)
    make = lambda: Engine(target, NgramDrafter(64), None, num_speculative_tokens=2,
                          adaptive=Options())
    first = make().step_costs(1)
    assert sorted(first) == list(calibration.FILLS) and all(len(c) == 3 for c in first.values())
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1  # the loop's steps
    engine = make()
    assert sorted(engine.step_costs(1)) == list(calibration.FILLS)
    plain = Engine(target).generate(prompts[:2], max_new_tokens=24, batch_size=1)
    got = engine.generate(prompts[:2], max_new_tokens=24, batch_size=1)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]


def test_continuous_batching_prices_tokens_not_the_slowest_rows_tail():
    """Two rows, one about to end (room 2) and one long: the lockstep objective (the batch's
    finish time) lets the long row's estimate decide; continuous batching (rows replaced) buys
    expected tokens per cost over both. At batch 1 both choose the same cap."""
    st = controller(3).init(2, [1.0, 1.5, 1.9, 2.2])
    st = dataclasses.replace(st, alpha=jnp.asarray([[0.9, 0.9, 0.9], [0.3, 0.3, 0.3]]))
    active, room = jnp.asarray([True, True]), jnp.asarray([2, 60])
    context = jnp.asarray([10, 10])
    plain = AdaptiveConfig(probe_every=0, explore=0.0)  # the objective alone decides
    lockstep = adaptive.Controller(3, plain).choose(st, jnp.zeros(2, jnp.int32), active, room,
                                                    context)
    replaced = adaptive.Controller(3, plain, rows_replaced=True).choose(
        st, jnp.zeros(2, jnp.int32), active, room, context)
    useful = jnp.clip(room - 1, 0, 3)
    times = adaptive.token_times(st, active, useful, context)
    assert int(jnp.max(replaced)) == int(jnp.argmin(times))
    assert int(jnp.max(lockstep)) == 0 < int(jnp.max(replaced)) == 1  # the long row's 0.3 vs
    # both rows' tokens: 1 node buys 3.2 expected tokens for 1.5 plain steps
    for row in range(2):  # alone, the two objectives agree
        one = jax.tree.map(lambda x: x[row : row + 1] if x.ndim and x.shape[0] == 2 else x, st)
        args = (one, jnp.zeros(1, jnp.int32), active[:1], jnp.asarray([40]), context[:1])
        assert int(adaptive.Controller(3, plain).choose(*args)[0]) == int(
            adaptive.Controller(3, plain, rows_replaced=True).choose(*args)[0])


# ---- the broken variant, last: it drops JAX's caches (patches_traced_code), so the programs
# the tests above share are not lowered twice; its control is the law test above, same settings


@pytest.mark.patches_traced_code
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_distribution_test_catches_a_length_that_peeks_at_the_draw(small_vocab, shape, monkeypatch):
    monkeypatch.setattr(adaptive, "cut", peeking_cut)  # the loop cuts proposals through it
    p, _ = adaptive_pvalue(*small_vocab, shape)
    assert p < FAIL_P
