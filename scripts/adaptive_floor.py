"""The floor of adaptive speculation: what a request that never drafts costs, against plain decoding.

    python scripts/adaptive_floor.py [--config configs/smollm2-135m-eagle-adaptive.yaml]
                                     [--pairs 20] [--max-new-tokens 160] [--probe-every 0]

The adaptive engine starts every request from an acceptance estimate of 0 (`prior=0`), so no
window pays (c* = 0) and every step is a plain run's step: plain decoding's own step inside the
adaptive program, plus the loop's bookkeeping and the drafter catching up after each run. With
--probe-every N > 0 every N-th step verifies a node, and what it sees may raise the estimate.
Same prompt, greedy (outputs checked equal), the two engines interleaved `--pairs` times; prints
each pair's decode tok/s and the median ratio adaptive / plain (this machine is shared: single
pairs swing ±10%, the median of many is the figure). The cost curve is the calibrated one.
"""

from __future__ import annotations

import argparse
import statistics

from jaxspec.build import build_engine
from jaxspec.config import load_config
from jaxspec.engine.runner import Engine

PROMPT = (
    "Summarize the following notes in three sentences: the committee met on Tuesday to discuss "
    "the budget for the new library, the schedule of the renovation, the hiring of two more "
    "staff, and a complaint about parking near the main entrance during the spring festival."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/smollm2-135m-eagle-adaptive.yaml")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--probe-every", type=int, default=0)
    args = parser.parse_args()
    overrides = ["sampling.temperature=0", "speculative.adaptive.prior=0",
                 f"speculative.adaptive.probe_every={args.probe_every}"]
    adaptive = build_engine(load_config(args.config, overrides))
    if adaptive.adaptive is None:
        parser.error(f"{args.config} does not enable speculative.adaptive: use an adaptive config")
    plain = Engine(adaptive.model)

    def run(engine):
        r = engine.generate([PROMPT], max_new_tokens=args.max_new_tokens, batch_size=1)[0]
        return r.decode_tokens_per_s, r.token_ids, r.metrics

    run(plain), run(adaptive)  # compile
    ratios = []
    for i in range(args.pairs):
        p, p_ids, _ = run(plain)
        a, a_ids, metrics = run(adaptive)
        assert a_ids == p_ids, "adaptive output differs from plain"
        assert not metrics["adaptive_switched_off"], "the cost curve switched batch 1 off"
        ratios.append(a / p)
        plain_share = metrics["adaptive_plain_fraction"]
        print(f"pair {i}: plain {p:.1f} tok/s, adaptive {a:.1f} tok/s, ratio {a / p:.3f}, "
              f"plain steps {plain_share:.0%}", flush=True)
    print(f"median adaptive / plain over {args.pairs} pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
