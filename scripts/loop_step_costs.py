"""What one step of the decode loop costs, in plain decoding's steps: the adaptive program held
at each length, the fixed-γ programs, and the calibrated curve the controller prices with.

    python scripts/loop_step_costs.py [--config configs/smollm2-135m-eagle-adaptive.yaml]
                                      [--rounds 5] [--steps 40]

For each program: generate `--steps` tokens for one prompt (greedy), its decode seconds over
its decode steps (the real jitted loop, speculate.decode; prefill excluded); each round times every program once
and a program's cost is the median over rounds of its time per step over plain's in the same
round. "adaptive@k": the adaptive engine with a given cost curve that makes c* = k every step
(1 <= k <= γ), i.e. the adaptive program running k nodes; "fixed γ=k": the same drafter's fixed
program (adaptive off, num_speculative_tokens k). Next to them, `calibration.loop_costs` at
128 tokens (measured afresh here): what the controller divides expected tokens by. The gap
between adaptive@k and fixed γ=k is what compiling for γ_max costs at k nodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from jaxspec.decode.adaptive import calibration
from jaxspec.build import build_engine
from jaxspec.engine.runner import Engine
from jaxspec.config import load_config

PROMPT = "Write a short persuasive essay about why cities should plant more trees."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2-135m-eagle-adaptive.yaml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    config = load_config(a.config, ["sampling.temperature=0"])
    plain = build_engine(load_config(None, ["sampling.temperature=0"]))
    target = plain.model
    g = config.speculative.num_speculative_tokens
    engines = {"plain": plain}
    for k in range(1, g + 1):
        fixed = [f"speculative.num_speculative_tokens={k}", "speculative.adaptive.enabled=false",
                 "sampling.temperature=0"]
        engines[f"fixed γ={k}"] = build_engine(load_config(a.config, fixed), target=target)
        built = build_engine(config, target=target)
        forced = [1.0] + [1.0 if i <= k else 10.0 for i in range(1, g + 1)]  # c* = k (the engine
        # makes a curve non-decreasing: 1..k cost one plain step, so the longest, k, wins)
        settings = dataclasses.replace(config.speculative.adaptive, step_costs=forced, draft_cost=0.0)
        engines[f"adaptive@{k}"] = Engine(target, built.drafter, built.drafter_params,
                                          num_speculative_tokens=g, adaptive=settings)

    def per_step(engine) -> float:  # decode seconds / decode steps, one request
        r = engine.generate([PROMPT], max_new_tokens=a.steps)[0]
        decode_s = (r.num_generated_tokens - 1) / r.decode_tokens_per_s
        return decode_s / r.metrics.get("num_steps", r.num_generated_tokens - 1)

    for engine in engines.values():
        per_step(engine)  # compile, warm
    rounds = []
    for _ in range(a.rounds):
        rounds.append({name: per_step(engine) for name, engine in engines.items()})
    ratio = {n: statistics.median(r[n] / r["plain"] for r in rounds) for n in engines}
    adaptive = build_engine(config, target=target)
    curve = calibration.loop_costs(
        target, adaptive.spec, adaptive.drafter_params, 1, recalibrate=True
    )[calibration.FILLS[0]]
    print(f"plain: {statistics.median(r['plain'] for r in rounds) * 1e3:.2f} ms a step")
    print("| nodes | fixed γ=k | adaptive@k | calibrated (128 tokens) |")
    print("|---|---|---|---|")
    for k in range(1, g + 1):
        print(f"| {k} | {ratio[f'fixed γ={k}']:.3f} | {ratio[f'adaptive@{k}']:.3f} | {curve[k]:.3f} |")


if __name__ == "__main__":
    main()
