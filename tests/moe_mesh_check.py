"""Run by tests/test_moe.py in a subprocess with 8 simulated CPU devices (the flag must be set
before jax starts): tiny Qwen3-MoE (16 experts, top 2), Qwen3.5 (Gated DeltaNet + gated
attention) and Qwen3.5-MoE on a (1, 2) and a (2, 4) mesh against one device: a prompt forward's
logits, greedy tokens plain (Qwen3.5) and with n-gram drafts (the MoE families: prompts, one-token
steps and verify windows with experts per device, `models/moe_shards.py`; the linear layers'
states kept per window entry and committed along the accepted path). Reported per run: the shard shapes of an expert
leaf, a linear layer's value-head leaf (in_z) and its q/k/v channels (in_qkv) as the rules
table cut them, and in the compiled forwards (a one-token step, a 4-token window; traced under
the mesh, as the decode loop traces them) `weight_gathers`: all-gathers whose result is as large
as a sharded weight (an expert, in_qkv, in_z), and `regathers`: collectives other than
all-reduce (activations moved between devices; none where the model axis splits whole key
heads, the channels being grouped by key head), and `expert_collectives`: the collectives of
the experts' combine (all-reduce / reduce-scatter of a [tokens, D] output) by the mesh axis
their replica groups run over. Qwen3-MoE runs on (2, 4) with the rules table's experts over
the first axis ("2x4e": `ShardingRules(experts="data")`), so a block that ignored the table
would move expert weights and combine over "model". Prints one JSON object on the last line.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/moe_mesh_check.py
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1])]  # this jaxspec

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.drafters import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.models import base, qwen3_5
from jaxspec.models.attention_kernels import kernel_mesh
from jaxspec.models.moe_shards import expert_placement
from jaxspec.models.qwen3_5_moe import Qwen35MoeTarget
from jaxspec.models.qwen3_moe import MoeConfig, MoeTarget, init_params
from jaxspec.sharding import MeshPlan, ShardingRules, make_mesh

V = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], list(range(3, 20)), [7, 8, 9, 7, 8, 9, 7], list(range(10, 30))]
MOE = dict(num_experts=16, top_k=2, moe_intermediate_size=16)


def qwen3_moe() -> base.Model:
    cfg = MoeConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=256,
                    moe_layers=(True, True), **MOE)
    return base.Model(target=MoeTarget(cfg), params=init_params(cfg, jax.random.key(0), 0.3),
                      eos_token_ids=(0,))


def qwen3_5_model(moe: bool) -> base.Model:
    """Three linear layers and one gated attention layer; 4 value heads, 64 q/k/v channels."""
    extra = dict(MOE, shared_expert_intermediate_size=32) if moe else {}
    cfg = qwen3_5.Qwen35Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, layer_types=("linear_attention",) * 3 + ("full_attention",),
        linear_key_heads=2, linear_value_heads=4, linear_key_dim=8, linear_value_dim=8,
        rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=256, **extra)
    target = Qwen35MoeTarget(cfg) if moe else qwen3_5.Qwen35Target(cfg)
    return base.Model(target=target, params=qwen3_5.init_params(cfg, jax.random.key(1), 0.3),
                      eos_token_ids=(0,))


def generate(m, drafter, plan=None):
    eng = Engine(m, drafter, None, num_speculative_tokens=3 if drafter else 0, mesh=plan)
    return [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=12, batch_size=len(PROMPTS))]


def prompt_logits(m, params, plan=None) -> np.ndarray:  # [B, T, V] of each prompt's first 7
    tokens = jnp.asarray([p[:7] for p in PROMPTS], jnp.int32)
    cache = m.target.init_cache(params, len(PROMPTS), 32)
    with traced_on(plan):  # traced as the decode loop traces: experts per shard
        out = jax.jit(m.target.forward)(params, tokens, cache)
    return np.asarray(m.target.logits(params, out.hidden))


@contextlib.contextmanager
def traced_on(plan):
    """Trace as speculate.prefill_jit / decode_jit do: kernel mesh and the rules' placement."""
    with kernel_mesh(None if plan is None else plan.mesh), \
            expert_placement(None if plan is None else plan.rules):
        yield


def sharded_leaves(layers) -> dict:
    """The leaves whose shards are reported: an expert leaf, a linear layer's in_z and in_qkv."""
    out = {}
    for lp in layers:
        for name in ("we_gate", "in_z", "in_qkv"):
            if name in lp and name not in out:
                out[name] = lp[name]
    return out


