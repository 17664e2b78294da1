"""Run by tests/test_families.py in a subprocess with 2 simulated CPU devices (the flag must be
set before jax starts): Qwen3 and Gemma 3 (sliding window past the prompts) on a (1, 2) mesh,
Qwen3 plain and Gemma 3 with n-gram drafts, against one device. Prints one JSON object on the last line.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/families_mesh_check.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1])]  # this jaxspec

import jax

from jaxspec.drafters import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.models import base, gemma, llama
from jaxspec.sharding import MeshPlan, make_mesh

V = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], list(range(3, 20)), [7, 8, 9, 7, 8, 9, 7], list(range(10, 30))]


def targets():
    qwen3 = llama.ModelConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=256)
    gemma3 = gemma.GemmaConfig(
        family="gemma3", vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
        sliding_layers=(True, True, False), rope_local_theta=10000.0, rope_theta=1e6,
        max_position_embeddings=256)
    key = jax.random.key(0)
    return {
        "qwen3": base.Model(target=llama.LlamaTarget(qwen3, name="qwen3"),
                            params=llama.init_params(qwen3, key, scale=0.3), eos_token_ids=(0,)),
        "gemma3": base.Model(target=gemma.GemmaTarget(gemma3),
                             params=gemma.init_params(gemma3, key, scale=0.3), eos_token_ids=(0,)),
    }


def generate(model, drafter, plan=None):
    eng = Engine(model, drafter, None, num_speculative_tokens=3 if drafter else 0, mesh=plan)
    return [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=16, batch_size=len(PROMPTS))]


def main() -> None:
    assert jax.device_count() >= 2, "run with --xla_force_host_platform_device_count=2"
    plan = MeshPlan(make_mesh(data=1, model=2))
    out = {}
    # Qwen3 plain, Gemma 3 with n-gram drafts (verify windows over a sliding window)
    runs = {"qwen3": (("plain", None),), "gemma3": (("ngram", NgramDrafter(V, 1, 3)),)}
    for name, model in targets().items():
        for method, drafter in runs[name]:
            one = generate(model, drafter)
            sharded = generate(model, drafter, plan)
            wq = plan.place_target(model.params, model.target)["layers"][0]["wq"]
            out[f"{name}/{method}"] = {
                "equal": one == sharded,
                "wq_shard": list(wq.sharding.shard_shape(wq.shape)),
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
