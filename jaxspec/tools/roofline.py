"""Roofline of the target's programs, device-independently: compile prefill, decode and verify from
abstract shapes (no weights, so 8B/70B shapes compile on a laptop) and compare XLA's count of bytes
with the minimum a step must move.

    python -m jaxspec.tools.roofline --config configs/smollm2-135m.yaml
    python -m jaxspec.tools.roofline --model-shape llama3-8b --batch 1,8,32 --window 1,5,16 --json
    python -m jaxspec.tools.roofline --target h200 --model-shape llama3-8b --batch 1 --json
    python -m jaxspec.tools.roofline --target v5e --mesh 1,8 --model-config path/to/config.json
    python -m jaxspec.tools.roofline --target h200 --model-shape llama3-8b --method ngram,eagle3,dflash

With --target (h100, h200, v5e, v5p, v6e) the programs compile for that accelerator here, on
compile-only devices (jaxspec.tools.aot; the `aot` extra's wheels), and are read per chip by
jaxspec.tools.accel_roofline: bytes moved, kernels, host syncs, collectives, attention, floor and
predicted milliseconds (jaxspec.tools.step_model); with --method, the decode loop's whole step
per method beside plain's (jaxspec.tools.spec_steps). Without it, as below, on this host's XLA:CPU.

Per program: XLA cost-analysis flops and bytes; the minimum bytes (weights once — the embedding
table only where it is the LM head, else the gathered rows — plus the valid KV prefix read, the new
KV rows written and the logits); their ratio; copies / zero-fills of cache-sized buffers
(jaxspec.hlo) and collectives in the optimised module; the attention implementation the compiled
program holds (its custom calls, `jaxspec.hlo.compiled_attention`), never the setting.

XLA's own byte count is printed as is, next to `bytes` = `jaxspec.hlo.device_bytes` of the same
optimised module: XLA counts an in-place cache update as the whole cache, a fused dynamic slice as
the whole stack and a while body (the stacked layout's layer loop) once; device_bytes counts the
updated rows, the slice, and the body times its trip count. The ratio is bytes / min bytes.
On XLA:CPU the stacked layout's per-layer weight slices are copied out before each dot (the CPU
compiler does not fuse a dynamic slice into a dot), so its CPU figures include ~2x the weights
more than a compiler that fuses them.
XLA's CPU-only YNNPACK library fusion is turned off for the compile (it materialises operands that
the accelerator compilers fuse). On a TPU/GPU with a bfloat16 model, attention "auto" compiles a
Pallas kernel (a custom call), whose operands device_bytes counts whole although the kernel reads
only valid pages; run with JAXSPEC_ATTENTION=xla there (scripts/bench_device.sh does) and time the
kernels with scripts/bench_attention.py.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import dataclasses
import importlib
import json
import sys

from jaxspec.errors import JaxspecError


class _OnFirstUse:
    """A module imported on its first attribute access, so `--help` never loads jax."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


jax = _OnFirstUse("jax")
jnp = _OnFirstUse("jax.numpy")
hlo = _OnFirstUse("jaxspec.hlo")
attention = _OnFirstUse("jaxspec.models.attention")
base = _OnFirstUse("jaxspec.models.base")
llama = _OnFirstUse("jaxspec.models.llama")

ACCEL_LIKE = {"xla_cpu_experimental_ynn_fusion_type": ""}
# The programs here are compiled to be read (HLO, costs), never run. On the CPU, LLVM's
# optimisation level acts after the HLO passes: level 0 with the default (MLIR) fusion emitters
# gives the default compile's optimised HLO exactly, in about half its compile time.
READ_ONLY_CPU = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": True}

MODEL_SHAPES = {
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                         "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "tie_word_embeddings": True,
                         "rope_theta": 100000.0, "max_position_embeddings": 8192},
    "llama3-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                  "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "head_dim": 64,
                  "tie_word_embeddings": True, "rope_theta": 500000.0,
                  "max_position_embeddings": 131072},
    "llama3-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32,
                      "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
                      "max_position_embeddings": 131072},
    "llama3-70b": {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                       "num_layers": 80, "num_heads": 64, "num_kv_heads": 8, "head_dim": 128,
                       "rope_theta": 500000.0, "max_position_embeddings": 131072},
    "qwen3-8b": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_layers": 36, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                 "qk_norm": True, "rope_theta": 1000000.0, "max_position_embeddings": 40960},
    "gemma3-12b": lambda dtype: _gemma3_12b(dtype),  # family hook: a Gemma target
    # MoE shapes (jaxspec.tools.moe_shapes): --json rows add the active (woken) expert bytes
    "qwen3-30b-a3b": lambda dtype: moe_shapes.qwen3_30b_a3b(dtype),
    "qwen3.5-35b-a3b": lambda dtype: moe_shapes.qwen3_5_35b_a3b(dtype),
}
moe_shapes = _OnFirstUse("jaxspec.tools.moe_shapes")


