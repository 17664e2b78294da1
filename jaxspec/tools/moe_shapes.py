"""MoE model shapes for `jaxspec.tools.roofline` and the bytes a step reads of their *active*
weights: a step of N routed tokens (batch x window) reads the experts those tokens wake
(`models.moe.experts_woken`), not all of them, so a verify window costs more than a decode
token on an MoE model while its dense part costs the same.

    weight_bytes         every weight, once
    active_weight_bytes  the dense part + per MoE layer experts_woken(N) x one expert's bytes
                         (+ the shared expert, which every token runs)

Shapes: Qwen3-30B-A3B (48 layers, 128 experts top-8, width 768) and Qwen3.5-35B-A3B-like
(transformers' Qwen3_5MoeTextConfig defaults: 40 hybrid layers 3 linear : 1 full, 256 experts
top-8, width 512, shared expert 512).
"""

from __future__ import annotations

# Imported inside functions: jax and the jaxspec modules that load it, so that
# `python -m jaxspec.tools.moe_shapes --help` answers without importing jax.
import argparse
import json
import math
import re
import sys
from typing import TYPE_CHECKING

from jaxspec.errors import JaxspecError

if TYPE_CHECKING:
    from jaxspec.models import qwen3_5_moe, qwen3_moe

EXPERT_LEAVES = ("we_gate", "we_up", "we_down")


def qwen3_30b_a3b(dtype: str) -> qwen3_moe.MoeTarget:
    from jaxspec.models import qwen3_moe
    from jaxspec.models.decoder import ModelConfig

    base = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True,
                       rope_theta=1e6, max_position_embeddings=40960, dtype=dtype)
    cfg = qwen3_moe.MoeConfig(**{k: getattr(base, k) for k in base.__dataclass_fields__},
                              num_experts=128, top_k=8, moe_intermediate_size=768,
                              norm_topk_prob=True, moe_layers=(True,) * 48)
    return qwen3_moe.MoeTarget(cfg)


def qwen3_5_35b_a3b(dtype: str) -> qwen3_5_moe.Qwen35MoeTarget:
    from jaxspec.models import qwen3_5, qwen3_5_moe

    cfg = qwen3_5.Qwen35Config(
        vocab_size=248320, hidden_size=2048, intermediate_size=512, num_layers=40,
        num_heads=16, num_kv_heads=2, head_dim=256,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(40)),
        linear_key_heads=16, linear_value_heads=32, linear_key_dim=128, linear_value_dim=128,
        max_position_embeddings=262144, dtype=dtype, num_experts=256, top_k=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512)
    return qwen3_5_moe.Qwen35MoeTarget(cfg)


def _moe_dims(target):
    """(num_experts, top_k) of an MoE target, None for a dense one."""
    cfg = getattr(target, "cfg", None)
    experts, top_k = getattr(cfg, "num_experts", 0), getattr(cfg, "top_k", 0)
    return (experts, top_k) if experts and top_k else None


def weight_bytes(target) -> tuple[float, float, int]:
    """(every weight's bytes, the routed experts' bytes, MoE layer count), from abstract params
    (no weights built)."""
    import jax
    import jax.numpy as jnp

    params = jax.eval_shape(lambda: target.init_params(jax.random.key(0)))
    nbytes = lambda x: x.size * jnp.dtype(x.dtype).itemsize  # noqa: E731
    total = sum(nbytes(x) for x in jax.tree.leaves(params))
    layers = params["layers"]
    experts = sum(nbytes(lp[k]) for lp in layers for k in EXPERT_LEAVES if k in lp)
    return float(total), float(experts), sum("router" in lp for lp in layers)


def active_weight_bytes(target, tokens: int) -> float:
    """Weight bytes a step of `tokens` routed tokens reads: the dense part whole, the routed
    experts as many as the tokens wake (`moe.active_weight_bytes`)."""
    from jaxspec.models import moe

    dims = _moe_dims(target)
    total, experts, layers = weight_bytes(target)
    if dims is None or not layers:
        return total
    num_experts, top_k = dims
    one_expert = experts / (layers * num_experts)
    return total - experts + layers * moe.active_weight_bytes(tokens, top_k, num_experts,
                                                              one_expert)


def active_fields(target, batch: int, window: int) -> dict:
    """Extra roofline row fields for an MoE target ({} for a dense one): experts woken per
    layer, the active weight bytes and their share of all weights."""
    from jaxspec.models import moe

    dims = _moe_dims(target)
    if dims is None:
        return {}
    total, _, _ = weight_bytes(target)
    active = active_weight_bytes(target, batch * window)
    return {"experts_woken": round(moe.experts_woken(batch * window, dims[1], dims[0]), 2),
            "active_weight_bytes": active, "active_share": round(active / total, 4)}


# ---- one MoE block compiled for a mesh of chips: bytes per chip against its share

SHAPES = {"qwen3-30b-a3b": qwen3_30b_a3b, "qwen3.5-35b-a3b": qwen3_5_35b_a3b}
_UNKNOWN_TRIP_WHILE = re.compile(r"\bwhile\((?![^\n]*known_trip_count)")


