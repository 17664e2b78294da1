"""Spec-Bench-style benchmark: methods side by side on the same target, per category, with peers.

    python -m jaxspec.bench --config configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml \\
        --n-per-category 3 --max-new-tokens 128 --peers hf --gammas 1,2,3,5,8 \\
        --batch-sizes 1,2,4,8,16,32 --out bench_out

Protocol (Spec-Bench): greedy, batch 1, the first turn of each question, warm-up excluded (each
engine runs once per prompt-length bucket before timing), plain decoding of the same target in the
same run is the baseline, methods interleaved per prompt (baseline, A, B, [HF peers] for prompt 1,
then prompt 2, ...) so machine noise hits all alike. Every method's tokens are checked against the
baseline's. Speedup = mean per-question tokens/s of a method / that of the baseline.

Two throughput figures, both per question then averaged:
  tokens_per_s      decode only: generated tokens after the first / decode wall time (the engine's
                    `decode_tokens_per_s`; prefill and the first token excluded)
  e2e_tokens_per_s  end to end: generated tokens / (prefill + decode) wall time — what HF's
                    `generate` timing measures, so the one to compare with transformers.

Writes to --out: results.json (rewritten after every prompt, so Ctrl-C leaves the partial run),
summary.md (Markdown tables), and PNGs (per-category speedup, accepted-length histogram, per-position
acceptance, γ sweep against the formula, batch sweep). Bad input: one line `error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from jaxspec import bench_formula as formula
from jaxspec.cli_support import EXIT_USAGE, ArgumentParser, enable_compilation_cache
from jaxspec.errors import JaxspecError
from jaxspec.jsonl import read_jsonl

EXIT_INTERRUPTED = 130
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_NAME = Path("shared", "data", "spec_bench_dev.jsonl")
# The repo's sibling `shared/` (CI layout), else a `shared/` inside the checkout.
DEFAULT_DATA = next(
    (p for p in (REPO_ROOT.parent / DATA_NAME, REPO_ROOT / DATA_NAME) if p.is_file()),
    REPO_ROOT.parent / DATA_NAME,
)


def category_of(raw: str) -> str:
    """Spec-Bench's own categories; everything else (writing, coding, ...) is MT-bench."""
    return raw if raw in SPEC_BENCH_CATEGORIES[1:] else "mt_bench"