def _gemma3_12b(dtype: str) -> base.Target:
    """Gemma 3 12B's text decoder (48 layers, 5 local : 1 global, window 1024)."""
    from jaxspec.models import gemma

    cfg = gemma.GemmaConfig(
        family="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
        num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, sliding_layers=tuple(bool((i + 1) % 6) for i in range(48)),
        rope_theta=1e6, rope_local_theta=1e4, rope_linear_factor=8.0,
        max_position_embeddings=131072, dtype=dtype)
    return gemma.GemmaTarget(cfg)


@dataclasses.dataclass(frozen=True)
class Program:
    program: str  # prefill | decode | verify
    batch: int
    window: int  # query tokens per row (prompt length for prefill)
    valid: int  # committed cache slots per row before the step
    capacity: int
    flops: float  # XLA's cost analysis (a while body counted once)
    xla_bytes: float  # XLA's cost analysis, as is
    bytes: float  # jaxspec.hlo.device_bytes: in-place rows, fused slices, loops x trip count
    fused_bytes: float  # the same with slices fused into their dots (see hlo.device_bytes)
    min_bytes: float
    cache_copies: int
    zero_fills: int
    collectives: int
    attention: str  # read from the compiled program (jaxspec.hlo.compiled_attention)

    @property
    def ratio(self) -> float:
        return self.bytes / self.min_bytes

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"ratio": round(self.ratio, 3),
                                           "fused_ratio": round(self.fused_bytes / self.min_bytes, 3)}


step_programs = _OnFirstUse("jaxspec.tools.step_programs")


def abstract_params(target: base.Target, layout: str):
    """The target's params as ShapeDtypeStructs (jaxspec.tools.step_programs)."""
    return step_programs.abstract_params(target, layout)


def abstract_cache(target: base.Target, params, batch, capacity):
    return step_programs.abstract_cache(target, params, batch, capacity)


def _cache_block(cache) -> tuple[int, ...]:
    return step_programs._cache_block(cache)


def _step(target: base.Target, last_only):
    return step_programs._step(target, last_only)


def min_bytes(target: base.Target, params, cache, batch, window, valid, logits_rows) -> float:
    """Weights once + valid KV + new KV + f32 logits (jaxspec.tools.step_programs.min_bytes)."""
    return step_programs.min_bytes(target, params, cache, batch, window, valid, logits_rows)


def compile_options() -> dict:
    """XLA options for a compile that is read, not run: ACCEL_LIKE, and READ_ONLY_CPU on a CPU."""
    return {**ACCEL_LIKE, **(READ_ONLY_CPU if jax.default_backend() == "cpu" else {})}


def _compile(fn, *args):
    return fn.lower(*args).compile(compiler_options=compile_options())


def _costs(compiled) -> tuple[float, float]:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


def measure(target: base.Target, layout, program, batch, window, capacity, valid) -> Program:
    params = abstract_params(target, layout)
    last_only = program == "prefill"
    tokens = jax.ShapeDtypeStruct((batch, window), jnp.int32)
    cache = abstract_cache(target, params, batch, capacity)
    compiled = _compile(_step(target, last_only), params, tokens, cache)
    flops, xla_bytes = _costs(compiled)
    text = compiled.as_text()
    blocks = attention.cache_loop_trips(valid, capacity)  # the attention's loop over valid cache blocks
    traffic = hlo.cache_traffic(text, _cache_block(cache))
    rows = 1 if last_only else window
    return Program(
        program=program, batch=batch, window=window, valid=valid, capacity=capacity,
        flops=flops, xla_bytes=xla_bytes, bytes=float(hlo.device_bytes(text, unknown_trip=blocks)),
        fused_bytes=float(hlo.device_bytes(text, slices_fused_into_dots=True, unknown_trip=blocks)),
        min_bytes=min_bytes(target, params, cache, batch, window, valid, rows),
        cache_copies=len(traffic.copies), zero_fills=len(traffic.zero_fills),
        collectives=len(traffic.collectives), attention=hlo.compiled_attention(text),
    )


def table(target, layout, batches, windows, capacity, fill, prefill=True) -> list[Program]:
    valid = int(capacity * fill)
    out = []
    for b in batches:
        if prefill:
            out.append(measure(target, layout, "prefill", b, valid, capacity, 0))
        for w in windows:
            out.append(
                measure(target, layout, "decode" if w == 1 else "verify", b, w, capacity, valid)
            )
    return out