def block_program(place, target, batch: int, window: int, path: str | None, rules=None):
    """(compiled text, layer-0 MoE params as placed): the routed block (+ shared expert) of
    `target`'s first MoE layer on x [batch*window, D], compiled for `place` (accel_roofline's
    placement; its mesh set as the trace mesh, as the decode loop traces). path None: the
    per-shard path on a mesh splitting the experts; "gather" etc.: that path under GSPMD.
    rules: the `sharding.ShardingRules` placing params, tokens and experts (None: defaults)."""
    import jax
    import jax.numpy as jnp

    from jaxspec import sharding
    from jaxspec.models import attention_kernels, moe, moe_shards
    from jaxspec.tools import aot

    params = jax.eval_shape(lambda: target.init_params(jax.random.key(0)))
    layer = next(i for i, lp in enumerate(params["layers"]) if "router" in lp)
    if place.mesh is None:
        shard = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(place.devices[0]), params)
        tokens = shard["embed"]
    else:
        rules = rules or sharding.ShardingRules()
        shard = sharding.target_shardings(target, params, place.mesh, rules)
        rows = rules.batch if batch % place.mesh.shape[rules.batch] == 0 else None
        tokens = jax.sharding.NamedSharding(place.mesh, jax.sharding.PartitionSpec(rows))
    keep = lambda lp: {k: v for k, v in lp.items() if k == "router" or k.startswith(("we_", "ws_"))}  # noqa: E731
    lp = aot.on(keep(params["layers"][layer]), keep(shard["layers"][layer]))
    x = jax.ShapeDtypeStruct((batch * window, target.hidden_size), jnp.dtype(target.dtype),
                             sharding=tokens)
    top_k = target.cfg.top_k
    fn = jax.jit(lambda p, x: moe.moe_block(p, x, top_k=top_k, norm_topk=True, path=path))
    with attention_kernels.kernel_mesh(place.mesh), moe_shards.expert_placement(rules):
        compiled = aot.compile_for(place.target, fn, lp, x)
    return compiled.as_text(), lp


