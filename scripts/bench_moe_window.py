"""A verify window's cost against a plain step on a tiny MoE (Qwen3-MoE shape) next to a dense
Qwen3 of the same active MLP width (k experts x expert width = the dense MLP), on this CPU.

    PYTHONPATH=. python scripts/bench_moe_window.py [--batches 1,4] [--widths 1,2,3,5]
    PYTHONPATH=. python scripts/bench_moe_window.py --paths 1,4,20,64,256
    PYTHONPATH=. python scripts/bench_moe_window.py --predict h200,v5e

Each row: seconds of the plain 1-entry step, then each window's time in plain steps (the
calibration's own timing, `decode.calibration.measure_verify`: the loop's verify on a cache
holding 128 tokens, distinct draft tokens), the expert path the window takes and the experts it
wakes per layer (expected, `moe.experts_woken`). A dense model's window costs ~1 plain step on a
memory-bound machine; an MoE window reads more experts than one token does. `--paths`: one MoE
block alone per expert path (gather, grouped = ragged_dot, dense) at each token count, ms
(median of 20 calls after a warm-up), where `moe.path_for` switches paths. `--predict`: at
the real shapes (Qwen3-30B-A3B, Qwen3.5-35B-A3B; bfloat16, `tools.moe_shapes`) the weight bytes
a step reads (the experts its tokens wake) and that time at each chip's HBM bandwidth, and a
window's predicted cost in plain steps (`moe.window_cost_ratio`; weights only, no KV).
After each cost table (the measured one when --widths is 1,2,..,n): the γ adaptive length
chooses on that curve for rows accepting each draft with probability 0.5 / 0.7 / 0.9, and
the predicted speedup over plain (`controller.best_gain`).
"""

from __future__ import annotations

import argparse
import time

import jax

from jaxspec.decode.adaptive import calibration
from jaxspec.models import base, llama, moe
from jaxspec.models.qwen3_moe import MoeConfig, MoeTarget, init_params

DIMS = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=64, qk_norm=True, max_position_embeddings=4096)
E, K, F = 32, 4, 128


def models() -> dict[str, base.Model]:
    key = jax.random.key(0)
    sparse = MoeConfig(**DIMS, intermediate_size=K * F, num_experts=E, top_k=K,
                       moe_intermediate_size=F, norm_topk_prob=True, moe_layers=(True,) * 4)
    dense = llama.ModelConfig(**DIMS, intermediate_size=K * F)
    return {
        f"moe E={E} k={K}": base.Model(target=MoeTarget(sparse), params=init_params(sparse, key)),
        f"dense F={K * F}": base.Model(target=llama.LlamaTarget(dense, name="qwen3"),
                                       params=llama.init_params(dense, key)),
        f"qwen3.5-moe E={E} k={K}": _hybrid_moe(key),
    }


def _hybrid_moe(key) -> base.Model:
    """A Qwen3.5-MoE of the same dims: 3 linear layers, 1 full, experts + a shared expert."""
    from jaxspec.models import qwen3_5, qwen3_5_moe

    cfg = qwen3_5.Qwen35Config(
        **{k: v for k, v in DIMS.items() if k != "qk_norm"}, intermediate_size=F,
        layer_types=("linear_attention",) * 3 + ("full_attention",), linear_key_heads=2,
        linear_value_heads=4, linear_key_dim=64, linear_value_dim=64, num_experts=E, top_k=K,
        moe_intermediate_size=F, shared_expert_intermediate_size=F)
    return base.Model(target=qwen3_5_moe.Qwen35MoeTarget(cfg),
                      params=qwen3_5.init_params(cfg, key))


