"""Logprobs and penalties inside the decode loop (issue 44 items 1 and 3):

- the emitted tokens' logprobs (and top-k) equal a full forward's log_softmax at the position
  that emitted each token, greedy and sampled, plain, chain, tree and adaptive decoding;
- "processed" logprobs with penalties equal a numpy recomputation from that forward (vLLM's
  penalties at each position, then the sampling transform);
- greedy decoding with penalties and logit_bias follows a numpy reference token for token, and
  greedy speculative == greedy plain with the same penalties, for chain, tree and draft model;
- no logprobs and no penalties: nothing of either is in the state (the program as before).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import AdaptiveConfig
from jaxspec.decode import sampling
from jaxspec.decode.sampling import SamplingParams
from jaxspec.drafters.draft_model import layer_skip_drafter
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from tiny import sequence_logits, tiny_model

V = 64
PROMPTS = [[5, 9, 3, 5, 9, 3, 5, 9], [7, 1, 7, 1, 7, 2, 7]]
PENALTIES = (0.4, 0.3, 1.25, {"11": 2.5, "44": -3.0})
K = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1, vocab=V, layers=2, hidden=32, eos=(-1,))


def drafter_for(model, name):
    """(drafter, γ): prompt lookup as a chain and as a tree, and a draft model (sampled q)."""
    if name == "plain":
        return None, 0
    if name == "ngram":
        return NgramDrafter(V, 1, 3), 3
    if name == "ngram_tree":
        return NgramDrafter(V, 1, 3, branches=2, depth=3), 3
    return layer_skip_drafter(model.target, 1), 2


def full_logits(model, ids) -> np.ndarray:
    """f64[T, V]: the target's logits over a whole sequence, one forward."""
    return sequence_logits(model.target, model.params, ids)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def vllm_adjust(logits, prompt, generated, setting):
    """numpy transcription of vLLM's penalties + logit_bias at one position."""
    presence, frequency, repetition, bias = setting
    out = np.asarray(logits, np.float64).copy()
    counts = np.bincount(np.asarray(generated, int), minlength=len(out))
    seen = counts > 0
    seen[np.asarray(prompt, int)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    out -= frequency * counts + presence * (counts > 0)
    for tok, b in bias.items():
        out[int(tok)] += b
    return out


@pytest.mark.parametrize("name", ["plain", "ngram", "ngram_tree", "layer_skip"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_a_full_forward(model, name, temperature):
    drafter, gamma = drafter_for(model, name)
    engine = Engine(model, drafter, num_speculative_tokens=gamma, logprobs=K)
    sp = SamplingParams.make(temperature=temperature)
    results = engine.generate(PROMPTS, max_new_tokens=14, sampling=sp, seed=4, batch_size=2)
    for prompt, r in zip(PROMPTS, results):
        ref = log_softmax(full_logits(model, prompt + r.token_ids))
        assert len(r.logprobs) == len(r.token_ids) == 14
        for i, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs)):
            row = ref[len(prompt) - 1 + i]  # the position that predicted token i
            assert abs(entry["logprob"] - row[tok]) < 1e-4, (i, entry["logprob"], row[tok])
            ids, values = zip(*entry["top"])
            np.testing.assert_allclose(values, np.sort(row)[::-1][:K], atol=1e-4)
            np.testing.assert_allclose(row[list(ids)], values, atol=1e-4)
    if drafter is not None and (temperature == 0.0 or name == "layer_skip"):
        # drafted tokens were accepted: their logprobs came from the path (prompt lookup's
        # one-hot drafts are rarely accepted on this flat model at temperature 0.9)
        assert sum(r.metrics["num_accepted_tokens"] for r in results) > 0


# Found by a seeded search over prompts (the same model): the trigram [50, 3, 24] (24 is the
# prefill's greedy token) occurs twice; the most recent match (the tree's branch 0, and what the
# chain drafts) continues 62, 26, 28, the earlier one (branch 1) 11, 19, 15: what greedy writes.
BRANCH_PROMPT = [59, 12, 50, 3, 24, 11, 19, 15, 8, 9, 50, 3, 24, 62, 26, 28, 46, 4, 57, 14, 10, 35, 50, 3]


def test_tree_logprobs_along_a_non_first_branch_at_depth_three(model):
    """One tree step accepts three tokens through branch 1 (nodes 2, 4, 6 in the level-by-level
    layout, not 1, 2, 3): the chain, which drafts branch 0 alone, takes more steps for the same
    tokens; every token's logprob still equals the full forward's at the node that predicted it."""
    tree = Engine(model, NgramDrafter(V, 1, 3, branches=2, depth=3), num_speculative_tokens=3,
                  logprobs=K)
    chain = Engine(model, NgramDrafter(V, 1, 3), num_speculative_tokens=3)
    [t] = tree.generate([BRANCH_PROMPT], max_new_tokens=4)
    [c] = chain.generate([BRANCH_PROMPT], max_new_tokens=4)
    assert t.token_ids == c.token_ids
    assert t.metrics["num_steps"] == 1 and t.metrics["num_accepted_tokens"] == 3, t.metrics
    assert t.metrics["accepted_per_position"][2] == 1.0
    assert c.metrics["num_steps"] >= 2, c.metrics  # branch 0 alone did not accept all three
    ref = log_softmax(full_logits(model, BRANCH_PROMPT + t.token_ids))
    for i, (tok, entry) in enumerate(zip(t.token_ids, t.logprobs)):
        row = ref[len(BRANCH_PROMPT) - 1 + i]
        assert abs(entry["logprob"] - row[tok]) < 1e-4, (i, entry["logprob"], row[tok])
        np.testing.assert_allclose([v for _, v in entry["top"]], np.sort(row)[::-1][:K], atol=1e-4)


def test_adaptive_one_token_steps_record_logprobs_too(model):
    """Adaptive speculation's plain steps (the one-token branch) record as the window step."""
    adaptive = AdaptiveConfig(enabled=True, step_costs=[1.0, 3.0, 3.1, 3.2])  # mostly plain
    engine = Engine(model, NgramDrafter(V, 2, 3), num_speculative_tokens=3, logprobs=2,
                    adaptive=adaptive)
    [r] = engine.generate([PROMPTS[1]], max_new_tokens=12, sampling=SamplingParams.make())
    ref = log_softmax(full_logits(model, PROMPTS[1] + r.token_ids))
    got = [e["logprob"] for e in r.logprobs]
    want = [ref[len(PROMPTS[1]) - 1 + i, t] for i, t in enumerate(r.token_ids)]
    np.testing.assert_allclose(got, want, atol=1e-4)


def greedy_reference(model, prompt, steps, setting):
    """Plain greedy decoding with penalties, recomputed from full forwards in numpy."""
    out = []
    for _ in range(steps):
        logits = full_logits(model, prompt + out)[-1]
        out.append(int(np.argmax(vllm_adjust(logits, prompt, out, setting))))
    return out


@pytest.mark.parametrize("name", ["plain", "ngram", "ngram_tree", "layer_skip"])
def test_greedy_with_penalties_follows_the_reference(model, name):
    drafter, gamma = drafter_for(model, name)
    engine = Engine(model, drafter, num_speculative_tokens=gamma)
    results = engine.generate(PROMPTS, max_new_tokens=12, batch_size=2, penalties=PENALTIES)
    for prompt, r in zip(PROMPTS, results):
        assert r.token_ids == greedy_reference(model, prompt, 12, PENALTIES)
    plain = Engine(model, None).generate(PROMPTS, max_new_tokens=12, batch_size=2)
    assert [r.token_ids for r in results] != [r.token_ids for r in plain]  # penalties did act
    if name == "layer_skip":  # (penalised text rarely repeats: prompt lookup finds no match)
        assert sum(r.metrics["num_accepted_tokens"] for r in results) > 0


@pytest.mark.parametrize("name", ["plain", "layer_skip"])
def test_processed_logprobs_with_penalties(model, name):
    """mode "processed": log of the law the token was drawn from (penalties, logit_bias,
    temperature, top-k), per position from that position's own counts."""
    drafter, gamma = drafter_for(model, name)
    engine = Engine(model, drafter, num_speculative_tokens=gamma, logprobs=3,
                    logprobs_mode="processed")
    sp = SamplingParams.make(temperature=0.7, top_k=20)
    [r] = engine.generate([PROMPTS[0]], max_new_tokens=12, sampling=sp, seed=2,
                          penalties=PENALTIES)
    prompt = PROMPTS[0]
    logits = full_logits(model, prompt + r.token_ids)
    for i, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs)):
        adjusted = vllm_adjust(logits[len(prompt) - 1 + i], prompt, r.token_ids[:i], PENALTIES)
        probs = np.asarray(sampling.logits_to_probs(jnp.asarray(adjusted, jnp.float32), sp))
        assert probs[tok] > 0  # drawn from its own position's law
        assert abs(entry["logprob"] - np.log(probs[tok])) < 1e-4