# ---- input --------------------------------------------------------------------------------------
def _int_list(flag: str, lo: int, hi: int):
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} {text!r}: give comma-separated integers, e.g. 1,2,4"
            ) from None
        if not values or any(not lo <= v <= hi for v in values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: each value must be in {lo}..{hi}")
        return sorted(set(values))

    return parse


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: use an integer >= 1")
        return v

    return parse


def _threads(text: str) -> int | str:
    return text if text == "auto" else _positive("--hf-threads")(text)


def make_parser() -> argparse.ArgumentParser:
    from jaxspec.limits import MAX_SPECULATIVE_TOKENS

    p = ArgumentParser(
        prog="python -m jaxspec.bench",
        description="Spec-Bench-style benchmark of jaxspec configs against plain decoding "
        "(and transformers with --peers hf).",
    )
    p.add_argument(
        "--config",
        nargs="+",
        action="extend",
        required=True,
        metavar="C.yaml",
        help="one or more configs (same model); plain decoding of that model is always "
        "run as the baseline",
    )
    p.add_argument(
        "--data",
        default=str(DEFAULT_DATA),
        metavar="FILE.jsonl",
        help="Spec-Bench questions (question_id, category, turns); default: "
        "<repo>/../shared/data/spec_bench_dev.jsonl",
    )
    p.add_argument("--n-per-category", type=_positive("--n-per-category"), default=5, metavar="N")
    p.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=128, metavar="M")
    p.add_argument("--out", required=True, metavar="DIR", help="results.json, summary.md, PNGs")
    p.add_argument(
        "--peers",
        choices=["none", "hf"],
        default="none",
        help="hf: transformers (PyTorch, CPU) plain, prompt lookup, assisted",
    )
    p.add_argument(
        "--hf-threads",
        type=_threads,
        default="auto",
        metavar="T|auto",
        help="torch threads for the HF peers; auto (default): time 1 thread and all "
        "cores on a short warm-up and keep the faster",
    )
    p.add_argument(
        "--hf-prompt-lookup-tokens",
        type=_positive("--hf-prompt-lookup-tokens"),
        metavar="G",
        help="HF prompt_lookup_num_tokens (default: γ of the first ngram config, else 4)",
    )
    p.add_argument(
        "--gammas",
        type=_int_list("--gammas", 1, MAX_SPECULATIVE_TOKENS),
        metavar="1,2,3,5,8",
        help="γ sweep of --sweep-config (omit: no γ sweep)",
    )
    p.add_argument(
        "--batch-sizes",
        type=_int_list("--batch-sizes", 1, 256),
        metavar="1,4,16",
        help="batch sweep: plain vs --sweep-config (omit: none)",
    )
    p.add_argument(
        "--sweep-config",
        metavar="C.yaml",
        help="speculative config for the sweeps (default: first speculative --config)",
    )
    p.add_argument(
        "--sweep-prompts",
        type=_positive("--sweep-prompts"),
        default=6,
        metavar="N",
        help="prompts in the γ sweep (default 6)",
    )
    p.add_argument(
        "--batch-rounds",
        type=_positive("--batch-rounds"),
        default=2,
        metavar="R",
        help="batch sweep: full batches timed per batch size (default 2)",
    )
    p.add_argument(
        "--batch-max-new-tokens", type=_positive("--batch-max-new-tokens"), default=64, metavar="M"
    )
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="skip configs whose method is not registered or whose drafter fails to "
        "build (missing checkpoint), instead of stopping",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument(
        "--sweeps-only",
        action="store_true",
        help="skip the Spec-Bench phase: run only the γ / batch sweeps (prompts still come from "
        "--data and --n-per-category)",
    )
    return p


def read_questions(path: str | Path) -> list[dict[str, Any]]:
    """Spec-Bench lines -> [{question_id, category (mapped), raw_category, prompt (first turn)}]."""
    rows = []
    for n, row in read_jsonl(path, "data file", ": pass --data FILE.jsonl"):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
            raise JaxspecError(f'data file {path} line {n}: expected "turns", a list of strings')
        raw = str(row.get("category", "mt_bench"))
        rows.append(
            {
                "question_id": row.get("question_id", n),
                "category": category_of(raw),
                "raw_category": raw,
                "prompt": turns[0],
            }
        )
    if not rows:
        raise JaxspecError(f"data file {path} has no questions")
    return rows


def select(rows: list[dict[str, Any]], n_per_category: int) -> list[dict[str, Any]]:
    """The first N questions of each category (file order), interleaved across categories."""
    by_cat: dict[str, list] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    picked = {c: rs[:n_per_category] for c, rs in by_cat.items()}
    order = [c for c in SPEC_BENCH_CATEGORIES if c in picked]
    out = []
    for i in range(n_per_category):
        out += [picked[c][i] for c in order if i < len(picked[c])]
    return out


def label_of(path: str) -> str:
    return Path(path).stem


# ---- aggregation ---------------------------------------------------------------------------------
def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else 0.0


def _ratio(a: float, b: float) -> float | None:
    return a / b if a and b else None


def record(result, wall_s: float) -> dict[str, Any]:
    """One GenerationResult -> the per-prompt row kept in results.json."""
    n = result.num_generated_tokens
    m = result.metrics
    decode_s = (n - 1) / result.decode_tokens_per_s if n > 1 and result.decode_tokens_per_s else 0.0
    total_s = result.time_to_first_token_s + decode_s
    return {
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_generated_tokens": n,
        "ttft_s": result.time_to_first_token_s,
        "decode_s": decode_s,
        "wall_s": wall_s,
        "tokens_per_s": result.decode_tokens_per_s,
        "e2e_tokens_per_s": n / total_s if total_s > 0 else 0.0,
        "num_steps": m["num_steps"],
        "num_draft_tokens": m["num_draft_tokens"],
        "num_accepted_tokens": m["num_accepted_tokens"],
        "accepted_per_position": m["accepted_per_position"],
        "token_ids": result.token_ids,
        "compile_s": m.get("compile_s", 0.0),  # must be 0: compilation happens in the warm-up
    }


