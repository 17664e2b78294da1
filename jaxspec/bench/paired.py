"""Paired decode benchmark: plain, n-gram and EAGLE in interleaved rounds, one process per source
tree, reporting each method's step cost in plain steps. The check every change to the decode path
runs before it lands (docs/usage.md, "The paired decode benchmark").

    python -m jaxspec.bench.paired --configs plain ngram eagle --prompts 6 --max-new-tokens 64 \\
        --rounds 3 --out bench_out/paired.json [--tree /path/to/other/tree]

Protocol: the target is loaded and every method compiled once (warm-up untimed); then R rounds,
each running every method on every prompt (greedy, batch 1; per prompt the methods back to back,
their order rotated by one each round), so the shared machine's drift lands on all methods alike.
Per round and method: decode tok/s (generated tokens after the first / decode seconds), speedup
(tok/s over plain's in the same round), mean accepted length (tokens per decode step) and
**step cost** (seconds per decode step over plain's in the same round: what one speculative step
costs in plain steps; speedup = mean accepted length / step cost). The summary takes the median
over rounds of each per-round ratio, never absolute tok/s across rounds, and the same ratios per
(round, prompt) pair with their median over all pairs (`*_by_prompt`: one stalled call on a busy
machine moves one pair, where it moves its whole round's sum).

With --tree DIR a second source tree (another commit's worktree) runs in its own process
(PYTHONPATH = DIR, cwd = DIR, the same prompts) and the two take turns round by round; the summary
adds, per method, the median over rounds of the other tree's tok/s and step cost over this one's,
and whether both produced identical tokens. Only public API present in older trees is used on that
side (load_config, load_model, build_engine, Engine.warmup/generate), so any commit since the target
protocol can be measured against any other.

This file imports no jaxspec module at the top: `_worker_main` runs it as a script under the other
tree's PYTHONPATH.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_NAMES = {  # short names for the shipped SmolLM2 configs; any other value is a YAML path
    "plain": "configs/smollm2-135m.yaml",
    "ngram": "configs/smollm2-135m-ngram.yaml",
    "eagle": "configs/smollm2-135m-eagle.yaml",
    "eagle-tree": "configs/smollm2-135m-eagle-tree.yaml",
    "eagle-lookup": "configs/smollm2-135m-eagle-lookup.yaml",
}
BASELINE = "plain"
TURN_WAIT_S = 1800.0  # longest wait for the other tree's turn (its warm-up compiles)


# ---- figures (pure functions over per-prompt rows) ---------------------------------------------
def round_figures(rows: list[dict]) -> dict[str, Any]:
    """One round of one method (rows: one per prompt, with decode_s, num_steps,
    num_generated_tokens) -> decode tok/s, seconds per decode step and mean accepted length."""
    steps = sum(r["num_steps"] for r in rows)
    decode_s = sum(r["decode_s"] for r in rows)
    emitted = sum(max(r["num_generated_tokens"] - 1, 0) for r in rows)
    return {
        "decode_tokens_per_s": emitted / decode_s if decode_s > 0 else 0.0,
        "step_s": decode_s / steps if steps else 0.0,
        "mean_accepted_length": emitted / steps if steps else 0.0,
    }


def _step_s(row: dict) -> float:
    return row["decode_s"] / row["num_steps"] if row["num_steps"] else 0.0


def _tps(row: dict) -> float:
    return (row["num_generated_tokens"] - 1) / row["decode_s"] if row["decode_s"] > 0 else 0.0


def _ratio(a: float, b: float) -> float | None:
    return a / b if a and b else None


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise_tree(rows: list[dict], methods: list[str]) -> dict[str, Any]:
    """All rows of one tree (round, method, prompt, figures, tokens) -> per method: per-round
    figures against plain of the same round, and their medians over rounds."""
    rounds = sorted({r["round"] for r in rows})
    by = {(r["round"], r["method"]): [] for r in rows}
    for r in rows:
        by[(r["round"], r["method"])].append(r)
    base_by_prompt = {(r["round"], r["prompt"]): r for r in rows if r["method"] == BASELINE}
    out = {}
    for m in methods:
        per_round = []
        for k in rounds:
            mine = sorted(by.get((k, m), []), key=lambda r: r["prompt"])
            base = sorted(by.get((k, BASELINE), []), key=lambda r: r["prompt"])
            if not mine:
                continue
            f, fb = round_figures(mine), round_figures(base)
            per_round.append({
                "round": k,
                **f,
                "speedup": _ratio(f["decode_tokens_per_s"], fb["decode_tokens_per_s"]),
                "step_cost": _ratio(f["step_s"], fb["step_s"]),
                "tokens_equal_plain": [r["tokens"] for r in mine] == [r["tokens"] for r in base],
            })
        pairs = [(r, base_by_prompt[(r["round"], r["prompt"])]) for r in rows
                 if r["method"] == m and (r["round"], r["prompt"]) in base_by_prompt]
        out[m] = {
            "rounds": per_round,
            # the same ratios per (round, prompt) pair, median over all pairs: one stalled call
            # (a busy machine's memory pressure) moves one pair, not a whole round
            "step_cost_by_prompt": _median(
                _ratio(_step_s(r), _step_s(b)) for r, b in pairs),
            "speedup_by_prompt": _median(_ratio(_tps(r), _tps(b)) for r, b in pairs),
            "decode_tokens_per_s": _median(p["decode_tokens_per_s"] for p in per_round),
            "speedup": _median(p["speedup"] for p in per_round),
            "speedup_min": min((p["speedup"] for p in per_round if p["speedup"]), default=None),
            "speedup_max": max((p["speedup"] for p in per_round if p["speedup"]), default=None),
            "mean_accepted_length": _median(p["mean_accepted_length"] for p in per_round),
            "step_cost": _median(p["step_cost"] for p in per_round),
            "tokens_equal_plain": all(p["tokens_equal_plain"] for p in per_round),
        } | _calibration([r for r in rows if r["method"] == m])
    return out


def _calibration(rows: list[dict]) -> dict[str, Any]:
    from jaxspec.bench.rows import calibration

    return calibration(rows)


def compare_trees(a: dict[str, Any], b: dict[str, Any], rows_a: list[dict],
                  rows_b: list[dict]) -> dict[str, Any]:
    """Two trees' summaries (this one `a`, the other `b`) -> per method, the medians over rounds
    of b / a: decode tok/s, step cost and speedup (round k of b against round k of a, taken in
    turns), and whether b's tokens equal a's for every prompt and round."""
    def tokens(rows, m):
        return sorted((r["round"], r["prompt"], r["tokens"]) for r in rows if r["method"] == m)

    out = {}
    for m in a:
        if m not in b:
            continue
        pairs = list(zip(a[m]["rounds"], b[m]["rounds"]))
        out[m] = {
            "tokens_per_s_b_over_a": _median(
                _ratio(pb["decode_tokens_per_s"], pa["decode_tokens_per_s"]) for pa, pb in pairs),
            "step_cost_b_over_a": _median(
                _ratio(pb["step_cost"], pa["step_cost"]) for pa, pb in pairs),
            "speedup_b_over_a": _median(_ratio(pb["speedup"], pa["speedup"]) for pa, pb in pairs),
            "step_cost_by_prompt_b_over_a": _ratio(b[m]["step_cost_by_prompt"],
                                                   a[m]["step_cost_by_prompt"]),
            "tokens_equal": tokens(rows_a, m) == tokens(rows_b, m),
        }
    return out


def format_table(summary: dict[str, Any], label: str) -> str:
    lines = [(f"{label}: method | decode tok/s | speedup (min-max over rounds; by prompt) "
              "| mean accepted | step cost (by prompt) | tokens = plain")]
    for m, s in summary.items():
        lines.append(
            f"  {m:<12} {s['decode_tokens_per_s']:6.1f}  {s['speedup']:.2f}x "
            f"({s['speedup_min']:.2f}-{s['speedup_max']:.2f}; {s['speedup_by_prompt']:.2f}x)  "
            f"{s['mean_accepted_length']:.2f}  {s['step_cost']:.2f} "
            f"({s['step_cost_by_prompt']:.2f})  {s['tokens_equal_plain']}")
    return "\n".join(lines)


# ---- prompts and configs ----------------------------------------------------------------------
def pick_prompts(data: str | Path, n: int) -> list[str]:
    """The first turn of n Spec-Bench questions: the first of each category, then the second of
    each, ... (jaxspec.bench.spec_bench.select's order)."""
    from jaxspec.bench.spec_bench import read_questions, select

    rows = read_questions(data)
    per_cat = -(-n // 6)
    return [r["prompt"] for r in select(rows, per_cat)][:n]


def config_path(name: str, root: Path) -> str:
    """A short name (CONFIG_NAMES) or a YAML path, resolved against a tree's root."""
    rel = CONFIG_NAMES.get(name, name)
    return str(Path(rel) if Path(rel).is_absolute() else root / rel)


# ---- one tree's process -----------------------------------------------------------------------
def run_tree(job: dict[str, Any]) -> list[dict]:
    """Load, compile, then time `job["rounds"]` rounds, each on this tree's turn when `job`
    names a turn directory. Returns (and appends to <dir>/<label>.jsonl) one row per round,
    method and prompt. Uses only API that older trees have too."""
    from jaxspec.build import build_engine
    from jaxspec.config import load_config
    from jaxspec.loading import load_model

    try:  # the persistent XLA cache, where this tree has one
        from jaxspec.cli_support import enable_compilation_cache
        enable_compilation_cache()
    except ImportError:
        pass
    root, methods = Path(job["root"]), job["methods"]
    cfgs = {m: load_config(config_path(m, root)) for m in methods}
    first = cfgs[methods[0]].model
    target = load_model(first.name, dtype=first.dtype, layout=first.layout)
    engines = {m: build_engine(c, target=target) for m, c in cfgs.items()}
    ids = [engines[BASELINE].encode(p) for p in job["prompts"]]
    batch = job.get("batch_size", 1)
    groups = [ids[i : i + batch] for i in range(0, len(ids), batch)]  # one call each
    for e in engines.values():
        for g in groups:
            e.warmup(max(g, key=len), max_new_tokens=job["max_new_tokens"], batch_size=batch)
    turns = Path(job["turn_dir"]) if job.get("turn_dir") else None
    log = turns / f"{job['label']}.jsonl" if turns else None
    if turns:
        log.write_text("")
        (turns / f"{job['label']}.ready").touch()
        if job.get("first"):
            _wait(lambda: (turns / f"{job['peer']}.ready").exists(), job)
            (turns / "turn").write_text(job["label"])
    rows = []
    for k in range(job["rounds"]):
        if turns:
            _wait(lambda: (turns / "turn").read_text() == job["label"], job)
        order = methods[k % len(methods):] + methods[: k % len(methods)]
        load = os.getloadavg()[0]
        for i, x in enumerate(groups):
            for m in order:
                out = engines[m].generate(x, max_new_tokens=job["max_new_tokens"],
                                          batch_size=batch)
                row = {"round": k, "method": m, "prompt": i, **batch_figures(out),
                       "load_average": load}
                rows.append(row)
                if log:
                    with log.open("a") as f:
                        f.write(json.dumps(row) + "\n")
        if turns:
            (turns / "turn").write_text(job["peer"])
    return rows


def batch_figures(results) -> dict[str, Any]:
    """One generate call's rows (a batch decodes together: every row reports the same decode
    seconds) -> one row of figures: tokens after each row's first, row-steps summed."""
    decode_s = max(((r.num_generated_tokens - 1) / r.decode_tokens_per_s
                    for r in results if r.num_generated_tokens > 1 and r.decode_tokens_per_s),
                   default=0.0)
    from jaxspec.bench.rows import calibration

    tokens = [list(r.token_ids) for r in results]
    return {"num_generated_tokens": 1 + sum(max(r.num_generated_tokens - 1, 0) for r in results),
            "num_steps": sum(int(r.metrics["num_steps"]) for r in results),
            "decode_s": decode_s, "tokens": tokens[0] if len(tokens) == 1 else tokens,
            # a DSpark chain: its confidence head against verification, the lengths it chose
            **calibration([r.metrics for r in results])}


def _wait(ready, job: dict[str, Any]) -> None:
    """Until ready() (the other tree's turn); stops when the other process is gone or after
    TURN_WAIT_S, so neither side can hang."""
    t0, parent = time.monotonic(), os.getppid()
    proc = job.get("proc")
    while not _safe(ready):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the other tree's process exited with status {proc.returncode}")
        if proc is None and job.get("worker") and os.getppid() != parent:
            raise SystemExit("the benchmark's main process is gone")
        if time.monotonic() - t0 > TURN_WAIT_S:
            raise RuntimeError(f"no turn after {TURN_WAIT_S:.0f} s")
        time.sleep(0.2)


def _safe(ready) -> bool:
    try:
        return ready()
    except OSError:  # the turn file not written yet
        return False


def _worker_main() -> int:
    """python paired.py --worker JOB.json, with PYTHONPATH and cwd = the other tree."""
    job = json.loads(Path(sys.argv[sys.argv.index("--worker") + 1]).read_text())
    job["worker"] = True
    run_tree(job)
    return 0


# ---- the command ------------------------------------------------------------------------------
def make_parser():
    from jaxspec.cli_support import ArgumentParser

    p = ArgumentParser(prog="python -m jaxspec.bench.paired",
                       description="Plain, n-gram and EAGLE in interleaved rounds: decode tok/s, "
                       "speedup, mean accepted length and step cost per method (optionally "
                       "against a second source tree, in turns).")
    p.add_argument("--configs", nargs="+", default=["plain", "ngram", "eagle"], metavar="NAME",
                   help=f"short names ({', '.join(CONFIG_NAMES)}) or YAML paths; plain is "
                   "always run as the baseline")
    p.add_argument("--prompts", type=int, default=6, metavar="N",
                   help="Spec-Bench first turns, one per category then again (default 6)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="T")
    p.add_argument("--rounds", type=int, default=3, metavar="R")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="prompts decoded together per call (default 1); speedup is then "
                   "throughput over plain's, step cost per row-step")
    p.add_argument("--data", default=str(REPO_ROOT / "data" / "spec_bench_dev.jsonl"),
                   metavar="FILE.jsonl")
    p.add_argument("--tree", metavar="DIR", help="a second source tree (e.g. a worktree of "
                   "another commit) timed in turns with this one")
    p.add_argument("--out", required=True, metavar="FILE.json")
    return p


def check_args(args) -> None:
    from jaxspec.errors import JaxspecError

    for flag, v in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                    ("--rounds", args.rounds), ("--batch-size", args.batch_size)):
        if v < 1:
            raise JaxspecError(f"{flag} {v}: use an integer >= 1")
    for name in args.configs:
        if name not in CONFIG_NAMES and not name.endswith((".yaml", ".yml")):
            raise JaxspecError(f"--configs {name!r}: use one of {', '.join(CONFIG_NAMES)} or a "
                               "path to a YAML config")
        if not Path(config_path(name, REPO_ROOT)).is_file():
            raise JaxspecError(f"--configs {name!r}: no file {config_path(name, REPO_ROOT)}")
    if args.tree and not (Path(args.tree) / "jaxspec" / "__init__.py").is_file():
        raise JaxspecError(f"--tree {args.tree}: not a jaxspec source tree (no jaxspec/__init__.py)"
                           "; give a worktree's root")


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    check_args(args)
    methods = [BASELINE] + [m for m in args.configs if m != BASELINE]
    prompts = pick_prompts(args.data, args.prompts)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    job = {"root": str(REPO_ROOT), "methods": methods, "prompts": prompts,
           "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "label": "a",
           "batch_size": args.batch_size}
    proc = None
    if args.tree:
        turn_dir = out.parent / (out.stem + ".turns")
        turn_dir.mkdir(exist_ok=True)
        for f in turn_dir.iterdir():
            f.unlink()
        other = Path(args.tree).resolve()
        job_b = {**job, "root": str(other), "label": "b", "peer": "a", "turn_dir": str(turn_dir)}
        (turn_dir / "job_b.json").write_text(json.dumps(job_b))
        env = {**os.environ, "PYTHONPATH": str(other)}
        code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], " \
               "run_name='__main__')"
        proc = subprocess.Popen([sys.executable, "-c", code, __file__, "--worker",
                                 str(turn_dir / "job_b.json")], cwd=other, env=env)
        job.update(peer="b", turn_dir=str(turn_dir), first=True, proc=proc)
    try:
        rows_a = run_tree(job)
        rows_b = []
        if proc is not None:
            if proc.wait(timeout=TURN_WAIT_S) != 0:
                raise RuntimeError(f"the other tree's process exited with {proc.returncode}")
            lines = (Path(job["turn_dir"]) / "b.jsonl").read_text().splitlines()
            rows_b = [json.loads(line) for line in lines]
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        from jaxspec.errors import JaxspecError

        raise JaxspecError(f"--tree {args.tree}: {e} (its output is above); check that the tree "
                           "runs `python -m jaxspec.generate` with these configs") from None
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
    result = {
        "command": "python -m jaxspec.bench.paired " + " ".join(argv or sys.argv[1:]),
        "settings": {"methods": {m: CONFIG_NAMES.get(m, m) for m in methods},
                     "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                     "rounds": args.rounds, "batch_size": args.batch_size, "data": args.data,
                     "tree_a": str(REPO_ROOT),
                     "tree_b": str(Path(args.tree).resolve()) if args.tree else None},
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": os.getloadavg(),
        "a": summarise_tree(rows_a, methods),
    }
    print(format_table(result["a"], "this tree" if args.tree else "paired"))
    if rows_b:
        result["b"] = summarise_tree(rows_b, methods)
        result["b_over_a"] = compare_trees(result["a"], result["b"], rows_a, rows_b)
        print(format_table(result["b"], f"--tree {args.tree}"))
        for m, c in result["b_over_a"].items():
            print(f"  b/a {m:<12} tok/s {c['tokens_per_s_b_over_a']:.3f}  step cost "
                  f"{c['step_cost_b_over_a']:.3f} (by prompt "
                  f"{c['step_cost_by_prompt_b_over_a']:.3f})  tokens equal {c['tokens_equal']}")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(_worker_main())
    from jaxspec.cli_support import run as run_cli

    sys.exit(run_cli(main))
