"""Per-position acceptance of shipped heads on held-out GSM8K questions, all heads in one run.

The questions are the tail of GSM8K train that `jaxspec.train.prompts.split_gsm8k` holds out
(never trained on; not Spec-Bench), skipping the first `--skip` (the trainer's own evaluation);
greedy, batch 1, the same γ for every head, decoded by the real loop (jaxspec.train.train.evaluate).

    python scripts/heldout_acceptance.py --heads eagle3=checkpoints/smollm2-135m-eagle3 \\
        peagle=checkpoints/smollm2-135m-peagle --gamma 4 --prompts 12 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", nargs="+", required=True, help="METHOD=CHECKPOINT_DIR ...")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gsm8k", default="../shared/data/gsm8k_train.jsonl")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--skip", type=int, default=4, help="held-out rows the trainer evaluates on")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    from jaxspec.formats import load_drafter_checkpoint
    from jaxspec.loading import load_model
    from jaxspec.train import prompts as prompt_sets
    from jaxspec.train.train import evaluate

    _, held = prompt_sets.split_gsm8k(prompt_sets.read_gsm8k(args.gsm8k))
    questions = [r["question"] for r in held[args.skip: args.skip + args.prompts]]
    target = load_model(args.model)
    rows = {}
    for spec in args.heads:
        method, path = spec.split("=", 1)
        drafter, dparams = load_drafter_checkpoint(method, path, target)
        rows[spec] = evaluate(target, drafter, dparams, questions, args.gamma, args.max_new_tokens)
        print(json.dumps({"head": spec, **rows[spec]}), flush=True)
    print(f"| head | mean accepted | {' | '.join(f'pos {i + 1}' for i in range(args.gamma))} |")
    for spec, r in rows.items():
        per = " | ".join(f"{x:.3f}" for x in r["accepted_per_position"])
        print(f"| {spec} | {r['mean_accepted_length']:.2f} | {per} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
