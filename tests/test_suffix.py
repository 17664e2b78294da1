"""Suffix decoding: greedy identity with plain decoding (chain and tree, batch 1 and 8, mixed
lengths), the exact law under sampling with a store that proposes (and a variant that peeks at
the step's acceptance draw, which must fail), the store's eviction and size bound, and a
request's output independent of what earlier requests left in the store."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distribution import FAIL_P, PASS_P, pvalue
from tiny import tiny_model

from jaxspec.decode import speculate
from jaxspec.config import load_config
from jaxspec.drafters import suffix_store
from jaxspec.drafters.suffix import SuffixDrafter, SuffixFirst
from jaxspec.engine.runner import Engine
from jaxspec.loading.params import unpack_params
from jaxspec.errors import JaxspecError
from jaxspec.decode.sampling import SamplingParams
from jaxspec.train import methods

V = 64
LENGTHS = (5, 17, 9, 30, 12, 6, 22, 14)  # batch 8, mixed


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=V, layers=2, hidden=32, packed=True, eos=(-1,))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    out = []
    for n in LENGTHS:  # random text with a repeated motif: the own context matches too
        motif = list(rng.integers(1, V, size=3))
        out.append([int(t) for t in (list(rng.integers(1, V, size=n // 2)) + motif * 5)[:n]])
    return out


@pytest.fixture(scope="module")
def plain(target, prompts):
    return [r.token_ids for r in Engine(target).generate(prompts, max_new_tokens=24, batch_size=8)]


def history(prompts, plain, rows):
    """Earlier requests the store learns from: these prompts with their (plain) outputs."""
    return [prompts[i] + plain[i] for i in rows]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_suffix_is_token_identical(target, prompts, plain, tree, batch_size):
    drafter = SuffixDrafter(V, store_tokens=512, budget=8 if tree else 0, depth=4 if tree else 0)
    store = drafter.observe(drafter.empty_store(), history(prompts, plain, range(0, 8, 2)))
    engine = Engine(target, drafter, store, num_speculative_tokens=4)
    results = engine.generate(prompts, max_new_tokens=24, batch_size=batch_size)
    assert [r.token_ids for r in results] == plain
    seen = [r.metrics["mean_accepted_length"] for r in results]
    assert max(seen[0::2]) > 3.0  # rows whose output the store holds copy it
    # the engine added this call's requests: a second call accepts more
    again = engine.generate(prompts, max_new_tokens=24, batch_size=batch_size)
    assert [r.token_ids for r in again] == plain
    assert sum(r.metrics["num_steps"] for r in again) < sum(r.metrics["num_steps"] for r in results)


def test_suffix_first_then_eagle_is_token_identical(target, prompts, plain):
    """speculative.suffix.then: suffix proposals where there is a match, EAGLE's elsewhere."""
    method = methods.Eagle(hidden_layers=(0, 1, 1), input_scale=1.0)
    unpacked = dataclasses.replace(target, params=unpack_params(target.params, target.cfg))
    params, frozen = method.init(unpacked, np.arange(V, dtype=np.int32), jax.random.key(7))
    suffix = SuffixDrafter(V, store_tokens=512)
    store = suffix.observe(suffix.empty_store(), history(prompts, plain, range(0, 8, 2)))
    drafter = SuffixFirst(method.drafter(target.cfg), suffix)
    engine = Engine(target, drafter, (method.runtime(params, frozen), store),
                    num_speculative_tokens=3)
    results = engine.generate(prompts, max_new_tokens=24, batch_size=8)
    assert [r.token_ids for r in results] == plain
    assert max(r.metrics["mean_accepted_length"] for r in results) > 2.5


def test_output_does_not_depend_on_earlier_requests(target, prompts, plain):
    """The same prompt after two different histories: the same greedy tokens (only speed
    differs); one history holds the prompt's own earlier output, one only unrelated text."""
    drafter = SuffixDrafter(V, store_tokens=256)
    outs, steps = [], []
    for earlier in (history(prompts, plain, [3]), [list(range(1, 60))] * 3):
        engine = Engine(target, drafter, drafter.empty_store(), num_speculative_tokens=4)
        engine.generate(earlier, max_new_tokens=8)
        result = engine.generate([prompts[3]], max_new_tokens=24)[0]
        outs.append(result.token_ids)
        steps.append(result.metrics["num_steps"])
    assert outs[0] == outs[1] == plain[3]
    assert steps[0] < steps[1]  # the store did change the drafts


