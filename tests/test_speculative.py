"""The speculative loop end to end on tiny random models: greedy identity, exact distribution,
EOS, cache contents, batching and recompilation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import cases
import pytest
from compiles import counting_lowerings
from distribution import PASS_P, chi_square_pvalue, counts_of, exact_law
from tiny import motif_prompts, tiny_model

from jaxspec.decode import acceptance
from jaxspec.models.cache import init_cache
from jaxspec.drafters.draft_model import ModelDrafter, layer_skip_drafter
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.models import llama
from jaxspec.decode.sampling import SamplingParams

PROMPT_LENGTHS = (5, 17, 9, 30)


def perturbed(params, seed, noise):
    """A draft close to the target: accepts often but not always (both branches of the rule)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [w + noise * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
    )


@pytest.fixture(scope="module")
def prompts():
    return motif_prompts(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def plain_greedy(target, prompts):
    return [r.token_ids for r in Engine(target).generate(prompts, max_new_tokens=40, batch_size=4)]


def drafters(target):
    return {
        "ngram": (NgramDrafter(vocab_size=64, min_ngram=1, max_ngram=3), None),
        "layer_skip": (layer_skip_drafter(target.target, 1), None),
        "draft_model": (
            ModelDrafter(model=llama.LlamaTarget(target.cfg), target_vocab=64),
            perturbed(target.params, 1, 0.05),
        ),
    }


# Every method (tests/cases.py) at every γ, at batch 1 or 4 by turns (a Latin square): every pair
# of (method, γ), (method, batch) and (γ, batch) is run, each with its own programs, in half the
# cases of the full product (a bug needing all three at once would have to miss every pair).
GREEDY_CASES = [(method, gamma, (1, 4)[(i + j) % 2])
                for i, method in enumerate(cases.names("greedy")) for j, gamma in enumerate((1, 3, 5))]


def test_the_greedy_cases_cover_every_pair():
    runs = {(m, g, b) for m, g, b in GREEDY_CASES}
    pairs = lambda a, b: {(r[a], r[b]) for r in runs}  # noqa: E731
    assert pairs(0, 1) == {(m, g) for m in cases.names("greedy") for g in (1, 3, 5)}
    assert pairs(0, 2) == {(m, b) for m in cases.names("greedy") for b in (1, 4)}
    assert pairs(1, 2) == {(g, b) for g in (1, 3, 5) for b in (1, 4)}


@pytest.mark.parametrize("method,gamma,batch_size", GREEDY_CASES,
                         ids=[f"{b}-{g}-{m}" for m, g, b in GREEDY_CASES])
def test_greedy_speculative_is_token_identical(target, prompts, plain_greedy, method, gamma, batch_size):
    drafter, dparams = drafters(target)[method]
    engine = Engine(target, drafter, dparams, num_speculative_tokens=gamma)
    results = engine.generate(prompts, max_new_tokens=40, batch_size=batch_size)
    assert [r.token_ids for r in results] == plain_greedy
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    assert 0 < accepted < drafted  # both the accept and the reject path were exercised


def test_plain_greedy_matches_a_step_by_step_reference(target, prompts, plain_greedy):
    """The jitted loop against a host loop of single-token forwards, no bucketing or batching."""
    step = jax.jit(llama.forward_logits, static_argnames="cfg")
    for ids, expected in zip(prompts, plain_greedy):
        cache = init_cache(2, 1, 128, 2, 16)
        logits, cache = step(target.params, jnp.asarray([ids]), cache, target.cfg)
        cache = cache.commit(jnp.asarray([len(ids)]))
        out = [int(jnp.argmax(logits[0, -1]))]
        while len(out) < 40 and out[-1] != 0:
            logits, cache = step(target.params, jnp.asarray([[out[-1]]]), cache, target.cfg)
            cache = cache.commit(jnp.asarray([1]))
            out.append(int(jnp.argmax(logits[0, -1])))
        assert out == expected


def test_self_draft_accepts_everything(target, prompts):
    no_eos = dataclasses.replace(target, eos_token_ids=(-1,))
    engine = Engine(no_eos, ModelDrafter(model=llama.LlamaTarget(target.cfg), target_vocab=64), target.params,
                    num_speculative_tokens=4)
    sp = SamplingParams.make(temperature=1.0)
    for r in engine.generate(prompts, max_new_tokens=30, sampling=sp, batch_size=4):
        assert r.metrics["acceptance_rate"] == 1.0
        assert r.metrics["accepted_per_position"] == [1.0] * 4


def test_eos_inside_the_window_stops_the_row(target, prompts):
    no_eos = dataclasses.replace(target, eos_token_ids=(-1,))
    plain = Engine(no_eos).generate(prompts[:1], max_new_tokens=30)[0].token_ids
    eos = plain[6]
    first = plain.index(eos)
    eos_target = dataclasses.replace(target, eos_token_ids=(eos,))
    expected = plain[: first + 1]
    assert Engine(eos_target).generate(prompts[:1], max_new_tokens=30)[0].token_ids == expected
    engine = Engine(eos_target, ModelDrafter(model=llama.LlamaTarget(target.cfg), target_vocab=64), target.params,
                    num_speculative_tokens=5)  # α = 1: EOS lands inside an accepted window
    assert engine.generate(prompts[:1], max_new_tokens=30)[0].token_ids == expected


def test_max_new_tokens_is_exact(target, prompts):
    no_eos = dataclasses.replace(target, eos_token_ids=(-1,))
    engine = Engine(no_eos, ModelDrafter(model=llama.LlamaTarget(target.cfg), target_vocab=64), target.params,
                    num_speculative_tokens=5)
    for r in engine.generate(prompts, max_new_tokens=13, batch_size=4):
        assert r.num_generated_tokens == 13


def test_cache_after_speculation_equals_plain_prefill(target, prompts):
    """Target k/v below each row's length == a fresh forward over the committed tokens."""
    drafter, dparams = drafters(target)["draft_model"]
    engine = Engine(target, drafter, dparams, num_speculative_tokens=3)
    sp = SamplingParams.make()
    state = engine.prefill(prompts, 20, sp, 0, list(range(4)), 4)
    state = engine.decode(state, sp, 3)  # stop mid-generation: rejected drafts sit past lengths
    committed = np.asarray(state.lengths) - 1
    # the rollback was exercised: drafts were rejected, and their k/v sit written past a row's
    # length (masked, never read), where a fresh forward over the committed tokens has none
    assert (np.asarray(state.num_accepted) < np.asarray(state.num_draft)).any()
    assert any(np.abs(np.asarray(state.cache.k[0][row, :, committed[row]])).sum() > 0
               for row in range(4))
    fresh = init_cache(2, 4, state.tokens.shape[1], 2, 16)
    out = llama.forward(target.params, state.tokens, fresh, target.cfg)
    for layer in range(2):
        for row in range(4):
            n = committed[row]
            np.testing.assert_allclose(
                state.cache.k[layer][row, :, :n], out.cache.k[layer][row, :, :n], rtol=1e-4, atol=1e-5
            )
            np.testing.assert_allclose(
                state.cache.v[layer][row, :, :n], out.cache.v[layer][row, :, :n], rtol=1e-4, atol=1e-5
            )


def test_sampled_rows_do_not_depend_on_their_batch(target, prompts):
    drafter, dparams = drafters(target)["draft_model"]
    engine = Engine(target, drafter, dparams, num_speculative_tokens=3)
    sp = SamplingParams.make(temperature=0.8, top_p=0.9)
    alone = [r.token_ids for r in engine.generate(prompts, max_new_tokens=20, sampling=sp, seed=3)]
    batched = engine.generate(prompts, max_new_tokens=20, sampling=sp, seed=3, batch_size=4)
    assert [r.token_ids for r in batched] == alone


def test_no_recompilation_across_requests(target):
    engine = Engine(target, NgramDrafter(vocab_size=64), num_speculative_tokens=3)
    rng = np.random.default_rng(1)
    requests = [[int(t) for t in rng.integers(1, 64, size=int(n))] for n in rng.integers(1, 60, 50)]
    engine.generate(requests[:2], max_new_tokens=16)  # warm up
    with counting_lowerings() as lowered:
        for ids in requests:
            engine.generate([ids], max_new_tokens=16, sampling=SamplingParams.make(temperature=0.5))
    # prompt lengths 1..59: prefill widths 16, 32, 48, 64 (engine.prepare.prompt_bucket) over
    # caches of three sizes (16, 32, 64): one program per width / size at most
    assert lowered("decode") <= 3 and lowered("prefill") <= 4, (lowered("decode"), lowered("prefill"))
    with counting_lowerings() as again:  # every shape seen: nothing is lowered
        for ids in requests[::5]:
            engine.generate([ids], max_new_tokens=16, sampling=SamplingParams.make(temperature=0.7))
    assert again() == 0


def test_bad_speculative_settings_are_clear_errors(target):
    with pytest.raises(JaxspecError, match="num_speculative_tokens"):
        Engine(target, NgramDrafter(vocab_size=64), num_speculative_tokens=0)
    with pytest.raises(JaxspecError, match="num_speculative_tokens"):
        Engine(target, NgramDrafter(vocab_size=64), num_speculative_tokens=99)
    with pytest.raises(JaxspecError, match="ngram"):
        NgramDrafter(vocab_size=64, min_ngram=3, max_ngram=2)
    with pytest.raises(JaxspecError, match="speculative.layer_skip.layers"):
        layer_skip_drafter(target.target, 2)
    short = ModelDrafter(model=llama.LlamaTarget(dataclasses.replace(target.cfg, max_position_embeddings=40)),
                         target_vocab=64)
    engine = Engine(target, short, target.params, num_speculative_tokens=2)
    with pytest.raises(JaxspecError, match="draft model's context of 40"):
        engine.generate([[1] * 30], max_new_tokens=20)


# ---- the sampled distribution of the whole loop ------------------------------------------------

V = 6
NUM_ROWS = 12000


def sampled_counts(target, draft_params, sp, prompt, num_tokens=3, gamma=2):
    engine = Engine(target, ModelDrafter(model=llama.LlamaTarget(target.cfg), target_vocab=V), draft_params,
                    num_speculative_tokens=gamma)
    results = engine.generate([prompt] * NUM_ROWS, max_new_tokens=num_tokens, sampling=sp,
                              batch_size=NUM_ROWS, seed=11)
    return counts_of([r.token_ids for r in results], V, num_tokens), results


@pytest.fixture(scope="module")
def small_vocab():
    target = tiny_model(seed=5, scale=0.6, vocab=V, layers=2, hidden=32, eos=(-1,))
    draft_params = perturbed(target.params, 6, 0.3)
    return target, draft_params


SETTINGS = {
    "temperature": dict(temperature=0.9),
    "top_k": dict(temperature=1.2, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.8),
}


# The sampled law of the engine (settings, γ, EOS, mixed lengths, batch sizes) is tested in
# tests/test_distributions.py; here, the classic broken rule must fail the same chi-square test,
# and its control (the real rule, the same drafter, settings, prompt and rows) pass it.
def test_the_real_rule_passes_the_broken_rules_test(small_vocab):
    target, draft_params = small_vocab
    sp = SamplingParams.make(**SETTINGS["temperature"])
    prompt = [1, 2, 3, 4, 5]
    counts, results = sampled_counts(target, draft_params, sp, prompt, gamma=1)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    assert 0.05 * drafted < accepted < 0.95 * drafted  # the residual is drawn from: rejections
    assert chi_square_pvalue(counts, exact_law(target, prompt, sp, 3)) > PASS_P


@pytest.mark.patches_traced_code
def test_distribution_test_catches_a_broken_rule(small_vocab, monkeypatch):
    target, draft_params = small_vocab
    sp = SamplingParams.make(**SETTINGS["temperature"])
    prompt = [1, 2, 3, 4, 5]
    # A classic bug: after a rejection the next token comes from the target's p instead of the
    # residual norm(max(0, p - q)) (the rule without its residual update); the rest is the real rule.
    broken = functools.partial(acceptance.accept_tree, update_residual=False)
    monkeypatch.setattr(acceptance, "accept_tree", broken)  # speculate reads it
    counts, _ = sampled_counts(target, draft_params, sp, prompt, gamma=1)
    assert chi_square_pvalue(counts, exact_law(target, prompt, sp, 3)) < 1e-6