def aggregate(rows: list[dict], base_rows: list[dict], gamma: int) -> dict[str, Any]:
    """Method rows + the baseline rows of the same prompts -> one overall/category object."""
    tps = _mean(r["tokens_per_s"] for r in rows)
    e2e = _mean(r["e2e_tokens_per_s"] for r in rows)
    btps = _mean(r["tokens_per_s"] for r in base_rows)
    be2e = _mean(r["e2e_tokens_per_s"] for r in base_rows)
    steps = sum(r["num_steps"] for r in rows)
    emitted = sum(max(r["num_generated_tokens"] - 1, 0) for r in rows)
    drafted = sum(r["num_draft_tokens"] for r in rows)
    accepted = sum(r["num_accepted_tokens"] for r in rows)
    mal = emitted / steps if steps else 1.0
    per_pos = [0.0] * gamma
    for r in rows:
        for i, a in enumerate(r["accepted_per_position"][:gamma]):
            per_pos[i] += a * r["num_steps"]
    per_pos = [x / steps if steps else 0.0 for x in per_pos]
    step_s = sum(r["decode_s"] for r in rows) / steps if steps else 0.0
    bsteps = sum(r["num_steps"] for r in base_rows)
    base_step_s = sum(r["decode_s"] for r in base_rows) / bsteps if bsteps else 0.0
    cost = _ratio(step_s, base_step_s)
    matches = [r["token_ids"] == b["token_ids"] for r, b in zip(rows, base_rows)]
    alpha = formula.alpha_from_accepted_length(mal, gamma) if gamma else None
    return {
        "num_prompts": len(rows),
        "num_generated_tokens": sum(r["num_generated_tokens"] for r in rows),
        "tokens_per_s": tps,
        "baseline_tokens_per_s": btps,
        "speedup": _ratio(tps, btps),
        "e2e_tokens_per_s": e2e,
        "baseline_e2e_tokens_per_s": be2e,
        "e2e_speedup": _ratio(e2e, be2e),
        "mean_accepted_length": mal,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "nodes_per_step": drafted / steps if steps else 0.0,  # draft nodes verified per forward
        "accepted_per_position": per_pos,
        "step_cost_ratio": cost,
        "alpha_from_accepted_length": alpha,
        "predicted_speedup": (
            formula.speedup(alpha, gamma, step_cost=cost)
            if gamma and alpha is not None and cost
            else None
        ),
        "outputs_match_baseline": all(matches) if matches else None,
        "match_rate": sum(matches) / len(matches) if matches else None,
        "compile_s_in_timed_runs": sum(r.get("compile_s", 0.0) for r in rows),
    }


def aggregate_peer(rows: list[dict], base_rows: list[dict], ours: dict[str, list[dict]]):
    """HF rows -> {tokens_per_s, match rate vs our baseline, our e2e/decode ratios to it}."""
    tps = _mean(r["tokens_per_s"] for r in rows)
    matches = [r["token_ids"] == b["token_ids"] for r, b in zip(rows, base_rows)]
    ratios = {}
    for label, ours_rows in ours.items():
        ratios[label] = {
            "e2e_ratio": _ratio(_mean(r["e2e_tokens_per_s"] for r in ours_rows), tps),
            "decode_ratio": _ratio(_mean(r["tokens_per_s"] for r in ours_rows), tps),
        }
    return {
        "num_prompts": len(rows),
        "tokens_per_s": tps,
        "matches_our_baseline": all(matches) if matches else None,
        "match_rate_vs_our_baseline": sum(matches) / len(matches) if matches else None,
        "ours_over_this": ratios,
    }


