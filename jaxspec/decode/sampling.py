"""Logits -> probabilities (temperature, top-k, top-p, min-p) and sampling.

One transform shared by plain decoding, the drafter and the verifier: speculative decoding is
lossless only if target and draft probabilities both come from `logits_to_probs` with the same
`SamplingParams`. The params are arrays, so changing their values never recompiles.

Cost: temperature 0 is an argmax (a `lax.cond` branch); the vocabulary sort behind top-k/top-p
runs only when one of them is on; min-p is elementwise. A greedy program (mode "greedy") picks
its tokens with `greedy_tokens` (an argmax: no one-hot law, no prefix sum over the vocabulary).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec.errors import JaxspecError
from jaxspec.limits import sampling_problem


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: jax.Array  # f32[]; 0 = greedy (argmax)
    top_k: jax.Array  # int32[]; 0 = off
    top_p: jax.Array  # f32[]; 1.0 = off, in (0, 1]
    min_p: jax.Array  # f32[]; 0.0 = off, in [0, 1)
    # Static (part of the jit cache key): "greedy" and "sampled" compile only their own path, so
    # a greedy program carries no sampling code; "any" decides on device with a lax.cond.
    mode: str = dataclasses.field(default="any", metadata=dict(static=True))

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) -> SamplingParams:
        """Validate host values and store them as arrays (new values reuse compiled code)."""
        t = _host_float("temperature", temperature)
        k = _host_float("top_k", top_k)
        tp = _host_float("top_p", top_p)
        mp = _host_float("min_p", min_p)
        problem = sampling_problem(t, k, tp, mp)
        if problem is not None:
            name, fix = problem
            given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)[name]
            raise JaxspecError(f"{name}={given!r} is invalid: {fix}")
        return cls(
            mode="greedy" if t == 0.0 else "sampled",
            temperature=jnp.asarray(t, jnp.float32),
            top_k=jnp.asarray(int(k), jnp.int32),
            top_p=jnp.asarray(tp, jnp.float32),
            min_p=jnp.asarray(mp, jnp.float32),
        )

    @classmethod
    def rows(cls, settings) -> SamplingParams:
        """Per-row params (serving: each row its own request's): `settings` one (temperature,
        top_k, top_p, min_p) per row, each validated as `make` does. Mode "greedy" when every
        row is greedy (the program carries no sampling code), else "any" (a greedy row's law is
        still the one-hot argmax)."""
        made = [cls.make(*s) for s in settings]
        stack = lambda name: jnp.stack([getattr(m, name) for m in made])  # noqa: E731
        mode = "greedy" if all(m.mode == "greedy" for m in made) else "any"
        return cls(stack("temperature"), stack("top_k"), stack("top_p"), stack("min_p"), mode)

    @property
    def is_greedy(self) -> bool:
        """Host-side check; only valid on concrete (not traced) params."""
        return float(self.temperature) == 0.0


def _host_float(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise JaxspecError(f"{name}={value!r} is not a number: pass a Python or NumPy scalar") from None


def logits_to_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """f32[..., V] logits -> f32[..., V] probs.

    temperature == 0: one-hot of argmax (first max on ties). Otherwise softmax(logits / T)
    restricted to top-k, then top-p of the renormalised top-k set (smallest prefix whose mass
    reaches top_p; the top token is always kept), then min-p (p >= min_p * max p), renormalised.
    Tokens tied with the last kept one are kept too.

    Pass the whole batch ([B, T, V]) rather than vmapping: with scalar params the branches stay
    real `lax.cond`s. (Per-row params under vmap work, but then every branch runs.)
    """
    logits = logits.astype(jnp.float32)
    if sp.mode == "greedy":
        return _greedy_probs(logits, sp)
    if jnp.ndim(sp.temperature) == 1:  # per-row params (serving): each row its own settings
        return _per_row_probs(logits, sp)
    if sp.mode == "sampled":
        return _sampled_probs(logits, sp)
    return lax.cond(sp.temperature == 0.0, _greedy_probs, _sampled_probs, logits, sp)


def _per_row_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """logits_to_probs with per-row params (f32[B] / int32[B] fields, `SamplingParams.rows`):
    vmapped over the logits' batch axis -- the leading one ([B, ...]), the second ([G, B, N]:
    per-head logits), or a flattened [B * F, V] -- so a row's law depends on its own settings."""
    b = sp.temperature.shape[0]
    fields = (sp.temperature, sp.top_k, sp.top_p, sp.min_p)
    one = lambda x, t, k, p, m: logits_to_probs(x, SamplingParams(t, k, p, m, mode=sp.mode))  # noqa: E731
    if logits.shape[0] == b:
        return jax.vmap(one)(logits, *fields)
    if logits.ndim >= 3 and logits.shape[1] == b:
        return jax.vmap(one, in_axes=(1, 0, 0, 0, 0), out_axes=1)(logits, *fields)
    if logits.ndim == 2 and logits.shape[0] % b == 0:
        rows = logits.reshape(b, -1, logits.shape[-1])
        return jax.vmap(one)(rows, *fields).reshape(logits.shape)
    raise ValueError(f"per-row sampling params for {b} rows do not fit logits {logits.shape}")


