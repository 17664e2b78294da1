"""What a benchmark run will measure, decided before any model loads: the configs (each checked
against the registered drafters), the one shared target and its plain baseline config, the sweep
config, the prompts, and the settings block written to results.json.

    plan = plan_bench(args, prompts)   # args: jaxspec.bench's parsed command line
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from jaxspec.bench.rows import SPEC_BENCH_CATEGORIES
from jaxspec.errors import JaxspecError

GREEDY = ("sampling.temperature=0",)


def label_of(path: str) -> str:
    return Path(path).stem


@dataclasses.dataclass
class BenchPlan:
    configs: dict[str, Any]  # label -> Config, in command-line order (skipped ones removed)
    config_paths: dict[str, str]  # label -> the --config path
    base_cfg: Any  # plain decoding of the same target: the baseline
    sweep_label: str | None  # the config the γ and batch sweeps vary
    sweep_cfg: Any
    prompts: list[dict[str, Any]]
    skipped: dict[str, str]  # label -> why (--skip-unavailable)

    def skip(self, label: str, why: str) -> None:
        self.skipped[label] = why
        self.configs.pop(label, None)
        print(f"warning: skipping config {label}: {why}", file=sys.stderr)


def plan_bench(args: argparse.Namespace, prompts: list[dict[str, Any]]) -> BenchPlan:
    from jaxspec import drafters
    from jaxspec.config import load_config

    plan = BenchPlan({}, {}, None, None, None, prompts, {})
    for path in args.config:
        label = label_of(path)
        if label in plan.config_paths:
            raise JaxspecError(f"--config {path}: a config named {label!r} is given twice")
        plan.config_paths[label] = str(path)
        cfg = load_config(path, GREEDY)
        try:
            drafters.check_method(cfg.speculative.method)
        except JaxspecError as e:
            if not args.skip_unavailable:
                raise
            plan.skip(label, str(e))
            continue
        plan.configs[label] = cfg
    if not plan.configs:
        raise JaxspecError("no usable config: every --config was skipped")
    first = next(iter(plan.configs.values()))
    for label, cfg in plan.configs.items():
        if cfg.model != first.model:
            raise JaxspecError(
                f"--config {label}: model section differs from the first config's; all "
                "configs must share one target (one baseline)"
            )
    plan.sweep_label, plan.sweep_cfg = _sweep(args, plan, first)
    plan.base_cfg = _baseline(first)
    return plan


def _sweep(args, plan: BenchPlan, first) -> tuple[str | None, Any]:
    from jaxspec import drafters
    from jaxspec.config import load_config

    if args.sweep_config:
        label = label_of(args.sweep_config)
        cfg = plan.configs.get(label)
        if cfg is None:
            cfg = load_config(args.sweep_config, GREEDY)
            drafters.check_method(cfg.speculative.method)
            if cfg.model != first.model:
                raise JaxspecError("--sweep-config must use the same model as --config")
        if cfg.speculative.method == "none":
            raise JaxspecError("--sweep-config must be a speculative config (method != none)")
        return label, cfg
    if args.gammas or args.batch_sizes:
        spec = [l for l, c in plan.configs.items() if c.speculative.method != "none"]
        if not spec:
            raise JaxspecError(
                "--gammas/--batch-sizes need a speculative config: add one to "
                "--config or pass --sweep-config"
            )
        return spec[0], plan.configs[spec[0]]
    return None, None


def _baseline(first):
    """Plain decoding of the first config's target, chat template and system prompt."""
    from jaxspec.config import load_config

    base = load_config(
        None,
        [
            *GREEDY,
            f"model.name={first.model.name}",
            f"model.dtype={first.model.dtype}",
            f"model.layout={first.model.layout}",
            f"generation.chat_template={str(first.generation.chat_template).lower()}",
        ],
    )
    generation = dataclasses.replace(base.generation, system_prompt=first.generation.system_prompt)
    return dataclasses.replace(base, generation=generation)


def settings(args: argparse.Namespace, plan: BenchPlan) -> dict[str, Any]:
    """The run's protocol and parameters, as results.json states them."""
    return {
        "configs": {l: plan.config_paths[l] for l in plan.configs},
        "data": str(args.data),
        "n_per_category": args.n_per_category,
        "num_prompts": len(plan.prompts),
        "categories": sorted(
            {p["category"] for p in plan.prompts}, key=SPEC_BENCH_CATEGORIES.index
        ),
        "max_new_tokens": args.max_new_tokens,
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
        "peers": args.peers,
        "gammas": args.gammas,
        "batch_sizes": args.batch_sizes,
        "sweep_config": plan.sweep_label,
        "sweeps_only": bool(args.sweeps_only),
        "config_values": {l: c.to_dict() for l, c in plan.configs.items()},
    }
