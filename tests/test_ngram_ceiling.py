"""The host replay behind `python -m jaxspec.tools.ngram_ceiling` takes exactly the engine's steps, so its
bounds on prompt lookup are about the text, not an approximation of the drafter."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.tools.ngram_ceiling import ceilings, latest_match, replay_oracle, replay_policy
from tiny import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, layers=2, packed=True)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    out = []
    for n in (6, 14, 23, 31):  # random head, then a repeated motif: matches of every length
        motif = list(rng.integers(1, 64, size=5))
        out.append([int(t) for t in (list(rng.integers(1, 64, size=n // 2)) + motif * 5)[:n]])
    return out


@pytest.fixture(scope="module")
def outputs(target, prompts):
    return [r.token_ids for r in Engine(target).generate(prompts, max_new_tokens=48)]


@pytest.mark.parametrize("gamma,min_ngram,max_ngram", [(1, 1, 3), (4, 1, 3), (4, 2, 3), (6, 2, 5)])
def test_replay_takes_the_engines_steps(target, prompts, outputs, gamma, min_ngram, max_ngram):
    drafter = NgramDrafter(vocab_size=64, min_ngram=min_ngram, max_ngram=max_ngram)
    results = Engine(target, drafter, num_speculative_tokens=gamma).generate(prompts, max_new_tokens=48)
    steps = [r.metrics["num_steps"] for r in results]
    replayed = [replay_policy(p, o, gamma, min_ngram, max_ngram) for p, o in zip(prompts, outputs)]
    assert [r.token_ids for r in results] == outputs
    assert replayed == steps
    assert any(s < len(o) - 1 for s, o in zip(steps, outputs))  # some drafts were accepted


def test_replay_takes_the_engines_steps_on_smollm2(smollm2):
    """The shipped ngram settings on the real model and chat template, where copying is common."""
    prompts = [
        "Repeat this list exactly twice: apple, banana, cherry, date, elderberry, fig.",
        "Rewrite in the past tense: The cat sits on the mat. The dog runs to the park.",
    ]
    plain = Engine(smollm2).generate(prompts, max_new_tokens=40)
    spec = Engine(smollm2, NgramDrafter(smollm2.cfg.vocab_size, 2, 3), num_speculative_tokens=4)
    results = spec.generate(prompts, max_new_tokens=40)
    ids = [spec.encode(p) for p in prompts]
    replayed = [replay_policy(i, r.token_ids, 4, 2, 3) for i, r in zip(ids, plain)]
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert replayed == [r.metrics["num_steps"] for r in results]
    assert sum(replayed) < sum(len(r.token_ids) - 1 for r in plain)  # some drafts were accepted


def test_latest_match_prefers_the_longest_then_the_latest():
    seq = [5, 1, 2, 9, 1, 2, 7, 3, 1, 2]  # suffix [1, 2] at 1 and 4; [3, 1, 2] nowhere earlier
    assert latest_match(seq, len(seq), 1, 3) == (6, 2)  # continuation of the later [1, 2]
    assert latest_match(seq, len(seq), 3, 3) == (0, 0)


def test_oracle_copies_the_best_continuation():
    prompt = [9, 1, 2, 5, 6, 7, 3, 1, 2, 8, 1]
    output = [2, 5, 6, 7, 4]  # 2 comes from prefill; 5 6 7 follow the first [1, 2] only
    # latest [1, 2] continues with 8: rejected, the target gives 5; then [1, 2, 5] -> 6 7 (+4)
    assert replay_policy(prompt, output, 4, 1, 3) == 2
    assert replay_oracle(prompt, output, gamma=4, min_match=1) == 1  # 5 6 7 + the target's 4
    assert replay_oracle(prompt, output, gamma=2, min_match=1) == 2  # 5 6 (+7), then 4
    table = ceilings([{"category": "qa", "prompt": prompt, "output": output}], 4, 1, 3)
    assert table["qa"] == {"policy": 2.0, "oracle_n1": 4.0}
