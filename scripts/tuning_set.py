"""Write a Spec-Bench-format tuning set (for choosing γ / draft_confidence without touching
spec_bench_dev.jsonl): held-out GSM8K-train questions (never trained on) and passage tasks with
a fresh random draw over the target's own stage-1 passages (pairings no training dir used).

    python scripts/tuning_set.py --out out/tuning.jsonl
    python -m jaxspec.bench --data out/tuning.jsonl --config ... --out bench_out/tune
"""

from __future__ import annotations

import argparse
import json

from jaxspec.train import prompts as prompt_sets
from jaxspec.train.data import read_passages

KIND = {0: "summarization", 1: "rag", 2: "qa", 4: "mt_bench", 5: "summarization"}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/tuning.jsonl")
    ap.add_argument("--passages", default="out/distill/smollm2-135m-passages")
    ap.add_argument("--gsm8k", default="../shared/data/gsm8k_train.jsonl")
    ap.add_argument("--per-kind", type=int, default=6)
    args = ap.parse_args(argv)

    from jaxspec.loading import load_model

    tokenizer = load_model("smollm2-135m").tokenizer
    _, held_out = prompt_sets.split_gsm8k(prompt_sets.read_gsm8k(args.gsm8k))
    rows = [("math_reasoning", r["question"]) for r in held_out[: args.per_kind]]
    tasks = prompt_sets.passage_tasks(read_passages(args.passages, tokenizer), 6 * args.per_kind, draw=99)
    rows += [(KIND[i % 6], t) for i, t in enumerate(tasks) if i % 6 in KIND]
    with open(args.out, "w") as f:
        for qid, (cat, text) in enumerate(rows):
            f.write(json.dumps({"question_id": qid, "category": cat, "turns": [text]}) + "\n")
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