def predict(chips: list[str], batches=(1, 8), windows=(1, 2, 4, 5, 8)) -> None:
    from jaxspec.tools import aot, moe_shapes

    print("| shape | chip | batch | window | experts woken | active GB | step ms (weights) "
          "| window / plain |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for make in (moe_shapes.qwen3_30b_a3b, moe_shapes.qwen3_5_35b_a3b):
        target = make("bfloat16")
        total, experts, _ = moe_shapes.weight_bytes(target)
        cfg = target.cfg
        for chip in chips:
            bw = aot.target(chip).bandwidth
            for b in batches:
                for w in windows:
                    active = moe_shapes.active_weight_bytes(target, b * w)
                    share = experts * moe.experts_woken(b, cfg.top_k, cfg.num_experts) / (
                        cfg.num_experts * moe_shapes.active_weight_bytes(target, b))
                    ratio = moe.window_cost_ratio(w, b, cfg.top_k, cfg.num_experts, share)
                    woken = moe.experts_woken(b * w, cfg.top_k, cfg.num_experts)
                    print(f"| {target.name} | {chip} | {b} | {w} | {woken:.1f} | "
                          f"{active / 1e9:.2f} | {1e3 * active / bw:.2f} | {ratio:.2f} |")


ALPHAS = (0.5, 0.7, 0.9)


def chosen_gamma(costs: list[float], alpha: float) -> tuple[int, float]:
    """(γ, speedup) the adaptive controller settles on for rows accepting each draft with
    probability alpha: the cap whose expected tokens per step over its cost (in plain steps,
    costs[γ]: a window of γ + 1) is highest (`controller.best_gain`'s argmax; 0 = plain)."""
    best, gain, run, expected = 0, 1.0, 1.0, 1.0
    for g in range(1, len(costs)):
        run *= alpha
        expected += run
        if expected / costs[g] > gain:
            best, gain = g, expected / costs[g]
    return best, gain


def adaptive_table(curves: dict, gamma_max: int) -> None:
    """What adaptive length chooses on each cost curve ({label: [cost of a window of 1 ..
    gamma_max + 1 in plain steps]}): γ and the predicted speedup per acceptance rate."""
    print(f"| curve (windows 1..{gamma_max + 1}, plain steps) | "
          + " | ".join(f"α {a}: γ (speedup)" for a in ALPHAS) + " |")
    print("|---|" + "---:|" * len(ALPHAS))
    for label, costs in curves.items():
        cells = [f"{g} ({s:.2f}x)" for g, s in (chosen_gamma(costs, a) for a in ALPHAS)]
        print(f"| {label}: {' '.join(f'{c:.2f}' for c in costs)} | {' | '.join(cells)} |")


def predicted_curves(chips: list[str], batches=(1, 8), gamma_max: int = 7) -> dict:
    """At the real shapes, a window's predicted cost in plain steps (`moe.window_cost_ratio`:
    the experts it wakes, weights only) for windows 1 .. gamma_max + 1."""
    from jaxspec.tools import moe_shapes

    out = {}
    for make in (moe_shapes.qwen3_30b_a3b, moe_shapes.qwen3_5_35b_a3b):
        target = make("bfloat16")
        _, experts, _ = moe_shapes.weight_bytes(target)
        cfg = target.cfg
        for b in batches:
            share = experts * moe.experts_woken(b, cfg.top_k, cfg.num_experts) / (
                cfg.num_experts * moe_shapes.active_weight_bytes(target, b))
            out[f"{target.name} batch {b} ({'/'.join(chips)}, bandwidth-bound)"] = [
                moe.window_cost_ratio(w, b, cfg.top_k, cfg.num_experts, share)
                for w in range(1, gamma_max + 2)]
    return out


def path_table(token_counts: list[int]) -> None:
    keys = jax.random.split(jax.random.key(0), 5)
    d = DIMS["hidden_size"]
    p = {"router": jax.random.normal(keys[0], (E, d)),
         "we_gate": 0.05 * jax.random.normal(keys[1], (E, F, d)),
         "we_up": 0.05 * jax.random.normal(keys[2], (E, F, d)),
         "we_down": 0.05 * jax.random.normal(keys[3], (E, d, F))}
    paths = ("gather", "grouped", "dense")
    print(f"| tokens | {' | '.join(paths)} (ms) | path_for |")
    print("|---:|" + "---:|" * len(paths) + "---|")
    for n in token_counts:
        x = jax.random.normal(keys[4], (n, d))
        cells = []
        for path in paths:
            fn = jax.jit(lambda p, x, path=path: moe.moe_block(p, x, top_k=K, norm_topk=True,
                                                               path=path))
            fn(p, x).block_until_ready()
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                fn(p, x).block_until_ready()
                times.append(time.perf_counter() - t0)
            cells.append(f"{1e3 * sorted(times)[10]:.2f}")
        print(f"| {n} | {' | '.join(cells)} | {moe.path_for(n, K, E)} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4")
    p.add_argument("--widths", default="1,2,3,5")
    p.add_argument("--paths", default=None, help="token counts: time one MoE block per path")
    p.add_argument("--predict", default=None, help="chips (h200,v5e): bytes at real shapes")
    args = p.parse_args(argv)
    if args.predict:
        predict(args.predict.split(","))
        print()
        adaptive_table(predicted_curves(args.predict.split(",")), 7)
        return 0
    if args.paths:
        path_table([int(n) for n in args.paths.split(",")])
        return 0
    widths = [int(w) for w in args.widths.split(",")]
    print(f"| model | batch | plain step (ms) | {' | '.join(f'window {w}' for w in widths[1:])} |")
    print("|---|---:|---:|" + "---:|" * (len(widths) - 1))
    curves = {}
    for name, m in models().items():
        for b in (int(x) for x in args.batches.split(",")):
            secs = calibration.measure_verify(m, b, widths)
            if widths == list(range(1, len(widths) + 1)):  # a full curve: adaptive's input
                curves[f"{name} batch {b} (CPU)"] = [s / secs[0] for s in secs]
            cells = []
            for w, s in zip(widths[1:], secs[1:]):
                cell = f"{s / secs[0]:.2f}"
                if "moe" in name:
                    path = moe.path_for(b * w, K, E)
                    cell += f" ({path}, {moe.experts_woken(b * w, K, E):.0f} experts)"
                cells.append(cell)
            print(f"| {name} | {b} | {1e3 * secs[0]:.2f} | {' | '.join(cells)} |")
    if curves:
        print()
        adaptive_table(curves, len(widths) - 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
