"""Benchmark the trained drafters against plain decoding on Spec-Bench (spec_bench_dev.jsonl):
greedy, batch 1, the same prompts interleaved per method (CPU noise hits every method alike),
every prompt-length bucket compiled before timing.

    python -m jaxspec.train.bench_trained --per-category 3 --max-new 64 --out bench_out/trained.json

Reports per method and per category: mean accepted length (tokens per target forward, bonus
included), acceptance rate, accepted-per-position, decode tokens/s and speedup over plain.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
METHODS = {
    "eagle": ("eagle", "checkpoints/smollm2-135m-eagle", 4),
    "medusa": ("medusa", "checkpoints/smollm2-135m-medusa", 3),
    "draft": ("draft_model", "checkpoints/smollm2-135m-draft", 3),
}


def pick_prompts(path, per_category: int, max_prompt_tokens: int, encode):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    chosen, counts = [], defaultdict(int)
    for r in rows:
        cat = "mt_bench" if r["category"] in MT_BENCH else r["category"]
        if counts[cat] >= per_category:
            continue
        text = r["turns"][0]
        if len(encode(text)) > max_prompt_tokens:
            continue
        counts[cat] += 1
        chosen.append((cat, r["question_id"], text))
    return chosen


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "data" /
                                          "spec_bench_dev.jsonl"))
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--methods", default="eagle,medusa,draft")
    ap.add_argument("--gammas", default="", help="e.g. eagle=4,medusa=3")
    ap.add_argument("--out", default="bench_out/trained.json")
    args = ap.parse_args(argv)

    import jax

    jax.config.update("jax_compilation_cache_dir", str(Path(".jax_cache").resolve()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from jaxspec.engine.runner import Engine, bucket
    from jaxspec.loading import load_model
    from jaxspec.train.load import load_trained_drafter

    target = load_model("smollm2-135m")
    gammas = dict(kv.split("=") for kv in args.gammas.split(",") if kv)
    engines = {"plain": Engine(target)}
    for name in args.methods.split(","):
        method, path, gamma = METHODS[name]
        drafter, dparams = load_trained_drafter(method, path, target)
        engines[name] = Engine(target, drafter, dparams, num_speculative_tokens=int(gammas.get(name, gamma)))
    prompts = pick_prompts(args.data, args.per_category, args.max_prompt_tokens, engines["plain"].encode)
    buckets = sorted({bucket(len(engines["plain"].encode(t))) for _, _, t in prompts})
    t0 = time.time()
    for b in buckets:  # compile every (method, bucket) before timing
        for e in engines.values():
            e.generate([[1] * (b - 8)], max_new_tokens=args.max_new)
    print(f"warm-up {time.time() - t0:.0f} s, buckets {buckets}, {len(prompts)} prompts", flush=True)
    rows = []
    for cat, qid, text in prompts:
        ref = None
        for name, e in engines.items():
            r = e.generate([text], max_new_tokens=args.max_new)[0]
            if ref is None:
                ref = r.token_ids
            rows.append({
                "method": name, "category": cat, "question_id": qid,
                "identical_to_plain": r.token_ids == ref,
                "tokens": r.num_generated_tokens,
                "tok_s": r.decode_tokens_per_s,
                **{k: r.metrics[k] for k in ("mean_accepted_length", "acceptance_rate", "num_steps", "accepted_per_position")},
            })
        print(cat, qid, {x["method"]: round(x["tok_s"], 1) for x in rows[-len(engines):]}, flush=True)
    summary = summarize(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary, "args": vars(args)}, indent=1))
    print(table(summary))


def summarize(rows):
    out = {}
    plain = {(r["category"], r["question_id"]): r["tok_s"] for r in rows if r["method"] == "plain"}
    by = defaultdict(list)
    for r in rows:
        by[(r["method"], "overall")].append(r)
        by[(r["method"], r["category"])].append(r)
    for (m, cat), rs in by.items():
        steps = sum(r["num_steps"] for r in rs)
        per_pos = None
        if rs[0]["accepted_per_position"]:
            per_pos = np.sum([np.asarray(r["accepted_per_position"]) * r["num_steps"] for r in rs], 0) / max(steps, 1)
        speed = np.mean([r["tok_s"] for r in rs])
        base = np.mean([plain[(r["category"], r["question_id"])] for r in rs])
        out.setdefault(m, {})[cat] = {
            "n": len(rs),
            "mean_accepted_length": float(np.mean([r["mean_accepted_length"] for r in rs])),
            "acceptance_rate": float(np.mean([r["acceptance_rate"] for r in rs])),
            "accepted_per_position": None if per_pos is None else [round(float(x), 3) for x in per_pos],
            "tok_s": float(speed),
            "speedup": float(np.mean([r["tok_s"] / plain[(r["category"], r["question_id"])] for r in rs])),
            "speedup_of_means": float(speed / base),
            "all_identical": all(r["identical_to_plain"] for r in rs),
        }
    return out


def table(summary) -> str:
    lines = ["| method | category | n | mean acc. len | acc. rate | per position | tok/s | speedup | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, cats in summary.items():
        for cat in ["overall"] + sorted(c for c in cats if c != "overall"):
            s = cats[cat]
            pp = "-" if s["accepted_per_position"] is None else " / ".join(f"{x:.2f}" for x in s["accepted_per_position"])
            lines.append(f"| {m} | {cat} | {s['n']} | {s['mean_accepted_length']:.2f} | {s['acceptance_rate']:.2f} | {pp} | "
                         f"{s['tok_s']:.1f} | {s['speedup']:.2f}x | {s['all_identical']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
