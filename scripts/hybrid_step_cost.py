"""Step cost of a Qwen3.5-shaped hybrid target on this CPU: a plain one-token step against a
verify window of γ + 1 entries (which also returns every entry's linear-layer states for the
commit), random weights, float32, batch 1. Prints the medians and their ratio (one run: the
machine's speed swings between runs, the ratio much less).

    PYTHONPATH=$PWD python scripts/hybrid_step_cost.py [--hidden 1024] [--layers 8] [--gamma 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jaxspec.decode import tree
from jaxspec.models import qwen3_5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    d = args.hidden
    cfg = qwen3_5.Qwen35Config(
        vocab_size=8192, hidden_size=d, intermediate_size=3 * d, num_layers=args.layers,
        num_heads=d // 128, num_kv_heads=2, head_dim=128,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(args.layers)),
        linear_key_heads=d // 256, linear_value_heads=d // 128, linear_key_dim=128,
        linear_value_dim=128, max_position_embeddings=4096)
    target = qwen3_5.Qwen35Target(cfg)
    params = target.init_params(jax.random.key(0))
    cache = target.init_cache(params, 1, args.context)
    cache = cache.with_lengths(jnp.full((1,), args.context // 2, jnp.int32))
    t = args.gamma + 1
    window = tree.build_window(jnp.zeros((1,), jnp.int32), cache.lengths,
                               jnp.ones((1, args.gamma), jnp.int32),
                               tree.chain_parents(1, args.gamma),
                               jnp.full((1,), args.gamma, jnp.int32))
    plain = jax.jit(lambda p, x, c: target.logits(p, target.forward(p, x, c).hidden))
    def verify_fn(p, x, c):  # the window's logits and every entry's k/v and states
        out = target.forward(p, x, c, positions=window.positions, window_mask=window.mask,
                             write_cache=False)
        return target.logits(p, out.hidden), out.window_kv

    verify = jax.jit(verify_fn)
    runs = {"plain step (T=1)": lambda: plain(params, window.tokens[:, :1], cache),
            f"verify window (T={t})": lambda: verify(params, window.tokens, cache)}
    times = {}
    for name, fn in runs.items():
        jax.block_until_ready(fn())
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
        print(f"{name}: {times[name] * 1e3:.2f} ms")
    a, b = times.values()
    print(f"verify / plain: {b / a:.2f}x")


if __name__ == "__main__":
    main()