# ---- the run -------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, argv: list[str], target=None, hf_model=None):
        self.args = args
        self._target, self._hf_model = target, hf_model  # already loaded (tests, notebooks)
        self.out = Path(args.out)
        self.results: dict[str, Any] = {
            "command": "python -m jaxspec.bench " + " ".join(argv),
            "status": "running",
            "settings": {},
            "machine": {},
        }
        self.rows: dict[str, list[dict]] = {}  # label -> per-prompt rows, in prompt order
        self.prompts: list[dict] = []

    # -- setup
    def prepare(self) -> None:
        from jaxspec import drafters
        from jaxspec.config import load_config

        a = self.args
        greedy = ["sampling.temperature=0"]
        self.configs = {}
        for path in a.config:
            label = label_of(path)
            if label in self.configs:
                raise JaxspecError(f"--config {path}: a config named {label!r} is given twice")
            cfg = load_config(path, greedy)
            try:
                drafters.check_method(cfg.speculative.method)
            except JaxspecError as e:
                if not a.skip_unavailable:
                    raise
                self._skip(label, str(e))
                continue
            self.configs[label] = cfg
        if not self.configs:
            raise JaxspecError("no usable config: every --config was skipped")
        first = next(iter(self.configs.values()))
        for label, cfg in self.configs.items():
            if cfg.model != first.model:
                raise JaxspecError(
                    f"--config {label}: model section differs from the first config's; all "
                    "configs must share one target (one baseline)"
                )
        self.sweep_label = None
        if a.sweep_config:
            self.sweep_label = label_of(a.sweep_config)
            if self.sweep_label not in self.configs:
                cfg = load_config(a.sweep_config, greedy)
                drafters.check_method(cfg.speculative.method)
                if cfg.model != first.model:
                    raise JaxspecError("--sweep-config must use the same model as --config")
                self.sweep_cfg = cfg
            else:
                self.sweep_cfg = self.configs[self.sweep_label]
            if self.sweep_cfg.speculative.method == "none":
                raise JaxspecError("--sweep-config must be a speculative config (method != none)")
        elif a.gammas or a.batch_sizes:
            spec = [l for l, c in self.configs.items() if c.speculative.method != "none"]
            if not spec:
                raise JaxspecError(
                    "--gammas/--batch-sizes need a speculative config: add one to "
                    "--config or pass --sweep-config"
                )
            self.sweep_label, self.sweep_cfg = spec[0], self.configs[spec[0]]
        self.prompts = select(read_questions(a.data), a.n_per_category)
        self.base_cfg = load_config(
            None,
            greedy
            + [
                f"model.name={first.model.name}",
                f"model.dtype={first.model.dtype}",
                f"model.layout={first.model.layout}",
                f"generation.chat_template={str(first.generation.chat_template).lower()}",
            ],
        )
        if first.generation.system_prompt is not None:
            import dataclasses

            self.base_cfg = dataclasses.replace(
                self.base_cfg,
                generation=dataclasses.replace(
                    self.base_cfg.generation, system_prompt=first.generation.system_prompt
                ),
            )
        self.results["settings"] = {
            "configs": {
                l: str(p) for l, p in zip(map(label_of, a.config), a.config) if l in self.configs
            },
            "data": str(a.data),
            "n_per_category": a.n_per_category,
            "num_prompts": len(self.prompts),
            "categories": sorted(
                {p["category"] for p in self.prompts}, key=SPEC_BENCH_CATEGORIES.index
            ),
            "max_new_tokens": a.max_new_tokens,
            "sampling": "greedy",
            "batch_size": 1,
            "turns": "first turn of each question",
            "warm_up": "one untimed run per engine per prompt-length bucket",
            "baseline": "plain decoding (speculative.method=none) of the same loaded target",
            "tokens_per_s": "decode only: (generated - 1) / decode wall time, mean per question",
            "e2e_tokens_per_s": "generated / (prefill + decode) wall time, mean per question",
            "speedup": "mean per-question tokens/s of the method / of the baseline",
            "alpha": "alpha_from_accepted_length: α with (1-α^(γ+1))/(1-α) = mean accepted "
            "length; acceptance_rate = accepted / drafted tokens",
            "step_cost_ratio": "(decode s / target forwards) of the method / of the baseline",
            "peers": a.peers,
            "gammas": a.gammas,
            "batch_sizes": a.batch_sizes,
            "sweep_config": self.sweep_label,
            "sweeps_only": bool(a.sweeps_only),
            "config_values": {l: c.to_dict() for l, c in self.configs.items()},
        }
        self.results["machine"] = machine_facts()

    def _skip(self, label: str, why: str) -> None:
        self.results.setdefault("skipped_configs", {})[label] = why
        print(f"warning: skipping config {label}: {why}", file=sys.stderr)

    def load(self) -> None:
        from jaxspec.build import build_engine
        from jaxspec.loading import load_model

        enable_compilation_cache()
        m = self.base_cfg.model
        self.target = self._target or load_model(m.name, dtype=m.dtype, layout=m.layout)
        self.results["machine"]["model_layout"] = self.target.layout
        self.engines = {"baseline": build_engine(self.base_cfg, target=self.target)}
        for label, cfg in list(self.configs.items()):
            if cfg.speculative.method == "none":
                continue  # a plain config *is* the baseline: reported with its rows
            try:
                self.engines[label] = build_engine(cfg, target=self.target)
            except (JaxspecError, OSError, ValueError) as e:  # e.g. a checkpoint not trained yet
                if not self.args.skip_unavailable:
                    raise
                self._skip(label, str(e))
                del self.configs[label]
        self.ids = [self.engines["baseline"].encode(p["prompt"]) for p in self.prompts]
        self.peers = None
        if self.args.peers == "hf":
            from jaxspec.bench_peers import HFPeers

            g = self.args.hf_prompt_lookup_tokens or next(
                (
                    c.speculative.num_speculative_tokens
                    for c in self.configs.values()
                    if c.speculative.method == "ngram"
                ),
                4,
            )
            self.peers = HFPeers(
                self.target,
                self.configs,
                threads=self.args.hf_threads,
                prompt_lookup_tokens=g,
                model=self._hf_model,
            )
            self.results["peers"] = {"hf": {"info": self.peers.info}}

    def warm_up(self, engine, ids_list: list[list[int]], max_new: int, batch_size: int = 1):
        """Run once per prompt-length bucket (same capacity, fewer tokens): compile untimed."""
        from jaxspec.engine import bucket
        from jaxspec.sampling import SamplingParams

        short = bucket(max_new) // 2 + 1 if max_new > 16 else max_new
        seen = set()
        for i in range(0, len(ids_list), batch_size):
            chunk = ids_list[i : i + batch_size]
            b = bucket(max(len(x) for x in chunk))
            if b not in seen:
                seen.add(b)
                if hasattr(engine, "_ensure_compiled"):  # prefill + one step: compiles, cheap
                    engine._ensure_compiled(chunk, max_new, SamplingParams.make(), batch_size)
                else:
                    engine.generate(chunk, max_new_tokens=short, batch_size=batch_size)

    # -- phase 1: Spec-Bench protocol
    def run_main(self) -> None:
        from tqdm import tqdm

        a = self.args
        for name, engine in self.engines.items():
            self.warm_up(engine, self.ids, a.max_new_tokens)
        if self.peers:
            self.peers.warm_up(self.ids[0])
        labels = list(self.engines)
        peer_names = list(self.peers.methods) if self.peers else []
        for name in labels + peer_names:
            self.rows[name] = []
        bar = tqdm(list(zip(self.prompts, self.ids)), desc="bench", unit="prompt", file=sys.stderr)
        for prompt, ids in bar:
            for name in labels:
                t0 = time.perf_counter()
                res = self.engines[name].generate([ids], max_new_tokens=a.max_new_tokens)[0]
                row = record(res, time.perf_counter() - t0)
                row["question_id"], row["category"] = prompt["question_id"], prompt["category"]
                self.rows[name].append(row)
            for name in peer_names:
                row = self.peers.generate(name, ids, a.max_new_tokens)
                row["question_id"], row["category"] = prompt["question_id"], prompt["category"]
                self.rows[name].append(row)
            base = self.rows["baseline"][-1]["tokens_per_s"]
            bar.set_postfix(
                {n: f"{self.rows[n][-1]['tokens_per_s'] / base:.2f}x" for n in labels[1:]}
                if base
                else {}
            )
            self.summarise()
            self.write(plots=False)

    # -- phase 2: γ sweep
    def run_gamma_sweep(self) -> None:
        import dataclasses

        from tqdm import tqdm

        from jaxspec.build import build_engine

        a = self.args
        cfg = self.sweep_cfg
        prompts = self.prompts[: a.sweep_prompts]
        ids = self.ids[: a.sweep_prompts]
        engines = {"baseline": self.engines["baseline"]}
        for g in a.gammas:
            spec = dataclasses.replace(cfg.speculative, num_speculative_tokens=g)
            engines[g] = build_engine(
                dataclasses.replace(cfg, speculative=spec), target=self.target
            )
            self.warm_up(engines[g], ids, a.max_new_tokens)
        rows: dict[Any, list] = {k: [] for k in engines}
        sweep = self.results["gamma_sweep"] = {
            "config": self.sweep_label,
            "num_prompts": len(prompts),
            "points": [],
        }
        for i in tqdm(range(len(ids)), desc="gamma sweep", unit="prompt", file=sys.stderr):
            for k, engine in engines.items():
                res = engine.generate([ids[i]], max_new_tokens=a.max_new_tokens)[0]
                rows[k].append(record(res, 0.0))
            sweep["points"] = [
                {"gamma": g, **_drop(aggregate(rows[g], rows["baseline"], g))} for g in a.gammas
            ]
            self._fit_gamma_curve(sweep)
            self.write(plots=False)

    def _fit_gamma_curve(self, sweep: dict) -> None:
        pts = [p for p in sweep["points"] if p["step_cost_ratio"]]
        r0, r1 = formula.fit_step_cost(
            [p["gamma"] for p in pts], [p["step_cost_ratio"] for p in pts]
        )
        tot_steps = sum(p["num_generated_tokens"] for p in pts)
        alphas = [(p["alpha_from_accepted_length"], p["num_generated_tokens"]) for p in pts]
        alpha = sum(x * w for x, w in alphas) / tot_steps if tot_steps else 0.0
        gmax = max([16, *(p["gamma"] for p in pts)])
        grid = list(range(1, gmax + 1))
        sweep["formula"] = {
            "alpha": alpha,
            "alpha_definition": "token-weighted mean of alpha_from_accepted_length over γ points",
            "step_cost_fit": {"r0": r0, "r1": r1, "form": "r(γ) = r0 + r1·γ, least squares"},
            "curve": {"gamma": grid, "speedup": formula.speedup_curve(alpha, grid, r0, r1)},
            "optimal_gamma": formula.optimal_gamma(alpha, r0, r1, gmax),
            "curve_free_verify": {
                "gamma": grid,
                "speedup": formula.speedup_curve(alpha, grid, 1.0, 0.0),
            },
        }

    # -- phase 3: batch sweep
    def run_batch_sweep(self) -> None:
        from tqdm import tqdm

        from jaxspec.build import build_engine

        a = self.args
        m = a.batch_max_new_tokens
        engines = {
            "plain": self.engines["baseline"],
            self.sweep_label: self.engines.get(self.sweep_label)
            or build_engine(self.sweep_cfg, target=self.target),
        }
        sweep = self.results["batch_sweep"] = {
            "config": self.sweep_label,
            "rounds": a.batch_rounds,
            "max_new_tokens": m,
            "method": "at batch size b: `rounds` full batches of b requests (the 8 shortest prompts, "
            "cycled); throughput = generated tokens / wall time; latency = wall time of the batch "
            "a request was in",
            "points": [],
        }
        # the shortest prompts, cycled: every batch size sees the same prompt-length bucket, so
        # throughput and latency move with the batch, not with which prompts happened to be in it
        pool = sorted(self.ids, key=len)[: max(1, min(8, len(self.ids)))]
        for b in tqdm(a.batch_sizes, desc="batch sweep", unit="batch size", file=sys.stderr):
            n = b * a.batch_rounds
            ids = [pool[i % len(pool)] for i in range(n)]
            point = {"batch_size": b, "num_requests": n}
            for name, engine in engines.items():
                self.warm_up(engine, ids, m, batch_size=b)
                tokens, wall, lat = 0, 0.0, []
                for s in range(0, n, b):
                    chunk = ids[s : s + b]
                    t0 = time.perf_counter()
                    res = engine.generate(chunk, max_new_tokens=m, batch_size=b)
                    dt = time.perf_counter() - t0
                    wall += dt
                    tokens += sum(r.num_generated_tokens for r in res)
                    lat += [dt] * len(chunk)
                    outs = [r.token_ids for r in res]
                    point.setdefault(f"{name}_outputs", []).extend(outs)
                key = "plain" if name == "plain" else "speculative"
                point[f"{key}_tokens_per_s"] = tokens / wall if wall else 0.0
                point[f"{key}_latency_s"] = statistics.fmean(lat)
            po = point.pop("plain_outputs")
            so = point.pop(f"{self.sweep_label}_outputs")
            point["outputs_match"] = po == so
            point["speedup"] = _ratio(
                point["speculative_tokens_per_s"], point["plain_tokens_per_s"]
            )
            sweep["points"].append(point)
            self.write(plots=False)
        faster = [p["batch_size"] for p in sweep["points"] if (p["speedup"] or 0) >= 1.0]
        sweep["speculative_faster_at"] = faster
        # the first batch size, after one where speculation won, at which plain decoding wins
        later = [
            p["batch_size"]
            for p in sweep["points"]
            if faster and p["batch_size"] > faster[0] and (p["speedup"] or 0) < 1.0
        ]
        sweep["crossover_batch_size"] = later[0] if later else None

    # -- results
    def summarise(self) -> None:
        base = self.rows.get("baseline", [])
        if not base:
            return
        cats = [c for c in SPEC_BENCH_CATEGORIES if any(r["category"] == c for r in base)]
        out = {}
        for label, cfg in self.configs.items():
            gamma = (
                cfg.speculative.num_speculative_tokens if cfg.speculative.method != "none" else 0
            )
            rows = self.rows.get("baseline" if gamma == 0 else label, [])[: len(base)]
            if len(rows) < len(base):
                base_n = base[: len(rows)]
            else:
                base_n = base
            entry = {
                "config": self.results["settings"]["configs"].get(label),
                "method": cfg.speculative.method if gamma else "plain",
                "num_speculative_tokens": gamma,
                "overall": aggregate(rows, base_n, gamma),
                "categories": {
                    c: aggregate(
                        [r for r in rows if r["category"] == c],
                        [r for r in base_n if r["category"] == c],
                        gamma,
                    )
                    for c in cats
                },
            }
            out[label] = entry
        self.results["configs"] = out
        spec = {l: e for l, e in out.items() if e["num_speculative_tokens"]}
        pick = (
            max(spec, key=lambda l: spec[l]["overall"]["speedup"] or 0) if spec else next(iter(out))
        )
        self.results["best_config"] = pick
        self.results["overall"] = {"config": pick, **out[pick]["overall"]}
        self.results["categories"] = out[pick]["categories"]
        if self.peers:
            ours = {
                l: self.rows.get("baseline" if e["num_speculative_tokens"] == 0 else l, [])
                for l, e in out.items()
            }
            if not any(e["num_speculative_tokens"] == 0 for e in out.values()):
                ours["plain (baseline)"] = base
            hf = self.results["peers"]["hf"]
            methods = {}
            for name in self.peers.methods:
                rows = self.rows.get(name, [])
                n = len(rows)
                ours_n = {l: r[:n] for l, r in ours.items()}
                methods[name] = {
                    "overall": aggregate_peer(rows, base[:n], ours_n),
                    "categories": {
                        c: aggregate_peer(
                            [r for r in rows if r["category"] == c],
                            [r for r in base[:n] if r["category"] == c],
                            {l: [r for r in rs if r["category"] == c] for l, rs in ours_n.items()},
                        )
                        for c in cats
                    },
                }
            hf["methods"] = methods
            plain = methods["hf_plain"]["overall"]["tokens_per_s"]
            best_name = max(
                (m for m in methods if m != "hf_plain"),
                key=lambda m: methods[m]["overall"]["tokens_per_s"],
                default=None,
            )
            best = methods[best_name]["overall"]["tokens_per_s"] if best_name else None
            our_best = self.results["overall"]
            hf["targets"] = {
                "our_plain_e2e_over_hf_plain": _ratio(
                    _mean(r["e2e_tokens_per_s"] for r in base), plain
                ),
                "our_best_e2e_over_hf_plain": _ratio(our_best["e2e_tokens_per_s"], plain),
                "hf_best_speculative": best_name,
                "our_best_e2e_over_hf_best_speculative": _ratio(our_best["e2e_tokens_per_s"], best),
                "our_plain_decode_over_hf_plain": _ratio(
                    _mean(r["tokens_per_s"] for r in base), plain
                ),
                "our_best_decode_over_hf_plain": _ratio(our_best["tokens_per_s"], plain),
                "our_best_decode_over_hf_best_speculative": _ratio(our_best["tokens_per_s"], best),
            }

    def write(self, plots: bool) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.results["per_prompt"] = {
            name: [_drop(r, keep_ids=False) for r in rows] for name, rows in self.rows.items()
        }
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=_json_default) + "\n")
        tmp.replace(self.out / "results.json")
        if plots:
            from jaxspec.bench_plots import write_plots, write_summary

            write_summary(self.results, self.out / "summary.md")
            if not self.args.no_plots:
                self.results["plots"] = write_plots(self.results, self.out)
                tmp.write_text(json.dumps(self.results, indent=1, default=_json_default) + "\n")
                tmp.replace(self.out / "results.json")


