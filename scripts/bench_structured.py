"""Structured output under speculation: the JSON-extraction workload (data/structured_extraction.jsonl,
16 documents -> one schema'd object each), constrained to the schema vs free, plain decoding vs
each drafter, in the same run, greedy, at batch 1 and 8. Not a timed test: figures go to
BENCHMARKS.md.

    python scripts/bench_structured.py                       # plain, ngram, suffix; batch 1 and 8
    python scripts/bench_structured.py --methods plain ngram --batches 1 --limit 8
    python scripts/bench_structured.py --methods none configs/smollm2-135m-eagle.yaml --batches 1
    # a config's path in --methods: its whole speculative section (a trained head's checkpoint)

Per (method, batch, constrained): decode tokens/s (generated tokens over decode time; compile
excluded), speedup over plain at the same batch and constraint, mean accepted length, the
fraction of draft tokens the mask removed, and how many outputs are complete objects that
validate against the schema. "kept" is the constrained speedup over the free speedup (the
issue's target: >= 90%); the mask's cost is plain constrained vs plain free seconds per step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema

from jaxspec.build import build_engine
from jaxspec.config import Config, GenerationConfig, SpeculativeConfig, load_config
from jaxspec.constrain import Constraint

DATA = Path(__file__).resolve().parents[1] / "data" / "structured_extraction.jsonl"
PROMPT = ("Extract the person's name, city, age and occupation from the text as a JSON object with "
          "the keys name, city, age, occupation.\n\nText: {document}")


def rows(limit: int | None):
    out = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return out[:limit] if limit else out


def valid(text: str, schema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def run(method: str, batch: int, constrained: bool, data, new: int, gamma: int) -> dict:
    if method.endswith((".yaml", ".yml")):  # a shipped config: its drafter and its γ
        spec = load_config(method).speculative
    else:
        spec = SpeculativeConfig(method=method, num_speculative_tokens=gamma)
    engine = build_engine(Config(speculative=spec, generation=GenerationConfig(batch_size=batch)))
    prompts = [PROMPT.format(document=r["document"]) for r in data]
    schema = data[0]["schema"]
    constraint = Constraint(json_schema=schema) if constrained else None
    engine.generate(prompts[:batch], max_new_tokens=new, batch_size=batch, constraint=constraint)  # warm
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens=new, batch_size=batch, constraint=constraint)
    wall = time.perf_counter() - t0
    tokens = sum(r.num_generated_tokens - 1 for r in results)
    decode_s = 0.0  # every row of a batch reports the batch's decode time: one per batch
    for start in range(0, len(results), batch):
        timed = [r for r in results[start:start + batch] if r.decode_tokens_per_s]
        if timed:
            decode_s += (timed[0].num_generated_tokens - 1) / timed[0].decode_tokens_per_s
    steps = sum(r.metrics["num_steps"] for r in results)
    # the mask's share of the proposed drafts (before the mask: constrain/draft.py)
    drafted = sum(r.metrics.get("num_proposed_draft_tokens", r.metrics["num_draft_tokens"])
                  for r in results)
    masked = sum(r.metrics.get("num_masked_draft_tokens", 0) for r in results)
    return {
        "method": method, "batch": batch, "constrained": constrained,
        "tokens": tokens, "decode_s": decode_s, "wall_s": wall,
        "tokens_per_s": tokens / decode_s if decode_s else 0.0,
        "s_per_step": decode_s * batch / steps if steps else 0.0,
        "mean_accepted_length": tokens / steps if steps else 1.0,
        "masked_draft_fraction": masked / drafted if drafted else 0.0,
        "valid": sum(valid(r.text, schema) for r in results), "n": len(results),
        "example": results[0].text,
    }


def mask_cost(data, batch: int, reps: int = 5, steps: int = 16) -> tuple[float, float]:
    """(s/step free, s/step constrained) of plain decoding, the two interleaved `reps` times
    (min of each: the least disturbed run on a shared machine), `steps` steps from the same
    prefilled prompts, prefill excluded."""
    import jax

    from jaxspec.decode.sampling import SamplingParams

    engine = build_engine(Config(generation=GenerationConfig(batch_size=batch)))
    ids = [engine.encode(PROMPT.format(document=r["document"])) for r in data[:batch]]
    sp = SamplingParams.make()
    grammar = lambda: engine.grammar_for([Constraint(json_schema=data[0]["schema"])] * len(ids), batch)  # noqa: E731
    best = {False: float("inf"), True: float("inf")}
    for _ in range(reps + 1):  # the first round compiles
        for constrained in (False, True):
            engine._ensure_compiled(ids, 64, sp, batch, grammar() if constrained else None)
            state = engine.prefill(ids, 64, sp, 0, list(range(len(ids))), batch,
                                   grammar() if constrained else None)
            jax.block_until_ready(state.tokens)
            before = int(jax.device_get(state.row_steps).max())
            t0 = time.perf_counter()
            state = engine.decode(state, sp, steps)
            jax.block_until_ready(state.tokens)
            dt = time.perf_counter() - t0
            done = int(jax.device_get(state.row_steps).max()) - before
            best[constrained] = min(best[constrained], dt / max(done, 1))
    return best[False], best[True]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "suffix"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--limit", type=int, default=None, help="first N documents")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--schema-only", action="store_true",
                   help="only the constrained runs (the free ones do not read the grammar)")
    p.add_argument("--out", default=None, help="also write the rows as JSON lines here")
    p.add_argument("--mask-cost", action="store_true",
                   help="only the mask's cost per plain step, constrained vs free, interleaved")
    args = p.parse_args(argv)
    data = rows(args.limit)
    if args.mask_cost:
        for batch in args.batches:
            free, con = mask_cost(data, batch)
            print(f"batch {batch}: plain step {1e3 * free:.2f} ms free, {1e3 * con:.2f} ms "
                  f"constrained ({100 * (con / free - 1):+.1f}%)", flush=True)
        return 0
    out = []
    for batch in args.batches:
        for constrained in (True,) if args.schema_only else (False, True):
            for method in args.methods:
                r = run(method, batch, constrained, data, args.max_new_tokens, args.gamma)
                out.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "example"}), flush=True)
    print("\n| batch | constraint | method | tok/s | speedup | accepted/step | masked drafts | valid |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    base = {(r["batch"], r["constrained"]): r for r in out if r["method"] == "none"}
    for r in out:
        b = base.get((r["batch"], r["constrained"]))
        speed = r["tokens_per_s"] / b["tokens_per_s"] if b and b["tokens_per_s"] else float("nan")
        r["speedup"] = speed
        print(f"| {r['batch']} | {'schema' if r['constrained'] else 'free'} | {r['method']} | "
              f"{r['tokens_per_s']:.1f} | {speed:.2f}x | {r['mean_accepted_length']:.2f} | "
              f"{100 * r['masked_draft_fraction']:.1f}% | {r['valid']}/{r['n']} |")
    for batch in args.batches:
        free, con = base.get((batch, False)), base.get((batch, True))
        if free and con:
            print(f"batch {batch}: mask cost (plain, s/step constrained vs free): "
                  f"{1e3 * con['s_per_step']:.2f} ms vs {1e3 * free['s_per_step']:.2f} ms "
                  f"({100 * (con['s_per_step'] / free['s_per_step'] - 1):+.1f}%)")
        for m in args.methods:
            f = next((r for r in out if (r["method"], r["batch"], r["constrained"]) == (m, batch, False)), None)
            c = next((r for r in out if (r["method"], r["batch"], r["constrained"]) == (m, batch, True)), None)
            if m != "none" and f and c and f["speedup"] > 1:
                kept = (c["speedup"] - 1) / (f["speedup"] - 1)
                print(f"batch {batch} {m}: speedup free {f['speedup']:.2f}x, constrained "
                      f"{c['speedup']:.2f}x (kept {100 * kept:.0f}% of the gain)")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
