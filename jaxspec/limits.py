"""Bounds on user settings, shared by the config, the engine and the sampling params (no jax
import: the config checks them before anything heavy loads)."""

from __future__ import annotations

import math

MAX_SPECULATIVE_TOKENS = 16  # γ above this costs more verify than it can win back
# Below this, logits / T overflow float32 for ordinary logits (T = 1e-38 gave NaN probabilities);
# use 0 for greedy decoding.
MIN_TEMPERATURE = 1e-4


def sampling_problem(temperature, top_k, top_p, min_p) -> tuple[str, str] | None:
    """(field, what to use instead) for the first invalid sampling value, else None. Values are
    Python numbers (non-numbers are reported by the callers' type checks)."""
    t, k, tp, mp = (float(x) for x in (temperature, top_k, top_p, min_p))
    if not (math.isfinite(t) and t >= 0.0):
        return "temperature", "use a finite value >= 0 (0 = greedy)"
    if 0.0 < t < MIN_TEMPERATURE:
        return "temperature", f"use 0 for greedy decoding or a value >= {MIN_TEMPERATURE:g}"
    if not (math.isfinite(k) and k >= 0 and k == int(k) and k <= 2**31 - 1):
        return "top_k", "use an integer >= 0 (0 = off)"
    if not 0.0 < tp <= 1.0:
        return "top_p", "use a value in (0, 1] (1.0 = off)"
    if not 0.0 <= mp < 1.0:
        return "min_p", "use a value in [0, 1) (0.0 = off)"
    return None
