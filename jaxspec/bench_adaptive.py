"""Batch sweep for adaptive speculation: plain, fixed-γ and adaptive configs side by side.

    python -m jaxspec.bench_adaptive --config configs/smollm2-135m-ngram.yaml \\
        configs/smollm2-135m-ngram-adaptive.yaml --batch-sizes 1,2,4,8,16,32 \\
        --max-new-tokens 64 --out bench_out/adaptive

Batch sweep prompts: one Spec-Bench question per category whose chat-formatted prompt fits one
length bucket (one compile per engine and batch size), cycled to fill `rounds` batches of b
requests. Per category (batch 1, every category): the first `--per-category` questions of each
category in that category's most common prompt bucket (few compiles), each run by every engine
in turn; speedup = mean over the category's prompts of decode tok/s / plain's (Spec-Bench's
protocol), "all" = over every prompt.
Per batch size: each engine is compiled (and an adaptive one calibrated) untimed, then the
engines run the same batches interleaved (plain, A, B, plain, A, B ...), so machine noise hits
all alike. Throughput = generated tokens / wall time (compilation excluded: an adaptive
engine that switches programs compiles the other one on first use). At batch 1 the per-category speedups are
per prompt. Greedy: every output is checked against plain's. Writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxspec.bench import DEFAULT_DATA, int_list, label_of, read_questions, select
from jaxspec.errors import JaxspecError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench_adaptive")
    p.add_argument("--config", nargs="+", required=True, help="speculative configs (plain added)")
    p.add_argument("--batch-sizes", type=int_list("--batch-sizes", 1, 256), default=[1, 2, 4, 8])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="timed batches per engine and size")
    p.add_argument("--bucket", type=int, default=64, help="prompt-length bucket (tokens)")
    p.add_argument("--per-category", type=int, default=2,
                   help="batch-1 prompts per category (0: skip the per-category run)")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        return run(a)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(a) -> int:
    from jaxspec.build import build_engine
    from jaxspec.cli_support import enable_compilation_cache
    from jaxspec.config import load_config
    from jaxspec.engine import bucket
    from jaxspec.loading import load_model

    enable_compilation_cache()
    configs = {label_of(c): load_config(c, ["sampling.temperature=0"]) for c in a.config}
    first = next(iter(configs.values()))
    target = load_model(first.model.name, dtype=first.model.dtype, layout=first.model.layout)
    engines = {"plain": build_engine(load_config(None, []), target=target)}
    engines |= {label: build_engine(cfg, target=target) for label, cfg in configs.items()}
    questions = select(read_questions(a.data), max(20, a.per_category))
    picked, seen = [], set()
    for q in questions:  # one per category, all in one prompt bucket
        ids = engines["plain"].encode(q["prompt"])
        if q["category"] not in seen and bucket(len(ids)) == a.bucket:
            seen.add(q["category"])
            picked.append((q["category"], ids))
    if not picked:
        raise JaxspecError(f"no prompt fits bucket {a.bucket}: pass another --bucket")
    out = {"settings": vars(a) | {"categories": [c for c, _ in picked]}, "points": []}
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    m = a.max_new_tokens
    for b in a.batch_sizes:
        reqs = [
            picked[i % len(picked)][1]
            for i in range(max(b * a.rounds, len(picked) if b == 1 else 0))
        ]
        point = {"batch_size": b, "num_requests": len(reqs)}
        prep = {}
        for name, engine in engines.items():  # compile (+ calibrate) untimed
            t0 = time.perf_counter()
            engine.warmup(reqs[0], max_new_tokens=m, batch_size=b)
            prep[name] = time.perf_counter() - t0
        point["prepare_s"] = prep
        stats = {
            n: {"tokens": 0, "wall": 0.0, "outputs": [], "metrics": [], "per_req": []}
            for n in engines
        }
        for s in range(0, len(reqs), b):
            chunk = reqs[s : s + b]
            for name, engine in engines.items():
                t0 = time.perf_counter()
                res = engine.generate(chunk, max_new_tokens=m, batch_size=b)
                # an adaptive engine may switch programs between batches: a first use compiles
                dt = time.perf_counter() - t0 - res[0].metrics.get("compile_s", 0.0)
                st = stats[name]
                st["tokens"] += sum(r.num_generated_tokens for r in res)
                st["wall"] += dt
                st["outputs"] += [r.token_ids for r in res]
                st["metrics"] += [r.metrics for r in res]
                st["per_req"] += [sum(r.num_generated_tokens for r in res) / dt]
        base = stats["plain"]["tokens"] / stats["plain"]["wall"]
        for name, st in stats.items():
            tps = st["tokens"] / st["wall"]
            entry = {
                "tokens_per_s": tps,
                "speedup": tps / base,
                "outputs_match": st["outputs"] == stats["plain"]["outputs"],
            }
            ms = st["metrics"]
            if ms and "adaptive_gamma_mean" in ms[0]:
                entry["gamma_mean"] = sum(x["adaptive_gamma_mean"] for x in ms) / len(ms)
                entry["plain_fraction"] = sum(x["adaptive_plain_fraction"] for x in ms) / len(ms)
                entry["switched_off"] = any(x["adaptive_switched_off"] for x in ms)
                entry["step_costs"] = engines[name].step_costs(b)
            if b == 1:
                entry["per_category_speedup"] = {
                    c: st["per_req"][i] / stats["plain"]["per_req"][i]
                    for i, (c, _) in enumerate(picked[: len(st["per_req"])])
                }
            point[name] = entry
        out["points"].append(point)
        (outdir / "results.json").write_text(json.dumps(out, indent=1))
        print(
            json.dumps({"batch": b} | {n: round(point[n]["speedup"], 3) for n in engines}),
            file=sys.stderr,
            flush=True,
        )
    if a.per_category > 0:
        out["categories"] = per_category(a, engines, questions)
        (outdir / "results.json").write_text(json.dumps(out, indent=1))
    (outdir / "summary.md").write_text(summary(out, list(engines)))
    print(summary(out, list(engines)))
    return 0


def per_category(a, engines, questions) -> dict:
    """Batch 1, every category: -> {category: {engine: {speedup, tokens_per_s, ...}}}."""
    from collections import Counter

    from jaxspec.engine import bucket

    plain = engines["plain"]
    by_cat: dict[str, list] = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append((q, plain.encode(q["prompt"])))
    runs = []  # (category, ids)
    for cat, rows in by_cat.items():
        common = Counter(bucket(len(ids)) for _, ids in rows).most_common(1)[0][0]
        runs += [(cat, ids) for _, ids in rows if bucket(len(ids)) == common][: a.per_category]
    ratios: dict[str, dict[str, list]] = {}
    outputs_match: dict[str, bool] = {n: True for n in engines}
    extra: dict[str, dict[str, list]] = {}
    for cat, ids in runs:
        got = {}
        for name, engine in engines.items():
            engine.warmup(ids, max_new_tokens=a.max_new_tokens)  # compile untimed
            got[name] = engine.generate([ids], max_new_tokens=a.max_new_tokens)[0]
        base = got["plain"].decode_tokens_per_s
        for name, r in got.items():
            for key in (cat, "all"):
                ratios.setdefault(key, {}).setdefault(name, []).append(r.decode_tokens_per_s / base)
                if "adaptive_gamma_mean" in r.metrics:
                    e = extra.setdefault(key, {}).setdefault(name, [])
                    e.append((r.metrics["adaptive_gamma_mean"], r.metrics["adaptive_plain_fraction"]))
            outputs_match[name] &= r.token_ids == got["plain"].token_ids
    table = {}
    for key, per in ratios.items():
        table[key] = {}
        for name, xs in per.items():
            entry = {"speedup": sum(xs) / len(xs), "prompts": len(xs)}
            if name in extra.get(key, {}):
                gs = extra[key][name]
                entry["gamma_mean"] = sum(g for g, _ in gs) / len(gs)
                entry["plain_fraction"] = sum(f for _, f in gs) / len(gs)
            table[key][name] = entry
    return {"table": table, "outputs_match": outputs_match}


def summary(out, names) -> str:
    head = (
        "| batch | "
        + " | ".join(f"{n} tok/s (x plain)" for n in names)
        + " | adaptive γ mean / plain steps | outputs equal |"
    )
    lines = [head, "|" + "---|" * (len(names) + 3)]
    for pt in out["points"]:
        cells = [f"{pt[n]['tokens_per_s']:.1f} ({pt[n]['speedup']:.2f}x)" for n in names]
        ad = [
            f"{n}: {pt[n]['gamma_mean']:.2f} / {pt[n]['plain_fraction']:.0%}"
            + (" off" if pt[n]["switched_off"] else "")
            for n in names
            if "gamma_mean" in pt[n]
        ]
        eq = all(pt[n]["outputs_match"] for n in names)
        lines.append(
            f"| {pt['batch_size']} | " + " | ".join(cells) + f" | {'; '.join(ad)} | {eq} |"
        )
    cats = out.get("categories")
    if cats:
        title = "Batch 1 per category (mean per-prompt decode speedup over plain; adaptive: γ mean"
        lines += ["", title + " / plain steps):", ""]
        lines.append("| category | prompts | " + " | ".join(names[1:]) + " |")
        lines.append("|" + "---|" * (len(names) + 1))
        for cat, per in cats["table"].items():
            cells = []
            for n in names[1:]:
                e = per[n]
                cell = f"{e['speedup']:.2f}x"
                if "gamma_mean" in e:
                    cell += f" ({e['gamma_mean']:.2f} / {e['plain_fraction']:.0%})"
                cells.append(cell)
            lines.append(f"| {cat} | {per['plain']['prompts']} | " + " | ".join(cells) + " |")
        lines.append(f"\noutputs equal to plain: {cats['outputs_match']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
