"""Meshes and logical-axis rules: every param and cache leaf names its axes (the target's
`param_axes` / `cache_axes` traits, models/base.py); one rules table maps logical names to mesh
axes ("data", "model").

    mesh = make_mesh(data=2, model=4)
    plan = MeshPlan(mesh)
    params = shard_params(model.params, model.target, mesh)   # or load_model(..., mesh=plan)
    engine = Engine(model, drafter, mesh=plan)             # cache, tokens, state sharded too

Tensor parallelism is by whole heads: weights keep torch's flattened layout (`wq: [N*H, D]`), and
cutting that dim into `m` contiguous blocks gives every device whole heads iff `m` divides the head
COUNT N (not N*H). Query heads must divide (`check_model` says which sizes fit); kv heads that do
not divide stay replicated over `model`, as does any mlp / vocab dim the axis does not divide.
With q/k/v split by heads and wo / w_down contracted over the split dim, a layer needs two
all-reduces (Megatron). Routed experts (`models/moe.py`, `[E, ...]` leaves) split whole experts
over the axis `ShardingRules.experts` names (`model` by default; `data` too: the block then
gathers its tokens over `data` and reduce-scatters them back): each device runs its own
(`models/moe_shards.py`, placed by the same rules at trace time), no expert weight is gathered.
Gated DeltaNet layers (Qwen3.5, Qwen3-Next) split their value heads (`linear_heads`: in_z, in_a,
in_b, out and the recurrent state) and their mixed q/k/v channels (`linear_channels`: in_qkv, the
per-channel conv and its state) over `model`; the channels are grouped by key head on load
(`linear_attention.grouped_channels`), so where `model` divides the key heads each device's
block holds the q, k and v of its own heads and the conv output is not regathered.
Drafters are replicated over `model` by default (their batch rows still
follow `data`); `MeshPlan(shard_drafter=True)` shards a draft model by the target's rules.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.models.cache import CACHE_AXES, KVCache
from jaxspec.models.hybrid_cache import HybridCache, cache_axes as hybrid_cache_axes
from jaxspec.models.paged_attention import PagedKVCache
from jaxspec.errors import JaxspecError
from jaxspec.models import base, llama

AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    batch: str | None = "data"
    heads: str | None = "model"
    kv_heads: str | None = "model"
    mlp: str | None = "model"
    experts: str | None = "model"  # routed experts (models/moe.py): whole experts per device
    # Gated DeltaNet layers (models/linear_attention.py): value heads (in_z, in_a/in_b, out, the
    # recurrent state) and the mixed q/k/v channels (in_qkv, the depthwise conv and its state)
    linear_heads: str | None = "model"
    linear_channels: str | None = "model"
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

    def replicated_over_model(self) -> ShardingRules:
        """Only the batch keeps its axis (the default for drafters)."""
        return ShardingRules(batch=self.batch, heads=None, kv_heads=None, mlp=None, experts=None,
                             linear_heads=None, linear_channels=None, vocab=None)


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first data*model devices (`jax.make_mesh` picks a
    topology-aware order); `model=None` takes the devices that `data` leaves."""
    devices = list(devices if devices is not None else jax.devices())
    if data < 1 or (model is not None and model < 1):
        raise JaxspecError(f"mesh data={data}, model={model} is invalid: both sizes must be >= 1")
    model = model if model is not None else max(len(devices) // data, 1)
    if data * model > len(devices):
        raise JaxspecError(
            f"mesh data={data} x model={model} needs {data * model} devices but "
            f"{len(devices)} are available: choose sizes whose product is at most {len(devices)}"
        )
    used = devices[: data * model]
    auto = (AxisType.Auto, AxisType.Auto)
    if len(used) == len(jax.devices()) and devices == list(jax.devices()):
        return jax.make_mesh((data, model), AXES, auto)
    return jax.make_mesh((data, model), AXES, auto, devices=used)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_model(cfg: llama.ModelConfig, mesh: Mesh) -> None:
    """The model axis must give each device whole query heads."""
    _check_heads(cfg.num_heads, mesh)


def check_target(target: base.Target, mesh: Mesh) -> None:
    """check_model for any target: whole query heads (a target without `head_counts` keeps
    its params replicated over `model`, see target_shardings)."""
    counts = base.target_traits(target).head_counts
    if counts is not None:
        _check_heads(counts()["heads"], mesh)


def _check_heads(num_heads: int, mesh: Mesh) -> None:
    m = mesh.shape["model"]
    if num_heads % m:
        raise JaxspecError(
            f"mesh model={m} cannot split num_heads={num_heads} into whole heads: "
            f"use mesh.model in ({_divisors(num_heads)})"
        )


def check_batch(batch: int, mesh: Mesh) -> None:
    d = mesh.shape["data"]
    if batch % d:
        raise JaxspecError(
            f"batch of {batch} rows does not divide over mesh data={d}: "
            f"use a batch_size that is a multiple of {d}"
        )


def _fitted_spec(rules: ShardingRules, logical: tuple, shape: tuple, mesh: Mesh, counts) -> P:
    """The rules' spec, with any mesh axis that does not divide its dimension's unit count
    (heads for "heads"/"kv_heads", else the dim size) dropped: whole heads or nothing."""
    spec = rules.spec(*logical)
    fitted = []
    for i, a in enumerate(spec):
        count = counts.get(logical[i], shape[i]) if logical[i] else shape[i]
        fitted.append(a if a is None or count % mesh.shape[a] == 0 else None)
    return P(*fitted)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def shardings_for(tree, axes, mesh: Mesh, rules: ShardingRules = ShardingRules(), counts=None):
    """NamedSharding for every leaf of `tree` (arrays or ShapeDtypeStructs), from the parallel
    pytree of logical axis names. `counts`: unit counts per logical name ({"heads": N, ...})."""
    flat_axes = jax.tree.leaves(axes, is_leaf=_is_axes)
    flat, treedef = jax.tree.flatten(tree)
    if len(flat_axes) != len(flat):
        raise ValueError(f"{len(flat)} leaves but {len(flat_axes)} axis names")
    out = [
        NamedSharding(mesh, _fitted_spec(rules, ax, leaf.shape, mesh, counts or {}))
        for ax, leaf in zip(flat_axes, flat)
    ]
    return jax.tree.unflatten(treedef, out)


def head_counts(cfg: llama.ModelConfig) -> dict[str, int]:
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}


