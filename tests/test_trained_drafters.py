"""Trained drafters are lossless: the shipped SmolLM2-135M checkpoints give token-identical
greedy output, and sampled output (with draft-vocabulary reduction on) has the target's exact
distribution on a tiny model (each law test runs the real drafter as its control and a
deliberately broken one, same settings and rows: the control passes, the broken one fails)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decode import sampling
from jaxspec.drafters import NgramDrafter
from jaxspec.drafters import eagle_head as eagle_lib
from jaxspec.drafters.prompt_lookup_first import LookupFirst
from jaxspec.engine.runner import Engine
from jaxspec.models import base
from jaxspec.decode.sampling import SamplingParams
from jaxspec.train import methods
from jaxspec.train.load import load_trained_drafter
from distribution import FAIL_P, PASS_P, chi_square_pvalue, counts_of, exact_law, sample_rows
from tiny import tiny_model

# ---- shipped checkpoints on the real target ------------------------------------------------

PROMPTS = [
    "A baker makes 24 muffins and sells 3 boxes of 5. How many muffins are left?",
    "Write two sentences about why people enjoy gardening.",
]
SHIPPED = [
    ("eagle", "checkpoints/smollm2-135m-eagle", 4),
    ("eagle3", "checkpoints/smollm2-135m-eagle3", 3),
    ("peagle", "checkpoints/smollm2-135m-peagle", 4),
    ("medusa", "checkpoints/smollm2-135m-medusa", 3),
    ("draft_model", "checkpoints/smollm2-135m-draft", 3),
]


@pytest.fixture(scope="module")
def target(smollm2):
    """The target as configs load it (the packed CPU-kernel layout where available)."""
    return smollm2


@pytest.fixture(scope="module")
def plain(target):
    return Engine(target).generate(PROMPTS, max_new_tokens=32, batch_size=2)


@pytest.mark.parametrize("method,path,gamma", SHIPPED, ids=[s[0] for s in SHIPPED])
def test_shipped_drafter_greedy_is_token_identical(target, plain, method, path, gamma):
    drafter, dparams = load_trained_drafter(method, path, target)
    engine = Engine(target, drafter, dparams, num_speculative_tokens=gamma)
    spec = engine.generate(PROMPTS, max_new_tokens=32, batch_size=2)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
    # the drafter is trained: it gets drafts accepted
    assert np.mean([r.metrics["mean_accepted_length"] for r in spec]) > 1.2


def test_shipped_eagle3_head_exports_to_a_layout_vllm_loads(target, tmp_path):
    """The shipped eagle3 head, exported as vLLM runs it (issue 45: the same head in both engines),
    fits vLLM's Eagle3LlamaForCausalLM schema on the real target: shapes, taps, d2t/t2d."""
    from test_vllm_peer import vllm_eagle3_problems

    from jaxspec.export import export

    export("checkpoints/smollm2-135m-eagle3", "eagle3", tmp_path / "e3", target=target)
    cfg = target.cfg
    assert vllm_eagle3_problems(tmp_path / "e3", cfg.num_layers, cfg.vocab_size) == []


# ---- exact distribution on a tiny target, draft vocabulary reduced ---------------------------

V = 8
DRAFT_IDS = np.array([0, 2, 3, 5, 6], np.int32)  # 5 of the 8 target tokens
BROKEN_ROWS = 6000  # each broken variant below fails under FAIL_P at this size
NUM_TOKENS = 3
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def small():
    return tiny_model(seed=5, scale=0.6, vocab=V, layers=2, hidden=32, eos=(-1,))


METHODS = {"eagle": methods.Eagle(hidden_layers=(0, 1, 1), input_scale=1.0)}  # taps of 2 layers