def _drop(row: dict, keep_ids: bool = False) -> dict:
    return {k: v for k, v in row.items() if keep_ids or k != "token_ids"}


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def machine_facts() -> dict[str, Any]:
    import jax

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def check_extras(args) -> None:
    """The optional packages this run needs, checked before anything runs (not at the end)."""
    need = []
    if not args.no_plots:
        need.append(("matplotlib", "draws the plots (or pass --no-plots)"))
    if args.peers == "hf":
        need += [("torch", "runs the HF peers"), ("transformers", "runs the HF peers")]
    for module, why in need:
        if importlib.util.find_spec(module) is None:
            raise JaxspecError(
                f"{module} is not installed and {why}: pip install -e '.[bench]' "
                f"(torch==2.13.0, the CPU wheel)"
            )


def main(argv: list[str] | None = None, *, target=None, hf_model=None) -> int:
    """The CLI. `target` (a LoadedModel) / `hf_model` (its transformers twin): reuse loaded ones."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = None
    try:
        args = make_parser().parse_args(argv)
        check_extras(args)
        bench = Bench(args, argv, target=target, hf_model=hf_model)
        bench.prepare()
        bench.load()
        if not args.sweeps_only:
            bench.run_main()
        if args.gammas:
            bench.run_gamma_sweep()
        if args.batch_sizes:
            bench.run_batch_sweep()
        bench.results["status"] = "complete"
        bench.summarise()
        bench.write(plots=True)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if bench is not None and (bench.rows or "gamma_sweep" in bench.results):
            bench.results["status"] = "interrupted"
            bench.summarise()
            bench.write(plots=True)
            print(f"\ninterrupted: partial results in {bench.out}/results.json", file=sys.stderr)
        else:
            print("\ninterrupted before any result", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"results: {bench.out}/results.json, {bench.out}/summary.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
