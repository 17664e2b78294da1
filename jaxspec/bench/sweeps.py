"""The benchmark's two sweeps of one speculative config against plain decoding, same prompts:

    gamma_sweep(...)   γ = 1, 2, ... at batch 1: accepted length, step cost, speedup, and the
                       Leviathan formula fitted to them (alpha, r(γ) = r0 + r1·γ, optimal γ)
    batch_sweep(...)   batch sizes 1, 2, ...: throughput and latency, and where plain wins

Each fills a dict in results.json as it goes (`on_point()` after every point, so an interrupted
run keeps what it measured).
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxspec.bench import formula
from jaxspec.bench.rows import aggregate, drop_ids, ratio, record


def gamma_sweep(
    sweep: dict[str, Any],
    *,
    cfg,
    target,
    baseline,
    ids: list[list[int]],
    gammas: list[int],
    max_new_tokens: int,
    warm_up: Callable,
    on_point: Callable[[], None],
) -> None:
    """Fills `sweep` ({"points", "formula"}) for `cfg` at each γ in `gammas`."""
    from tqdm import tqdm

    from jaxspec.build import build_engine

    engines = {"baseline": baseline}
    for g in gammas:
        spec = dataclasses.replace(cfg.speculative, num_speculative_tokens=g)
        engines[g] = build_engine(dataclasses.replace(cfg, speculative=spec), target=target)
        warm_up(engines[g], ids, max_new_tokens)
    rows: dict[Any, list] = {k: [] for k in engines}
    for i in tqdm(range(len(ids)), desc="gamma sweep", unit="prompt", file=sys.stderr):
        for k, engine in engines.items():
            res = engine.generate([ids[i]], max_new_tokens=max_new_tokens)[0]
            rows[k].append(record(res, 0.0))
        sweep["points"] = [
            {"gamma": g, **drop_ids(aggregate(rows[g], rows["baseline"], g))} for g in gammas
        ]
        sweep["formula"] = fit_gamma_curve(sweep["points"])
        on_point()


def fit_gamma_curve(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The formula through the sweep: token-weighted alpha, a linear step-cost fit, the curve."""
    pts = [p for p in points if p["step_cost_ratio"]]
    r0, r1 = formula.fit_step_cost([p["gamma"] for p in pts], [p["step_cost_ratio"] for p in pts])
    tot = sum(p["num_generated_tokens"] for p in pts)
    alphas = [(p["alpha_from_accepted_length"], p["num_generated_tokens"]) for p in pts]
    alpha = sum(x * w for x, w in alphas) / tot if tot else 0.0
    gmax = max([16, *(p["gamma"] for p in pts)])
    grid = list(range(1, gmax + 1))
    return {
        "alpha": alpha,
        "alpha_definition": "token-weighted mean of alpha_from_accepted_length over γ points",
        "step_cost_fit": {"r0": r0, "r1": r1, "form": "r(γ) = r0 + r1·γ, least squares"},
        "curve": {"gamma": grid, "speedup": formula.speedup_curve(alpha, grid, r0, r1)},
        "optimal_gamma": formula.optimal_gamma(alpha, r0, r1, gmax),
        "curve_free_verify": {"gamma": grid, "speedup": formula.speedup_curve(alpha, grid, 1.0, 0.0)},
    }


def batch_sweep(
    sweep: dict[str, Any],
    *,
    engines: dict[str, Any],
    ids: list[list[int]],
    batch_sizes: list[int],
    rounds: int,
    max_new_tokens: int,
    warm_up: Callable,
    on_point: Callable[[], None],
) -> None:
    """Fills `sweep["points"]` for engines {"plain": ..., label: speculative}: at batch size b,
    `rounds` full batches of b requests (the 8 shortest prompts, cycled, so every batch size sees
    the same prompt-length bucket); throughput = generated tokens / wall time."""
    from tqdm import tqdm

    (label,) = [k for k in engines if k != "plain"]
    pool = sorted(ids, key=len)[: max(1, min(8, len(ids)))]
    for b in tqdm(batch_sizes, desc="batch sweep", unit="batch size", file=sys.stderr):
        n = b * rounds
        batch_ids = [pool[i % len(pool)] for i in range(n)]
        point: dict[str, Any] = {"batch_size": b, "num_requests": n}
        outputs = {}
        for name, engine in engines.items():
            warm_up(engine, batch_ids, max_new_tokens, batch_size=b)
            tokens, wall, latency, outs = 0, 0.0, [], []
            for s in range(0, n, b):
                chunk = batch_ids[s : s + b]
                t0 = time.perf_counter()
                res = engine.generate(chunk, max_new_tokens=max_new_tokens, batch_size=b)
                dt = time.perf_counter() - t0
                wall += dt
                tokens += sum(r.num_generated_tokens for r in res)
                latency += [dt] * len(chunk)
                outs += [r.token_ids for r in res]
            outputs[name] = outs
            key = "plain" if name == "plain" else "speculative"
            point[f"{key}_tokens_per_s"] = tokens / wall if wall else 0.0
            point[f"{key}_latency_s"] = statistics.fmean(latency)
        point["outputs_match"] = outputs["plain"] == outputs[label]
        point["speedup"] = ratio(point["speculative_tokens_per_s"], point["plain_tokens_per_s"])
        sweep["points"].append(point)
        on_point()
    faster = [p["batch_size"] for p in sweep["points"] if (p["speedup"] or 0) >= 1.0]
    sweep["speculative_faster_at"] = faster
    # the first batch size, after one where speculation won, at which plain decoding wins
    later = [
        p["batch_size"]
        for p in sweep["points"]
        if faster and p["batch_size"] > faster[0] and (p["speedup"] or 0) < 1.0
    ]
    sweep["crossover_batch_size"] = later[0] if later else None
