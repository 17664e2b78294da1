"""How far can prompt lookup go on this target's own text? Exact greedy replay, no timing.

    python -m jaxspec.tools.ngram_ceiling --config configs/smollm2-135m-ngram.yaml --n-per-category 10

Greedy speculation emits exactly plain greedy's tokens, so once the plain output of a prompt is
known, the steps any n-gram policy takes on it follow on the host: at committed length L the policy
proposes k tokens, the target accepts their longest prefix that equals output[L:], and L advances by
accepted + 1. Replaying the shipped drafter's rule (`NgramDrafter`: latest match, longest n wins)
reproduces the engine's step count exactly (tests/test_ngram_ceiling.py), so the bounds below are
about the text, not the machine:

  policy          the configured drafter's mean accepted length (tokens per target forward)
  oracle n>=N     the best continuation among *all* earlier positions that match the last N tokens
                  (no real selector does better than this oracle with the same N and γ)

Mean accepted length is also the speedup at zero verification cost, so a category whose oracle is
below a speedup target cannot reach it by any prompt-lookup policy with that γ.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from jaxspec.errors import JaxspecError


def latest_match(seq: Sequence[int], length: int, min_ngram: int, max_ngram: int) -> tuple[int, int]:
    """NgramDrafter._match_row on the host: (start of the continuation, matched n; 0 = none)."""
    start, found = 0, 0
    for n in range(min_ngram, max_ngram + 1):
        if length - n < 0:
            break
        pattern = list(seq[length - n : length])
        for j in range(length - n - 1, -1, -1):  # latest first; j + n <= length - 1
            if list(seq[j : j + n]) == pattern:
                start, found = j + n, n
                break
    return start, found


def _agree(seq, src: int, dst: int, limit: int, end: int, committed: int) -> int:
    """How many of seq[src:src+limit] (committed text only) equal seq[dst:] (the future)."""
    a = 0
    while a < limit and dst + a < end and src + a < committed and seq[src + a] == seq[dst + a]:
        a += 1
    return a


def replay_policy(prompt, output, gamma: int, min_ngram: int, max_ngram: int) -> int:
    """Target forwards the configured n-gram drafter takes to emit `output` after `prompt`."""
    seq = list(prompt) + list(output)
    length, end, steps = len(prompt) + 1, len(seq), 0  # the first token comes from prefill
    while length < end:
        start, n = latest_match(seq, length, min_ngram, max_ngram)
        proposed = min(gamma, length - start) if n else 0
        length += _agree(seq, start, length, proposed, end, length) + 1
        steps += 1
    return steps


def replay_oracle(prompt, output, gamma: int, min_match: int) -> int:
    """Target forwards when every step copies the best continuation of any `min_match`-gram match."""
    seq = list(prompt) + list(output)
    length, end, steps = len(prompt) + 1, len(seq), 0
    while length < end:
        pattern = seq[length - min_match : length]
        best = 0
        for j in range(min_match, length - 1):
            if seq[j - min_match : j] == pattern:
                best = max(best, _agree(seq, j, length, gamma, end, length))
        length += best + 1
        steps += 1
    return steps


def ceilings(rows: list[dict], gamma: int, min_ngram: int, max_ngram: int) -> dict[str, dict]:
    """rows: {category, prompt, output} -> per category (and overall) mean accepted lengths."""
    policies = {
        "policy": lambda r: replay_policy(r["prompt"], r["output"], gamma, min_ngram, max_ngram),
        "oracle_n1": lambda r: replay_oracle(r["prompt"], r["output"], gamma, 1),
        f"oracle_n{min_ngram}": lambda r: replay_oracle(r["prompt"], r["output"], gamma, min_ngram),
    }
    totals: dict = defaultdict(lambda: defaultdict(int))
    for r in rows:
        emitted = len(r["output"]) - 1  # decode tokens (after the prefill's)
        if emitted < 1:
            continue
        for cat in (r["category"], "overall"):
            totals[cat]["tokens"] += emitted
            for name, replay in policies.items():
                totals[cat][name] += replay(r)
    return {
        cat: {name: t["tokens"] / t[name] for name in policies} for cat, t in totals.items()
    }


def _greedy_outputs(config_path: str, n_per_category: int, max_new_tokens: int, data: str) -> list[dict]:
    from jaxspec.bench import spec_bench as bench
    from jaxspec.build import build_engine
    from jaxspec.config import load_config

    plain = load_config(config_path, ["speculative.method=none", "sampling.temperature=0"])
    engine = build_engine(plain)
    rows = []
    for q in bench.select(bench.read_questions(data), n_per_category):
        ids = engine.encode(q["prompt"])
        [res] = engine.generate([ids], max_new_tokens=max_new_tokens)
        rows.append({"category": q["category"], "prompt": ids, "output": res.token_ids})
        print(f"  {q['category']:15s} prompt {len(ids):4d}  output {len(res.token_ids):4d}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    from jaxspec.bench.options import DEFAULT_DATA  # off --help's import path
    from jaxspec.bench.rows import SPEC_BENCH_CATEGORIES
    from jaxspec.config import load_config

    ap = argparse.ArgumentParser(prog="python -m jaxspec.tools.ngram_ceiling", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="an ngram config (its γ and n-gram sizes are replayed)")
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--n-per-category", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, help="replay with this γ instead of the config's")
    ap.add_argument("--outputs", help="JSON cache of the greedy outputs (read if present, else written)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        spec = cfg.speculative
        if spec.method != "ngram":
            raise JaxspecError(f"{args.config} has speculative.method={spec.method}: give an ngram config")
        cache = Path(args.outputs) if args.outputs else None
        if cache is not None and cache.is_file():
            rows = json.loads(cache.read_text())
        else:
            rows = _greedy_outputs(args.config, args.n_per_category, args.max_new_tokens, args.data)
            if cache is not None:
                cache.write_text(json.dumps(rows))
        gamma = args.gamma or spec.num_speculative_tokens
        min_n, max_n = spec.options.min_ngram, spec.options.max_ngram
        table = ceilings(rows, gamma, min_n, max_n)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = list(next(iter(table.values())))
    print(f"mean accepted length (= speedup at zero verification cost), γ={gamma}, "
          f"n-gram {min_n}..{max_n}, {len(rows)} prompts")
    print(f"| category | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for cat in [c for c in SPEC_BENCH_CATEGORIES if c in table] + ["overall"]:
        print(f"| {cat} | {' | '.join(f'{table[cat][n]:.2f}' for n in names)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
