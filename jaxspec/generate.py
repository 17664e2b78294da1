"""Command line: generate text with a config, streaming to the terminal or as JSON lines.

    python -m jaxspec.generate --config configs/smollm2-135m-ngram.yaml --prompt "Hi!"
    python -m jaxspec.generate --config configs/smollm2-135m.yaml --prompts-file q.jsonl --json \\
        sampling.temperature=0.7 speculative.method=ngram

Settings are layered: dataclass defaults < the --config YAML < positional `section.key=value`
overrides < the shorthand flags (--temperature, --max-new-tokens, ...). Every mistake in the input
prints one line `error: ...` on stderr and exits with status 2.

Compiled programs are kept in a persistent XLA cache (`xla/` under $JAXSPEC_CACHE_DIR, default
~/.cache/jaxspec; JAXSPEC_XLA_CACHE=0 turns it off), so a second run of the same config and shapes
starts without recompiling.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import json
import os
import sys
import textwrap

from jaxspec import catalog, distributed, progress
from jaxspec.cli_support import ArgumentParser, enable_compilation_cache
from jaxspec.errors import JaxspecError
from jaxspec.jsonl import read_jsonl


def epilog() -> str:
    """Overrides, the drafting methods and the shipped configs (read without jax: `catalog`)."""
    wrap = lambda text: textwrap.fill(text, 88, subsequent_indent="  ")
    configs = catalog.shipped_configs()
    lines = [
        wrap("overrides: section.key=value, e.g. sampling.temperature=0.7 speculative.method=ngram "
             "speculative.num_speculative_tokens=4 speculative.ngram.max_ngram=4 "
             "model.name=/path/to.gguf"),
        "",
        wrap("methods (speculative.method): none (plain decoding), "
             + ", ".join(catalog.registered_methods())),
    ]
    if configs:
        lines += ["", "shipped configs (--config):"]
        lines += [f"  {path:46s} {method}" for path, method in configs.items()]
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m jaxspec.generate",
        description="Speculative decoding with JAX: generate text for one or more prompts.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML config (default: all defaults)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="repeatable")
    p.add_argument(
        "--prompts-file",
        metavar="FILE.jsonl",
        help='JSON lines: Spec-Bench {"turns": [...]} (first turn is used) or {"prompt": ...}',
    )
    p.add_argument("--model", metavar="NAME_OR_PATH", help="= model.name (a path, a short name "
                   "or a Hub id ORG/NAME[@REVISION])")
    p.add_argument("--gguf-file", metavar="FILE.gguf",
                   help="the one .gguf to fetch from the Hub repo named by --model")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="= generation.max_new_tokens")
    p.add_argument("--batch-size", type=int, metavar="B", help="= generation.batch_size")
    p.add_argument("--temperature", type=float, metavar="T", help="= sampling.temperature")
    p.add_argument("--top-k", type=int, metavar="K", help="= sampling.top_k (0 = off)")
    p.add_argument("--top-p", type=float, metavar="P", help="= sampling.top_p (1.0 = off)")
    p.add_argument("--min-p", type=float, metavar="P", help="= sampling.min_p (0.0 = off)")
    p.add_argument("--seed", type=int, metavar="S", help="= sampling.seed")
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="= generation.chat_template=false (feed prompts as raw text)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (loading, compiling; on by default)")
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="= speculative.adaptive.recalibrate=true (measure the step-cost curve again)",
    )
    return p


_FLAGS = {
    "model": "model.name",
    "max_new_tokens": "generation.max_new_tokens",
    "batch_size": "generation.batch_size",
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
}


def flag_overrides(args: argparse.Namespace) -> list[str]:
    out = [f"{key}={v}" for flag, key in _FLAGS.items() if (v := getattr(args, flag)) is not None]
    if args.no_chat_template:
        out.append("generation.chat_template=false")
    if getattr(args, "recalibrate", False):
        out.append("speculative.adaptive.recalibrate=true")
    return out


def with_gguf_file(config, gguf_file: str):
    """model.name ORG/NAME[@REV] + --gguf-file FILE.gguf -> the Hub id ORG/NAME[@REV]/FILE.gguf."""
    import dataclasses

    from jaxspec.loading import hub

    hub_id = hub.parse(config.model.name)
    if not gguf_file.endswith(".gguf") or "/" in gguf_file or hub_id is None or hub_id.gguf_file:
        raise JaxspecError(
            f"--gguf-file {gguf_file} names one .gguf file of the Hub repo given as --model "
            f"ORG/NAME[@REVISION] (model.name is {config.model.name}); a local .gguf file is "
            f"passed as --model PATH"
        )
    model = dataclasses.replace(config.model, name=f"{config.model.name}/{gguf_file}")
    return dataclasses.replace(config, model=model)


def read_prompts_file(path: str) -> list[str]:
    """Spec-Bench lines ({"turns": [first, ...]}) or {"prompt": text}; blank lines are skipped."""
    prompts = []
    for n, row in read_jsonl(path, "prompts file"):
        turns = row.get("turns") if isinstance(row, dict) else None
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            prompts.append(turns[0])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        else:
            raise JaxspecError(
                f"prompts file {path} line {n}: expected an object with \"turns\" (a list of "
                f'strings) or "prompt" (a string)'
            )
    if not prompts:
        raise JaxspecError(f"prompts file {path} has no prompts")
    return prompts


def parse(argv: list[str] | None = None):
    """argv -> (args, Config, prompts); everything checked that can be without loading a model."""
    args = make_parser().parse_intermixed_args(argv)  # before any heavy import: --help is instant
    progress.set_quiet(args.quiet)
    reading = progress.start(f"reading {args.config or 'the default config'} (and importing jax)",
                             announce=False)
    from jaxspec.config import load_config

    config = load_config(args.config, [*args.overrides, *flag_overrides(args)])
    if args.gguf_file:
        config = with_gguf_file(config, args.gguf_file)
    reading()
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise JaxspecError("no prompt given: pass --prompt TEXT or --prompts-file FILE.jsonl")
    for i, prompt in enumerate(prompts):
        _check_text(prompt, f"prompt {i + 1}")
    return args, config, prompts


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JaxspecError(
            f"{what} holds characters that are not valid Unicode (at position {e.start}; "
            f"undecodable bytes or a lone surrogate): pass UTF-8 text"
        ) from None


def run(argv: list[str] | None = None) -> int:
    args, config, prompts = parse(argv)
    from jaxspec.build import build_engine, sampling_params

    distributed.start(config.distributed)  # before any device is touched
    enable_compilation_cache()
    sp = sampling_params(config)  # validated before the model load
    constraint = config.structured.constraint()  # an unsupported keyword: one line, exit 2
    engine = build_engine(config)
    gen = config.generation
    seed = config.sampling.seed

    primary = distributed.is_primary()  # every process computes; process 0 prints
    note = engine.model_note()
    if note and primary:
        print(f"note: {note}", file=sys.stderr)
    if len(prompts) == 1 and not args.json and engine.plan is None and constraint is None:
        n = gen.max_new_tokens
        pieces = engine.stream(prompts[0], max_new_tokens=n, sampling=sp, seed=seed)
        while True:
            try:
                piece = next(pieces)
            except StopIteration as finished:
                result = finished.value
                break
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(summary_line(result), file=sys.stderr)
        return 0

    results = engine.generate(
        prompts,
        max_new_tokens=gen.max_new_tokens,
        sampling=sp,
        seed=seed,
        batch_size=gen.batch_size,
        constraint=constraint,
    )
    for r in results if primary else ():
        if args.json:
            print(json.dumps(r.to_json()), flush=True)
        else:
            print(r.text + "\n", flush=True)
            print(summary_line(r), file=sys.stderr)
    return 0


def summary_line(result) -> str:
    """One line per prompt on stderr: tokens, speed, acceptance, accepted length, layout."""
    m = result.metrics
    return (
        f"[{result.num_generated_tokens} tokens, {result.decode_tokens_per_s:.1f} tok/s, "
        f"{m['method']}: acceptance {m['acceptance_rate']:.2f}, "
        f"{m['mean_accepted_length']:.2f} tokens/step, layout {m['layout']}]"
    )


def main(argv: list[str] | None = None) -> int:
    """The CLI: `cli_support.run` gives the exit statuses (2: bad input, one line; 130: Ctrl-C)."""
    from jaxspec.cli_support import run as run_cli

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no tokenizer chatter on stderr
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
