"""Paged vs contiguous decode step cost on the embedded SmolLM2-135M, same run: the whole jitted
decode loop (the engine's) over a contiguous KV cache, over a paged cache whose layers read the
pool through the page table (`models.paged_layer`, what serving runs), and over a paged cache
read as a gathered contiguous view (the path before it). Seconds per decode step (median of
rounds) and each paged path's ratio to contiguous. Markdown table; record it in BENCHMARKS.md.

    python scripts/bench_paged_step.py                 # batch 1 and 4, plain and n-gram (γ=4)
    python scripts/bench_paged_step.py --smoke         # one short round (checks the script)
"""

from __future__ import annotations

import argparse
import statistics

import jax

from jaxspec.build import build_engine
from jaxspec.config import load_config
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.models.base import Model, layout
from jaxspec.serving.paged_cache import PagedTarget

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The story should have a beginning, a middle and an end, and the keeper's name is "
          "Ada. Ada has kept the light for twenty years.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    rounds, steps = (1, 8) if a.smoke else (a.rounds, a.steps)
    base = build_engine(load_config(None, ["sampling.temperature=0"])).model
    ids = base.tokenizer(PROMPT)["input_ids"]
    targets = {
        "contiguous": base.target,
        "paged (pages)": PagedTarget(base.target, a.page_size),
        "paged (view)": PagedTarget(base.target, a.page_size, read="view"),
    }
    models = {n: Model(target=t, params=base.params, eos_token_ids=(-1,), name=n)
              for n, t in targets.items()}
    drafters = {"plain": (None, 0), "ngram γ=4": (NgramDrafter(base.cfg.vocab_size, 1, 3), 4)}
    batches = (1,) if a.smoke else (1, 4)

    def per_step(engine, batch) -> float:  # decode seconds / decode steps
        rs = engine.generate([ids] * batch, max_new_tokens=steps, batch_size=batch)
        r = rs[0]
        decode_s = (r.num_generated_tokens - 1) / r.decode_tokens_per_s
        return decode_s / r.metrics.get("num_steps", r.num_generated_tokens - 1)

    print(f"backend {jax.default_backend()}, SmolLM2-135M {base.cfg.dtype}, layout "
          f"{layout(base.target, base.params)}, page size {a.page_size}, {steps} new tokens, "
          f"median of {rounds} rounds")
    print("| method | batch | contiguous ms/step | paged (pages) ms/step | ratio | "
          "paged (view) ms/step | ratio |")
    print("|---|---|---|---|---|---|---|")
    for dname, (drafter, gamma) in drafters.items():
        for batch in batches:
            engines = {n: Engine(m, drafter, None, num_speculative_tokens=gamma)
                       for n, m in models.items()}
            outs = {n: e.generate([ids], max_new_tokens=steps)[0].token_ids
                    for n, e in engines.items()}  # compile, warm; greedy: the same tokens
            if len({tuple(o) for o in outs.values()}) != 1:
                raise SystemExit(f"paged greedy tokens differ from contiguous ({dname})")
            for n, e in engines.items():
                per_step(e, batch)
            times = {n: [] for n in engines}
            for _ in range(rounds):  # interleaved: drift hits every path alike
                for n, e in engines.items():
                    times[n].append(per_step(e, batch))
            med = {n: statistics.median(t) for n, t in times.items()}
            c = med["contiguous"]
            print(f"| {dname} | {batch} | {c * 1e3:.2f} | {med['paged (pages)'] * 1e3:.2f} | "
                  f"{med['paged (pages)'] / c:.2f}x | {med['paged (view)'] * 1e3:.2f} | "
                  f"{med['paged (view)'] / c:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
