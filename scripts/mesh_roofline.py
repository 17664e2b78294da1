"""Per-mesh roofline figures of one compiled decode step, from shapes alone (no weights read):
params and state are `jax.ShapeDtypeStruct`s with their shardings, `jit(...).lower().compile()`
gives XLA's cost analysis (per device) and the optimised HLO, whose collectives are counted with
their bytes. Run with simulated devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python scripts/mesh_roofline.py --model smollm2 --mesh 1x1 1x3 2x3 1x8
    ... --model llama3-8b --dtype bfloat16 --layout stacked --mesh 1x1 1x8 2x4

Bytes per device = weights + cache shards that device holds; "accessed" is XLA's bytes-accessed
estimate for the step (a while-loop body is counted once).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode import speculate
from jaxspec.drafters import NgramDrafter
from jaxspec.errors import JaxspecError
from jaxspec.models import llama
from jaxspec.decode.sampling import SamplingParams
from jaxspec.sharding import (
    MeshPlan,
    check_batch,
    check_model,
    make_mesh,
    param_shapes,
    param_shardings,
    state_shardings,
)

MODELS = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
                    max_position_embeddings=8192),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                      max_position_embeddings=8192),
}
COLLECTIVE = re.compile(
    r"= (\(?[a-z0-9]+\[[0-9,]*\][^ ]*(?:, [a-z0-9]+\[[0-9,]*\][^ ]*)*\)?) "
    r"(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\("
)
SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def collectives(hlo: str) -> dict[str, list[int]]:
    """op -> [count, bytes] over the optimised HLO (output shapes; tuples summed)."""
    out: dict[str, list[int]] = {}
    for shapes, op in COLLECTIVE.findall(hlo):
        n = sum(BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                for t, dims in SHAPE.findall(shapes))
        c = out.setdefault(op, [0, 0])
        c[0] += 1
        c[1] += n
    return out


def abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def measure(cfg, mesh_shape, batch, prompt, max_new, gamma, stacked):
    plan = MeshPlan(make_mesh(*mesh_shape))
    check_model(cfg, plan.mesh)
    check_batch(batch, plan.mesh)
    drafter = NgramDrafter(cfg.vocab_size, 1, 3) if gamma else None
    spec = speculate.LoopSpec(cfg=cfg, drafter=drafter, num_speculative_tokens=gamma, eos_ids=(0,),
                              windows=(1, 2), mesh=plan)
    params = abstract(param_shapes(cfg, stacked), param_shardings(cfg, plan.mesh, plan.rules, stacked))
    sp = SamplingParams.make()
    rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
    capacity = prompt + max_new + gamma + 1
    state = jax.eval_shape(
        lambda p, t, l, m, r: speculate.prefill(spec, p, (), t, l, m, sp, jax.random.key(0), r, capacity),
        params, jax.ShapeDtypeStruct((batch, prompt), jnp.int32), rows, rows, rows,
    )
    b = batch
    dsh = state_shardings(state.drafter_state, b, plan.mesh, plan.drafter_rules)
    import dataclasses

    sh = state_shardings(dataclasses.replace(state, drafter_state=None), b, plan.mesh, plan.rules)
    sh = dataclasses.replace(sh, drafter_state=dsh)
    state = abstract(state, sh)
    lowered = speculate.decode_jit.lower(spec, params, (), state, sp, jnp.int32(1))
    compiled = lowered.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    hlo = compiled.as_text()

    def per_device(tree):
        return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree))

    return {
        "weights_per_device": per_device(params),
        "cache_per_device": per_device(state.cache),
        "flops": cost.get("flops", 0.0),
        "accessed": cost.get("bytes accessed", 0.0),
        "collectives": collectives(hlo),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layout", choices=("unrolled", "stacked"), default="unrolled")
    p.add_argument("--mesh", nargs="+", default=["1x1", "1x8", "2x4"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--gamma", type=int, default=0)
    a = p.parse_args()
    cfg = llama.ModelConfig(**MODELS[a.model], dtype=a.dtype)
    print(f"{a.model} {a.dtype} {a.layout}, batch {a.batch}, cache {a.prompt}+{a.max_new} slots, "
          f"γ={a.gamma} ({'plain' if not a.gamma else 'ngram'}), one decode step, per device:")
    print("| mesh | weights MB | KV cache MB | XLA bytes accessed MB | GFLOP | all-reduce (n / KB) "
          "| all-gather (n / KB) | other collectives (n / KB) |")
    print("|---|---|---|---|---|---|---|---|")
    for m in a.mesh:
        shape = tuple(int(x) for x in m.split("x"))
        try:
            r = measure(cfg, shape, a.batch, a.prompt, a.max_new, a.gamma, a.layout == "stacked")
        except JaxspecError as e:
            print(f"| {m} | refused: {e} |||||||", flush=True)
            continue
        c = r["collectives"]
        ar, ag = c.pop("all-reduce", [0, 0]), c.pop("all-gather", [0, 0])
        other = [sum(v[0] for v in c.values()), sum(v[1] for v in c.values())]
        fmt = lambda v: f"{v[0]} / {v[1] / 1e3:.1f}"
        print(f"| {m} | {r['weights_per_device'] / 1e6:.1f} | {r['cache_per_device'] / 1e6:.1f} | "
              f"{r['accessed'] / 1e6:.1f} | {r['flops'] / 1e9:.2f} | {fmt(ar)} | {fmt(ag)} | {fmt(other)} |",
              flush=True)


if __name__ == "__main__":
    main()
