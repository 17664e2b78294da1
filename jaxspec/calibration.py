"""Step-cost calibration: how long one target forward takes for a batch of B rows verifying a
window of 1..γ+1 entries, on this machine, for this model. Adaptive speculation (adaptive.py)
divides expected tokens by these costs, so it learns e.g. that on a 2-core CPU a 5-entry window
at batch 32 costs several plain steps while at batch 1 it costs little more than one.

    costs = step_costs(model, batch=8, gamma=4)       # [γ+1] relative: costs[0] == 1.0

Measured once per (model, dtype, layout, device kind, kernel switches) and batch size, by timing
`speculate.verify` (the loop's own verify, same kernels) over a chain window on a cache holding
`FILL` tokens; kept as JSON under <jaxspec cache>/calibration/<key hash>.json. A changed key is a
different file, so a new model, dtype, layout or device measures afresh; `recalibrate=True`
(the CLI's --recalibrate) measures again and overwrites.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import paths, speculate, tree
from jaxspec.cache import init_cache
from jaxspec.models import llama
from jaxspec.sampling import SamplingParams

FILL = 128  # committed tokens in the calibration cache (a typical prompt + some output)
REPS = 7  # timed rounds over all windows; each window's fastest run is kept

Measure = Callable[[Any, int, list[int]], list[float]]  # (model, batch, widths) -> seconds each


def calibration_key(model) -> dict[str, Any]:
    """What a measured cost depends on. A field that changes gives a different cache file."""
    cfg = model.cfg
    return {
        "model": str(getattr(model, "name", "")),
        "source": str(getattr(model, "source_path", "") or ""),
        "config": repr(cfg),  # shapes and dtypes
        "layout": str(getattr(model, "layout", ""))
        or ("packed" if llama.uses_cpu_kernels(model.params) else "unrolled"),
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "kernels": [
            os.environ.get("JAXSPEC_CPU_KERNELS", ""),
            os.environ.get("JAXSPEC_CPU_ATTENTION", ""),
        ],
        "fill": FILL,
    }


def cache_file(model) -> Path:
    key = json.dumps(calibration_key(model), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return paths.cache_root() / "calibration" / f"{digest}.json"


def step_costs(
    model, batch: int, gamma: int, *, recalibrate: bool = False, measure: Measure | None = None
) -> list[float]:
    """Relative step cost for k = 0..γ draft nodes at this batch size: time(1 + k) / time(1).
    Reads the cache; measures (and writes it) for widths it lacks, or all with recalibrate."""
    measure = measure or measure_verify
    path = cache_file(model)
    data = _read(path)
    if data.get("key") != calibration_key(model):
        data = {"key": calibration_key(model), "batches": {}}
    times = {} if recalibrate else dict(data["batches"].get(str(batch), {}))
    missing = [w for w in range(1, gamma + 2) if str(w) not in times]
    if missing:  # the plain window is measured with them: ratios come from one sitting
        widths = sorted(set(missing) | {1})
        times |= {str(w): t for w, t in zip(widths, measure(model, batch, widths))}
    data["batches"][str(batch)] = times
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    base = times["1"]
    return [times[str(w)] / base for w in range(1, gamma + 2)]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("batches"), dict) else {}


@functools.partial(jax.jit, static_argnames=("spec", "width"))
def _verify(spec, tparams, cache, window, sp, width):
    probs, _, cache, window_kv = speculate.verify(spec, tparams, cache, window, sp, width)
    return probs, cache, window_kv


def measure_verify(model, batch: int, widths: list[int]) -> list[float]:
    """Seconds for one target forward over a chain window of each width at this batch size. The
    widths are timed in interleaved rounds and each keeps its fastest run: on a shared machine
    load comes and goes, and the minimum is the cost the program itself has."""
    cfg = model.cfg
    spec = speculate.LoopSpec(cfg=cfg, drafter=None, num_speculative_tokens=0, eos_ids=())
    stacked = isinstance(model.params["layers"], dict)
    cache = init_cache(
        cfg.num_layers, batch, FILL + 64, cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype, stacked
    ).with_lengths(jnp.full((batch,), FILL, jnp.int32))
    sp = SamplingParams.make()
    runs = {}
    for width in widths:
        n = width - 1
        window = tree.build_window(
            jnp.ones((batch,), jnp.int32),
            cache.lengths,
            jnp.ones((batch, n), jnp.int32),
            tree.chain_parents(batch, n),
            jnp.full((batch,), n, jnp.int32),
        )
        runs[width] = functools.partial(_verify, spec, model.params, cache, window, sp, width)
        jax.block_until_ready(runs[width]())  # compile
    best = {w: math.inf for w in widths}
    for _ in range(REPS):
        for width in widths:
            t0 = time.perf_counter()
            jax.block_until_ready(runs[width]())
            best[width] = min(best[width], time.perf_counter() - t0)
    return [best[w] for w in widths]
