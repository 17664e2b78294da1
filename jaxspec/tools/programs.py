"""What a run compiles, without its device: every program a generation run with a config would
compile, exported for TPU or CUDA (`jax.export`, lowered on this host) or compiled for this CPU,
each with its shapes, dtype and the attention it holds, read from the program itself
(`hlo.compiled_attention`: the kernel's custom-call name, or "xla").

    python -m jaxspec.tools.programs --config configs/smollm2-135m-eagle.yaml --platform tpu --json

A device run loads the model as the device's defaults say (`model.dtype: auto` is bfloat16 on TPU
and GPU, `model.layout: auto` stacked on TPU, per-layer (unrolled) on GPU), so the programs listed are the ones that run
there; on `--platform cpu` the config loads as it would here. The shipped-config test
(tests/test_device_exports.py) reads the same function. Bad input: one line `error: ...`, exit 2.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import dataclasses
import json
import sys
from typing import Any

PLATFORMS = ("tpu", "cuda", "cpu")
BACKEND = {"tpu": "tpu", "cuda": "gpu", "cpu": "cpu"}  # jax.default_backend() names


def device_overrides(config, platform: str) -> list[str]:
    """The overrides that load `config` as a run on `platform` would: its dtype and layout
    defaults ("auto") resolved for that device (CPU: left to the loader, as here)."""
    if platform == "cpu":
        return []
    out = []
    if config.model.dtype == "auto":
        out.append("model.dtype=bfloat16")
    if config.model.layout in ("auto", "packed"):  # packed: CPU kernels, which a device lacks
        out.append("model.layout=" + ("stacked" if platform == "tpu" else "unrolled"))
    return out


def _state_for(spec, args, capacity: int, batch: int):
    """The decode program's abstract input: the prefill's output (with the adaptive controller's
    state on flat costs: a listing measures nothing)."""
    import jax

    from jaxspec.decode import speculate

    state = jax.eval_shape(lambda *a: speculate.prefill(spec, *a, capacity=capacity), *args)
    if spec.adaptive is not None:
        state = dataclasses.replace(state, adaptive=spec.adaptive.init(
            batch, [1.0] * (spec.adaptive.gamma + 1)))
    return state


def generation_programs(engine, platform: str, *, batch: int = 1, prompt: int = 32,
                        max_new_tokens: int = 8, spec=None,
                        capacity: int | None = None) -> list[dict[str, Any]]:
    """The (prefill, decode) programs `engine` runs for a batch of `batch` prompts of up to
    `prompt` tokens and `max_new_tokens` new tokens on `platform`, each as {"name", "platform",
    "batch", "prompt_bucket", "capacity", "cache", "dtype", "attention", "kernel_calls",
    "text"} ("text": the exported StableHLO, or the CPU's compiled HLO). `spec`: the loop to
    list (default the engine's own, adaptive where it adapts); `capacity`: the cache's slots
    (default what the engine allots on that platform)."""
    import jax
    import jax.numpy as jnp
    from jax import export

    from jaxspec import hlo
    from jaxspec.decode import speculate
    from jaxspec.decode.sampling import SamplingParams
    from jaxspec.engine.prepare import bucket, prompt_bucket as width_of

    spec = engine.spec if spec is None else spec
    prompt_bucket = width_of(prompt)  # the prefill's width; the cache is sized by `bucket`
    if capacity is None:
        capacity = engine.capacity(bucket(prompt), max_new_tokens, backend=BACKEND[platform])
    sp = SamplingParams.make()
    args = (engine.model.params, engine.drafter_params,
            jnp.zeros((batch, prompt_bucket), jnp.int32), jnp.ones((batch,), jnp.int32),
            jnp.full((batch,), max_new_tokens, jnp.int32), sp, jax.random.key(0),
            jnp.zeros((batch,), jnp.int32))
    state = _state_for(spec, args, capacity, batch)
    decode_args = (spec, engine.model.params, engine.drafter_params, state, sp, jnp.int32(1))
    if platform == "cpu":  # what runs here: the compiled program
        texts = {"prefill": speculate.prefill_jit.lower(spec, *args, capacity=capacity),
                 "decode": speculate.decode_jit.lower(*decode_args)}
        texts = {k: v.compile().as_text() for k, v in texts.items()}
    else:
        checks = [export.DisabledSafetyCheck.custom_call(t) for t in hlo.ATTENTION_TARGETS]
        ex = lambda f: export.export(f, platforms=[platform], disabled_checks=checks)  # noqa: E731
        texts = {"prefill": ex(speculate.prefill_jit)(spec, *args, capacity=capacity).mlir_module(),
                 "decode": ex(speculate.decode_jit)(*decode_args).mlir_module()}
    cache = jax.tree.leaves(state.cache)[0]
    return [
        {"name": name, "platform": platform, "batch": batch, "prompt_bucket": prompt_bucket,
         "capacity": capacity, "cache": list(cache.shape), "dtype": str(cache.dtype),
         "attention": hlo.compiled_attention(text), "kernel_calls": hlo.attention_kernel_calls(text),
         "text": text}
        for name, text in texts.items()
    ]


def _program_text(program, platform: str) -> str:
    """A (jitted function, args, kwargs) program exported for `platform` (its StableHLO), or on
    "cpu" compiled here (its optimised HLO): the text its attention is read from."""
    from jax import export

    from jaxspec import hlo

    fn, args, kwargs = program
    if platform == "cpu":
        return fn.lower(*args, **kwargs).compile().as_text()
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in hlo.ATTENTION_TARGETS]
    return export.export(fn, platforms=[platform], disabled_checks=checks)(
        *args, **kwargs).mlir_module()


def serving_scheduler(engine, config):
    """The scheduler `python -m jaxspec.serve` builds for this config's `serving` section (the
    engine built with serving.max_context): its programs are the server's."""
    from jaxspec.serving.scheduler import Scheduler

    return Scheduler(engine, config.serving, tables="one")  # as jaxspec.serve.serving_engine


def serving_programs(engine, config, platform: str, prompt_lengths) -> list[dict[str, Any]]:
    """Every program a server with `config` compiles on `platform` for prompts of these
    lengths: its decode calls (each call width x page-table width; the verify window is in
    the decode program) and its prefill programs (whole prompts per bucket, tails over
    written pages, prompt chunks, at every admission width), as the scheduler's warm-up lists
    them (`Scheduler.decode_programs`, `prefill_programs`), each exported for `platform` (or
    compiled on cpu) with the attention read from it. Each {"name", "platform", "rows",
    "table_pages", "prompt_bucket", "tokens", "kv_layout", "mesh", "dtype", "attention",
    "kernel_calls", "text"}."""
    import jax

    from jaxspec import hlo

    sched = serving_scheduler(engine, config)
    mesh = sched.spec.mesh
    shape = None if mesh is None else dict(mesh.mesh.shape)
    dtype = str(jax.tree.leaves(engine.model.params)[0].dtype)
    out = []
    for row in [*sched.decode_programs(), *sched.prefill_programs(prompt_lengths)]:
        text = _program_text(row.pop("program"), platform)
        out.append({"name": row["name"], "platform": platform, "rows": row["rows"],
                    "table_pages": row.get("table_pages"),
                    "prompt_bucket": row.get("prompt_bucket"), "tokens": row.get("tokens"),
                    "kv_layout": "paged" if sched.paged else "contiguous", "mesh": shape,
                    "dtype": dtype, "attention": hlo.compiled_attention(text),
                    "kernel_calls": hlo.attention_kernel_calls(text), "text": text})
    return out


def mesh_shape(text: str) -> tuple[int, int]:
    """--mesh D,M -> (data, model)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"--mesh {text}: use DATA,MODEL, e.g. 2,4")
    return int(parts[0]), int(parts[1])


def make_parser() -> argparse.ArgumentParser:
    from jaxspec.bench.options import int_list
    from jaxspec.cli_support import ArgumentParser

    p = ArgumentParser(prog="python -m jaxspec.tools.programs",
                       description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--config", required=True, help="a YAML config (configs/*.yaml)")
    p.add_argument("--platform", choices=PLATFORMS, required=True,
                   help="tpu / cuda: exported for that device here; cpu: compiled for this CPU")
    p.add_argument("--batch-sizes", type=int_list("--batch-sizes", 1, 256), default=[1],
                   help="comma-separated batch sizes (default 1)")
    p.add_argument("--prompt", type=int_list("--prompt", 1, 1 << 20), default=[128],
                   help="prompt lengths (bucketed as a run buckets them; default 128)")
    p.add_argument("--max-new-tokens", type=int_list("--max-new-tokens", 1, 1 << 20),
                   default=[128], help="new tokens per request (default 128)")
    p.add_argument("--serving", action="store_true",
                   help="the programs a server with this config compiles (its serving section): "
                        "decode calls per width, prefill programs per prompt bucket")
    p.add_argument("--mesh", type=mesh_shape, metavar="D,M",
                   help="export under a mesh of DATA x MODEL devices (mesh.data, mesh.model); "
                        "on a host without them, that many CPU devices are simulated")
    p.add_argument("--json", action="store_true", help="print a JSON list (else a table)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    return p


def main(argv: list[str] | None = None) -> int:
    from jaxspec.cli_support import EXIT_USAGE
    from jaxspec.errors import JaxspecError

    try:
        args = make_parser().parse_args(argv)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    mesh = [] if args.mesh is None else [f"mesh.data={args.mesh[0]}", f"mesh.model={args.mesh[1]}"]
    if args.mesh is not None:
        simulate_devices(args.mesh[0] * args.mesh[1])
    try:
        from jaxspec.build import build_engine
        from jaxspec.config import load_config

        config = load_config(args.config, args.overrides)
        overrides = [*device_overrides(config, args.platform), *mesh, *args.overrides]
        config = load_config(args.config, overrides)
        if args.serving:  # the engine as the server builds it
            config = dataclasses.replace(config, generation=dataclasses.replace(
                config.generation, max_context=config.serving.max_context))
        engine = build_engine(config)
        if args.serving:
            rows = serving_programs(engine, config, args.platform, args.prompt)
        else:
            rows = [row for b in args.batch_sizes for n in args.prompt
                    for m in args.max_new_tokens
                    for row in generation_programs(engine, args.platform, batch=b, prompt=n,
                                                   max_new_tokens=m)]
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    for row in rows:
        row.pop("text")
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.serving:
        print("| program | platform | rows | table pages | prompt bucket | tokens | kv | mesh | "
              "dtype | attention | kernel calls |")
        print("|---|---|---:|---:|---:|---:|---|---|---|---|---:|")
        for r in rows:
            mesh_ = "x".join(map(str, r["mesh"].values())) if r["mesh"] else "-"
            print(f"| {r['name']} | {r['platform']} | {r['rows']} | {r['table_pages'] or '-'} | "
                  f"{r['prompt_bucket'] or '-'} | {r['tokens'] or '-'} | {r['kv_layout']} | "
                  f"{mesh_} | {r['dtype']} | {r['attention']} | {r['kernel_calls']} |")
    else:
        print("| program | platform | batch | capacity | cache | dtype | attention | kernel calls |")
        print("|---|---|---:|---:|---|---|---|---:|")
        for r in rows:
            print(f"| {r['name']} | {r['platform']} | {r['batch']} | {r['capacity']} | "
                  f"{'x'.join(map(str, r['cache']))} | {r['dtype']} | {r['attention']} | "
                  f"{r['kernel_calls']} |")
    return 0


def simulate_devices(count: int) -> None:
    """Before jax starts: this host's CPU platform shows `count` devices (XLA_FLAGS), so a
    mesh of that many can be built and exported here; an explicit device count is kept."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


if __name__ == "__main__":
    sys.exit(main())
