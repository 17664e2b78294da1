"""Time jaxspec's attention op per backend implementation on decode/verify shapes, against the
bandwidth floor of the bytes it must read (the valid cache prefix + the queries). Markdown table.

Rows: each shape on a per-layer cache `[B, K, S, H]` and on a stacked one `[L, B, K, S, H]` read at
a traced layer (the stacked layout's case: a kernel that copied the layer out would show it in
time). Impls: "xla" (the reference) and this backend's kernels (TPU: "pallas_tpu", JAX's paged
attention on a zero-copy view of the cache; GPU: "pallas_gpu", JAX's Pallas decode kernel on a
per-layer cache, jaxspec's own Pallas kernel on a stack). `(auto)` marks the one attend picks
here; `max |Δ|` is the largest difference from xla.

A second table times prefill: a prompt window of T tokens (G*T > attention.PALLAS_MAX_QUERIES,
so the kernel impls run JAX's flash kernels: TPU splash attention, GPU Pallas's Triton flash
attention) over an empty cache (an engine prefill) and over an earlier cache (a prompt chunk),
against XLA's chunked path, in causal-attention TFLOP/s (prefill is compute-bound).

    python scripts/bench_attention.py            # on a TPU / GPU: XLA vs this backend's kernel
    python scripts/bench_attention.py --smoke    # tiny shapes, every kernel in Pallas interpret mode
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxspec import hlo
from jaxspec.models import attention

STACK = 4  # layers in the stacked rows' cache (the row reads layer 2)


def bench(fn, *args, reps=20) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def impls_here(smoke: bool) -> list[str]:
    if smoke:  # CPU: the kernels run in interpret mode, which checks the script's kernel branches
        return ["xla", "pallas_tpu", "pallas_gpu"]
    kernel = {"tpu": ["pallas_tpu"], "gpu": ["pallas_gpu"]}.get(jax.default_backend(), [])
    return ["xla", *kernel]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    dtype = jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32
    # (B, T, N, K, H, S, valid): SmolLM2 and Llama-3-8B heads, cache half full
    shapes = [(1, 2, 4, 2, 16, 128, 40)] if args.smoke else [
        (1, 1, 9, 3, 64, 2048, 1024), (8, 5, 9, 3, 64, 2048, 1024),
        (8, 1, 32, 8, 128, 2048, 1024), (8, 5, 32, 8, 128, 2048, 1024),
        (32, 5, 32, 8, 128, 2048, 1024),
    ]
    reps = 2 if args.smoke else 20
    print(f"backend {jax.default_backend()}, {jnp.dtype(dtype).name}, one layer")
    print("| B | T | N/K | H | S | valid | cache | impl | compiled | µs | valid bytes | GB/s | "
          "max \\|Δ\\| vs xla |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b, t, n, kv, h, s, valid in shapes:
        need = 2 * b * kv * valid * h * jnp.dtype(dtype).itemsize
        shape = (b, t, n, kv, h, s, valid)
        for row, sec, diff in timed_impls(shape, dtype, args.smoke, reps, seed=0, empty="| | | |"):
            print(f"{row} {sec * 1e6:.1f} | {need / 1e6:.2f} MB | {need / sec / 1e9:.1f} | {diff} |")
    prefill(args.smoke, dtype, reps)


def prefill(smoke: bool, dtype, reps: int) -> None:
    """Prompt windows (causal) over an empty or partly filled cache: the flash kernels vs XLA."""
    # (B, T, N, K, H, S, earlier valid slots)
    shapes = [(2, 300, 4, 2, 32, 256, 0), (2, 300, 4, 2, 32, 256, 37)] if smoke else [
        (1, 1024, 9, 3, 64, 2048, 0), (8, 512, 9, 3, 64, 2048, 0),
        (1, 2048, 32, 8, 128, 4096, 0), (8, 1024, 32, 8, 128, 2048, 0),
        (1, 1024, 32, 8, 128, 4096, 1024),
    ]
    print()
    print(f"prefill: backend {jax.default_backend()}, {jnp.dtype(dtype).name}, one layer, causal")
    print("| B | T | N/K | H | S | earlier valid | cache | impl | compiled | ms | TFLOP/s | "
          "max \\|Δ\\| vs xla |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b, t, n, kv, h, s, valid in shapes:
        flops = 4 * b * n * h * (t * (t + 1) // 2 + t * valid)  # q.k and p.v over what is seen
        shape = (b, t, n, kv, h, s, valid)
        for row, sec, diff in timed_impls(shape, dtype, smoke, reps, seed=1, empty="| | |"):
            print(f"{row} {sec * 1e3:.2f} | {flops / sec / 1e12:.2f} | {diff} |")


def timed_impls(shape, dtype, smoke: bool, reps: int, *, seed: int, empty: str):
    """For one (B, T, N, K, H, S, valid) shape, each cache layout and each impl here: (the row's
    leading cells, seconds per call, max |Δ| vs xla). A kernel that does not build here gets its
    row printed as failed (`empty` fills the remaining cells) and is skipped."""
    b, t, n, kv, h, s, valid = shape
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, t, n, h), dtype)
    kw, vw = (jax.random.normal(k, (b, t, kv, h), dtype) for k in ks[3:5])
    lengths = jnp.full((b,), valid, jnp.int32)
    auto = attention.resolve_impl("auto", cache_dtype=dtype)
    for cache in ("per-layer", "stacked"):
        cache_shape = (b, kv, s, h) if cache == "per-layer" else (STACK, b, kv, s, h)
        kc, vc = (jax.random.normal(k, cache_shape, dtype) for k in ks[1:3])
        layer = None if cache == "per-layer" else jnp.int32(2)
        ref = None
        for impl in impls_here(smoke):
            fn = jax.jit(lambda *a, impl=impl, layer=layer: attention.attend(
                *a, layer=layer, impl=impl, interpret=smoke and impl != "xla"))
            label = f"{impl} (auto)" if impl == auto else impl
            row = f"| {b} | {t} | {n}/{kv} | {h} | {s} | {valid} | {cache} | {label} |"
            try:
                # what the compiled program holds (interpret mode on CPU lowers to plain XLA ops)
                compiled = hlo.compiled_attention(fn.lower(q, kc, vc, kw, vw, lengths).as_text())
                compiled += " (interpret)" if smoke and impl != "xla" else ""
                row = f"{row} {compiled} |"
                sec = bench(fn, q, kc, vc, kw, vw, lengths, reps=reps)
                out = fn(q, kc, vc, kw, vw, lengths).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001  a kernel that does not build here: say so
                print(f"{row} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} {empty}")
                continue
            ref = out if impl == "xla" else ref
            yield row, sec, "" if ref is None else f"{float(jnp.max(jnp.abs(out - ref))):.2e}"

if __name__ == "__main__":
    main()
