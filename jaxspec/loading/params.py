"""Flat tensors from any checkpoint format -> the param pytree of `jaxspec.models.llama`.

Format readers hand over `{"embed": a, "final_norm": a, "layers.3.wq": a, ...}` (numpy or jax
arrays in `[out, in]` layout). This module checks the set of names and every shape against
`param_shapes(cfg)`, casts to the compute dtype and puts each leaf on the default device.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from jaxspec import kernels
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import ModelConfig, Params, qkv_splits, param_shapes, stack_layers

DTYPES = ("float32", "bfloat16", "float16", "auto")
ACCELERATORS = ("tpu", "gpu")
LAYOUTS = ("auto", "unrolled", "stacked", "packed")
LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # packed by layout="packed"


def check_options(dtype: str, layout: str) -> None:
    if dtype not in DTYPES:
        raise JaxspecError(f"unsupported dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if layout not in LAYOUTS:
        raise JaxspecError(
            f"unsupported layout {layout!r}: use 'auto', 'unrolled' (per-layer arrays), "
            f"'packed' (per-layer, CPU panel kernel) or 'stacked' ([L, ...] arrays for lax.scan)"
        )
    if layout == "packed" and dtype not in ("float32", "auto"):
        raise JaxspecError(f"layout 'packed' needs dtype float32, got {dtype}: use layout 'unrolled'")


def resolve_dtype(dtype: str) -> str:
    """"auto": bfloat16 on an accelerator (TPU/GPU), float32 on CPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if jax.default_backend() in ACCELERATORS else "float32"


def resolve_layout(layout: str, dtype: str) -> str:
    """"auto": "packed" where the CPU panel kernel runs (float32, one CPU device), "stacked" on an
    accelerator (lax.scan over layers: one compiled layer, the cache updated in place), else
    "unrolled"."""
    if layout != "auto":
        if layout == "packed" and not kernels.available():
            raise JaxspecError(
                "layout 'packed' needs the CPU panel kernel, which is unavailable here (a CPU "
                "backend and g++ are needed): use layout 'unrolled'"
            )
        return layout
    if jax.default_backend() in ACCELERATORS:
        return "stacked"
    single_cpu = jax.default_backend() == "cpu" and jax.device_count() == 1
    return "packed" if dtype == "float32" and single_cpu and kernels.available() else "unrolled"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = param_shapes(cfg)
    flat = {k: v for k, v in shapes.items() if k != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        flat |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    return flat


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
    layers = tuple(
        {k.split(".", 2)[2]: flat[k] for k in want if k.startswith(f"layers.{i}.")}
        for i in range(cfg.num_layers)
    )
    params: Params = {k: flat[k] for k in want if not k.startswith("layers.")}
    params["layers"] = layers
    return params


def place(params: Params, dtype: str, layout: str) -> Params:
    """Cast every leaf to `dtype` (on the host for numpy inputs) and put it on the device."""
    np_dtype = np.dtype(jax.numpy.dtype(dtype))

    def put(x):
        if isinstance(x, np.ndarray):
            x = np.ascontiguousarray(x, dtype=np_dtype)
        return jax.device_put(x).astype(np_dtype)

    params = jax.tree.map(put, params)
    if layout == "stacked":
        return stack_layers(params)
    return pack_params(params) if layout == "packed" else params


def pack_params(params: Params) -> Params:
    """Per-layer params -> the "packed" layout: matmul weights as `PackedWeight` panels, q/k/v
    fused into "wqkv" and gate/up into "w_gate_up" (fewer, longer weight streams per layer).

    A tied LM head gets its own packed copy (the embedding table stays for the token lookup).
    """

    def pack_layer(layer):
        rest = {k: w for k, w in layer.items() if k not in LINEAR_KEYS}
        fused = {
            "wqkv": np.concatenate([np.asarray(layer[k]) for k in ("wq", "wk", "wv")]),
            "w_gate_up": np.concatenate([np.asarray(layer[k]) for k in ("w_gate", "w_up")]),
            "wo": layer["wo"],
            "w_down": layer["w_down"],
        }
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
