"""Flat tensors from any checkpoint format -> the param pytree of `jaxspec.models.llama`.

Format readers hand over `{"embed": a, "final_norm": a, "layers.3.wq": a, ...}` (numpy or jax
arrays in `[out, in]` layout). This module checks the set of names and every shape against
`param_shapes(cfg)`, casts to the compute dtype and puts each leaf on the default device.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import numpy as np

from jaxspec import kernels
from jaxspec.errors import JaxspecError
from jaxspec.models import fused_layout
from jaxspec.models.decoder import ModelConfig
from jaxspec.models.llama import Params, param_shapes, qkv_splits
from jaxspec.sharding import check_model, param_shardings

DTYPES = ("float32", "bfloat16", "float16", "auto")
ACCELERATORS = ("tpu", "gpu")
LAYOUTS = ("auto", "unrolled", "stacked", "packed", "fused")
LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # packed by layout="packed"


def check_options(dtype: str, layout: str) -> None:
    if dtype not in DTYPES:
        raise JaxspecError(f"unsupported dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if layout not in LAYOUTS:
        raise JaxspecError(
            f"unsupported layout {layout!r}: use 'auto', 'unrolled' (per-layer arrays), "
            f"'packed' (per-layer, CPU panel kernel), 'fused' (per-layer, q/k/v and gate/up fused: "
            f"GPU) or 'stacked' ([L, ...] arrays for lax.scan)"
        )
    if layout == "packed" and dtype not in ("float32", "auto"):
        raise JaxspecError(f"layout 'packed' needs dtype float32, got {dtype}: use layout 'unrolled'")


def resolve_dtype(dtype: str) -> str:
    """"auto": bfloat16 on an accelerator (TPU/GPU), float32 on CPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if jax.default_backend() in ACCELERATORS else "float32"


def resolve_layout(layout: str, dtype: str) -> tuple[str, str]:
    """(layout, why it was chosen). "auto": "packed" where the CPU panel kernel runs (float32, one
    CPU device), "stacked" on TPU (which reads a stack's layer slices in place), else "unrolled"
    (on GPU the accelerator layout "fused": per-layer weights, each read once a step, q/k/v and
    gate/up fused, models/fused_layout.py) -- and the why says which condition failed, since the packed layout is the one
    whose greedy output is bit-identical across batch and window sizes."""
    if layout != "auto":
        if layout == "packed" and not kernels.available():
            raise JaxspecError(
                "layout 'packed' needs the CPU panel kernel, which is unavailable here (a CPU "
                "backend and g++ are needed): use layout 'unrolled'"
            )
        return layout, "requested"
    if jax.default_backend() == "tpu":  # TPU reads a stack's layer slices in place
        return "stacked", "auto: lax.scan over layers on tpu (each layer's slice read in place)"
    if jax.default_backend() in ACCELERATORS:
        return "fused", (f"auto: per-layer weights on {jax.default_backend()}, q/k/v and gate/up "
                         "fused (each read once a step in two projections; a stack's layer slices "
                         "are copied out on GPU)")
    if jax.default_backend() != "cpu":
        return "unrolled", f"auto: the {jax.default_backend()} backend has no CPU kernels"
    if jax.device_count() != 1:
        return "unrolled", f"auto: {jax.device_count()} devices (the CPU kernels run on one)"
    if dtype != "float32":
        return "unrolled", f"auto: the CPU kernels are float32 only, dtype is {dtype}"
    why_not = kernels.unavailable_reason()
    if why_not is not None:
        return "unrolled", f"auto fell back: CPU kernels unavailable ({why_not})"
    return "packed", "auto: float32 on one CPU device with the CPU kernels"


