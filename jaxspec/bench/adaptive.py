"""Batch sweep for adaptive speculation: plain, fixed-γ and adaptive configs side by side.

    python -m jaxspec.bench.adaptive --config configs/smollm2-135m-ngram.yaml \\
        configs/smollm2-135m-ngram-adaptive.yaml --batch-sizes 1,2,4,8,16,32 \\
        --max-new-tokens 64 --out bench_out/adaptive

Batch sweep prompts: one Spec-Bench question per category whose chat-formatted prompt fits one
length bucket (one compile per engine and batch size), cycled to fill `rounds` batches of b
requests. Per category (batch 1, every category): the first `--per-category` questions of each
category in that category's most common prompt bucket (few compiles), each run by every engine
in turn (`--rounds` times over the whole list); speedup = mean over the category's prompts of decode tok/s / plain's (Spec-Bench's
protocol), "all" = over every prompt.
Per batch size: each engine is compiled (and an adaptive one calibrated) untimed, then the
engines run the same batches interleaved (plain, A, B, plain, A, B ...), so machine noise hits
all alike. Each part -- the per-category table first, then each batch size -- runs in its own
process (fresh engines: no history carried between parts, and compiled programs of one batch
size never pile up next to the next size's; `--in-process` runs all in this one), and
results.json / summary.md are rewritten after every part, so a stopped run keeps what finished. Throughput = generated tokens / wall time (compilation excluded: an adaptive
engine that switches programs compiles the other one on first use). At batch 1 the per-category speedups are
per prompt. Greedy: every output is checked against plain's. Writes results.json and summary.md.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import json
import sys
import time
from pathlib import Path

from jaxspec.bench.options import DEFAULT_DATA, int_list
from jaxspec.bench.spec_bench import read_questions, select
from jaxspec.bench.plan import label_of
from jaxspec.cli_support import ArgumentParser
from jaxspec.errors import JaxspecError


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m jaxspec.bench.adaptive")
    p.add_argument("--config", nargs="+", required=True, help="speculative configs (plain added)")
    p.add_argument("--batch-sizes", type=int_list("--batch-sizes", 1, 256), default=[1, 2, 4, 8])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="timed batches per engine and size")
    p.add_argument("--min-rows", type=int, default=0,
                   help="batch sweep: at least this many requests per engine and size (more "
                        "batches at small sizes: a serving-like run, not the first two batches)")
    p.add_argument("--bucket", type=int, default=64, help="prompt-length bucket (tokens)")
    p.add_argument("--per-category", type=int, default=2,
                   help="batch-1 prompts per category (0: skip the per-category run)")
    p.add_argument("--categories", default="",
                   help="per-category run: only these (comma-separated; default: every category)")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--out", required=True)
    p.add_argument("--sweep-first", action="store_true",
                   help="run the batch sizes before the per-category table (one process each)")
    p.add_argument("--in-process", action="store_true",
                   help="run every part in this process (default: one process per part)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child: categories|sweep
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = p.parse_args(argv)
        for flag, value, least in (("--rounds", a.rounds, 1), ("--min-rows", a.min_rows, 0),
                                   ("--max-new-tokens", a.max_new_tokens, 1),
                                   ("--per-category", a.per_category, 0)):
            if value < least:
                p.error(f"{flag}={value}: use an integer >= {least}")
        if a.part is None and not a.in_process:
            return run_parts(a, argv)
        return run(a)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_parts(a, argv) -> int:
    """One child process per part (the per-category table, then each batch size), merged."""
    import resource
    import subprocess

    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    parts = [("categories", [])] if a.per_category > 0 else []
    sweep = [(f"batch{b}", ["--batch-sizes", str(b), "--per-category", "0"]) for b in a.batch_sizes]
    parts = sweep + parts if a.sweep_first else parts + sweep
    out: dict = {"settings": vars(a) | {"parts": {}}, "points": []}
    names = None
    for name, extra in parts:
        sub = outdir / name
        cmd = [sys.executable, "-m", "jaxspec.bench.adaptive", *argv, *extra,
               "--part", "categories" if name == "categories" else "sweep", "--out", str(sub)]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, check=False).returncode
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # MB, largest so far
        out["settings"]["parts"][name] = {
            "returncode": rc, "seconds": time.perf_counter() - t0, "max_rss_mb_so_far": rss,
        }
        print(json.dumps({"part": name, "rc": rc, "max_rss_mb": round(rss)}), file=sys.stderr,
              flush=True)
        try:
            got = json.loads((sub / "results.json").read_text())
        except (OSError, ValueError):
            continue
        names = got.get("engines", names)
        out["settings"]["categories"] = got["settings"].get("categories")
        out["points"] += got.get("points", [])
        if "categories" in got:
            out["categories"] = got["categories"]
        out["engines"] = names
        (outdir / "results.json").write_text(json.dumps(out, indent=1))
        if names:
            (outdir / "summary.md").write_text(summary(out, names))
    if names:
        print(summary(out, names))
    return 0 if names else 1


def run(a) -> int:
    from jaxspec.build import build_engine
    from jaxspec.cli_support import enable_compilation_cache
    from jaxspec.config import load_config
    from jaxspec.engine.runner import bucket
    from jaxspec.loading import load_model

    enable_compilation_cache()
    configs = {label_of(c): load_config(c, ["sampling.temperature=0"]) for c in a.config}
    first = next(iter(configs.values()))
    target = load_model(first.model.name, dtype=first.model.dtype, layout=first.model.layout)
    engines = {"plain": build_engine(load_config(None, []), target=target)}
    engines |= {label: build_engine(cfg, target=target) for label, cfg in configs.items()}
    questions = select(read_questions(a.data), max(20, a.per_category))
    picked = _one_per_category(questions, engines["plain"], a.bucket, bucket)
    out = {"settings": vars(a) | {"categories": [c for c, _ in picked]}, "points": [],
           "engines": list(engines)}
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    m = a.max_new_tokens
    if a.part != "categories" and a.per_category > 0:  # in process: the main table first
        out["categories"] = per_category(a, engines, questions)
        (outdir / "results.json").write_text(json.dumps(out, indent=1))
    for b in a.batch_sizes if a.part != "categories" else []:
        rounds = max(a.rounds, -(-a.min_rows // b))  # batches per engine at this size
        reqs = [
            picked[i % len(picked)][1]
            for i in range(max(b * rounds, len(picked) if b == 1 else 0))
        ]
        point = _batch_point(engines, picked, reqs, b, m)
        out["points"].append(point)
        (outdir / "results.json").write_text(json.dumps(out, indent=1))
        print(
            json.dumps({"batch": b} | {n: round(point[n]["speedup"], 3) for n in engines}),
            file=sys.stderr,
            flush=True,
        )
    if a.part == "categories":
        out["categories"] = per_category(a, engines, questions)
        (outdir / "results.json").write_text(json.dumps(out, indent=1))
    (outdir / "summary.md").write_text(summary(out, list(engines)))
    print(summary(out, list(engines)))
    return 0


def _one_per_category(questions, plain, prompt_bucket: int, bucket) -> list[tuple[str, list[int]]]:
    """(category, prompt ids): the first question of each category whose prompt falls in the
    bucket, so every engine compiles one prompt width."""
    picked, seen = [], set()
    for q in questions:
        ids = plain.encode(q["prompt"])
        if q["category"] not in seen and bucket(len(ids)) == prompt_bucket:
            seen.add(q["category"])
            picked.append((q["category"], ids))
    if not picked:
        raise JaxspecError(f"no prompt fits bucket {prompt_bucket}: pass another --bucket")
    return picked


def _batch_point(engines, picked, reqs, b: int, m: int) -> dict:
    """One batch size: every engine warmed up (untimed), then the batches interleaved across
    engines, timed; each engine's rate, speedup over plain and adaptive figures."""
    point = {"batch_size": b, "num_requests": len(reqs), "batches": -(-len(reqs) // b)}
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
    return _point_entries(point, engines, stats, picked, b)


def _point_entries(point: dict, engines, stats: dict, picked, b: int) -> dict:
    """Each engine's figures at this batch size, beside plain decoding's."""
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
    return point


def per_category(a, engines, questions) -> dict:
    """Batch 1, every category: -> {category: {engine: {speedup, tokens_per_s, ...}}}."""
    from collections import Counter

    from jaxspec.engine.runner import bucket

    plain = engines["plain"]
    by_cat: dict[str, list] = {}
    only = {c.strip() for c in a.categories.split(",") if c.strip()}
    for q in questions:
        if not only or q["category"] in only:
            by_cat.setdefault(q["category"], []).append((q, plain.encode(q["prompt"])))
    runs = []  # (category, ids)
    for cat, rows in by_cat.items():
        common = Counter(bucket(len(ids)) for _, ids in rows).most_common(1)[0][0]
        runs += [(cat, ids) for _, ids in rows if bucket(len(ids)) == common][: a.per_category]
    tps: dict[tuple[int, str], list[float]] = {}  # (prompt, engine) -> decode tok/s per round
    outputs_match: dict[str, bool] = {n: True for n in engines}
    extra: dict[str, dict[str, list]] = {}
    for _ in range(a.rounds):  # the whole list again: each prompt's runs spread over the run
        for i, (cat, ids) in enumerate(runs):
            got = {}
            for name, engine in engines.items():
                engine.warmup(ids, max_new_tokens=a.max_new_tokens)  # compile untimed
                got[name] = engine.generate([ids], max_new_tokens=a.max_new_tokens)[0]
            for name, r in got.items():
                tps.setdefault((i, name), []).append(r.decode_tokens_per_s)
                if "adaptive_gamma_mean" in r.metrics:
                    for key in (cat, "all"):
                        e = extra.setdefault(key, {}).setdefault(name, [])
                        e.append((r.metrics["adaptive_gamma_mean"],
                                  r.metrics["adaptive_plain_fraction"],
                                  r.metrics["adaptive_switched_off"]))
                outputs_match[name] &= r.token_ids == got["plain"].token_ids
    # per prompt: best round / plain's best round (a load spike slows a run, never speeds one
    # up), and the mean over rounds of the per-round ratio; then the mean over prompts
    best: dict[str, dict[str, list]] = {}
    mean: dict[str, dict[str, list]] = {}
    for i, (cat, _) in enumerate(runs):
        for name in engines:
            xs, base = tps[(i, name)], tps[(i, "plain")]
            for key in (cat, "all"):
                best.setdefault(key, {}).setdefault(name, []).append(max(xs) / max(base))
                per_round = [x / y for x, y in zip(xs, base)]
                mean.setdefault(key, {}).setdefault(name, []).append(sum(per_round) / len(xs))
    table = {}
    for key, per in best.items():
        table[key] = {}
        for name, xs in per.items():
            ms = mean[key][name]
            entry = {"speedup": sum(xs) / len(xs), "speedup_mean_of_rounds": sum(ms) / len(ms),
                     "prompts": len(xs), "rounds": a.rounds,
                     "per_prompt": [round(x, 3) for x in xs]}
            if name in extra.get(key, {}):
                gs = extra[key][name]
                entry["gamma_mean"] = sum(g for g, _, _ in gs) / len(gs)
                entry["plain_fraction"] = sum(f for _, f, _ in gs) / len(gs)
                entry["switched_off"] = sum(o for _, _, o in gs) / len(gs)  # prompts run plain
            table[key][name] = entry
    raw = {f"{runs[i][0]}#{i}|{n}": v for (i, n), v in tps.items()}
    costs = {n: e.step_costs(1) for n, e in engines.items() if e.adaptive is not None}
    return {"table": table, "outputs_match": outputs_match, "raw_tokens_per_s": raw,
            "step_costs": costs}


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
        title = ("Batch 1 per category (mean over prompts of decode tok/s, best round, over "
                 "plain's best round; adaptive: γ mean")
        lines += ["", title + " / plain steps):", ""]
        lines.append("| category | prompts | " + " | ".join(names[1:]) + " |")
        lines.append("|" + "---|" * (len(names) + 1))
        for cat, per in cats["table"].items():
            cells = []
            for n in names[1:]:
                e = per[n]
                cell = f"{e['speedup']:.2f}x"
                if "gamma_mean" in e:
                    off = f", {e['switched_off']:.0%} off" if e.get("switched_off") else ""
                    cell += f" ({e['gamma_mean']:.2f} / {e['plain_fraction']:.0%}{off})"
                cells.append(cell)
            lines.append(f"| {cat} | {per['plain']['prompts']} | " + " | ".join(cells) + " |")
        lines.append(f"\noutputs equal to plain: {cats['outputs_match']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
