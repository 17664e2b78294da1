"""The roofline of a model's programs compiled for a real accelerator target on this host
(`python -m jaxspec.tools.roofline --target h200|h100|v5e|v5p|v6e`): each program's bytes from the
compiled program (per chip), kernel launches and host round trips (jaxspec.tools.step_model),
collectives, the attention implementation found in it, the bandwidth floor and the predicted
time. Compile-only devices come from jaxspec.tools.aot; nothing runs.

Programs: `decode` (one token per row: forward + logits) and `verify` (a window of γ+1 tokens),
the target forwards a decode loop's step runs, with their KV cache donated, at a capacity the
attention kernels take (a multiple of 128 slots).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxspec import hlo, sharding
from jaxspec.errors import JaxspecError
from jaxspec.models import attention, attention_kernels, base
from jaxspec.tools import aot, step_model, step_programs


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a program's inputs live: the compile-only devices and the (data, model) mesh."""

    target: aot.AccelTarget
    devices: list
    mesh: jax.sharding.Mesh | None
    over_memory_ok: bool = False  # compile (and report by how much) what does not fit

    @property
    def chips(self) -> int:
        return len(self.devices)


def placement(target_name: str, mesh: tuple[int, int] | None, model: base.Target,
              over_memory_ok: bool = False) -> Placement:
    t = aot.target(target_name)
    chips = 1 if mesh is None else mesh[0] * mesh[1]
    devs = aot.devices(t, chips)
    if mesh is None:
        return Placement(t, devs, None, over_memory_ok)
    m = sharding.make_mesh(mesh[0], mesh[1], devices=devs)
    sharding.check_target(model, m)
    return Placement(t, devs, m, over_memory_ok)


def _placed(p: Placement, model: base.Target, params, cache, tokens):
    if p.mesh is None:
        s = jax.sharding.SingleDeviceSharding(p.devices[0])
        return aot.on(params, s), aot.on(cache, s), aot.on(tokens, s)
    sharding.check_batch(tokens.shape[0], p.mesh)
    rep = jax.sharding.NamedSharding(p.mesh, jax.sharding.PartitionSpec())
    batch = jax.sharding.NamedSharding(p.mesh, sharding.ShardingRules().spec("batch"))
    return (aot.on(params, sharding.target_shardings(model, params, p.mesh)),
            aot.on(cache, sharding.cache_shardings(cache, p.mesh)),
            aot.on(tokens, batch if tokens.shape[0] % p.mesh.shape["data"] == 0 else rep))


def _check_fits(need: float, p: Placement, program: str) -> float:
    """need: bytes per chip (memory_analysis() of the compiled program, or before compiling its
    arguments' share). Returns the GiB over the chip's memory (0: fits) where the placement
    allows that, else refuses in one line."""
    if need > p.target.memory and p.over_memory_ok:
        return round((need - p.target.memory) / 2**30, 2)
    if need > p.target.memory:
        raise JaxspecError(
            f"the {program} program needs {need / 2**30:.1f} GiB per chip but a {p.target.name} "
            f"has {p.target.memory / 2**30:.1f} GiB ({(need - p.target.memory) / 2**30:.1f} GiB "
            f"over): use a larger --mesh, a smaller --batch or --capacity (--over-memory: "
            f"compile it anyway)")
    return 0.0


def _chip_share(*placed) -> float:
    """The fraction of these placed trees' bytes one chip holds (1 / chips when every leaf is
    split over all chips; more where leaves are replicated, e.g. weights over a data axis)."""
    leaves = [x for t in placed for x in jax.tree.leaves(t)]
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    per_chip = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    return per_chip / total


