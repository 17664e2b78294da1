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

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from jaxspec import progress
from jaxspec.bench.facts import json_default, machine_facts
from jaxspec.bench.plan import BenchPlan, plan_bench, settings
from jaxspec.bench.rows import (  # noqa: F401 -- aggregate: re-exported
    SPEC_BENCH_CATEGORIES,
    aggregate,
    drop_ids,
    record,
    summarise_configs,
    summarise_peers,
)
from jaxspec.bench.sweeps import batch_sweep, gamma_sweep
from jaxspec.cli_support import enable_compilation_cache
from jaxspec.errors import JaxspecError
from jaxspec.jsonl import read_jsonl

EXIT_INTERRUPTED = 130


def category_of(raw: str) -> str:
    """Spec-Bench's own categories; everything else (writing, coding, ...) is MT-bench."""
    return raw if raw in SPEC_BENCH_CATEGORIES[1:] else "mt_bench"


# ---- input --------------------------------------------------------------------------------------
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


# ---- the run -------------------------------------------------------------------------------------
class Bench:
    """One run: plan (configs, prompts) -> load (target, engines, peers) -> main protocol and
    sweeps -> results.json / summary.md. The figures come from jaxspec.bench.rows."""

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
        self.vllm = None  # the vLLM peer (jaxspec.bench.vllm_peer.VLLMPeers), --peers vllm
        self.plan: BenchPlan | None = None

    @property
    def configs(self) -> dict[str, Any]:
        return self.plan.configs if self.plan else {}

    @property
    def prompts(self) -> list[dict[str, Any]]:
        return self.plan.prompts if self.plan else []

    def prepare(self) -> None:
        prompts = select(read_questions(self.args.data), self.args.n_per_category)
        self.plan = plan_bench(self.args, prompts)
        self.results["settings"] = settings(self.args, self.plan)
        self.results["machine"] = machine_facts()
        self._note_skipped()

    def _note_skipped(self) -> None:
        if self.plan.skipped:
            self.results["skipped_configs"] = dict(self.plan.skipped)

    def load(self) -> None:
        from jaxspec.build import build_engine
        from jaxspec.loading import load_model

        enable_compilation_cache()
        m = self.plan.base_cfg.model
        self.target = self._target or load_model(m.name, dtype=m.dtype, layout=m.layout)
        self.results["machine"]["model_layout"] = self.target.layout
        self.results["machine"]["model_revision"] = getattr(self.target, "revision", "")
        self.engines = {"baseline": build_engine(self.plan.base_cfg, target=self.target)}
        for label, cfg in list(self.configs.items()):
            if cfg.speculative.method == "none":
                continue  # a plain config *is* the baseline: reported with its rows
            try:
                self.engines[label] = build_engine(cfg, target=self.target)
            except (JaxspecError, OSError, ValueError) as e:  # e.g. a checkpoint not trained yet
                if not self.args.skip_unavailable:
                    raise
                self.plan.skip(label, str(e))
        self._note_skipped()
        self.results["settings"]["configs"] = {
            l: self.plan.config_paths[l] for l in self.configs
        }
        self.ids = [self.engines["baseline"].encode(p["prompt"]) for p in self.prompts]
        self.peers = self.vllm = None
        if "vllm" in self.args.peers:
            from jaxspec.bench.vllm_peer import VLLMPeers

            self.vllm = VLLMPeers(
                self.configs,
                eos_token_ids=list(self.target.eos_token_ids),
                eagle3_dir=self.args.vllm_eagle3,
                log_dir=self.out / "vllm_logs",
                enforce_eager=self.args.vllm_eager,
            )
            self.results.setdefault("peers", {})["vllm"] = {"info": self.vllm.info}
        if "hf" in self.args.peers:
            from jaxspec.bench.peers import HFPeers

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
            self.results.setdefault("peers", {})["hf"] = {"info": self.peers.info}

    @staticmethod
    def warm_up(engine, ids_list: list[list[int]], max_new: int, batch_size: int = 1) -> None:
        """Compile untimed: once per prompt-length bucket (the longest prompt of each batch)."""
        from jaxspec.engine.runner import bucket

        seen = set()
        for i in range(0, len(ids_list), batch_size):
            longest = max(ids_list[i : i + batch_size], key=len)
            if bucket(len(longest)) not in seen:
                seen.add(bucket(len(longest)))
                engine.warmup(longest, max_new_tokens=max_new, batch_size=batch_size)

    # -- phase 1: Spec-Bench protocol
    def run_main(self) -> None:
        from tqdm import tqdm

        a = self.args
        if self.vllm:  # vLLM plain's start-up (torch.compile: minutes) overlaps our warm-up
            self.vllm.start_in_background(self.vllm.methods[0], self.ids[0])
        warm = tqdm(self.engines.values(), desc="warm-up: compiling each method (cached afterwards)",
                    unit="method", file=sys.stderr)
        for engine in warm:
            self.warm_up(engine, self.ids, a.max_new_tokens)
        if self.peers:
            with progress.step("warm-up: transformers peers (and their thread count)"):
                self.peers.warm_up(self.ids[0])
        if self.vllm:  # start-up (torch.compile) and warm-up: timed apart, in peers.vllm.info
            with progress.step("waiting for the vLLM engines' start-up (minutes each)"):
                self.vllm.wait_ready()
        labels = list(self.engines)
        peer_names = list(self.peers.methods) if self.peers else []
        vllm_names = self.vllm.methods[:1] if self.vllm else []  # vllm_plain; others: phases
        for name in labels + peer_names + vllm_names:
            self.rows[name] = []
        bar = tqdm(
            list(zip(self.prompts, self.ids)), desc="bench", unit="prompt", file=sys.stderr
        )
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
            for name in vllm_names:
                row = self.vllm.generate(name, ids, a.max_new_tokens)
                row["question_id"], row["category"] = prompt["question_id"], prompt["category"]
                self.rows[name].append(row)
            if self.vllm:
                ours = self.rows["baseline"][-1]["token_ids"]
                self.vllm.note_reference(prompt["question_id"], ours)
            base = self.rows["baseline"][-1]["tokens_per_s"]
            bar.set_postfix(
                {n: f"{self.rows[n][-1]['tokens_per_s'] / base:.2f}x" for n in labels[1:]}
                if base
                else {}
            )
            self.summarise()
            self.write(plots=False)

    def run_vllm_phases(self) -> None:
        """Each speculative vLLM method alone (one engine at a time: memory), interleaved prompt
        by prompt with a fresh run of our plain decoding (jaxspec.bench.vllm_peer)."""
        from jaxspec.bench.vllm_peer import paired_label

        a = self.args
        self.vllm.stop(self.vllm.methods[0])
        for name in self.vllm.methods[1:]:
            try:
                with progress.step(f"start-up: vLLM {name} (minutes)"):
                    self.vllm.start(name, self.ids[0])
            except JaxspecError as e:  # one method vLLM cannot run does not end the run
                self.vllm.stop(name)
                self.vllm.not_applicable[name] = f"failed in vLLM: {e}"
                print(f"warning: vLLM {name}: {e}", file=sys.stderr)
                continue
            self.rows[name], self.rows[paired_label(name)] = [], []
            for prompt, ids in zip(self.prompts, self.ids):
                t0 = time.perf_counter()
                res = self.engines["baseline"].generate([ids], max_new_tokens=a.max_new_tokens)[0]
                mine = record(res, time.perf_counter() - t0)
                row = self.vllm.generate(name, ids, a.max_new_tokens)
                for r in (mine, row):
                    r["question_id"], r["category"] = prompt["question_id"], prompt["category"]
                self.rows[paired_label(name)].append(mine)
                self.rows[name].append(row)
                self.summarise()
                self.write(plots=False)
            self.vllm.stop(name)

    # -- phases 2 and 3: the sweeps (jaxspec.bench.sweeps)
    def run_gamma_sweep(self) -> None:
        n = self.args.sweep_prompts
        sweep = self.results["gamma_sweep"] = {
            "config": self.plan.sweep_label,
            "num_prompts": len(self.prompts[:n]),
            "points": [],
        }
        gamma_sweep(
            sweep,
            cfg=self.plan.sweep_cfg,
            target=self.target,
            baseline=self.engines["baseline"],
            ids=self.ids[:n],
            gammas=self.args.gammas,
            max_new_tokens=self.args.max_new_tokens,
            warm_up=self.warm_up,
            on_point=lambda: self.write(plots=False),
        )

    def run_batch_sweep(self) -> None:
        from jaxspec.build import build_engine

        a, label = self.args, self.plan.sweep_label
        engines = {
            "plain": self.engines["baseline"],
            label: self.engines.get(label) or build_engine(self.plan.sweep_cfg, target=self.target),
        }
        sweep = self.results["batch_sweep"] = {
            "config": label,
            "rounds": a.batch_rounds,
            "max_new_tokens": a.batch_max_new_tokens,
            "method": "at batch size b: `rounds` full batches of b requests (the 8 shortest prompts, "
            "cycled); throughput = generated tokens / wall time; latency = wall time of the batch "
            "a request was in",
            "points": [],
        }
        batch_sweep(
            sweep,
            engines=engines,
            ids=self.ids,
            batch_sizes=a.batch_sizes,
            rounds=a.batch_rounds,
            max_new_tokens=a.batch_max_new_tokens,
            warm_up=self.warm_up,
            on_point=lambda: self.write(plots=False),
        )

    # -- results
    def summarise(self) -> None:
        summary = summarise_configs(self.configs, self.plan.config_paths, self.rows)
        if not summary:
            return
        self.results.update(summary)
        if self.peers:
            self.results["peers"]["hf"].update(
                summarise_peers(summary, self.rows, list(self.peers.methods))
            )
        if getattr(self, "vllm", None):
            from jaxspec.bench.vllm_peer import summarise_vllm

            ran = [m for m in self.vllm.methods if self.rows.get(m)]
            self.results["peers"]["vllm"].update(summarise_vllm(self.rows, ran, summary))

    def close(self) -> None:
        if getattr(self, "vllm", None):
            self.vllm.close()

    def _record_attention(self) -> None:
        """machine.attention: what the baseline's decode program compiled (read from the
        lowered programs by the engine, jaxspec.hlo.compiled_attention), never the setting;
        attention_compiled: every engine's, per program ("not compiled yet" before a run)."""
        compiled = {label: dict(e.compiled_attention) for label, e in (self.engines or {}).items()
                    if getattr(e, "compiled_attention", None)}
        machine = self.results.setdefault("machine", {})
        machine["attention"] = compiled.get("baseline", {}).get("decode", "not compiled yet")
        machine["attention_compiled"] = compiled

    def write(self, plots: bool) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._record_attention()
        from jaxspec.loading import hub  # every Hub id this run fetched (target, drafters): commit

        self.results["machine"]["hub_revisions"] = dict(hub.FETCHED)
        self.results["per_prompt"] = {
            name: [drop_ids(r) for r in rows] for name, rows in self.rows.items()
        }
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=json_default) + "\n")
        tmp.replace(self.out / "results.json")
        if plots:
            from jaxspec.bench.plots import write_plots, write_summary

            write_summary(self.results, self.out / "summary.md")
            if not self.args.no_plots:
                self.results["plots"] = write_plots(self.results, self.out)
                tmp.write_text(json.dumps(self.results, indent=1, default=json_default) + "\n")
                tmp.replace(self.out / "results.json")
