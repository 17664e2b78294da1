"""Benchmark rows: one `GenerationResult` -> a per-prompt row; rows -> aggregate figures; the
per-config / per-category summary of a run. Pure functions over lists of dicts (no engines, no
timing), so the figures in results.json can be recomputed from its per-prompt rows.

    row = record(result, wall_s)                       # one prompt of one method
    agg = aggregate(method_rows, baseline_rows, gamma)  # speedup, accepted length, alpha, ...
"""

from __future__ import annotations

import statistics
from typing import Any

from jaxspec.bench import formula

SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else 0.0


def ratio(a: float, b: float) -> float | None:
    return a / b if a and b else None


def record(result, wall_s: float) -> dict[str, Any]:
    """One GenerationResult -> the per-prompt row kept in results.json."""
    n = result.num_generated_tokens
    m = result.metrics
    decode_s = (n - 1) / result.decode_tokens_per_s if n > 1 and result.decode_tokens_per_s else 0.0
    total_s = result.time_to_first_token_s + decode_s
    return {
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_generated_tokens": n,
        "ttft_s": result.time_to_first_token_s,
        "decode_s": decode_s,
        "wall_s": wall_s,
        "tokens_per_s": result.decode_tokens_per_s,
        "e2e_tokens_per_s": n / total_s if total_s > 0 else 0.0,
        "num_steps": m["num_steps"],
        "num_draft_tokens": m["num_draft_tokens"],
        "num_accepted_tokens": m["num_accepted_tokens"],
        "accepted_per_position": m["accepted_per_position"],
        "token_ids": result.token_ids,
        "compile_s": m.get("compile_s", 0.0),  # must be 0: compilation happens in the warm-up
    } | {k: m[k] for k in CALIBRATION if k in m}


# a DSpark chain's confidence head against verification (dspark_heads.calibration_metrics)
CALIBRATION = ("confidence_predicted_per_position", "confidence_observed_per_position",
               "confidence_steps_per_position", "verify_length_hist",
               "confidence_used_per_position")


def calibration(rows: list[dict]) -> dict[str, Any]:
    """Rows with a confidence record -> per draft position the mean predicted survival and the
    observed acceptance over every verified step of every row, and the verify lengths chosen
    (summed); {} when no row has one."""
    rows = [r for r in rows if "confidence_steps_per_position" in r]
    if not rows:
        return {}
    n = [sum(c) for c in zip(*(r["confidence_steps_per_position"] for r in rows))]

    def pooled(key):
        tot = [0.0] * len(n)
        for r in rows:
            for i, (x, k) in enumerate(zip(r.get(key) or [], r["confidence_steps_per_position"])):
                tot[i] += (x or 0.0) * k
        return [round(t / k, 4) if k else None for t, k in zip(tot, n)]

    return {"confidence_predicted_per_position": pooled("confidence_predicted_per_position"),
            "confidence_observed_per_position": pooled("confidence_observed_per_position"),
            # the survival the scheduler priced with (the online-corrected confidence)
            "confidence_used_per_position": pooled("confidence_used_per_position"),
            "confidence_steps_per_position": n,
            "verify_length_hist": [sum(c) for c in zip(*(r["verify_length_hist"] for r in rows))]}


def aggregate(rows: list[dict], base_rows: list[dict], gamma: int) -> dict[str, Any]:
    """Method rows + the baseline rows of the same prompts -> one overall/category object."""
    tps = mean(r["tokens_per_s"] for r in rows)
    e2e = mean(r["e2e_tokens_per_s"] for r in rows)
    btps = mean(r["tokens_per_s"] for r in base_rows)
    be2e = mean(r["e2e_tokens_per_s"] for r in base_rows)
    steps = sum(r["num_steps"] for r in rows)
    emitted = sum(max(r["num_generated_tokens"] - 1, 0) for r in rows)
    drafted = sum(r["num_draft_tokens"] for r in rows)
    accepted = sum(r["num_accepted_tokens"] for r in rows)
    mal = emitted / steps if steps else 1.0
    per_pos = [0.0] * gamma
    for r in rows:
        for i, a in enumerate(r["accepted_per_position"][:gamma]):
            per_pos[i] += a * r["num_steps"]
    per_pos = [x / steps if steps else 0.0 for x in per_pos]
    step_s = sum(r["decode_s"] for r in rows) / steps if steps else 0.0
    bsteps = sum(r["num_steps"] for r in base_rows)
    base_step_s = sum(r["decode_s"] for r in base_rows) / bsteps if bsteps else 0.0
    cost = ratio(step_s, base_step_s)
    matches = [r["token_ids"] == b["token_ids"] for r, b in zip(rows, base_rows)]
    alpha = formula.alpha_from_accepted_length(mal, gamma) if gamma else None
    return {
        "num_prompts": len(rows),
        "num_generated_tokens": sum(r["num_generated_tokens"] for r in rows),
        "tokens_per_s": tps,
        "baseline_tokens_per_s": btps,
        "speedup": ratio(tps, btps),
        "e2e_tokens_per_s": e2e,
        "baseline_e2e_tokens_per_s": be2e,
        "e2e_speedup": ratio(e2e, be2e),
        "mean_accepted_length": mal,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "nodes_per_step": drafted / steps if steps else 0.0,  # draft nodes verified per forward
        "accepted_per_position": per_pos,
        "step_cost_ratio": cost,
        "alpha_from_accepted_length": alpha,
        "predicted_speedup": (
            formula.speedup(alpha, gamma, step_cost=cost)
            if gamma and alpha is not None and cost
            else None
        ),
        "outputs_match_baseline": all(matches) if matches else None,
        "match_rate": sum(matches) / len(matches) if matches else None,
        "compile_s_in_timed_runs": sum(r.get("compile_s", 0.0) for r in rows),
    } | calibration(rows)


