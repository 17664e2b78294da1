"""A one-branch draft tree equals the chain (n-gram greedy and sampled, Medusa greedy), and after
tree steps the kept k/v are bit for bit plain decoding's (compaction). Run with XLA's default code
generation (scripts/test.sh's production part): under the suite's fast flags the sampled
one-branch tree drew from non-finite probabilities (tests/conftest.py). The other tree tests:
tests/test_tree.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_tree import PROMPT_LENGTHS, TREE_DRAFTERS, trained_like
from tiny import motif_prompts

from jaxspec.decode import tree
from jaxspec.decode.sampling import SamplingParams
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine


@pytest.fixture(scope="module")
def prompts():
    return motif_prompts(PROMPT_LENGTHS)


def test_one_branch_tree_equals_the_chain(target, prompts):
    chain = Engine(target, NgramDrafter(vocab_size=64, max_ngram=3), num_speculative_tokens=3)
    one = Engine(target, NgramDrafter(vocab_size=64, max_ngram=3, branches=1, depth=3),
                 num_speculative_tokens=3)
    for sp in (SamplingParams.make(), SamplingParams.make(temperature=0.8, top_p=0.9)):
        a = chain.generate(prompts, max_new_tokens=30, sampling=sp, batch_size=4, seed=5)
        b = one.generate(prompts, max_new_tokens=30, sampling=sp, batch_size=4, seed=5)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert {k: v for k, v in x.metrics.items() if k != "compile_s"} == {
                k: v for k, v in y.metrics.items() if k != "compile_s"
            }
        assert sum(r.metrics["num_accepted_tokens"] for r in a) > 0


def test_one_branch_medusa_tree_equals_the_medusa_chain(target, prompts):
    drafter, dparams = trained_like(target, "medusa")
    chain = Engine(target, drafter, dparams, num_speculative_tokens=3)
    one = Engine(target, dataclasses.replace(drafter, tree_choices=tree.chain_choices(3)),
                 dparams, num_speculative_tokens=3)
    a, b = (e.generate(prompts, max_new_tokens=30, batch_size=4) for e in (chain, one))
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert {k: v for k, v in x.metrics.items() if k != "compile_s"} == {
            k: v for k, v in y.metrics.items() if k != "compile_s"
        }


def test_committed_kv_after_tree_steps_equals_plain_decoding(target, prompts):
    """Compaction: after tree steps, the target k/v below each row's length are bit for bit
    the k/v plain decoding wrote (the packed layout's kernels: fixed-order sums)."""
    drafter, dparams = TREE_DRAFTERS["ngram"](target)
    engine = Engine(target, drafter, dparams, num_speculative_tokens=1)
    plain = Engine(target)
    sp = SamplingParams.make()
    state = engine.decode(engine.prefill(prompts, 20, sp, 0, list(range(4)), 4), sp, 4)
    ref = plain.decode(plain.prefill(prompts, 20, sp, 0, list(range(4)), 4), sp, 40)
    committed = np.asarray(state.lengths) - 1
    assert (np.asarray(state.num_accepted) > 0).any()  # some tree step kept drafts
    for layer in range(2):
        for row in range(4):
            n = committed[row]
            for mine, theirs in ((state.cache.k, ref.cache.k), (state.cache.v, ref.cache.v)):
                np.testing.assert_array_equal(mine[layer][row, :, :n], theirs[layer][row, :, :n])


