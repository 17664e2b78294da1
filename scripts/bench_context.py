"""python scripts/bench_context.py: decode speedup per speculative method against context length,
with adaptive speculation priced by the context (issue 61), in one run on this machine.

One target load; per prompt length (tokens of Spec-Bench questions run together, no chat
template, so each method reads the same ids): plain greedy decoding, then each shipped config as
it is (fixed γ), or with --adaptive switched on and calibrated at the context lengths asked
(`speculative.adaptive.context_lengths`). Every engine holds one cache of --max-context slots,
so one decode program serves every length (a prefill program per length). Per row: decode
tok/s (prefill and compilation excluded), the speedup over plain's run just before it, mean draft
length, plain-step fraction and the adaptive reasons (adaptive.REASONS); greedy outputs are
checked against plain's. A JSON line per (length, method).

    PYTHONPATH=$PWD python scripts/bench_context.py --lengths 1024 4096 8000 --new 32 [--adaptive]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

CONFIGS = ["configs/smollm2-135m-ngram.yaml", "configs/smollm2-135m-eagle3.yaml",
           "configs/smollm2-135m-dflash.yaml"]


def prompt_ids(tokenizer, n: int) -> list[int]:
    """n token ids: Spec-Bench questions run together (varied text, not one paragraph repeated,
    so prompt lookup finds only what real text repeats)."""
    from jaxspec.bench.options import DEFAULT_DATA
    from jaxspec.bench.spec_bench import read_questions

    ids: list[int] = []
    for q in read_questions(DEFAULT_DATA):
        ids += tokenizer.encode(q["prompt"] + "\n\n", add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the questions hold {len(ids)} tokens, fewer than {n}")


def run(engine, ids, new: int) -> dict:
    t0 = time.perf_counter()
    r = engine.generate([ids], max_new_tokens=new)[0]
    m = r.metrics
    out = {"decode_tok_s": round(r.decode_tokens_per_s, 2), "ttft_s": round(
        r.time_to_first_token_s, 2), "wall_s": round(time.perf_counter() - t0, 1)}
    for k in ("adaptive_gamma_mean", "adaptive_plain_fraction", "adaptive_reasons",
              "adaptive_switched_off", "adaptive_host_reason", "acceptance_rate"):
        if k in m:
            out[k] = round(m[k], 3) if isinstance(m[k], float) else m[k]
    return out | {"tokens": r.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    ap.add_argument("--calibrate-at", type=int, nargs="+", default=None,
                    help="context lengths of the step-cost calibration (default: --lengths)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--max-context", type=int, default=8192, help="KV slots per row, every engine")
    ap.add_argument("--adaptive", action="store_true", help="adaptive speculation, calibrated")
    ap.add_argument("--step-costs", type=json.loads, default=None, metavar="JSON",
                    help='with --adaptive: the loop\'s step-cost curves given, not measured, '
                         'e.g. \'{"1024": [1.2, 2.4, 2.4, 3.1], "8000": [1.0, 1.3, 1.4, 1.5]}\' '
                         '(k = 0..γ nodes, in plain steps; a calibration cache file\'s ratios)')
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted config override for every config, e.g. "
                         "speculative.num_speculative_tokens=3 (repeatable)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="requests per (length, method), after one plain run: with --adaptive "
                         "the later ones show what the acceptance seen at that length decided "
                         "(the host's per-context switch)")
    args = ap.parse_args()

    from jaxspec.build import build_engine
    from jaxspec.config import load_config
    from jaxspec.engine.runner import Engine
    from jaxspec.loading import load_model

    model = load_model(args.model)
    fills = args.calibrate_at or args.lengths
    plain = Engine(model, chat_template=False, max_context=args.max_context)
    engines = {}
    for path in args.configs:
        overrides = ["generation.chat_template=false", f"generation.max_context={args.max_context}"]
        if args.adaptive:
            overrides += ["speculative.adaptive.enabled=true",
                          f"speculative.adaptive.context_lengths=[{','.join(map(str, fills))}]"]
        config = load_config(path, overrides + args.override)
        if args.adaptive and args.step_costs:  # given curves: the drafting is in them
            costs = {int(f): [float(c) for c in curve] for f, curve in args.step_costs.items()}
            sp = config.speculative
            adaptive = dataclasses.replace(sp.adaptive, step_costs=costs, draft_cost=0.0)
            config = dataclasses.replace(config, speculative=dataclasses.replace(
                sp, adaptive=adaptive))
        engines[config.speculative.method] = build_engine(config, target=model)
    for method, engine in engines.items() if args.adaptive else ():  # the curves it decides by
        curves = engine.calibrate(1)  # {fill: [k = 0..γ]} in plain steps, measured or given
        print(json.dumps({"method": method, "step_costs": {
            str(f): [round(c, 3) for c in curve] for f, curve in curves.items()}}), flush=True)
    for n in args.lengths:
        ids = prompt_ids(model.tokenizer, n)
        for method, engine in engines.items():
            # plain right before each method: a pair meets the same neighbours on a shared box
            base = run(plain, ids, args.new)
            print(json.dumps({"context": n, "method": "plain"} | base | {"tokens": None}),
                  flush=True)
            for r in range(args.rounds):
                row = run(engine, ids, args.new)
                row["greedy_identical"] = row.pop("tokens") == base["tokens"]
                row["speedup"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3)
                print(json.dumps({"context": n, "method": method, "round": r} | row), flush=True)


if __name__ == "__main__":
    main()