def param_shapes(cfg: llama.ModelConfig, stacked: bool = False):
    """ShapeDtypeStructs of the (unpacked) params: shardings before any weight is read."""
    dtype = cfg.compute_dtype
    shapes = llama.param_shapes(cfg)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=is_shape)
    if stacked:
        layers = tree["layers"]
        tree["layers"] = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((len(layers), *s.shape), dtype), layers[0]
        )
    return tree


def param_shardings(
    cfg: llama.ModelConfig, mesh: Mesh, rules: ShardingRules = ShardingRules(), stacked=False
):
    """NamedSharding of every param leaf, from the config alone."""
    axes = llama.param_axes(cfg, stacked=stacked)
    return shardings_for(param_shapes(cfg, stacked), axes, mesh, rules, head_counts(cfg))


def target_shardings(target: base.Target, params, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """NamedSharding of every param leaf by the target's `param_axes` (whole heads by its
    `head_counts`); a target without `param_axes` is replicated."""
    t = base.target_traits(target)
    if t.param_axes is None:
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    counts = t.head_counts() if t.head_counts is not None else {}
    return shardings_for(params, t.param_axes(params), mesh, rules, counts)


def _refuse_packed(target: base.Target, params) -> None:
    if base.uses_cpu_kernels(target, params):
        raise JaxspecError(
            "packed params (CPU kernel layout) cannot be sharded: load with layout='unrolled'"
        )


def shard_params(params, target: base.Target, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """Place the target's params on the mesh by their logical axes (whole heads per device)."""
    _refuse_packed(target, params)
    check_target(target, mesh)
    return jax.device_put(params, target_shardings(target, params, mesh, rules))


def cache_shardings(cache: KVCache, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> KVCache:
    """KV cache: batch over `data`, kv heads over `model` when they divide it (a hybrid cache:
    its linear layers' states by value heads and q/k/v channels too)."""
    if isinstance(cache, HybridCache) and cache.snapshots is None:
        return shardings_for(cache, hybrid_cache_axes(len(cache.k), len(cache.ssm)), mesh, rules)
    stacked = not isinstance(cache.k, tuple)
    axes = CACHE_AXES if stacked else CACHE_AXES[1:]
    one = lambda x: NamedSharding(mesh, _fitted_spec(rules, axes, x.shape, mesh, {}))
    return KVCache(
        k=jax.tree.map(one, cache.k),
        v=jax.tree.map(one, cache.v),
        lengths=NamedSharding(mesh, rules.spec("batch")),
    )


def paged_cache_shardings(cache: PagedKVCache, mesh: Mesh,
                          rules: ShardingRules = ShardingRules()) -> PagedKVCache:
    """A serving page pool: each layer's pages [K, NP, P, H] over `model` by kv heads (whole
    heads, when they divide it; the pool has no row dim, so each data group holds all pages of
    its heads), the rows' page table [B, MP] and lengths [B] over `data`. A zero-size
    placeholder (the scheduler's pool held outside the state) is replicated."""
    def pages(x):
        if x.ndim != 4:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, _fitted_spec(rules, ("kv_heads", None, None, None), x.shape,
                                                mesh, {}))

    rows = lambda x: NamedSharding(  # noqa: E731
        mesh, _fitted_spec(rules, ("batch",) + (None,) * (x.ndim - 1), x.shape, mesh, {}))
    return PagedKVCache(k=jax.tree.map(pages, cache.k), v=jax.tree.map(pages, cache.v),
                        page_table=rows(cache.page_table), lengths=rows(cache.lengths))


def state_shardings(tree, batch: int, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """Any per-request pytree (decode state, drafter state, buffers): KV caches by the cache
    rules (a page pool by `paged_cache_shardings`), other leaves with a leading [B] axis over
    `batch`, everything else replicated."""

    def one(x):
        if isinstance(x, PagedKVCache):
            return paged_cache_shardings(x, mesh, rules)
        if isinstance(x, KVCache) or (isinstance(x, HybridCache) and x.snapshots is None):
            return cache_shardings(x, mesh, rules)
        if x.ndim >= 1 and x.shape[0] == batch:
            spec = _fitted_spec(rules, ("batch",) + (None,) * (x.ndim - 1), x.shape, mesh, {})
            return NamedSharding(mesh, spec)
        return NamedSharding(mesh, P())

    return jax.tree.map(
        one, tree, is_leaf=lambda x: isinstance(x, (KVCache, PagedKVCache, HybridCache)))


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A mesh and the rules for target and drafter (hashable: a static part of the loop spec)."""

    mesh: Mesh
    rules: ShardingRules = ShardingRules()
    shard_drafter: bool = False  # False: drafter params and state replicated over `model`

    @property
    def drafter_rules(self) -> ShardingRules:
        return self.rules if self.shard_drafter else self.rules.replicated_over_model()

    def constrain(self, tree, batch: int, drafter: bool = False):
        """with_sharding_constraint by `state_shardings` (inside jit)."""
        if tree is None:
            return None
        rules = self.drafter_rules if drafter else self.rules
        return jax.lax.with_sharding_constraint(tree, state_shardings(tree, batch, self.mesh, rules))

    def constrain_drafter_state(self, state, batch: int, drafter):
        """A drafter's state inside jit: by the drafter's rules, except for a drafter that runs on
        the target's own (sharded) weights (layer_skip, `shared_layers`): its cache is computed
        by kv-head shards, and replicating it gathered it every step."""
        if state is None:
            return None
        if getattr(drafter, "shared_layers", 0):
            return self.constrain(state, batch)
        cfg = getattr(drafter, "cfg", None)  # an EAGLE-style decoder layer of the target's shape
        if not self.shard_drafter or not isinstance(cfg, llama.ModelConfig):
            return self.constrain(state, batch, drafter=True)
        # shard_drafter: the layer's [B, K, S, H] cache leaves by kv heads like the target's
        # cache (its k/v come out of kv-head-sharded weights; replicated, they were gathered)
        cache_shape = lambda x: (x.ndim == 4 and x.shape[0] == batch  # noqa: E731
                                 and x.shape[1] == cfg.num_kv_heads and x.shape[3] == cfg.head_dim)
        axes = CACHE_AXES[1:]

        def one(x):
            if isinstance(x, KVCache) or not cache_shape(x):
                return self.constrain(x, batch, drafter=True)
            spec = _fitted_spec(self.rules, axes, x.shape, self.mesh, {})
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, KVCache))

    def constrain_window_kv(self, window_kv):
        """Window k/v ([B, T, K, H] per layer, or [L, B, T, K, H]) sharded like the cache."""
        logical = ("batch", None, "kv_heads", "head_dim")

        def one(x):
            axes = logical if x.ndim == 4 else ("layers", *logical)
            spec = _fitted_spec(self.rules, axes, x.shape, self.mesh, {})
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(one, window_kv)

    def put(self, tree, batch: int, drafter: bool = False):
        """device_put by `state_shardings` (outside jit)."""
        rules = self.drafter_rules if drafter else self.rules
        return jax.device_put(tree, state_shardings(tree, batch, self.mesh, rules))

    def batch_sharding(self, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec("batch", *([None] * (ndim - 1))))

    def put_batch(self, x: np.ndarray) -> jax.Array:
        """A host batch [B, ...] onto the mesh, rows over `data`. With several processes each
        hands over only the rows its devices hold (`make_array_from_process_local_data`)."""
        check_batch(x.shape[0], self.mesh)
        sharding = self.batch_sharding(x.ndim)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        rows = [idx[0] for idx in sharding.addressable_devices_indices_map(x.shape).values()]
        lo = min(r.start or 0 for r in rows)
        hi = max(x.shape[0] if r.stop is None else r.stop for r in rows)
        return jax.make_array_from_process_local_data(sharding, x[lo:hi], x.shape)

    def put_replicated(self, tree):
        """Small values (sampling params, PRNG keys) as replicated global arrays."""
        rep = NamedSharding(self.mesh, P())

        def one(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jax.random.wrap_key_data(put_global(jax.random.key_data(x), rep))
            return put_global(x, rep)

        return jax.tree.map(one, tree)

    def place_target(self, params, target: base.Target):
        """The target's params on the mesh (a no-op when they already are)."""
        check_target(target, self.mesh)
        _refuse_packed(target, params)
        want = target_shardings(target, params, self.mesh, self.rules)
        return jax.tree.map(_put_if_needed, params, want)

    def place_drafter(self, dparams, cfg: llama.ModelConfig | None = None, model=None):
        """Drafter params: replicated, or (shard_drafter) by the rules: a draft model by its own
        target's axes (`model`: decode.drafter.traits(d).model), an EAGLE-style decoder layer
        (`cfg`: traits(d).model_cfg) by the Llama layer's."""
        if dparams is None:
            return None
        rep = NamedSharding(self.mesh, P())
        if self.shard_drafter and model is not None:  # a draft model: its own target's rules
            check_target(model, self.mesh)
            want = target_shardings(model, dparams, self.mesh, self.rules)
            return jax.tree.map(_put_if_needed, dparams, want)
        if self.shard_drafter and cfg is not None and isinstance(dparams, dict):
            if "layer" in dparams:  # EAGLE: its decoder layer (and LM head) by the same rules
                return jax.tree.map(_put_if_needed, dparams, self.head_shardings(dparams, cfg))
        return jax.tree.map(lambda x: _put_if_needed(x, rep), dparams)

    def head_shardings(self, dparams, cfg: llama.ModelConfig):
        """An EAGLE-style head's NamedShardings (arrays or ShapeDtypeStructs) under
        shard_drafter: its decoder layer's projections by the Llama layer's axes, its own LM head
        [Nd, H] by vocabulary rows like the target's; norms, fc, d2t replicated. Each chip then
        reads its share of the head, not the whole head."""
        check_model(cfg, self.mesh)
        rep = NamedSharding(self.mesh, P())
        layer_axes = llama.param_axes(cfg)["layers"][0]
        counts = head_counts(cfg)

        def by(axes, x):
            spec = _fitted_spec(self.rules, axes, x.shape, self.mesh, counts)
            return NamedSharding(self.mesh, spec)

        out = jax.tree.map(lambda _: rep, dparams)
        out["layer"] = {k: by(layer_axes[k], w) if k in layer_axes and k != "attn_norm" else rep
                        for k, w in dparams["layer"].items()}
        if "lm_head" in dparams:
            out["lm_head"] = by(("vocab", "embed"), dparams["lm_head"])
        return out


def fetch(tree):
    """Arrays -> numpy on this host; sharded over several processes, the whole global value."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """`x` (the same value in every process) as a global array: with several processes each
    builds only the shards of its own devices."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _put_if_needed(x, sharding: NamedSharding):
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return put_global(x, sharding)


__all__ = [
    "MeshPlan",
    "ShardingRules",
    "cache_shardings",
    "check_batch",
    "check_model",
    "fetch",
    "make_mesh",
    "param_shardings",
    "shard_params",
    "shardings_for",
    "state_shardings",
    "target_shardings",
]
