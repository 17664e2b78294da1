"""Compare two greedy outputs of the same target, allowing for near-ties.

Greedy speculative output is token-identical to plain greedy output where both compute the target's
logits bit for bit alike (float32 on CPU with the packed kernel layout: verify rows equal the
one-token step). Elsewhere (bfloat16, accelerators, XLA's GEMMs whose reduction order depends on
the window size) the two can round differently, and where the target's top two logits are within
rounding of each other they may pick different tokens; from there the texts differ, both greedy.
`compare_greedy` finds the first difference and measures the target's top-2 logit gap there.

    same, near_tie, gap = compare_greedy(model, prompt_ids, plain_ids, spec_ids)
    assert same or near_tie
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.1}  # logit gaps rounding can flip


def compare_greedy(model, prompt_ids, a, b, margin: float | None = None):
    """model: LoadedModel or models.base.Model (target, params); prompt_ids, a, b: token id lists (a, b the
    generated tokens). Returns (identical, near_tie, gap): near_tie when at the first position
    where a and b differ the target's two best logits are within `margin` (default by dtype)."""
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    i = next((j for j in range(n) if a[j] != b[j]), n)
    if i == n and len(a) == len(b):
        return True, False, float("inf")
    if i == n:  # one stopped earlier (max length / EOS after a shared prefix): not a tie question
        return False, False, float("inf")
    prefix = list(prompt_ids) + a[:i]
    target = model.target
    cache = target.init_cache(model.params, 1, len(prefix) + 1)
    out = target.forward(model.params, jnp.asarray([prefix], jnp.int32), cache)
    logits = target.logits(model.params, out.hidden)
    top = np.sort(np.asarray(logits[0, -1], np.float64))[-2:]
    gap = float(top[1] - top[0])
    margin = NEAR_TIE.get(target.dtype, 0.5) if margin is None else margin
    return False, gap <= margin, gap
