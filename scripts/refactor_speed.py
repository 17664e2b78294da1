"""Decode speed of one code tree, for before/after checks of a refactor: plain, n-gram (γ = 4),
EAGLE (γ = 3) and adaptive n-gram (a given step-cost curve, so nothing is calibrated) on
SmolLM2-135M, greedy, batch 1, 64 new tokens over four short prompts; prints one JSON line of
mean decode tok/s per method and whether its tokens match plain decoding's.

    PYTHONPATH=/path/to/tree python scripts/refactor_speed.py     # once per tree, alternating

Compare the ratios to plain of the same run, never absolute tok/s across runs."""

from __future__ import annotations

import dataclasses
import json

from jaxspec.build import build_engine
from jaxspec.config import load_config
from jaxspec.engine.runner import Engine

PROMPTS = [
    "Summarise: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the "
    "lazy dog again and again.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Translate to French: I would like a cup of coffee and a croissant, please.",
    "List three facts about the Moon.",
]
GREEDY = ["sampling.temperature=0"]


def main() -> None:
    plain = build_engine(load_config("configs/smollm2-135m.yaml", GREEDY))
    target = plain.model
    engines = {"plain": plain}
    for name in ("ngram", "eagle"):
        config = load_config(f"configs/smollm2-135m-{name}.yaml", GREEDY)
        engines[name] = build_engine(config, target=target)
    ad = build_engine(load_config("configs/smollm2-135m-ngram-adaptive.yaml", GREEDY), target=target)
    settings = dataclasses.replace(ad.adaptive, step_costs=[1.0, 1.05, 1.1, 1.15, 1.2],
                                   draft_cost=0.0)
    engines["adaptive-ngram"] = Engine(target, ad.drafter, ad.drafter_params, adaptive=settings,
                                       num_speculative_tokens=ad.spec.num_speculative_tokens)
    for e in engines.values():
        e.generate(PROMPTS[:1], max_new_tokens=64)  # compile, warm
    out = {}
    for name, e in engines.items():
        results = [e.generate([p], max_new_tokens=64)[0] for p in PROMPTS]
        out[name] = (sum(r.decode_tokens_per_s for r in results) / len(results),
                     [r.token_ids for r in results])
    print(json.dumps({k: {"tok_s": tps, "match_plain": toks == out["plain"][1]}
                      for k, (tps, toks) in out.items()}))


if __name__ == "__main__":
    main()