def drafter_for(target, name, noise=0.3):
    m = METHODS[name]
    params, frozen = m.init(target, DRAFT_IDS, jax.random.key(7))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(8), len(leaves))
    params = jax.tree.unflatten(
        treedef, [w + noise * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
    )
    return m.drafter(target.cfg), m.runtime(params, frozen)


def sample(target, drafter, dparams, sp, gamma=2, prompt=PROMPT, *, rows):
    """(counts of each generated NUM_TOKENS-sequence over `rows` rows, the rows' results)."""
    results = sample_rows(target, drafter, dparams, sp, [prompt], rows=rows,
                          num_tokens=NUM_TOKENS, gamma=gamma)
    return counts_of([r.token_ids for r in results], V, NUM_TOKENS), results


def sampled_counts(target, drafter, dparams, sp, gamma=2, *, rows):
    counts, results = sample(target, drafter, dparams, sp, gamma, rows=rows)
    return counts, np.mean([r.metrics["acceptance_rate"] for r in results])


@jax.tree_util.register_static
class ArgmaxTokenEagle(eagle_lib.EagleDrafter):
    """Broken: returns the right q but proposes its argmax instead of a sample from q."""

    def _probs(self, dparams, h, sp, keys):
        _, probs = super()._probs(dparams, h, sp, keys)
        idx = jnp.argmax(sampling.logits_to_probs(eagle_lib.head_logits(dparams, h), sp), -1)
        return dparams["d2t"][idx], probs


def law_holds(pvalue: float, variant: str) -> None:
    """The control (the real drafter, same settings and rows) passes; the broken one fails."""
    if variant == "control":
        assert pvalue > PASS_P, pvalue
    else:
        assert pvalue < FAIL_P, pvalue


@pytest.mark.parametrize("variant", ["control", "broken"])
def test_eagle_with_a_reduced_vocabulary_has_the_law_and_an_argmax_proposer_does_not(small, variant):
    sp = SamplingParams.make(temperature=1.0)
    good, dparams = drafter_for(small, "eagle")
    drafter = good if variant == "control" else ArgmaxTokenEagle(
        cfg=good.cfg, target_vocab=good.target_vocab, hidden_layers=good.hidden_layers)
    counts, _ = sampled_counts(small, drafter, dparams, sp, rows=BROKEN_ROWS)
    law_holds(chi_square_pvalue(counts, exact_law(small, PROMPT, sp, NUM_TOKENS)), variant)


# ---- dynamic draft length (speculative.eagle.draft_confidence) -------------------------------


def test_confidence_gated_eagle_is_token_identical_and_drafts_less(target, plain):
    drafter, dparams = load_trained_drafter("eagle", "checkpoints/smollm2-135m-eagle", target)
    fixed = Engine(target, drafter, dparams, num_speculative_tokens=4)
    gated = Engine(target, dataclasses.replace(drafter, min_confidence=0.5, variable_length=True),
                   dparams, num_speculative_tokens=4)
    # batch 2: the fixed engine's program is test_shipped_drafter_greedy_is_token_identical's
    res_fixed = fixed.generate(PROMPTS, max_new_tokens=32, batch_size=2)
    res_gated = gated.generate(PROMPTS, max_new_tokens=32, batch_size=2)
    for a, b in zip(plain, res_gated):
        assert a.token_ids == b.token_ids
    drafted = lambda rs: sum(r.metrics["num_draft_tokens"] for r in rs)
    steps = lambda rs: sum(r.metrics["num_steps"] for r in rs)
    assert drafted(res_fixed) == 4 * steps(res_fixed)
    assert 0 < drafted(res_gated) < 4 * steps(res_gated)  # fewer drafts, not none
    rate = lambda rs: sum(r.metrics["num_accepted_tokens"] for r in rs) / drafted(rs)
    assert rate(res_gated) > rate(res_fixed)  # what it stops drafting is what would be rejected


@jax.tree_util.register_static
class SelfGatedEagle(eagle_lib.EagleDrafter):
    """Broken: gates each draft on the probability of the token it drew (conditions the draft on
    its own value, so the proposal is no longer distributed as q)."""

    @staticmethod
    def _gate(confidence, top, own):
        return confidence * own


@pytest.mark.parametrize("variant", ["control", "broken"])
def test_confidence_gated_eagle_has_the_law_and_a_self_gated_one_does_not(small, variant):
    sp = SamplingParams.make(temperature=1.0)
    good, dparams = drafter_for(small, "eagle")
    cls = eagle_lib.EagleDrafter if variant == "control" else SelfGatedEagle
    drafter = cls(**{f.name: getattr(good, f.name) for f in dataclasses.fields(good)}
                  | {"min_confidence": 0.6, "variable_length": True})
    counts, _ = sample(small, drafter, dparams, sp, rows=BROKEN_ROWS)
    law_holds(chi_square_pvalue(counts, exact_law(small, PROMPT, sp, NUM_TOKENS)), variant)


# ---- prompt lookup first, the trained drafter elsewhere (speculative.lookup) -------------------


COPY_PROMPT = "Repeat exactly: The old lighthouse keeper climbed the stairs every evening to light the lamp."


def test_lookup_first_eagle_is_token_identical_and_copies_in_fewer_steps(target, plain):
    drafter, dparams = load_trained_drafter("eagle", "checkpoints/smollm2-135m-eagle", target)
    mixed = LookupFirst(drafter, NgramDrafter(target.cfg.vocab_size, 2, 3))
    res = Engine(target, mixed, dparams, num_speculative_tokens=3).generate(
        PROMPTS + [COPY_PROMPT], max_new_tokens=32, batch_size=3)
    # plain and EAGLE alone at batch 2 and EAGLE's γ = 4: the programs this module compiled above
    copy_plain = Engine(target).generate([COPY_PROMPT], max_new_tokens=32, batch_size=2)
    for a, b in zip(plain + copy_plain, res):
        assert a.token_ids == b.token_ids
    alone = Engine(target, drafter, dparams, num_speculative_tokens=4).generate(
        [COPY_PROMPT], max_new_tokens=32, batch_size=2)
    assert res[2].metrics["num_steps"] < alone[0].metrics["num_steps"]  # lookup copied the sentence
    # batch 1: steps where lookup found a continuation skip EAGLE's drafting (advance only)
    single = Engine(target, mixed, dparams, num_speculative_tokens=3).generate([COPY_PROMPT], max_new_tokens=32)
    assert single[0].token_ids == copy_plain[0].token_ids
    assert single[0].metrics["num_steps"] == res[2].metrics["num_steps"]


def test_eagle_advance_leaves_the_state_propose_leaves(small):
    """advance (used when lookup supplies every row's draft) must write the same cache entries
    for the committed text as propose, and keep the feature: the next proposal depends on them."""
    from jaxspec.drafters.base import DraftContext

    drafter, dparams = drafter_for(small, "eagle")
    b, p, cap = 2, 6, 16
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (b, cap)), jnp.int32)
    hidden = jnp.asarray(rng.normal(size=(3, b, p, small.cfg.hidden_size)), jnp.float32)
    lengths = jnp.asarray([p, p - 2], jnp.int32)
    state = drafter.init(dparams, base.bind(small.target, small.params), tokens[:, :p], lengths, hidden, cap)
    state = state._replace(feature=jnp.asarray(rng.normal(size=state.feature.shape), state.feature.dtype))
    ctx = DraftContext(tokens=tokens, lengths=lengths + 1, active=jnp.ones((b,), bool))
    sp = SamplingParams.make(temperature=1.0)
    _, proposed = drafter.propose(dparams, base.bind(small.target, small.params), state, ctx, 3, sp, jax.random.split(jax.random.key(0), b))
    advanced = drafter.advance(dparams, base.bind(small.target, small.params), state, ctx)
    for row in range(b):
        committed = int(lengths[row]) + 1  # slots below this hold committed text
        for a, c in ((advanced.k, proposed.k), (advanced.v, proposed.v)):
            np.testing.assert_array_equal(np.asarray(a[row, :, :committed]), np.asarray(c[row, :, :committed]))
        assert not np.array_equal(np.asarray(advanced.k[row, :, committed - 1]), np.asarray(state.k[row, :, committed - 1]))
    np.testing.assert_array_equal(np.asarray(advanced.feature), np.asarray(proposed.feature))


