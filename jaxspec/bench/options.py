"""The command line of `python -m jaxspec.bench`: its flags, their one-line errors, and the
optional packages a run needs, checked before anything loads."""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import importlib.util
from pathlib import Path

from jaxspec.cli_support import ArgumentParser
from jaxspec.errors import JaxspecError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO_ROOT / "data" / "spec_bench_dev.jsonl"  # shipped: data/README.md


def int_list(flag: str, lo: int, hi: int):
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
    _add_inputs(p)
    _add_peers(p)
    _add_sweeps(p, MAX_SPECULATIVE_TOKENS)
    _add_run_choices(p)
    return p


def _add_inputs(p: argparse.ArgumentParser) -> None:
    """The configs, the questions, the lengths and the output folder."""
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
        help="Spec-Bench questions (question_id, category, turns); default: the Spec-Bench "
        "development split shipped in data/spec_bench_dev.jsonl",
    )
    p.add_argument("--n-per-category", type=_positive("--n-per-category"), default=5, metavar="N")
    p.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=128, metavar="M")
    p.add_argument("--out", required=True, metavar="DIR", help="results.json, summary.md, PNGs")


def _add_peers(p: argparse.ArgumentParser) -> None:
    """The peers run beside jaxspec (transformers, vLLM) and their settings."""
    p.add_argument(
        "--peers",
        choices=["none", "hf", "vllm", "hf+vllm"],
        default="none",
        help="hf: transformers (PyTorch, CPU) plain, prompt lookup, assisted; vllm: vLLM plain "
        "and the twins of the configs' ngram / suffix / EAGLE-3 (jaxspec/bench/vllm_peer.py; "
        "its venv: scripts/setup_vllm_peer.sh)",
    )
    p.add_argument(
        "--vllm-eagle3",
        metavar="DIR",
        help="--peers vllm: an EAGLE-3 head in vLLM's layout (python -m jaxspec.export "
        "--format eagle3) run as the twin of the eagle / eagle3 configs",
    )
    p.add_argument(
        "--vllm-eager",
        action="store_true",
        help="--peers vllm: skip vLLM's torch.compile (faster start-up, slower decode)",
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


def _add_sweeps(p: argparse.ArgumentParser, max_gamma: int) -> None:
    """The γ sweep and the batch sweep."""
    p.add_argument(
        "--gammas",
        type=int_list("--gammas", 1, max_gamma),
        metavar="1,2,3,5,8",
        help="γ sweep of --sweep-config (omit: no γ sweep)",
    )
    p.add_argument(
        "--batch-sizes",
        type=int_list("--batch-sizes", 1, 256),
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


def _add_run_choices(p: argparse.ArgumentParser) -> None:
    """What runs: unavailable configs, plots, the workload, the sweeps alone."""
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="skip configs whose method is not registered or whose drafter fails to "
        "build (missing checkpoint), instead of stopping",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument(
        "--workload",
        choices=["spec-bench", "agent"],
        default="spec-bench",
        help="agent: the multi-turn tool-calling sessions of --agent-data, in order through one "
        "engine per config (jaxspec/bench/agent.py)",
    )
    p.add_argument(
        "--agent-data",
        default=str(REPO_ROOT / "data" / "agent_sessions.jsonl"),
        metavar="FILE.jsonl",
        help="--workload agent: the sessions (default: <repo>/data/agent_sessions.jsonl)",
    )
    p.add_argument(
        "--sweeps-only",
        action="store_true",
        help="skip the Spec-Bench phase: run only the γ / batch sweeps (prompts still come from "
        "--data and --n-per-category)",
    )


def check_extras(args) -> None:
    """The optional packages this run needs, checked before anything runs (not at the end)."""
    need = []
    if not args.no_plots:
        need.append(("matplotlib", "draws the plots (or pass --no-plots)"))
    if "hf" in args.peers:
        need += [("torch", "runs the HF peers"), ("transformers", "runs the HF peers")]
    for module, why in need:
        if importlib.util.find_spec(module) is None:
            raise JaxspecError(
                f"{module} is not installed and {why}: pip install -e '.[bench]' "
                f"(torch==2.13.0, the CPU wheel)"
            )
    if "vllm" in args.peers:
        from jaxspec.bench.vllm_peer import SETUP_HINT, model_dir, venv_python

        if not venv_python().is_file():
            raise JaxspecError(f"--peers vllm: no vLLM venv at {venv_python()}: {SETUP_HINT}")
        if not (model_dir() / "config.json").is_file():
            raise JaxspecError(f"--peers vllm: no converted model at {model_dir()}: {SETUP_HINT}")
    if args.vllm_eagle3 and not (Path(args.vllm_eagle3) / "config.json").is_file():
        raise JaxspecError(
            f"--vllm-eagle3 {args.vllm_eagle3}: no config.json there: write one with "
            f"python -m jaxspec.export --format eagle3"
        )
