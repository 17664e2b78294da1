"""Log-probabilities of a prompt's own tokens under the target: what `echo` with `logprobs` on
/v1/completions returns, and what lm-eval's loglikelihood tasks read.

One causal forward over the prompt (padded to a power-of-two length, so few programs compile;
padding sits after the prompt, which a causal forward never lets earlier positions see), its
logits through `decode.logprobs.scored` in "raw" mode: log_softmax of the unprocessed logits,
the numbers a transformers forward gives. Token t's entry scores it given tokens 0..t-1; the
first token has none (OpenAI returns null there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import kernels
from jaxspec.decode.logprobs import scored
from jaxspec.engine.prepare import prompt_bucket

TOP = 20  # alternatives computed per position (OpenAI's most); a request takes its first k


@functools.partial(jax.jit, static_argnames=("target",))
def _scores(target, params, tokens):
    """tokens int32[1, T] -> (chosen f32[T-1], top ids int32[T-1, TOP], top values f32[T-1, TOP])
    for tokens 1..T-1."""
    cache = target.init_cache(params, 1, tokens.shape[1])
    hidden = target.forward(kernels.for_prompts(params), tokens, cache).hidden  # [1, T, D]
    logits = target.logits(params, hidden[0, :-1])  # [T-1, V]: position t predicts t + 1
    return scored(logits, tokens[0, 1:], min(TOP, logits.shape[-1]))


def prompt_logprobs(target, params, ids: list[int]) -> list[dict]:
    """For tokens 1..len(ids)-1: {"logprob": float, "top": [(id, logprob), ...] (TOP of them,
    likeliest first)}, the shape the decode loop's recorded logprobs take."""
    if len(ids) < 2:
        return []
    padded = np.zeros((1, prompt_bucket(len(ids))), np.int32)
    padded[0, : len(ids)] = ids
    chosen, top_ids, top_values = jax.device_get(_scores(target, params, jnp.asarray(padded)))
    n = len(ids) - 1
    return [{"logprob": float(chosen[t]),
             "top": [(int(i), float(v)) for i, v in zip(top_ids[t], top_values[t])]}
            for t in range(n)]
