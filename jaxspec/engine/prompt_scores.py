"""Log-probabilities of a prompt's own tokens under the target: what `echo` with `logprobs` on
/v1/completions returns, and what lm-eval's loglikelihood tasks read.

The prompt runs through the target in chunks of SCORE_CHUNK tokens into one KV cache, each chunk
attending the chunks before it (padding sits after the prompt, which a causal forward never lets
earlier positions see): ONE program per cache size whatever the prompt's length, so a server
prepares it before /ready (`score_program`) and no echo request compiles. Each chunk's logits
go through `decode.logprobs.scored` in "raw" mode: log_softmax of the unprocessed logits, the
numbers a transformers forward gives. Token t's entry scores it given tokens 0..t-1; the first
token has none (OpenAI returns null there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import kernels
from jaxspec.decode.logprobs import scored

TOP = 20  # alternatives computed per position (OpenAI's most); a request takes its first k
SCORE_CHUNK = 64  # prompt positions scored per call of the chunk program


@functools.partial(jax.jit, static_argnums=0, donate_argnums=5)
def _score_chunk(target, params, tokens, following, start, cache):
    """tokens int32[1, C] at positions start.. (the cache holds the prompt's 0..start-1),
    following int32[C]: the token after each -> (the cache with the chunk's k/v written,
    chosen f32[C], top ids int32[C, TOP], top values f32[C, TOP])."""
    at = cache.with_lengths(jnp.full((1,), start, jnp.int32))
    out = target.forward(kernels.for_prompts(params), tokens, at)
    logits = target.logits(params, out.hidden[0])  # [C, V]: position t predicts t + 1
    return (out.cache, *scored(logits, following, min(TOP, logits.shape[-1])))


def score_capacity(n: int, capacity: int | None = None) -> int:
    """The cache slots scoring a prompt of n tokens uses: `capacity` (a server's max_context)
    rounded up to whole chunks, else the power of two >= n (few programs for lm-eval's many
    prompt lengths), at least one chunk."""
    size = capacity if capacity is not None else 1 << max(n - 1, 1).bit_length()
    return max(-(-size // SCORE_CHUNK) * SCORE_CHUNK, SCORE_CHUNK)


def _empty_cache(target, params, capacity: int):
    """A zero cache for one row, made on the host (no program runs or compiles for it)."""
    shapes = jax.eval_shape(lambda: target.init_cache(params, 1, capacity))
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def score_program(target, params, capacity: int | None):
    """(jitted function, args, kwargs) of the chunk program scoring prompts in a cache of
    `score_capacity(capacity)` slots (abstract: to compile ahead, as a server's warm-up does)."""
    size = score_capacity(1, capacity)
    cache = jax.eval_shape(lambda: target.init_cache(params, 1, size))
    i32 = jnp.int32
    args = (target, params, jax.ShapeDtypeStruct((1, SCORE_CHUNK), i32),
            jax.ShapeDtypeStruct((SCORE_CHUNK,), i32), jax.ShapeDtypeStruct((), i32), cache)
    return _score_chunk, args, {}


def _direct(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def prompt_logprobs(target, params, ids: list[int], capacity: int | None = None,
                    call=_direct) -> list[dict]:
    """For tokens 1..len(ids)-1: {"logprob": float, "top": [(id, logprob), ...] (TOP of them,
    likeliest first)}, the shape the decode loop's recorded logprobs take. capacity: the cache
    size (a server's max_context, so its one prepared program serves; None: by length); call:
    how the chunk program is called (a server's prepared-executable table)."""
    n = len(ids)
    if n < 2:
        return []
    size = score_capacity(n, capacity)
    padded = np.zeros(size + 1, np.int32)
    padded[:n] = ids
    cache = _empty_cache(target, params, size)
    rows = []
    for start in range(0, n - 1, SCORE_CHUNK):
        tokens = padded[None, start:start + SCORE_CHUNK]
        following = padded[start + 1:start + SCORE_CHUNK + 1]
        cache, *scores = call(_score_chunk, target, params, tokens, following, np.int32(start),
                              cache)
        rows.append(jax.device_get(scores))
    chosen, top_ids, top_values = (np.concatenate(part) for part in zip(*rows))
    return [{"logprob": float(chosen[t]),
             "top": [(int(i), float(v)) for i, v in zip(top_ids[t], top_values[t])]}
            for t in range(n - 1)]
