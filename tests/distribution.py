"""One exact-distribution check for every sampled-output test: the exact law of the first few
generated tokens of a tiny target (enumerating every prefix, EOS-terminated sequences included),
the law the engine's rows actually produced, and a chi-square test between them.

A sequence is a tuple of `num_tokens` ids; after an EOS the remaining places hold `V` (absent),
so `law[seq]` indexes an array of shape (V + 1,) * num_tokens.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jaxspec.decode import sampling
from jaxspec.engine.runner import Engine
from tiny import target_logits

PASS_P = 1e-3  # a correct rule passes at this level
FAIL_P = 1e-6  # a broken rule must fail below this one


_LAWS: dict = {}  # the tests ask for the same law many times (one per drafter and broken variant)


def exact_law(model, prompt, sp, num_tokens: int, eos=()) -> np.ndarray:
    """Exact probability of every generated sequence of `num_tokens` tokens (EOS stops a row)."""
    params = jax.tree.leaves(model.params)
    sampling_values = tuple(float(x) for x in (sp.temperature, sp.top_k, sp.top_p, sp.min_p))
    key = (model.target, tuple(id(x) for x in params), tuple(prompt), sampling_values, num_tokens,
           tuple(eos))
    if key not in _LAWS:
        _LAWS[key] = (params, _exact_law(model, prompt, sp, num_tokens, eos))  # params: ids stay live
    return _LAWS[key][1]


def _exact_law(model, prompt, sp, num_tokens: int, eos) -> np.ndarray:
    v = model.target.vocab_size
    prefixes = list(itertools.product(range(v), repeat=num_tokens - 1))
    ids = jnp.asarray([list(prompt) + list(seq) for seq in prefixes])  # [V^(n-1), P+n-1]
    logits = target_logits(model.params, ids, model.target)
    # The sampling transform op by op, not fused into one program: XLA:CPU at the suite's backend
    # optimisation level 0 was seen to miscompile it fused (a kept boundary token's weight came
    # out 0; the default level was right). The engine's programs are checked against this law.
    probs = np.asarray(sampling.logits_to_probs(logits, sp), np.float64)  # [R, T, V]
    row_of = {seq: i for i, seq in enumerate(prefixes)}
    law = np.zeros((v + 1,) * num_tokens)

    def walk(seq: tuple, prob: float) -> None:
        k = len(seq)
        p = probs[row_of[seq + (0,) * (num_tokens - 1 - k)], len(prompt) - 1 + k]
        for t in np.flatnonzero(p):
            s, q = seq + (int(t),), prob * p[t]
            if k + 1 == num_tokens or int(t) in eos:
                law[s + (v,) * (num_tokens - k - 1)] += q
            else:
                walk(s, q)

    walk((), 1.0)
    return law


def counts_of(token_lists, vocab: int, num_tokens: int) -> np.ndarray:
    """Histogram of generated sequences in the same indexing as `exact_law`."""
    counts = np.zeros((vocab + 1,) * num_tokens)
    for ids in token_lists:
        ids = list(ids)[:num_tokens]
        counts[tuple(ids) + (vocab,) * (num_tokens - len(ids))] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, law: np.ndarray) -> float:
    """Chi-square p-value of observed counts against an exact law. Cells expected below 5 are
    pooled into one; a sequence of probability zero observed even once gives 0."""
    expected = law.ravel() * counts.sum()
    observed = counts.ravel()
    if observed[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def sample_rows(target, drafter, dparams, sp, prompts, *, rows, num_tokens, gamma=2, seed=3,
                batch_size=None):
    """Generate `rows` rows cycling over `prompts`; returns the engine's results in row order."""
    engine = Engine(target, drafter, dparams, num_speculative_tokens=gamma)
    batch = [prompts[i % len(prompts)] for i in range(rows)]
    return engine.generate(batch, max_new_tokens=num_tokens, sampling=sp, seed=seed,
                           batch_size=batch_size or rows)


def pvalue(target, drafter, dparams, sp, prompt, *, rows, num_tokens=3, gamma=2, seed=3):
    """(chi-square p-value of sampled rows against the exact law, the results)."""
    results = sample_rows(target, drafter, dparams, sp, [prompt], rows=rows,
                          num_tokens=num_tokens, gamma=gamma, seed=seed)
    v = target.target.vocab_size
    counts = counts_of([r.token_ids for r in results], v, num_tokens)
    law = exact_law(target, prompt, sp, num_tokens, tuple(target.eos_token_ids))
    return chi_square_pvalue(counts, law), results
