"""Bounds on user settings, shared by the config, the engine and the sampling params (no jax
import: the config checks them before anything heavy loads)."""

from __future__ import annotations

import math

from jaxspec.errors import JaxspecError

MAX_SPECULATIVE_TOKENS = 16  # γ above this costs more verify than it can win back
# Below this, logits / T overflow float32 for ordinary logits (T = 1e-38 gave NaN probabilities);
# use 0 for greedy decoding.
MIN_TEMPERATURE = 1e-4
# Above this a sampled row is uniform for any logits a model gives; the bound keeps T finite in
# float32 (T = 1e300 becomes inf there).
MAX_TEMPERATURE = 100.0
# The smallest top_p the float32 nucleus keeps a token for (1e-300 becomes 0 there).
MIN_TOP_P = 1e-6


def sampling_problem(temperature, top_k, top_p, min_p) -> tuple[str, str] | None:
    """(field, what to use instead) for the first invalid sampling value, else None. Values are
    Python numbers (non-numbers are reported by the callers' type checks)."""
    t, k, tp, mp = (float(x) for x in (temperature, top_k, top_p, min_p))
    if not (math.isfinite(t) and t >= 0.0):
        return "temperature", "use a finite value >= 0 (0 = greedy)"
    if 0.0 < t < MIN_TEMPERATURE or t > MAX_TEMPERATURE:
        return "temperature", (f"use 0 for greedy decoding or a value in [{MIN_TEMPERATURE:g}, "
                               f"{MAX_TEMPERATURE:g}]")
    if not (math.isfinite(k) and k >= 0 and k == int(k) and k <= 2**31 - 1):
        return "top_k", "use an integer >= 0 (0 = off)"
    if not MIN_TOP_P <= tp <= 1.0:
        return "top_p", f"use a value in [{MIN_TOP_P:g}, 1] (1.0 = off)"
    if not 0.0 <= mp < 1.0:
        return "min_p", "use a value in [0, 1) (0.0 = off)"
    return None


# ---- memory, priced before anything is allocated ------------------------------------------

MEMORY_HEADROOM = 0.9  # of what is free: leave room for activations, logits and the runtime


def kv_cache_bytes(target, params, batch: int, capacity: int) -> int:
    """Bytes of the target's cache for `batch` rows of `capacity` slots, from the shapes its
    `init_cache` would allocate (`jax.eval_shape`: nothing is allocated)."""
    import jax
    import numpy as np

    shapes = jax.eval_shape(lambda p: target.init_cache(p, batch, capacity), params)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def free_memory_bytes() -> tuple[int | None, str]:
    """(bytes free for new buffers, where) on the default device: the device's memory_stats
    where it reports them (TPU, GPU), else the host's available RAM (CPU)."""
    import jax

    dev = jax.devices()[0]
    stats = None
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 -- backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{dev.platform} memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host RAM"
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host RAM"
    except (ValueError, OSError, AttributeError):
        return None, "memory"


def check_cache_fits(target, params, batch: int, capacity: int, free: int | None = None) -> None:
    """A one-line JaxspecError when the target's cache for batch x capacity slots would not fit
    in free memory (checked before the cache is allocated, where XLA would fail with
    RESOURCE_EXHAUSTED or the host would swap)."""
    need = kv_cache_bytes(target, params, batch, capacity)
    where = "memory"
    if free is None:
        free, where = free_memory_bytes()
    if free is None or need <= MEMORY_HEADROOM * free:
        return
    per_row = kv_cache_bytes(target, params, 1, capacity)
    rows = int(MEMORY_HEADROOM * free // per_row) if per_row else 0
    raise JaxspecError(
        f"the KV cache for batch {batch} x {capacity} slots needs {need / 2**30:.1f} GiB, but "
        f"{where} has {free / 2**30:.1f} GiB free: lower generation.batch_size (at most {rows} "
        f"rows fit at this length) or generation.max_context / max_new_tokens"
    )