def main() -> None:
    assert jax.device_count() >= 8, "run with --xla_force_host_platform_device_count=8"
    out = {}
    runs = {"qwen3_moe": (qwen3_moe(), ("ngram",)), "qwen3_5": (qwen3_5_model(False), ("plain",)),
            "qwen3_5_moe": (qwen3_5_model(True), ("ngram",))}
    meshes = {"1x2": (1, 2, "model"), "2x4": (2, 4, "model"), "2x4e": (2, 4, "data")}
    for name, (m, methods) in runs.items():
        drafters = {"plain": None, "ngram": NgramDrafter(V, 1, 3)}
        one = {method: generate(m, drafters[method]) for method in methods}
        logits = prompt_logits(m, m.params)
        # Qwen3-MoE's (2, 4) run puts the experts over "data" (the rules table's choice)
        for key in ("1x2", "2x4e") if name == "qwen3_moe" else ("1x2", "2x4"):
            data, mdl, experts = meshes[key]
            plan = MeshPlan(make_mesh(data=data, model=mdl), ShardingRules(experts=experts))
            params = plan.place_target(m.params, m.target)
            leaves = sharded_leaves(params["layers"])
            row = {"shards": {k: list(v.sharding.shard_shape(v.shape)) for k, v in leaves.items()},
                   "logits_max_diff": float(np.abs(prompt_logits(m, params, plan)
                                                   - logits).max()),
                   **compiled_collectives(m.target, params, leaves, plan)}
            for method in methods:
                row[f"equal/{method}"] = one[method] == generate(m, drafters[method], plan)
            out[f"{name}/{key}"] = row
    print(json.dumps(out))


def compiled_collectives(target, params, leaves: dict, plan) -> dict:
    """In the compiled forward of a one-token step (4 rows) and of a 4-token window:
    `weight_gathers`, float all-gathers whose result has the shape of a whole weight among
    `leaves` (or of one expert); `regathers`, collectives other than all-reduce (an activation
    moved between devices, e.g. q/k/v channels not aligned with their heads, or the tokens
    gathered into an experts-over-"data" block); `expert_collectives`, "op:axis" of the
    collectives inside the experts' shard_map (`expert_combines`)."""
    weights = {tuple(v.shape) for v in leaves.values()} | {
        tuple(v.shape[1:]) for k, v in leaves.items() if k == "we_gate"}  # a leaf, or one expert
    axes = axis_groups(plan.mesh)
    gathers, moves, combines = [], [], []
    for t in (1, 4):
        cache = target.init_cache(params, len(PROMPTS), 32)
        fwd = jax.jit(lambda p, x, c: target.forward(p, x, c).hidden)
        with traced_on(plan):
            lowered = fwd.lower(params, jnp.zeros((len(PROMPTS), t), jnp.int32), cache)
        hlo = lowered.compile().as_text()
        for dims in re.findall(r"= (?:f32|bf16)\[([0-9,]*)\]\{[^}]*\} all-gather\(", hlo):
            if tuple(int(d) for d in dims.split(",") if d) in weights:
                gathers.append(f"t{t}:[{dims}]")
        moves += [f"t{t}:{op}" for op in re.findall(
            r"\} (all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", hlo)]
        if "we_gate" in leaves:
            combines += expert_combines(hlo, axes)
    return {"weight_gathers": gathers, "regathers": moves,
            "expert_collectives": sorted(set(combines))}


def axis_groups(mesh) -> dict:
    """{frozenset of device-id groups: axis name} for each mesh axis (and "all")."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    out = {}
    for i, name in enumerate(mesh.axis_names):
        groups = np.moveaxis(ids, i, -1).reshape(-1, ids.shape[i])
        out.setdefault(frozenset(map(frozenset, groups.tolist())), name)
    out.setdefault(frozenset(map(frozenset, ids.reshape(1, -1).tolist())), "all")
    return out


def replica_groups(line: str) -> frozenset | None:
    """An HLO collective's replica groups, from either printed form ({{0,4},..} or the iota
    form [G,S]<=[dims]T(perm))."""
    if m := re.search(r"replica_groups=\{(\{[0-9,{}]*\})\}", line):
        return frozenset(frozenset(int(v) for v in g.split(",") if v)
                         for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line):
        dims = [int(v) for v in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(v) for v in m.group(4).split(",")])
        return frozenset(map(frozenset, ids.reshape(int(m.group(1)), int(m.group(2))).tolist()))
    return None


def expert_combines(hlo: str, axes: dict) -> list[str]:
    """"op:axis" for each all-reduce / reduce-scatter inside a shard_map (the experts' combine:
    the attention kernels' shard_map blocks hold no collective)."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r" (all-reduce|reduce-scatter)(?:-start)?\(", line)
        if m and "shard_map/" in line:
            out.append(f"{m.group(1)}:{axes.get(replica_groups(line), '?')}")
    return out


if __name__ == "__main__":
    main()