def aggregate_peer(rows: list[dict], base_rows: list[dict], ours: dict[str, list[dict]]):
    """HF rows -> {tokens_per_s, match rate vs our baseline, our e2e/decode ratios to it}."""
    tps = mean(r["tokens_per_s"] for r in rows)
    matches = [r["token_ids"] == b["token_ids"] for r, b in zip(rows, base_rows)]
    ratios = {}
    for label, ours_rows in ours.items():
        ratios[label] = {
            "e2e_ratio": ratio(mean(r["e2e_tokens_per_s"] for r in ours_rows), tps),
            "decode_ratio": ratio(mean(r["tokens_per_s"] for r in ours_rows), tps),
        }
    return {
        "num_prompts": len(rows),
        "tokens_per_s": tps,
        "matches_our_baseline": all(matches) if matches else None,
        "match_rate_vs_our_baseline": sum(matches) / len(matches) if matches else None,
        "ours_over_this": ratios,
    }


def drop_ids(row: dict, keep_ids: bool = False) -> dict:
    return {k: v for k, v in row.items() if keep_ids or k != "token_ids"}


def summarise_configs(
    configs: dict[str, Any], config_paths: dict[str, str], rows: dict[str, list[dict]]
) -> dict[str, Any]:
    """Per config (label -> Config): overall and per-category aggregates against the baseline rows
    of the same prompts. A plain config (method none) reports the baseline's own rows. Returns
    {"configs", "best_config", "overall", "categories"}; {} before the first baseline row."""
    base = rows.get("baseline", [])
    if not base:
        return {}
    cats = [c for c in SPEC_BENCH_CATEGORIES if any(r["category"] == c for r in base)]
    out = {}
    for label, cfg in configs.items():
        gamma = cfg.speculative.num_speculative_tokens if cfg.speculative.method != "none" else 0
        mine = rows.get("baseline" if gamma == 0 else label, [])[: len(base)]
        base_n = base[: len(mine)] if len(mine) < len(base) else base
        out[label] = {
            "config": config_paths.get(label),
            "method": cfg.speculative.method if gamma else "plain",
            "num_speculative_tokens": gamma,
            "overall": aggregate(mine, base_n, gamma),
            "categories": {
                c: aggregate(
                    [r for r in mine if r["category"] == c],
                    [r for r in base_n if r["category"] == c],
                    gamma,
                )
                for c in cats
            },
        }
    spec = {l: e for l, e in out.items() if e["num_speculative_tokens"]}
    pick = max(spec, key=lambda l: spec[l]["overall"]["speedup"] or 0) if spec else next(iter(out))
    return {
        "configs": out,
        "best_config": pick,
        "overall": {"config": pick, **out[pick]["overall"]},
        "categories": out[pick]["categories"],
    }


def summarise_peers(
    summary: dict[str, Any], rows: dict[str, list[dict]], peer_names: list[str]
) -> dict[str, Any]:
    """The HF peers' figures against ours: per peer method overall/per category, and the target
    ratios (our plain and best config over HF plain and HF's best speculative method)."""
    base = rows["baseline"]
    out = summary["configs"]
    cats = [c for c in SPEC_BENCH_CATEGORIES if any(r["category"] == c for r in base)]
    ours = {
        l: rows.get("baseline" if e["num_speculative_tokens"] == 0 else l, [])
        for l, e in out.items()
    }
    if not any(e["num_speculative_tokens"] == 0 for e in out.values()):
        ours["plain (baseline)"] = base
    methods = {}
    for name in peer_names:
        peer = rows.get(name, [])
        n = len(peer)
        ours_n = {l: r[:n] for l, r in ours.items()}
        methods[name] = {
            "overall": aggregate_peer(peer, base[:n], ours_n),
            "categories": {
                c: aggregate_peer(
                    [r for r in peer if r["category"] == c],
                    [r for r in base[:n] if r["category"] == c],
                    {l: [r for r in rs if r["category"] == c] for l, rs in ours_n.items()},
                )
                for c in cats
            },
        }
    plain = methods["hf_plain"]["overall"]["tokens_per_s"]
    best_name = max(
        (m for m in methods if m != "hf_plain"),
        key=lambda m: methods[m]["overall"]["tokens_per_s"],
        default=None,
    )
    best = methods[best_name]["overall"]["tokens_per_s"] if best_name else None
    our_best = summary["overall"]
    targets = {
        "our_plain_e2e_over_hf_plain": ratio(mean(r["e2e_tokens_per_s"] for r in base), plain),
        "our_best_e2e_over_hf_plain": ratio(our_best["e2e_tokens_per_s"], plain),
        "hf_best_speculative": best_name,
        "our_best_e2e_over_hf_best_speculative": ratio(our_best["e2e_tokens_per_s"], best),
        "our_plain_decode_over_hf_plain": ratio(mean(r["tokens_per_s"] for r in base), plain),
        "our_best_decode_over_hf_plain": ratio(our_best["tokens_per_s"], plain),
        "our_best_decode_over_hf_best_speculative": ratio(our_best["tokens_per_s"], best),
    }
    return {"methods": methods, "targets": targets}