def _greedy_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    del sp
    v = logits.shape[-1]  # == one_hot(argmax); a row holding NaN: all zero (no token drawable)
    return (jnp.arange(v, dtype=jnp.int32) == _first_max(logits)[..., None]).astype(jnp.float32)


def _first_max(logits: jax.Array) -> jax.Array:
    """f32[..., V] -> int32[...]: the first index of the max; V where a row holds NaN. Two plain
    reductions (XLA:CPU's argmax is ~2x slower), no vocabulary-sized output."""
    v = logits.shape[-1]
    iota = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    top = logits == jnp.max(logits, axis=-1, keepdims=True)
    return jnp.min(jnp.where(top, iota, v), axis=-1)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """f32[..., V] logits -> int32[...]: the token a greedy row emits -- the argmax, first max on
    ties -- picked without building the one-hot law or drawing from it (no vocabulary-sized
    prefix sum). Equal to `sample(key, logits_to_probs(logits, greedy))` for every key,
    INVALID_TOKEN included (a row holding NaN)."""
    first = _first_max(logits.astype(jnp.float32))
    return jnp.where(first < logits.shape[-1], first, INVALID_TOKEN).astype(jnp.int32)


def choose_rows(keys: jax.Array, logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """keys [B], logits [B, V] -> int32[B]: each row's token under `sp`. A greedy program
    (mode "greedy") takes the argmax (`greedy_tokens`); otherwise a draw from `logits_to_probs`."""
    if sp.mode == "greedy":
        return greedy_tokens(logits)
    return sample_rows(keys, logits_to_probs(logits, sp))


def _sampled_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    v = logits.shape[-1]
    # max-subtracted first, then scaled: the top token's x is exactly 0 in every fusion that
    # recomputes it. Scaling first (logits / T, then - max) let XLA round the division
    # differently per fusion, and the cut, read from one copy, excluded the top token of
    # another: every weight 0, no token drawable (seen at T <= 0.1 with top_k 1).
    x = (logits - jnp.max(logits, axis=-1, keepdims=True)) * (1.0 / sp.temperature)
    filter_on = ((sp.top_k > 0) & (sp.top_k < v)) | (sp.top_p < 1.0)
    cut = lax.cond(filter_on, _filter_cut, _no_cut, x, sp)  # [..., 1]
    w = jnp.where(x >= cut, jnp.exp(x), 0.0)
    w = jnp.where(w >= sp.min_p, w, 0.0)  # min-p: w / w_max >= min_p with w_max = 1
    return w / jnp.sum(w, axis=-1, keepdims=True)


def _no_cut(x: jax.Array, sp: SamplingParams) -> jax.Array:
    del sp
    return jnp.full(x.shape[:-1] + (1,), -jnp.inf, x.dtype)


# top-k / top-p read the largest _HEAD scaled logits (lax.top_k: ~0.6 ms for 49152 on a CPU
# core, where a full sort takes ~35 ms). A k above _HEAD, or a nucleus that does not close
# inside the head, falls back to an exact bisection that only iterates when some row needs it.
_HEAD = 256


def _filter_cut(x: jax.Array, sp: SamplingParams) -> jax.Array:
    """Smallest scaled logit kept by top-k then top-p: [..., 1]. x is max-subtracted (<= 0)."""
    v = x.shape[-1]
    h = min(_HEAD, v)
    head = lax.top_k(x, h)[0]  # [..., H] descending
    neg = -x  # [..., V] >= 0, the bisection works on these

    # top-k: keep x >= the k-th largest logit (ties with it kept).
    k_on = (sp.top_k > 0) & (sp.top_k < v)
    k = jnp.where(k_on, sp.top_k, v)
    cut_k = head[..., jnp.clip(k - 1, 0, h - 1)][..., None]
    far_k = k_on & (k > h)
    kth = -_bisect(neg, lambda d: jnp.sum(neg <= d, axis=-1, keepdims=True) >= k, far_k)
    cut_k = jnp.where(k_on, jnp.where(far_k, kth, cut_k), -jnp.inf)

    # top-p on the renormalised top-k set: the smallest prefix whose mass reaches top_p * Z.
    w = jnp.where(x >= cut_k, jnp.exp(x), 0.0)  # [..., V]
    target = sp.top_p * jnp.sum(w, axis=-1, keepdims=True)  # [..., 1]
    hw = jnp.where(head >= cut_k, jnp.exp(head), 0.0)  # [..., H]
    cum = jnp.cumsum(hw, axis=-1)
    count = jnp.maximum(jnp.sum(cum - hw < target, axis=-1, keepdims=True), 1)
    cut_p = jnp.take_along_axis(head, count - 1, axis=-1)
    p_on = sp.top_p < 1.0
    far_p = p_on & (cum[..., -1:] < target)  # the nucleus reaches past the head
    mass = lambda d: jnp.sum(jnp.where(neg <= d, w, 0.0), axis=-1, keepdims=True) >= target  # noqa: E731
    cut_p = jnp.where(far_p, -_bisect(neg, mass, far_p), cut_p)
    cut_p = jnp.where(p_on, cut_p, -jnp.inf)
    return jnp.maximum(cut_k, cut_p)


def _bisect(neg: jax.Array, ok, active: jax.Array) -> jax.Array:
    """Smallest d >= 0 with ok(d) ([..., 1] bool, monotone in d; ok(+inf) holds), per row: [..., 1].

    Exact: bisects the bit patterns of non-negative float32s (ordered like the values), <= 31
    steps, and none at all unless some row is `active`."""
    shape = neg.shape[:-1] + (1,)
    lo = jnp.full(shape, -1, jnp.int32)  # ok(lo) false (virtual)
    hi = jnp.full(shape, 0x7F800000, jnp.int32)  # +inf: ok(hi) true
    active = jnp.broadcast_to(active, shape)

    def body(c):
        lo, hi = c
        mid = lo + (hi - lo) // 2
        good = ok(lax.bitcast_convert_type(mid, jnp.float32))
        step = active & (hi - lo > 1)
        return jnp.where(step & ~good, mid, lo), jnp.where(step & good, mid, hi)

    lo, hi = lax.while_loop(lambda c: jnp.any(active & (c[1] - c[0] > 1)), body, (lo, hi))
    return lax.bitcast_convert_type(hi, jnp.float32)


INVALID_TOKEN = -1  # what `draw` returns for weights with no finite positive mass


def draw(u: jax.Array, weights: jax.Array) -> jax.Array:
    """Inverse-CDF draw: u f32[] in [0, 1), weights f32[V] >= 0 -> int32 index with
    P(i) = weights[i] / sum(weights). O(V) adds instead of V logs (Gumbel-max costs ~4 ms for
    V = 49152 on a CPU core). A zero-weight index is never returned, even where the float32
    prefix sums are not monotone. Weights holding NaN or inf, or all zero (NaN logits, a broken
    model), give INVALID_TOKEN, never a made-up id: the host checks the output after the loop
    (`check_tokens`) and stops with an error."""
    v = weights.shape[-1]
    iota = jnp.arange(v, dtype=jnp.int32)
    c = jnp.cumsum(weights)
    total = c[-1]
    t = jnp.minimum(u * total, jnp.nextafter(total, jnp.float32(0)))  # t < total
    i = jnp.minimum(jnp.sum(c <= t, dtype=jnp.int32), v - 1)
    pos = weights > 0
    # Rounding can only land on a zero weight at ulp-level odds: step back to a positive one.
    below = jnp.max(jnp.where(pos & (iota <= i), iota, -1))
    above = jnp.min(jnp.where(pos, iota, v))
    fallback = jnp.where(below >= 0, below, jnp.minimum(above, v - 1))  # in range even if all 0
    valid = jnp.isfinite(total) & (total > 0)
    return jnp.where(valid, jnp.where(pos[i], i, fallback), INVALID_TOKEN).astype(jnp.int32)


def check_tokens(tokens, where: str = "generation") -> None:
    """Host side, after the device loop: refuse an output holding INVALID_TOKEN (no host sync
    inside the loop). `tokens`: numpy ints."""
    import numpy as np

    if np.any(np.asarray(tokens) < 0):
        raise JaxspecError(
            f"{where} stopped: the model produced non-finite (NaN/inf) or all-zero probabilities, "
            f"so no token could be drawn; the checkpoint's weights or config (rope_theta, "
            f"rms_norm_eps, dtype) are broken: check or re-convert it"
        )


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """probs f32[V] -> int32 token, categorical over probs. Zero-probability tokens are never
    drawn, so greedy one-hot probs return the argmax."""
    return draw(jax.random.uniform(key), probs)


def sample_rows(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """keys [B], probs f32[B, V] -> int32[B]."""
    return jax.vmap(sample)(keys, probs)


def row_keys(key: jax.Array, row_ids: jax.Array, steps) -> jax.Array:
    """One key per row, fold_in(fold_in(key, row_id), step): a row's randomness depends on its
    request id and its own step count only, never on which other rows share the batch.
    row_ids int[B]; steps int[B] or a scalar -> keys [B]."""
    steps = jnp.broadcast_to(jnp.asarray(steps), jnp.shape(row_ids))
    return jax.vmap(lambda r, s: jax.random.fold_in(jax.random.fold_in(key, r), s))(row_ids, steps)
