"""Penalties and logit_bias keep speculation lossless (issue 44 item 2): sampled speculative
output under presence / frequency / repetition penalties and a logit_bias has the exact law of
plain decoding with the same penalties (each position penalised from the counts of its own
prefix), enumerated; and the broken variant that penalises a drafted position from the
committed tokens only (`penalties.window_logits(committed_only=True)`) fails the same test.
"""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from distribution import FAIL_P, PASS_P, chi_square_pvalue, counts_of
from jaxspec.decode import penalties as penalties_lib
from jaxspec.decode import sampling
from jaxspec.decode.sampling import SamplingParams
from jaxspec.drafters.draft_model import layer_skip_drafter
from jaxspec.engine.runner import Engine
from tiny import tiny_model
import test_loop_logprobs as ref

V = 8
PROMPT = [1, 2, 3, 4, 5]
NUM_TOKENS = 3
ROWS = 12000
BROKEN_ROWS = 6000
SETTING = (0.9, 0.7, 1.6, {"3": 1.0, "6": -0.5})  # strong enough that counts matter
SP = dict(temperature=0.8, top_k=7, top_p=0.97)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=5, scale=0.3, vocab=V, layers=2, hidden=32, eos=(-1,))


def exact_penalised_law(model, prompt, sp, setting, num_tokens) -> np.ndarray:
    """P(every generated sequence of `num_tokens` tokens) under plain decoding with penalties:
    each position's logits (one full forward per prefix) adjusted by vLLM's rule from the tokens
    generated before it, then the sampling transform."""
    law = np.zeros((V + 1,) * num_tokens)
    for seq in itertools.product(range(V), repeat=num_tokens):
        logits = ref.full_logits(model, list(prompt) + list(seq[:-1]))
        prob = 1.0
        for k in range(num_tokens):
            adjusted = ref.vllm_adjust(logits[len(prompt) - 1 + k], prompt, seq[:k], setting)
            probs = np.asarray(sampling.logits_to_probs(jnp.asarray(adjusted, jnp.float32), sp),
                               np.float64)
            prob *= probs[seq[k]]
        law[seq] = prob
    return law


_LAWS: dict = {}


def _law(target):
    if id(target) not in _LAWS:  # the module's one target, alive for the module
        _LAWS[id(target)] = exact_penalised_law(target, PROMPT, SamplingParams.make(**SP),
                                                SETTING, NUM_TOKENS)
    return _LAWS[id(target)]


def penalised_pvalue(target, drafter, gamma, rows):
    """(chi-square p-value of `rows` sampled rows against the penalised law, the results)."""
    engine = Engine(target, drafter, num_speculative_tokens=gamma)
    results = engine.generate([PROMPT] * rows, max_new_tokens=NUM_TOKENS,
                              sampling=SamplingParams.make(**SP), seed=3, batch_size=rows,
                              penalties=SETTING)
    counts = counts_of([r.token_ids for r in results], V, NUM_TOKENS)
    return chi_square_pvalue(counts, _law(target)), results


def test_the_reference_law_is_the_penalised_one(target):
    """Control on the reference: the unpenalised law differs from the penalised one."""
    from distribution import exact_law

    plain = exact_law(target, PROMPT, SamplingParams.make(**SP), NUM_TOKENS, ())
    assert np.abs(plain[(slice(0, V),) * NUM_TOKENS] - _law(target)[(slice(0, V),) * NUM_TOKENS]).sum() > 0.2
    assert abs(_law(target).sum() - 1.0) < 1e-6


@pytest.mark.parametrize("name", ["plain", "layer_skip"])
def test_sampling_under_penalties_has_the_plain_law(target, name):
    drafter = None if name == "plain" else layer_skip_drafter(target.target, 1)
    p, results = penalised_pvalue(target, drafter, 2, ROWS)
    if drafter is not None:
        drafted = sum(r.metrics["num_draft_tokens"] for r in results)
        accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
        assert 0.05 * drafted < accepted < 0.95 * drafted  # acceptance and rejection both happen
    assert p > PASS_P


@pytest.mark.patches_traced_code
def test_penalising_from_committed_tokens_only_fails(target, monkeypatch):
    broken = functools.partial(penalties_lib.window_logits, committed_only=True)
    monkeypatch.setattr(penalties_lib, "window_logits", broken)  # speculate reads it
    p, _ = penalised_pvalue(target, layer_skip_drafter(target.target, 1), 2, BROKEN_ROWS)
    assert p < FAIL_P