def measure(p: Placement, model: base.Target, layout: str, program: str, batch: int,
            window: int, capacity: int, valid: int, kernel_list: bool = False) -> dict:
    """One program compiled for the placement's target, read. weight_bytes: the params a step
    must read (the embedding table's gathered rows where it is not the LM head); kv_bytes: the
    valid KV prefix read and the window's rows written; min_bytes: both + the f32 logits out
    (step_programs.min_bytes), all model totals; bytes_moved: per chip; shard_bytes: the minimum
    scaled to one chip's share of params + cache (replicated leaves count whole), the floor's
    bytes."""
    params = step_programs.abstract_params(model, layout)
    cache = step_programs.abstract_cache(model, params, batch, capacity)
    tokens = jax.ShapeDtypeStruct((batch, window), jnp.int32)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    _check_fits((nbytes(params) + nbytes(cache)) / p.chips, p, program)  # before a long compile
    params_in, cache_in, tokens_in = _placed(p, model, params, cache, tokens)
    with attention_kernels.kernel_mesh(p.mesh):  # kernels per shard, as the decode loop traces
        compiled = aot.compile_for(p.target, step_programs._step(model, False), params_in,
                                   tokens_in, cache_in)
    mem = compiled.memory_analysis()
    over = 0.0
    if mem is not None:
        over = _check_fits(mem.argument_size_in_bytes + mem.output_size_in_bytes
                           - mem.alias_size_in_bytes + mem.temp_size_in_bytes, p, program)
    text = compiled.as_text()
    trips = attention.cache_loop_trips(valid, capacity)
    kernels, syncs = step_model.launches(text, unknown_trip=max(trips, 1))
    if p.target.platform == "tpu":
        syncs = 0  # control flow runs on the chip
    moved = hlo.device_bytes(text, unknown_trip=trips)
    need = step_programs.min_bytes(model, params, cache, batch, window, valid, window)
    kv = nbytes([x for x in jax.tree.leaves(cache) if x.ndim >= 4]) * (valid + window) / capacity
    logits = batch * window * model.vocab_size * 4
    shard = need * _chip_share(params_in, cache_in)  # the minimum one chip must move
    ca = compiled.cost_analysis()
    ca = (ca[0] if isinstance(ca, (list, tuple)) else ca) or {}
    row = {
        "target": p.target.name, "program": program, "batch": batch, "window": window,
        "layout": layout, "dtype": model.dtype, "capacity": capacity, "valid": valid,
        "chips": p.chips, "weight_bytes": int(need - kv - logits), "kv_bytes": int(kv),
        "min_bytes": int(need), "bytes_moved": moved, "bytes_ratio": round(moved * p.chips / need, 3),
        "kernels": kernels if p.target.platform == "cuda" else None, "host_syncs": syncs,
        "shard_bytes": int(shard), "shard_ratio": round(moved / shard, 3),
        "large_copies": len(step_model.large_copies(text)),
        "low_precision_dots": len(step_model.low_precision_dots(text)),
        "rope_kernels": step_model.kernels_computing(text, ("sine", "cosine")),
        "collectives": step_model.collectives(text), "attention": hlo.compiled_attention(text),
        "floor_ms": round(step_model.floor_ms(shard, p.target.bandwidth), 4),
        "predicted_ms": round(step_model.predicted_ms(
            moved, p.target.bandwidth, kernels if p.target.platform == "cuda" else 1, syncs), 4),
    }
    if over:
        row["over_memory_gib"] = over
    if kernel_list:  # the launched kernels, named (step_model.kernel_list)
        row["kernel_list"] = step_model.kernel_list(text)
    if "optimal_seconds" in ca and ca["optimal_seconds"] > 0:
        row["optimal_ms"] = round(1e3 * float(ca["optimal_seconds"]), 4)
    return row


def rows(p: Placement, model: base.Target, layout: str, batches, windows, capacity: int,
         fill: float, kernel_list: bool = False) -> list[dict]:
    capacity = attention.kernel_capacity(capacity, "gpu")  # what the kernels take
    valid = int(capacity * fill)
    return [measure(p, model, layout, "decode" if w == 1 else "verify", b, w, capacity, valid,
                    kernel_list) for b in batches for w in windows]


def format_rows(out: list[dict]) -> str:
    head = ("| target | program | batch | window | layout | bytes moved | ratio | kernels | "
            "host syncs | collectives | attention | floor ms | predicted ms |\n"
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|")
    lines = [f"| {r['target']} | {r['program']} | {r['batch']} | {r['window']} | {r['layout']} | "
             f"{r['bytes_moved'] / 1e9:.2f} GB | {r['bytes_ratio']:.2f} | {r['kernels'] or '-'} | "
             f"{r['host_syncs']} | {r['collectives']} | {r['attention']} | {r['floor_ms']:.2f} | "
             f"{r['predicted_ms']:.2f} |" for r in out]
    return "\n".join([head, *lines])
