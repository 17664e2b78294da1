"""Meshes and logical-axis rules: every param and cache leaf names its axes (models.llama.param_axes,
cache.cache_axes); one rules table maps logical names to mesh axes ("data", "model").

    mesh = make_mesh(data=2, model=4)
    params = shard_params(model.params, model.cfg, mesh)   # then generate as usual: jit follows

A dimension that the mesh axis does not divide stays replicated (e.g. SmolLM2's 3 kv heads on a
4-way model axis), so any rules table works on any model; small drafters stay replicated.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec import kernels
from jaxspec.errors import JaxspecError
from jaxspec.models import llama


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    batch: str | None = "data"
    heads: str | None = "model"
    kv_heads: str | None = "model"
    mlp: str | None = "model"
    vocab: str | None = "model"
    embed: str | None = None
    head_dim: str | None = None
    layers: str | None = None
    cache_seq: str | None = None

    def spec(self, *logical: str | None) -> P:
        axes = [getattr(self, n) if n else None for n in logical]
        used = [a for a in axes if a]
        if len(used) != len(set(used)):
            raise ValueError(f"{logical} maps two dims to one mesh axis: {axes}")
        return P(*axes)


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh; `model=None` takes the devices that `data` leaves."""
    devices = list(devices if devices is not None else jax.devices())
    model = model if model is not None else len(devices) // data
    if data * model != len(devices) or data < 1 or model < 1:
        raise JaxspecError(
            f"mesh data={data} x model={model} does not fit {len(devices)} devices: "
            "choose sizes whose product is the device count"
        )
    return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"))


def _fitted_spec(rules: ShardingRules, logical: tuple, shape: tuple, mesh: Mesh) -> P:
    """The rules' spec, with any mesh axis that does not divide its dimension dropped."""
    spec = rules.spec(*logical)
    fitted = [
        a if a is None or shape[i] % mesh.shape[a] == 0 else None for i, a in enumerate(spec)
    ]
    return P(*fitted)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def shardings_for(tree, axes, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """NamedSharding for every leaf of `tree`, from the parallel pytree of logical axis names."""
    flat_axes = jax.tree.leaves(axes, is_leaf=_is_axes)
    flat, treedef = jax.tree.flatten(tree)
    if len(flat_axes) != len(flat):
        raise ValueError(f"{len(flat)} leaves but {len(flat_axes)} axis names")
    out = [
        NamedSharding(mesh, _fitted_spec(rules, ax, leaf.shape, mesh))
        for ax, leaf in zip(flat_axes, flat)
    ]
    return jax.tree.unflatten(treedef, out)


def shard_params(params, cfg: llama.ModelConfig, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """Place the target's params on the mesh by their logical axes."""
    if isinstance(params.get("lm_head"), kernels.PackedWeight):
        raise JaxspecError("packed params (CPU kernel layout) cannot be sharded: load with layout='unrolled'")
    stacked = isinstance(params["layers"], dict)
    axes = llama.param_axes(cfg, stacked=stacked)
    return jax.device_put(params, shardings_for(params, axes, mesh, rules))


def replicate(tree, mesh: Mesh):
    """Small drafters: a full copy on every device."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