def format_table(rows: list[Program]) -> str:
    head = ("| program | batch | window | flops | XLA bytes | bytes | bytes, slices fused | min bytes |"
            " ratio (fused) | cache copies | zero-fills | collectives | attention |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [
        f"| {r.program} | {r.batch} | {r.window} | {r.flops:.3g} | {r.xla_bytes / 1e6:.1f} MB | "
        f"{r.bytes / 1e6:.1f} MB | {r.fused_bytes / 1e6:.1f} MB | "
        f"{r.min_bytes / 1e6:.1f} MB | {r.ratio:.2f} ({r.fused_bytes / r.min_bytes:.2f}) | "
        f"{r.cache_copies} | {r.zero_fills} | "
        f"{r.collectives} | {r.attention} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def shape_target(name: str, dtype: str) -> base.Target:
    """The target of a named MODEL_SHAPES entry: a Llama config's fields, or a callable
    (dtype) -> Target for another family."""
    if name not in MODEL_SHAPES:
        raise JaxspecError(f"unknown --model-shape {name!r}: use one of {', '.join(MODEL_SHAPES)}")
    shape = MODEL_SHAPES[name]
    if callable(shape):
        return shape(dtype)
    return llama.LlamaTarget(llama.ModelConfig(**shape, dtype=dtype))


def model_target(args, config) -> base.Target:
    from jaxspec.loading.params import resolve_dtype

    dtype = resolve_dtype(args.dtype or config.model.dtype)  # auto: this backend's choice
    if args.model_shape:
        return shape_target(args.model_shape, dtype)
    if getattr(args, "model_config", None):
        return config_json_target(args.model_config, dtype)
    from jaxspec.loading import resolve
    from jaxspec.loading.gguf_file import config_from_gguf, open_gguf
    from jaxspec.loading.safetensors_dir import config_from_hf, read_hf_config

    src = resolve(config.model.name)
    if src.kind == "gguf":
        cfg = config_from_gguf(open_gguf(src.path), dtype=dtype, source=str(src.path))
    else:
        cfg = config_from_hf(read_hf_config(src.path), dtype=dtype, source=str(src.path))
    return llama.LlamaTarget(cfg)


def config_json_target(path: str, dtype: str) -> base.Target:
    """A Llama-family target from a Hugging Face config.json (no weights are read)."""
    from pathlib import Path

    from jaxspec import validate
    from jaxspec.loading.safetensors_dir import config_from_hf
    from jaxspec.models import families, registry  # noqa: F401  (every family registers)

    hf = validate.read_json(Path(path), "--model-config")
    if not isinstance(hf, dict):
        raise JaxspecError(f"--model-config {path}: not a config.json object")
    family = registry.family_for_model_type(hf.get("model_type"), path)
    if family.target_from_hf is not None:  # a family's own config reader (no weights read)
        return family.target_from_hf(hf, dtype=dtype, source=path)
    return llama.LlamaTarget(config_from_hf(hf, dtype=dtype, source=path))


def _mesh(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise JaxspecError(f"--mesh {text!r}: use DATA,MODEL, e.g. 1,8")
    return int(parts[0]), int(parts[1])


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise JaxspecError(f"{text!r} is not a list of positive integers: use e.g. 1,8,32")
    return vals


def main(argv=None) -> int:
    from jaxspec.cli_support import ArgumentParser
    from jaxspec.config import load_config

    p = ArgumentParser(prog="python -m jaxspec.tools.roofline", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.add_argument("--config", metavar="FILE.yaml")
    p.add_argument("--model-shape", metavar="NAME", help=f"one of {', '.join(MODEL_SHAPES)}")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="default: model.dtype; auto = this backend's (bfloat16 on TPU/GPU, float32 "
                   "on CPU, where XLA upcasts bf16 ops and scatters: measure float32 here)")
    p.add_argument("--layout", choices=("stacked", "unrolled", "fused"),
                   help="default: model.layout; auto = this backend's (stacked on TPU, fused on "
                   "GPU; --target: fused, unrolled under a model-sharded --mesh)")
    p.add_argument("--batch", default="1,8,32", metavar="B,..")
    p.add_argument("--window", default="1,5,16", metavar="T,..", help="1 = decode, >1 = verify")
    p.add_argument("--capacity", type=int, default=2048, help="cache slots per row")
    p.add_argument("--fill", type=float, default=0.5, help="valid fraction of the cache")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per program")
    p.add_argument("--target", metavar="NAME", help="compile for this accelerator here: h100, "
                   "h200, v5e, v5p, v6e (default: this host's XLA:CPU)")
    p.add_argument("--mesh", metavar="D,M", help="with --target: a DATA x MODEL mesh of chips")
    p.add_argument("--model-config", metavar="config.json", help="a Hugging Face config.json")
    p.add_argument("--layers", type=int, metavar="N", help="with --target: the model's first N "
                   "layers only (a large model's per-layer program, read quickly or where the "
                   "whole does not fit the chips)")
    p.add_argument("--method", metavar="M,..", help="with --target: the decode loop's step for "
                   "these methods beside plain's (ngram, ngram_tree, eagle3, dflash), at each "
                   "--batch (on --mesh: per chip), instead of the decode/verify programs")
    p.add_argument("--gamma", type=int, metavar="N", help="with --method: drafts per step "
                   "(default: n-gram 4, EAGLE-3 3, DFlash 4)")
    p.add_argument("--kernels", action="store_true", help="with --target: list each program's "
                   "launched kernels in order (name, what it computes, shape, jax op)")
    p.add_argument("--over-memory", action="store_true", help="with --target: compile a program "
                   "that does not fit the chip's memory and report by how much (over_memory_gib)")
    try:
        args = p.parse_args(argv)
        config = load_config(args.config, args.overrides)
        if args.target:
            return _accelerator(args, config)
        layout = args.layout or config.model.layout
        if layout == "auto":  # this backend's choice; the CPU kernel's layout is not abstract
            from jaxspec.loading.params import resolve_layout

            layout, _ = resolve_layout("auto", "float32" if args.dtype is None else args.dtype)
            layout = "unrolled" if layout in ("packed", "fused") else layout
        if layout == "packed":
            raise JaxspecError("layout 'packed' is the CPU kernel's: use --layout stacked or unrolled")
        if not 0 <= args.fill < 1 or args.capacity < 16:
            raise JaxspecError("use --capacity >= 16 and 0 <= --fill < 1")
        target = model_target(args, config)
        rows = table(target, layout, _ints(args.batch), _ints(args.window), args.capacity, args.fill,
                     prefill=not args.no_prefill)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        for r in rows:
            print(json.dumps(r.to_json() | {"layout": layout, "dtype": target.dtype}
                             | moe_shapes.active_fields(target, r.batch, r.window)))
    else:
        print(f"{args.model_shape or config.model.name}, {layout}, {target.dtype}, capacity "
              f"{args.capacity}, cache {args.fill:.0%} full")
        print(format_table(rows))
    return 0


def _accelerator(args, config) -> int:
    """--target: the programs compiled for an accelerator (jaxspec.tools.accel_roofline)."""
    from jaxspec.tools import accel_roofline, aot

    aot.target(args.target)  # an unknown name fails before anything compiles
    mesh = _mesh(args.mesh) if args.mesh else None
    layout = args.layout or config.model.layout
    # auto: the per-layer layout on every target. A TPU run loads `stacked` (loading.params), but
    # the cost analysis counts a stacked layer loop's body once, not once per layer (0.35x the
    # weights at 1B on v5e): ask for --layout stacked to see that program, not its bytes.
    # The fused layout (q/k/v and gate/up fused) is one device's or a data mesh's.
    if layout not in ("stacked", "unrolled", "fused"):
        layout = "fused" if mesh is None or mesh[1] == 1 else "unrolled"
    if not 0 <= args.fill < 1 or args.capacity < 16:
        raise JaxspecError("use --capacity >= 16 and 0 <= --fill < 1")
    args.dtype = args.dtype or "bfloat16"  # the accelerators' dtype
    target = model_target(args, config)
    if args.layers:
        if not 1 <= args.layers <= target.num_layers:
            raise JaxspecError(f"--layers {args.layers}: use 1..{target.num_layers}")
        target = target.prefix(args.layers)
    place = accel_roofline.placement(args.target, mesh, target, args.over_memory)
    if args.method:
        from jaxspec.tools import spec_steps

        methods = [m.strip() for m in args.method.split(",") if m.strip()]
        unknown = [m for m in methods if m not in spec_steps.METHODS]
        if unknown or (args.gamma is not None and args.gamma < 1):
            raise JaxspecError(f"--method {','.join(unknown)} / --gamma {args.gamma}: use methods "
                               f"from {', '.join(spec_steps.METHODS)} and --gamma >= 1")
        out = spec_steps.rows(place, target, layout, methods, _ints(args.batch),
                              attention.kernel_capacity(args.capacity, "gpu"), args.fill, args.gamma)
        text = spec_steps.format_rows(out)
    else:
        out = accel_roofline.rows(place, target, layout, _ints(args.batch), _ints(args.window),
                                  args.capacity, args.fill, args.kernels)
        text = accel_roofline.format_rows(out)
        if args.kernels:  # the table, then each program's kernels
            text += "".join(f"\n\n{r['program']} batch {r['batch']} window {r['window']}: "
                            f"{len(r['kernel_list'])} kernels\n" + "\n".join(r["kernel_list"])
                            for r in out)
    if args.json:
        text = "\n".join(json.dumps(r | moe_shapes.active_fields(target, r.get("batch", 1),
                                                                 r.get("window", 1))) for r in out)
    print(text)
    return 0


if __name__ == "__main__":
    from jaxspec.cli_support import run as run_cli

    sys.exit(run_cli(main))