# tokens of the tiny target's vocabulary repeat in this prompt, so lookup matches on most steps
REPEATING = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 6, 1, 7, 0]


@jax.tree_util.register_static
class StaleQLookup(LookupFirst):
    """Broken: proposes lookup's tokens but keeps the inner drafter's q for them."""

    @staticmethod
    def _merge(found, own):
        merged = LookupFirst._merge(found, own)
        return merged._replace(probs=own.probs)


@jax.tree_util.register_static
class DraftingEagle(eagle_lib.EagleDrafter):
    advance = None  # always drafts, so StaleQLookup's merge runs on every step


@pytest.mark.parametrize("variant", ["control", "broken"])
def test_lookup_first_has_the_law_and_one_with_the_wrong_q_does_not(small, variant):
    sp = SamplingParams.make(temperature=1.0)
    good, dparams = drafter_for(small, "eagle")
    drafter = DraftingEagle(**{f.name: getattr(good, f.name) for f in dataclasses.fields(good)})
    mixed = (LookupFirst if variant == "control" else StaleQLookup)(drafter, NgramDrafter(V, 1, 2))
    counts, _ = sample(small, mixed, dparams, sp, gamma=3, prompt=REPEATING, rows=BROKEN_ROWS)
    law_holds(chi_square_pvalue(counts, exact_law(small, REPEATING, sp, NUM_TOKENS)), variant)
