"""Two source trees timed in turns: run one process per tree (each with its own PYTHONPATH), both
load and compile once, then take turns round by round through a shared turn directory, so the
shared machine's drift lands on both alike. Per round and config: decode tokens/s over a fixed set
of Spec-Bench first turns, greedy, batch 1.

    PYTHONPATH=TREE_A python scripts/bench_turns.py --label before --peer after --dir D --first &
    PYTHONPATH=TREE_B python scripts/bench_turns.py --label after --peer before --dir D

Each writes D/<label>.jsonl (one line per round and config). Run from the tree whose relative
checkpoint paths the configs name.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--peer", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--first", action="store_true", help="this process takes the first turn")
    p.add_argument("--configs", nargs="+", default=["configs/smollm2-135m.yaml",
                   "configs/smollm2-135m-ngram.yaml", "configs/smollm2-135m-eagle.yaml"])
    p.add_argument("--data", default="data/spec_bench_dev.jsonl")
    p.add_argument("--prompts", type=int, default=6, help="one per category, in file order")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()

    from jaxspec.build import build_engine
    from jaxspec.config import load_config
    from jaxspec.loading import load_model

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    seen, prompts = set(), []
    for line in open(args.data):
        q = json.loads(line)
        if q["category"] not in seen and len(prompts) < args.prompts:
            seen.add(q["category"])
            prompts.append(q["turns"][0])
    cfgs = [load_config(c) for c in args.configs]
    m = cfgs[0].model
    target = load_model(m.name, dtype=m.dtype, layout=m.layout)
    engines = [build_engine(c, target=target) for c in cfgs]
    ids = [engines[0].encode(q) for q in prompts]
    for e in engines:  # compile, untimed
        e.generate(ids, max_new_tokens=args.max_new_tokens)
    (d / f"{args.label}.ready").touch()
    turn = d / "turn"
    if args.first:
        while not (d / f"{args.peer}.ready").exists():
            time.sleep(0.5)
        turn.write_text(args.label)
    out = open(d / f"{args.label}.jsonl", "a")
    for r in range(args.rounds):
        while not (turn.exists() and turn.read_text() == args.label):
            time.sleep(0.2)
        for c, e in zip(args.configs, engines):
            res = e.generate(ids, max_new_tokens=args.max_new_tokens)
            toks = [r_.token_ids for r_ in res]
            n = sum(len(t) - 1 for t in toks)
            s = sum((len(t) - 1) / r_.decode_tokens_per_s for t, r_ in zip(toks, res)
                    if r_.decode_tokens_per_s > 0)
            out.write(json.dumps({"round": r, "config": c, "decode_tokens_per_s": n / s,
                                  "tokens": toks, "time": time.time()}) + "\n")
            out.flush()
        turn.write_text(args.peer)


if __name__ == "__main__":
    main()