def block_row(place, target, batch: int, window: int, path: str | None = None,
              experts_axis: str = "model") -> dict:
    """One MoE block's bytes per chip against its share of the active weights. The share: the
    router whole (replicated) + each split leaf's 1/chips-of-its-axis share, the experts as
    many as a chip's tokens wake (experts_woken(N / data) / the experts axis; all N where the
    experts split over "data"). The per-shard path's loop over a chip's woken experts has a
    data-dependent trip count; it states that same expectation in its name scope, which
    `hlo.device_bytes` counts, so the ratio checks that nothing else expert-sized is read or
    moved; another path's data-dependent loops count once (a floor). weight_gathers:
    all-gathers as large as one expert."""
    import jax.numpy as jnp

    from jaxspec import hlo, sharding
    from jaxspec.models import moe
    from jaxspec.tools import step_model

    rules = sharding.ShardingRules(experts=experts_axis)
    text, lp = block_program(place, target, batch, window, path, rules)
    num_experts, top_k = _moe_dims(target)
    mesh = place.mesh
    split = mesh.shape[experts_axis] if mesh is not None else 1
    rows = mesh is not None and experts_axis != "data" and batch % mesh.shape["data"] == 0
    data = mesh.shape["data"] if rows else 1  # experts over "data": every chip all tokens
    woken_per_chip = moe.experts_woken(batch * window // data, top_k, num_experts) / split
    nbytes = lambda x: x.size * jnp.dtype(x.dtype).itemsize  # noqa: E731
    chip = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize  # noqa: E731
    one_expert = sum(nbytes(lp[k]) for k in EXPERT_LEAVES) / num_experts
    share = (sum(chip(v) for k, v in lp.items() if k not in EXPERT_LEAVES)
             + woken_per_chip * one_expert)
    loops = len(_UNKNOWN_TRIP_WHILE.findall(text))
    # the per-shard loop at the woken count it states; other data-dependent loops (sorts) once
    per_chip = hlo.device_bytes(text, unknown_trip=1)
    least = lp["we_gate"].size // num_experts
    gathers = [d for d in re.findall(r"= (?:f32|bf16)\[([0-9,]*)\]\{[^}]*\} all-gather(?:-start)?\(",
                                     text)
               if math.prod(int(s) for s in d.split(",") if s) >= least]
    return {"target": place.target.name, "mesh": list(mesh.shape.values()) if mesh else [1, 1],
            "path": path or "shards", "experts_axis": experts_axis, "batch": batch,
            "window": window,
            "experts_woken": round(moe.experts_woken(batch * window, top_k, num_experts), 2),
            "share_bytes": int(share), "bytes_per_chip": int(per_chip),
            "ratio": round(per_chip / share, 3), "data_dependent_loops": loops,
            "collectives": step_model.collectives(text), "weight_gathers": gathers}


# ---- whole-model steps (accel_roofline's rows) against the active weights


def chip_active_fields(place, target, row: dict, experts_axis: str = "model") -> dict:
    """Fields that put an accelerator row (`accel_roofline.measure`: bytes_moved and
    shard_bytes per chip, min_bytes the model's) against the *active* weights: the experts a
    step's tokens wake, not all of them. active_min_bytes: min_bytes less the unwoken experts;
    active_shard_bytes: shard_bytes less the unwoken share of the experts this chip holds (its
    tokens: N / data where the batch and the experts split over different axes, else all N);
    active_ratio: bytes_moved over that, the figure that is 1.0 at the floor."""
    from jaxspec.models import moe

    dims = _moe_dims(target)
    if dims is None:
        return {}
    num_experts, top_k = dims
    _, experts, _ = weight_bytes(target)
    tokens = row["batch"] * row["window"]
    mesh = place.mesh
    split = mesh.shape[experts_axis] if mesh is not None else 1
    data = mesh.shape["data"] if mesh is not None and experts_axis != "data" else 1
    chip_tokens = tokens // data if tokens % data == 0 else tokens
    unwoken = lambda n: 1.0 - moe.experts_woken(n, top_k, num_experts) / num_experts  # noqa: E731
    active_min = row["min_bytes"] - experts * unwoken(tokens)
    active_shard = row["shard_bytes"] - experts / split * unwoken(chip_tokens)
    return {"experts_woken": round(moe.experts_woken(tokens, top_k, num_experts), 2),
            "active_min_bytes": int(active_min), "active_shard_bytes": int(active_shard),
            "active_ratio": round(row["bytes_moved"] / active_shard, 3),
            "active_floor_ms": round(1e3 * active_shard / place.target.bandwidth, 4)}


def whole_rows(place, target, batches, windows, capacity: int = 2048, fill: float = 0.5,
               layout: str = "unrolled") -> list[dict]:
    """accel_roofline's whole-forward rows (decode, verify windows) with `chip_active_fields`:
    the per-shard MoE loop counted at the experts its chip's tokens wake (the trip count it
    states, `hlo.expected_trips_scope`), the attention's loop at its own."""
    from jaxspec.tools import accel_roofline

    return [row | chip_active_fields(place, target, row)
            for row in accel_roofline.rows(place, target, layout, batches, windows, capacity, fill)]


def main(argv=None) -> int:
    """python -m jaxspec.tools.moe_shapes --target v5e --mesh 1,4 --shape qwen3-30b-a3b
    [--batch 1,8] [--window 1,5] [--path gather] [--experts-axis data]: one MoE block's bytes
    per chip (JSON rows); --whole [--layers N]: whole decode / verify steps against the active
    weights."""
    p = argparse.ArgumentParser(prog="python -m jaxspec.tools.moe_shapes", description=main.__doc__)
    p.add_argument("--target", default="v5e")
    p.add_argument("--mesh", default="1,4", metavar="D,M")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--batch", default="1,8")
    p.add_argument("--window", default="1,5")
    p.add_argument("--path", default=None, choices=["gather", "grouped", "dense", "looped"],
                   help="a one-device path under GSPMD instead of the per-shard one")
    p.add_argument("--whole", action="store_true", help="the whole forward (decode and verify "
                   "steps, accel_roofline's rows) against the active weights, not one block")
    p.add_argument("--layers", type=int, metavar="N", help="with --whole: the first N layers")
    p.add_argument("--experts-axis", default="model", choices=["model", "data"],
                   help="the rules table's mesh axis for the experts (ShardingRules.experts)")
    args = p.parse_args(argv)
    from jaxspec.tools import accel_roofline, aot  # jax loads only once the arguments parse

    aot.target(args.target)
    try:
        data, model = (int(v) for v in args.mesh.split(","))
        batches, windows = ([int(v) for v in s.split(",")] for s in (args.batch, args.window))
    except ValueError:
        raise JaxspecError(f"--mesh {args.mesh!r} / --batch / --window: use integers, e.g. "
                           f"--mesh 1,4 --batch 1,8 --window 1,5") from None
    target = SHAPES[args.shape]("bfloat16")
    if args.whole:
        target = target.prefix(args.layers) if args.layers else target
        place = accel_roofline.placement(args.target, None if data * model == 1
                                         else (data, model), target)
        keep = ("target", "program", "batch", "window", "chips", "bytes_moved", "shard_bytes",
                "shard_ratio", "collectives", "predicted_ms")
        for row in whole_rows(place, target, batches, windows):
            print(json.dumps({"shape": args.shape} | {k: row[k] for k in keep if k in row}
                             | chip_active_fields(place, target, row)))
        return 0
    place = accel_roofline.placement(args.target, (data, model), target)
    for b in batches:
        for w in windows:
            print(json.dumps({"shape": args.shape} | block_row(place, target, b, w, args.path,
                                                                  args.experts_axis)))
    return 0


if __name__ == "__main__":
    from jaxspec.cli_support import run as run_cli  # the CLI wrapper only when run

    sys.exit(run_cli(main))
