"""Time jaxspec's attention op per backend implementation on decode/verify shapes, against the
bandwidth floor of the bytes it must read (the valid cache prefix + the queries). Markdown table.

    python scripts/bench_attention.py            # on a GPU: XLA reference vs the Pallas GPU kernel
    python scripts/bench_attention.py --smoke    # tiny shapes (CPU check of the script)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxspec.models import attention


def bench(fn, *args, reps=20) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    dtype = jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32
    impls = ["xla"] + (["pallas_gpu"] if jax.default_backend() == "gpu" else [])
    # (B, T, N, K, H, S, valid): SmolLM2 and Llama-3-8B heads, cache half full
    shapes = [(1, 1, 4, 2, 16, 64, 32)] if args.smoke else [
        (1, 1, 9, 3, 64, 2048, 1024), (8, 5, 9, 3, 64, 2048, 1024),
        (8, 1, 32, 8, 128, 2048, 1024), (8, 5, 32, 8, 128, 2048, 1024),
        (32, 5, 32, 8, 128, 2048, 1024),
    ]
    print(f"backend {jax.default_backend()}, {jnp.dtype(dtype).name}, one layer")
    print("| B | T | N/K | H | S | valid | impl | µs | valid bytes | GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, t, n, kv, h, s, valid in shapes:
        ks = jax.random.split(jax.random.key(0), 5)
        q = jax.random.normal(ks[0], (b, t, n, h), dtype)
        kc, vc = (jax.random.normal(k, (b, kv, s, h), dtype) for k in ks[1:3])
        kw, vw = (jax.random.normal(k, (b, t, kv, h), dtype) for k in ks[3:5])
        lengths = jnp.full((b,), valid, jnp.int32)
        need = 2 * b * kv * valid * h * jnp.dtype(dtype).itemsize
        for impl in impls:
            fn = jax.jit(lambda *a, impl=impl: attention.attend(*a, impl=impl))
            try:
                sec = bench(fn, q, kc, vc, kw, vw, lengths)
            except Exception as e:  # a kernel that does not build here: say so, keep going
                print(f"| {b} | {t} | {n}/{kv} | {h} | {s} | {valid} | {impl} | failed: "
                      f"{type(e).__name__} | | |")
                continue
            print(f"| {b} | {t} | {n}/{kv} | {h} | {s} | {valid} | {impl} | {sec * 1e6:.1f} | "
                  f"{need / 1e6:.2f} MB | {need / sec / 1e9:.1f} |")


if __name__ == "__main__":
    main()