# ---- the store ---------------------------------------------------------------------------------
def test_store_keeps_its_size_bound_and_evicts_oldest_first():
    store = suffix_store.empty_store(20)
    for doc in ([1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15]):
        store = suffix_store.add_documents(store, [doc], "fifo")
    assert suffix_store.documents(store) == [[1, 2, 3, 4, 5], [6, 7, 8, 9], list(range(10, 16))]
    store = suffix_store.add_documents(store, [[20, 21, 22]], "fifo")  # 19 + 4 > 20: one goes
    assert suffix_store.documents(store) == [[6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [20, 21, 22]]
    assert np.asarray(store.tokens).shape == (20,)
    store = suffix_store.add_documents(store, [list(range(30, 60))], "fifo")  # longer than S
    assert suffix_store.documents(store) == [list(range(41, 60))]  # its last S - 1 tokens
    assert suffix_store.used_tokens(store) == 19


def test_lru_keeps_the_document_a_new_one_repeats():
    used = list(range(100, 110))
    store = suffix_store.empty_store(32)
    for doc in (used, list(range(200, 210)), list(range(300, 305))):
        store = suffix_store.add_documents(store, [doc], "lru")
    new = [1, 2, *used[1:9], 3]  # repeats 8 tokens of the oldest document
    lru = suffix_store.add_documents(store, [new], "lru")
    fifo = suffix_store.add_documents(store, [new], "fifo")
    assert used in suffix_store.documents(lru)
    assert used not in suffix_store.documents(fifo)
    assert list(range(200, 210)) not in suffix_store.documents(lru)  # the least recently used


def test_a_document_that_continues_a_stored_one_supersedes_it():
    store = suffix_store.add_documents(suffix_store.empty_store(64), [[1, 2, 3], [9, 9]])
    store = suffix_store.add_documents(store, [[1, 2, 3, 4, 5]])  # an agent's next call
    assert suffix_store.documents(store) == [[9, 9], [1, 2, 3, 4, 5]]


def test_bad_suffix_settings_are_clear_errors():
    with pytest.raises(JaxspecError, match="speculative.suffix.eviction"):
        load_config(None, ["speculative.method=suffix", "speculative.suffix.eviction=random"])
    with pytest.raises(JaxspecError, match="speculative.suffix.then"):
        load_config(None, ["speculative.method=suffix", "speculative.suffix.then=ngram"])
    with pytest.raises(JaxspecError, match="chains only"):
        load_config(None, ["speculative.method=suffix", "speculative.suffix.then=eagle",
                           "speculative.tree.kind=dynamic"])
    with pytest.raises(JaxspecError, match="min_match"):
        SuffixDrafter(V, min_match=4, max_match=2)


# ---- the law -----------------------------------------------------------------------------------
LAW_V = 8
LAW_PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 6, 1, 7, 0]
LAW_HISTORY = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [7, 0, 1, 2, 3, 1], [0, 3, 3, 1, 7, 0, 2]]
FILTERED = dict(temperature=0.6, top_k=6, top_p=0.95, min_p=0.05)


@pytest.fixture(scope="module")
def law_target():
    return tiny_model(seed=5, scale=0.3, vocab=LAW_V, layers=2, hidden=32, eos=(-1,))


def law_drafter(tree: bool) -> tuple[SuffixDrafter, suffix_store.SuffixStore]:
    drafter = SuffixDrafter(LAW_V, store_tokens=64, candidates=8, min_token_prob=0.0,
                            max_spec_factor=2.0, budget=6 if tree else 0, depth=3 if tree else 0)
    return drafter, drafter.observe(drafter.empty_store(), LAW_HISTORY)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampled_suffix_output_has_the_target_law(law_target, tree):
    drafter, store = law_drafter(tree)
    sp = SamplingParams.make(**FILTERED)
    p, results = pvalue(law_target, drafter, store, sp, LAW_PROMPT, rows=12000, gamma=3)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    assert 0.03 * drafted < accepted < 0.95 * drafted  # acceptance and rejection both happen
    assert p > PASS_P


@dataclasses.dataclass(frozen=True)
class PeekingSuffix(SuffixDrafter):
    """Broken: proposes its continuation only on steps whose acceptance uniform for the first
    node is below 1/2 -- it peeks at the step's draw (the test hands it the acceptance key)."""

    def propose(self, dparams, tparams, state, ctx, num_tokens, sampling, keys):
        proposal, state = super().propose(dparams, tparams, state, ctx, num_tokens, sampling, keys)
        u0 = jax.vmap(lambda k: jax.random.uniform(k, (num_tokens + 1,))[0])(keys)  # [B]
        return proposal._replace(num_proposed=jnp.where(u0 < 0.5, proposal.num_proposed, 0)), state


@pytest.mark.patches_traced_code
def test_suffix_proposals_that_peek_at_the_draw_fail(law_target, monkeypatch):
    real = speculate.drafted_step

    def leak(spec, tparams, dparams, state, sp, k_draft, k_accept, allowed):
        return real(spec, tparams, dparams, state, sp, k_accept, k_accept, allowed)

    monkeypatch.setattr(speculate, "drafted_step", leak)
    good, store = law_drafter(False)
    broken = PeekingSuffix(**{f.name: getattr(good, f.name) for f in dataclasses.fields(good)})
    sp = SamplingParams.make(**FILTERED)
    p, _ = pvalue(law_target, broken, store, sp, LAW_PROMPT, rows=6000, gamma=3)
    assert p < FAIL_P
