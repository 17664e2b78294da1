"""Run by tests/test_moe.py in a subprocess with 8 simulated CPU devices (the flag must be set
before jax starts): a tiny all-experts Qwen3-MoE (16 experts, top 2) on a (1, 2) and a (2, 4) mesh,
with n-gram drafts (prompts, one-token steps on the gather path, verify windows on the dense
one), against one device; the experts split over `model` by the rules table
(`ShardingRules.experts`), and no expert weight all-gathered in a decode step or a verify window
(`weight_gathers`: float all-gathers of at least one expert's size in the compiled forwards).
Prints one JSON object on the last line.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/moe_mesh_check.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1])]  # this jaxspec

import jax
import jax.numpy as jnp

from jaxspec.drafters import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.models import base
from jaxspec.models.qwen3_moe import MoeConfig, MoeTarget, init_params
from jaxspec.sharding import MeshPlan, make_mesh

V = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], list(range(3, 20)), [7, 8, 9, 7, 8, 9, 7], list(range(10, 30))]


def model() -> base.Model:
    cfg = MoeConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=256,
                    num_experts=16, top_k=2, moe_intermediate_size=16, moe_layers=(True, True))
    return base.Model(target=MoeTarget(cfg), params=init_params(cfg, jax.random.key(0), 0.3),
                      eos_token_ids=(0,))


def generate(m, drafter, plan=None):
    eng = Engine(m, drafter, None, num_speculative_tokens=3 if drafter else 0, mesh=plan)
    return [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=12, batch_size=len(PROMPTS))]


def main() -> None:
    assert jax.device_count() >= 8, "run with --xla_force_host_platform_device_count=8"
    m = model()
    out = {}
    drafter = NgramDrafter(V, 1, 3)
    one = generate(m, drafter)
    for data, mdl in ((1, 2), (2, 4)):
        plan = MeshPlan(make_mesh(data=data, model=mdl))
        params = plan.place_target(m.params, m.target)
        we = params["layers"][0]["we_gate"]
        out[f"ngram/{data}x{mdl}"] = {
            "equal": one == generate(m, drafter, plan),
            "experts_shard": list(we.sharding.shard_shape(we.shape)),
            "weight_gathers": weight_gathers(m.target, params, we.shape[1] * we.shape[2]),
        }
    print(json.dumps(out))


def weight_gathers(target, params, expert_size: int) -> int:
    """Float all-gathers of >= one expert's elements in the compiled forward of a one-token step
    (4 rows: the gather path) and of a 4-token window (the dense path on CPU)."""
    count = 0
    for t in (1, 4):
        cache = target.init_cache(params, len(PROMPTS), 32)
        fwd = jax.jit(lambda p, x, c: target.forward(p, x, c).hidden)
        hlo = fwd.lower(params, jnp.zeros((len(PROMPTS), t), jnp.int32), cache).compile().as_text()
        for dims in re.findall(r"= (?:f32|bf16)\[([0-9,]*)\]\{[^}]*\} all-gather\(", hlo):
            count += int(jnp.prod(jnp.asarray([int(d) for d in dims.split(",") if d]))) >= expert_size
    return count


if __name__ == "__main__":
    main()