def test_nothing_recorded_when_off(model):
    engine = Engine(model, NgramDrafter(V, 1, 3), num_speculative_tokens=3)
    state = engine.prefill([PROMPTS[0]], 8, SamplingParams.make(), 0, [0], 1)
    assert state.logprobs is None and state.penalties is None
    [r] = engine.generate([PROMPTS[0]], max_new_tokens=4, penalties=(0.0, 0.0, 1.0, {}))
    assert r.logprobs is None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: Engine(m, None, logprobs=21), "logprobs=21 is invalid"),
        (lambda m: Engine(m, None, logprobs_mode="soft"), "logprobs_mode='soft' is unknown"),
        (lambda m: Engine(m, None).generate([[1, 2]], penalties=(3.0, 0, 1, None)),
         "presence_penalty=3.0"),
        (lambda m: Engine(m, None).generate([[1, 2]], penalties=(0, 0, 1, {"99": 1})),
         r"ids in \[0, 64\)"),
    ],
)
def test_bad_settings_are_one_line_errors(model, call, match):
    with pytest.raises(JaxspecError, match=match):
        call(model)


def test_penalty_counts_follow_the_committed_tokens(model):
    """The counts the loop carries are the generated tokens' histogram (first token included)."""
    engine = Engine(model, NgramDrafter(V, 1, 3), num_speculative_tokens=3)
    ids = PROMPTS[0]
    state = engine.prefill([ids], 10, SamplingParams.make(), 0, [0], 1, penalties=PENALTIES)
    state = engine.decode(state, SamplingParams.make(), 1 << 30)
    state = jax.device_get(state)
    gen = state.tokens[0, len(ids): state.lengths[0]]
    np.testing.assert_array_equal(state.penalties.counts[0], np.bincount(gen, minlength=V))
    assert set(np.flatnonzero(state.penalties.prompt_mask[0])) == set(ids)


@pytest.mark.patches_traced_code
def test_reading_at_the_emitted_node_instead_of_its_parent_fails(model, monkeypatch):
    """The broken variant: each token's logprob read at its own window node (one position late)
    instead of the node that predicted it; the full-forward comparison catches it."""
    from jaxspec.decode import logprobs as lp

    real = lp.path_scored

    def late(logits, path, path_tokens, num_acc, next_token, k, sp=None, mode="raw"):
        shifted = jnp.concatenate([path[:, 1:], path[:, -1:]], axis=1)
        return real(logits, shifted, path_tokens, num_acc, next_token, k, sp, mode)

    monkeypatch.setattr(lp, "path_scored", late)  # speculate reads it
    engine = Engine(model, NgramDrafter(V, 1, 3), num_speculative_tokens=3, logprobs=1)
    [r] = engine.generate([PROMPTS[0]], max_new_tokens=14)
    assert r.metrics["num_accepted_tokens"] > 0
    ref = log_softmax(full_logits(model, PROMPTS[0] + r.token_ids))
    errors = [abs(e["logprob"] - ref[len(PROMPTS[0]) - 1 + i, t])
              for i, (t, e) in enumerate(zip(r.token_ids, r.logprobs))]
    assert max(errors) > 1e-2