def layout_of(params: Params) -> str:
    """"stacked", "packed" or "unrolled": the layout these params are in."""
    if isinstance(params["layers"], dict):
        return "stacked"
    return "packed" if is_packed(params) else "unrolled"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = param_shapes(cfg)
    flat = {k: v for k, v in shapes.items() if k != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        flat |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    return flat


def check_finite(name: str, tensor, source: str) -> None:
    """Refuse NaN or inf in a loaded weight (they would silently poison every token)."""
    values = np.asarray(tensor)
    floating = values.dtype.kind in "fc" or values.dtype.name == "bfloat16"
    if floating and not np.isfinite(values.astype(np.float32, copy=False)).all():
        raise JaxspecError(
            f"{source}: tensor {name} holds NaN or inf values: the checkpoint is corrupt — "
            f"re-download or re-convert it"
        )


def assemble(cfg: ModelConfig, flat: Mapping[str, object], *, source: str) -> Params:
    """Check names and shapes, then nest: `layers.3.wq` -> params["layers"][3]["wq"]."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(flat), key=_natural)
    extra = sorted(set(flat) - set(want), key=_natural)
    if missing:
        raise JaxspecError(
            f"{source} lacks tensors {_short(missing)}: the checkpoint is incomplete or does not "
            f"match its config — re-download or re-convert it"
        )
    if extra:
        raise JaxspecError(
            f"{source} has tensors {_short(extra)} that this architecture does not use: "
            f"the model variant is not supported"
        )
    for key, shape in want.items():
        got = tuple(flat[key].shape)
        if got != tuple(shape):
            raise JaxspecError(
                f"{source}: tensor {key} has shape {got}, config implies {tuple(shape)}: "
                f"the checkpoint does not match its config"
            )
        if not getattr(flat[key], "lazy", False):  # lazy (mesh) loads check each slice as read
            check_finite(key, flat[key], source)
    layers = tuple(
        {k.split(".", 2)[2]: flat[k] for k in want if k.startswith(f"layers.{i}.")}
        for i in range(cfg.num_layers)
    )
    params: Params = {k: flat[k] for k in want if not k.startswith("layers.")}
    params["layers"] = layers
    return params


def place(params: Params, dtype: str, layout: str) -> Params:
    """Cast every leaf to `dtype` (on the host for numpy inputs, so a bfloat16 load never holds a
    float32 copy on the device) and put it on the device.

    The stacked layout is built one layer at a time into a preallocated `[L, ...]` buffer per
    weight (updated in place, the buffer donated), so the device holds the final params plus one
    layer's tensor at most, never the per-layer copies and the stack together (`load_peak_bytes`).
    """
    np_dtype = np.dtype(jax.numpy.dtype(dtype))

    def put(x):
        if isinstance(x, np.ndarray):
            x = np.ascontiguousarray(x, dtype=np_dtype)
        return jax.device_put(x).astype(np_dtype)

    if layout != "stacked":
        params = jax.tree.map(put, params)
        if layout == "fused":  # one layer's concatenation in flight at a time
            return fused_layout.fuse(params)
        return pack_params(params) if layout == "packed" else params
    out = {k: jax.tree.map(put, v) for k, v in params.items() if k != "layers"}
    layers = params["layers"]
    if isinstance(layers, dict):  # already stacked
        return out | {"layers": jax.tree.map(put, layers)}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    stacked = {}
    for k in layers[0]:
        buf = _zeros((len(layers), *layers[0][k].shape), np_dtype, device)
        for i, layer in enumerate(layers):
            # waited for, so no later layer's host cast and device copy pile up behind it
            buf = _set_layer(buf, put(layer[k]), i).block_until_ready()
        stacked[k] = buf
    return out | {"layers": stacked}


def load_peak_bytes(cfg: ModelConfig, dtype: str) -> dict[str, int]:
    """Device bytes while `place` builds the stacked layout, by shape arithmetic (no weights
    read): {"final": the params, "largest_tensor": one layer's largest weight, "peak": their
    sum, what the layer-by-layer build holds at most}."""
    itemsize = np.dtype(jax.numpy.dtype(dtype)).itemsize
    flat = expected_shapes(cfg)
    sizes = {k: int(np.prod(v)) * itemsize for k, v in flat.items()}
    final = sum(sizes.values())
    largest = max(v for k, v in sizes.items() if k.startswith("layers."))
    return {"final": final, "largest_tensor": largest, "peak": final + largest}


def place_on_mesh(
    params: Params, cfg: ModelConfig, dtype: str, layout: str, plan, *, source: str = "checkpoint"
) -> Params:
    """Build every leaf straight onto its shards (`plan`: a sharding.MeshPlan).

    The shardings come from the logical axes before any weight is read; each device's callback
    reads only its slice of the memory-mapped (safetensors) or lazily dequantised (GGUF) host
    tensor, which is dropped once its leaf is built: a host holds one tensor in flight and a
    device its shards plus one tensor's shard. The stacked layout is assembled on the mesh, one
    layer at a time, into a preallocated sharded `[L, ...]` buffer.
    """
    if layout in ("packed", "fused"):
        raise JaxspecError(f"layout {layout!r} (one device) cannot be sharded: use 'unrolled' or 'stacked'")
    check_model(cfg, plan.mesh)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    stacked = layout == "stacked"
    shardings = param_shardings(cfg, plan.mesh, plan.rules, stacked)

    def build(src, sharding, name):
        def cb(idx):  # this device's slice only
            piece = np.ascontiguousarray(src[idx], dtype=np_dtype)
            if getattr(src, "lazy", False):
                check_finite(name, piece, source)
            return piece

        out = jax.make_array_from_callback(tuple(src.shape), sharding, cb)
        getattr(src, "release", lambda: None)()
        return out

    out = {k: build(v, shardings[k], k) for k, v in params.items() if k != "layers"}
    layers = params["layers"]
    if not stacked:
        out["layers"] = tuple(
            {k: build(v, shardings["layers"][i][k], f"layers.{i}.{k}") for k, v in layer.items()}
            for i, layer in enumerate(layers)
        )
        return out
    out["layers"] = {}
    for k, sharding in shardings["layers"].items():
        layer_sharding = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
        shape = (len(layers), *layers[0][k].shape)
        buf = _zeros(shape, np_dtype, sharding)
        for i, layer in enumerate(layers):
            buf = _set_layer(buf, build(layer[k], layer_sharding, f"layers.{i}.{k}"), i)
        out["layers"][k] = buf
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(shape, dtype, sharding):
    return jax.lax.with_sharding_constraint(jax.numpy.zeros(shape, dtype), sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buf, layer, i):  # buf [L, ...] <- layer [...] at i, in place, shards stay put
    return jax.lax.dynamic_update_index_in_dim(buf, layer.astype(buf.dtype), i, 0)


def pack_params(params: Params) -> Params:
    """Per-layer params -> the "packed" layout: matmul weights as `PackedWeight` panels, q/k/v
    fused into "wqkv" and gate/up into "w_gate_up" (fewer, longer weight streams per layer).

    A tied LM head gets its own packed copy (the embedding table stays for the token lookup).
    """

    def pack_layer(layer):
        rest = {k: w for k, w in layer.items() if k not in LINEAR_KEYS}
        fused = {
            "wqkv": np.concatenate([np.asarray(layer[k]) for k in ("wq", "wk", "wv")]),
            "wo": layer["wo"],
        }
        if "w_gate" in layer:  # absent on an MoE layer (its experts stay plain arrays)
            fused["w_gate_up"] = np.concatenate([np.asarray(layer[k]) for k in ("w_gate", "w_up")])
            fused["w_down"] = layer["w_down"]
        return rest | {k: kernels.pack(w) for k, w in fused.items()}

    layers = tuple(pack_layer(layer) for layer in params["layers"])
    head = kernels.pack(params.get("lm_head", params["embed"]))
    return params | {"layers": layers, "lm_head": head}


def unpack_params(params: Params, cfg: ModelConfig) -> Params:
    """The "packed" layout back to "unrolled" (plain `[out, in]` arrays), e.g. to copy weights."""
    q_end, k_end = qkv_splits(cfg)

    def unpack_layer(layer):
        rest = {k: w for k, w in layer.items() if not isinstance(w, kernels.PackedWeight)}
        qkv = kernels.unpack(layer["wqkv"])
        gate, up = jax.numpy.split(kernels.unpack(layer["w_gate_up"]), 2)
        return rest | {
            "wq": qkv[:q_end], "wk": qkv[q_end:k_end], "wv": qkv[k_end:],
            "wo": kernels.unpack(layer["wo"]), "w_gate": gate, "w_up": up,
            "w_down": kernels.unpack(layer["w_down"]),
        }

    out = {k: v for k, v in params.items() if k not in ("layers", "lm_head")}
    out["layers"] = tuple(unpack_layer(layer) for layer in params["layers"])
    if not cfg.tie_word_embeddings:
        out["lm_head"] = kernels.unpack(params["lm_head"])
    return out


def is_packed(params: Params) -> bool:
    return isinstance(params.get("lm_head"), kernels.PackedWeight)


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in key.split(".")]


def _short(names: list[str], n: int = 4) -> str:
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more
