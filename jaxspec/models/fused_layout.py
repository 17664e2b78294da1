"""The "fused" layout: the accelerator layout of the Llama family. Per-layer arrays (as
"unrolled") with the q/k/v projections concatenated into one "wqkv" `[(N + 2K) * H, D]` weight
and gate/up into one "w_gate_up" `[2F, D]`, so a layer runs two projections where it ran five:
one weight stream and one kernel each on a GPU, where a one-token step is launch bound.

Built from the checkpoint's separate weights at load time only (`fuse`), and split back for
anything that reads a layer's plain weights (`split_layer`): checkpoints, the CPU path and the
other families' param trees never see it. The split after the projection is exact (each output
row is the same dot product as before). One device or a data-parallel mesh: the fused rows mix
q/k/v heads, so a model-sharded mesh keeps the separate weights ("unrolled").

Dimension letters: N query heads, K kv heads, H head dim, D model dim, F mlp dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.models import blocks, gemv_gpu

Params = dict[str, Any]
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_layer(layer: Params) -> Params:
    """One layer's plain weights -> the fused ones (a group only where all its parts are there:
    an MoE layer has no gate/up)."""
    out = dict(layer)
    for fused, parts in FUSED.items():
        if all(p in layer for p in parts):
            out[fused] = jnp.concatenate([layer[p] for p in parts], axis=0)
            for p in parts:
                del out[p]
    return out


def fuse(params: Params) -> Params:
    """Per-layer ("unrolled") params -> the fused layout."""
    layers = params["layers"]
    if not isinstance(layers, tuple):
        raise ValueError("the fused layout is built from per-layer (unrolled) params")
    return params | {"layers": tuple(fuse_layer(lp) for lp in layers)}


def split_layer(layer: Params, qkv_splits: tuple[int, int]) -> Params:
    """A fused layer's plain `[out, in]` weights (wq/wk/wv, w_gate/w_up); other layers as they are."""
    out = {k: w for k, w in layer.items() if k not in FUSED}
    if "wqkv" in layer:
        out["wq"], out["wk"], out["wv"] = jnp.split(layer["wqkv"], qkv_splits)
    if "w_gate_up" in layer:
        out["w_gate"], out["w_up"] = jnp.split(layer["w_gate_up"], 2)
    return out


def is_fused(params: Params) -> bool:
    """True for plain-array fused layers (the packed CPU layout also holds "wqkv", as panels)."""
    layers = params["layers"]
    return (isinstance(layers, tuple) and "wqkv" in layers[0]
            and not isinstance(layers[0]["wqkv"], kernels.PackedWeight))


def is_fused_layer(layer: Params) -> bool:
    """True for one layer of the fused layout (plain-array "wqkv"; not the CPU's packed panels)."""
    return "wqkv" in layer and not isinstance(layer["wqkv"], kernels.PackedWeight)


def normed_linear(x: jax.Array, norm_w: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """rms_norm(x, norm_w) @ w.T as the fused layout runs it: x [..., D], w [out, D] -> [..., out]
    in x's dtype. The norm's per-row scale rsqrt(mean(x^2) + eps) multiplies the projection's f32
    sums instead of x (the same product: the dot is linear), so the norm is one fusion (the sum
    of squares beside x * norm_w in the projection's dtype) and the scale rides in the
    projection's epilogue: on a GPU at batch 1 the norm was a reduce kernel and a scale kernel
    before each projection. Rounding: x * norm_w is rounded to x's dtype where the plain norm
    rounds x * scale * norm_w (one bf16 rounding either way; exact in float32 up to order).
    The sum of squares is `blocks.row_sum` (fixed order on the CPU)."""
    x32 = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(blocks.row_sum(x32 * x32) / x.shape[-1] + eps)  # [..., 1]
    xw = (x32 * norm_w.astype(jnp.float32)).astype(x.dtype)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    out = jax.lax.dot_general(xw, w, dims, preferred_element_type=jnp.float32)  # f32 sums
    return (out * scale).astype(x.dtype)


def _one_token(kernel, xla, x, w):
    """kernel() where a GPU runs this one-token projection (models/gemv_gpu.py), else xla()."""
    return gemv_gpu.on_gpu(kernel, xla) if gemv_gpu.takes(x, w) else xla()


def normed_projection(x: jax.Array, norm_w: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """`normed_linear`; one token on a GPU: one Pallas kernel with the norm inside."""
    return _one_token(lambda: gemv_gpu.normed_gemv(x, norm_w, w, eps),
                      lambda: normed_linear(x, norm_w, w, eps), x, w)


def gated_mlp_input(x: jax.Array, norm_w: jax.Array, w_gate_up: jax.Array, eps: float) -> jax.Array:
    """silu(gate) * up of rms_norm(x) @ w_gate_up.T: x [..., D] -> [..., F] (the down
    projection's input); one token on a GPU: one kernel (norm, both halves, SiLU * up)."""
    def xla():
        gate, up = jnp.split(normed_linear(x, norm_w, w_gate_up, eps), 2, axis=-1)
        return jax.nn.silu(gate) * up

    return _one_token(lambda: gemv_gpu.gated_normed_gemv(x, norm_w, w_gate_up, eps), xla,
                      x, w_gate_up)


def residual_projection(x: jax.Array, w: jax.Array, res: jax.Array) -> jax.Array:
    """res + x @ w.T (the attention output and down projections); one token on a GPU: one
    kernel with the add inside."""
    def xla():
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
        return res + y.astype(x.dtype)

    return _one_token(lambda: gemv_gpu.residual_gemv(x, w, res), xla, x, w)


def layer_axes(layer_axes: Params) -> Params:
    """Logical axes of a fused layer from the plain layer's: the fused output rows mix heads
    (q/k/v) or halves (gate/up), so they are replicated over "model"."""
    out = {k: v for k, v in layer_axes.items() if not any(k in p for p in FUSED.values())}
    for fused, parts in FUSED.items():
        if all(p in layer_axes for p in parts):
            out[fused] = (None, "embed")
    return out
