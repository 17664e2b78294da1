"""Roofline of the target's programs, device-independently: compile prefill, decode and verify from
abstract shapes (no weights, so 8B/70B shapes compile on a laptop) and compare XLA's count of bytes
with the minimum a step must move.

    python -m jaxspec.roofline --config configs/smollm2-135m.yaml
    python -m jaxspec.roofline --model-shape llama3-8b --batch 1,8,32 --window 1,5,16 --json

Per program: XLA cost-analysis flops and bytes; the minimum bytes (weights once — the embedding
table only where it is the LM head, else the gathered rows — plus the valid KV prefix read, the new
KV rows written and the logits); their ratio; copies / zero-fills of cache-sized buffers
(jaxspec.hlo) and collectives in the optimised module.

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

import dataclasses
import json
import sys
from typing import TYPE_CHECKING

from jaxspec.errors import JaxspecError

if TYPE_CHECKING:
    from jaxspec.models import llama

# jax and the model code are imported inside the functions that use them, so `--help` is instant.

ACCEL_LIKE = {"xla_cpu_experimental_ynn_fusion_type": ""}

MODEL_SHAPES = {
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                         "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "tie_word_embeddings": True,
                         "rope_theta": 100000.0, "max_position_embeddings": 8192},
    "llama3-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32,
                      "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
                      "max_position_embeddings": 131072},
    "llama3-70b": {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                       "num_layers": 80, "num_heads": 64, "num_kv_heads": 8, "head_dim": 128,
                       "rope_theta": 500000.0, "max_position_embeddings": 131072},
}


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

    @property
    def ratio(self) -> float:
        return self.bytes / self.min_bytes

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"ratio": round(self.ratio, 3),
                                           "fused_ratio": round(self.fused_bytes / self.min_bytes, 3)}


def abstract_params(cfg: llama.ModelConfig, layout: str):
    import jax

    from jaxspec.models import llama

    params = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
    return jax.eval_shape(llama.stack_layers, params) if layout == "stacked" else params


def _cache(cfg, batch, capacity, stacked, num_layers=None):
    import jax

    from jaxspec.cache import init_cache

    n = cfg.num_layers if num_layers is None else num_layers
    return jax.eval_shape(lambda: init_cache(n, batch, capacity, cfg.num_kv_heads, cfg.head_dim,
                                             cfg.compute_dtype, stacked))


def _step(cfg, last_only):
    import jax

    from jaxspec.models import llama

    def step(params, tokens, cache):  # one target forward + logits; the cache is donated
        out = llama.forward(params, tokens, cache, cfg)
        hidden = out.hidden[:, -1:] if last_only else out.hidden
        return llama.lm_head(params, hidden), out.cache

    return jax.jit(step, donate_argnums=2)


def _compile(fn, *args):
    return fn.lower(*args).compile(compiler_options=ACCEL_LIKE)


def _costs(compiled) -> tuple[float, float]:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


def min_bytes(cfg, params, batch, window, valid, logits_rows) -> float:
    """Weights once + valid KV read + new KV written + f32 logits out."""
    import jax
    import jax.numpy as jnp

    item = jnp.dtype(cfg.compute_dtype).itemsize
    leaves = jax.tree.leaves({k: v for k, v in params.items() if k != "embed"})
    weights = sum(x.size * x.dtype.itemsize for x in leaves)
    if cfg.tie_word_embeddings:  # the table is the LM head: read whole
        weights += params["embed"].size * params["embed"].dtype.itemsize
    else:  # only the gathered rows
        weights += batch * window * cfg.hidden_size * item
    per_slot = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item
    kv = batch * (valid + window) * per_slot
    return float(weights + kv + batch * logits_rows * cfg.vocab_size * 4)


def measure(cfg, layout, program, batch, window, capacity, valid) -> Program:
    import jax
    import jax.numpy as jnp

    from jaxspec import hlo
    from jaxspec.models import attention

    params = abstract_params(cfg, layout)
    last_only = program == "prefill"
    tokens = jax.ShapeDtypeStruct((batch, window), jnp.int32)
    cache = _cache(cfg, batch, capacity, layout == "stacked")
    compiled = _compile(_step(cfg, last_only), params, tokens, cache)
    flops, xla_bytes = _costs(compiled)
    text = compiled.as_text()
    blocks = attention.cache_loop_trips(valid, capacity)  # the attention's loop over valid cache blocks
    traffic = hlo.cache_traffic(text, (batch, cfg.num_kv_heads, capacity, cfg.head_dim))
    rows = 1 if last_only else window
    return Program(
        program=program, batch=batch, window=window, valid=valid, capacity=capacity,
        flops=flops, xla_bytes=xla_bytes, bytes=float(hlo.device_bytes(text, unknown_trip=blocks)),
        fused_bytes=float(hlo.device_bytes(text, slices_fused_into_dots=True, unknown_trip=blocks)),
        min_bytes=min_bytes(cfg, params, batch, window, valid, rows),
        cache_copies=len(traffic.copies), zero_fills=len(traffic.zero_fills),
        collectives=len(traffic.collectives),
    )


def table(cfg, layout, batches, windows, capacity, fill, prefill=True) -> list[Program]:
    valid = int(capacity * fill)
    out = []
    for b in batches:
        if prefill:
            out.append(measure(cfg, layout, "prefill", b, valid, capacity, 0))
        for w in windows:
            out.append(measure(cfg, layout, "decode" if w == 1 else "verify", b, w, capacity, valid))
    return out


def format_table(rows: list[Program]) -> str:
    head = ("| program | batch | window | flops | XLA bytes | bytes | bytes, slices fused | min bytes |"
            " ratio (fused) | cache copies | zero-fills | collectives |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [
        f"| {r.program} | {r.batch} | {r.window} | {r.flops:.3g} | {r.xla_bytes / 1e6:.1f} MB | "
        f"{r.bytes / 1e6:.1f} MB | {r.fused_bytes / 1e6:.1f} MB | "
        f"{r.min_bytes / 1e6:.1f} MB | {r.ratio:.2f} ({r.fused_bytes / r.min_bytes:.2f}) | "
        f"{r.cache_copies} | {r.zero_fills} | "
        f"{r.collectives} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def model_config(args, config) -> llama.ModelConfig:
    from jaxspec.loading.params import resolve_dtype
    from jaxspec.models import llama

    dtype = resolve_dtype(args.dtype or config.model.dtype)  # auto: this backend's choice
    if args.model_shape:
        if args.model_shape not in MODEL_SHAPES:
            raise JaxspecError(f"unknown --model-shape {args.model_shape!r}: use one of "
                               f"{', '.join(MODEL_SHAPES)}")
        return llama.ModelConfig(**MODEL_SHAPES[args.model_shape], dtype=dtype)
    from jaxspec.loading import resolve
    from jaxspec.loading.gguf_file import config_from_gguf, open_gguf
    from jaxspec.loading.safetensors_dir import config_from_hf, read_hf_config

    src = resolve(config.model.name)
    if src.kind == "gguf":
        return config_from_gguf(open_gguf(src.path), dtype=dtype, source=str(src.path))
    return config_from_hf(read_hf_config(src.path), dtype=dtype, source=str(src.path))


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

    p = ArgumentParser(prog="python -m jaxspec.roofline", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.add_argument("--config", metavar="FILE.yaml")
    p.add_argument("--model-shape", metavar="NAME", help=f"one of {', '.join(MODEL_SHAPES)}")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="default: model.dtype; auto = this backend's (bfloat16 on TPU/GPU, float32 "
                   "on CPU, where XLA upcasts bf16 ops and scatters: measure float32 here)")
    p.add_argument("--layout", choices=("stacked", "unrolled"),
                   help="default: model.layout; auto = this backend's (stacked on TPU/GPU)")
    p.add_argument("--batch", default="1,8,32", metavar="B,..")
    p.add_argument("--window", default="1,5,16", metavar="T,..", help="1 = decode, >1 = verify")
    p.add_argument("--capacity", type=int, default=2048, help="cache slots per row")
    p.add_argument("--fill", type=float, default=0.5, help="valid fraction of the cache")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per program")
    try:
        args = p.parse_args(argv)
        config = load_config(args.config, args.overrides)
        layout = args.layout or config.model.layout
        if layout == "auto":  # this backend's choice; the CPU kernel's layout is not abstract
            from jaxspec.loading.params import resolve_layout

            layout, _ = resolve_layout("auto", "float32" if args.dtype is None else args.dtype)
            layout = "unrolled" if layout == "packed" else layout
        if layout == "packed":
            raise JaxspecError("layout 'packed' is the CPU kernel's: use --layout stacked or unrolled")
        if not 0 <= args.fill < 1 or args.capacity < 16:
            raise JaxspecError("use --capacity >= 16 and 0 <= --fill < 1")
        cfg = model_config(args, config)
        rows = table(cfg, layout, _ints(args.batch), _ints(args.window), args.capacity, args.fill,
                     prefill=not args.no_prefill)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        for r in rows:
            print(json.dumps(r.to_json() | {"layout": layout, "dtype": cfg.dtype}))
    else:
        print(f"{args.model_shape or config.model.name}, {layout}, {cfg.dtype}, capacity "
              f"{args.capacity}, cache {args.fill:.0%} full")
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    from jaxspec.cli_support import run as run_cli

    sys.exit(run_cli(main))
