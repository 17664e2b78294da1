"""One-token projections of the fused layout as Pallas (Triton) GEMV kernels on a GPU, each with
the elementwise work around it folded in, so a decode layer at batch 1 launches fewer kernels.

XLA:GPU runs a one-token projection as a split-K GEMM fusion (partial sums in f32, summed by the
next kernel) and keeps the RMS norm before it, the SiLU * up between gate/up and down, and each
residual add as kernels of their own: 15 kernels a layer, and a one-token step is launch bound on
an H100/H200. Here one Triton program reads a block of a weight's output rows whole (the dot
product over the model dim in a loop of `BLOCK_K` columns, f32 sums) and

  normed_gemv         rms_norm(x) @ w.T: the norm's scale (the sum of squares of x, recomputed
                      by each program from the one row) multiplies the f32 sums, as
                      `fused_layout.normed_linear` does: the q/k/v projection;
  gated_normed_gemv   silu(gate) * up of rms_norm(x) @ w_gate_up.T: each program reads the same
                      output rows of both halves, so the MLP's activation never leaves the chip;
  residual_gemv       res + x @ w.T: the attention output and down projections with their
                      residual adds.

Used only where a program is lowered for CUDA (`lax.platform_dependent`), at one token (batch x
window == 1), bfloat16 or float32 weights; every other case (and JAXSPEC_GPU_GEMV=0) runs the
XLA path, which these match up to the sums' order (tests run both on the CPU in Pallas interpret
mode). Rounding: as the XLA path, f32 sums rounded once to x's dtype, then the elementwise op in
x's dtype.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

ENV_SWITCH = "JAXSPEC_GPU_GEMV"  # "0": the XLA path on GPU too (A/B measurements)
BLOCK_ROWS = 16  # output rows per program: 6144 q/k/v rows of an 8B layer -> 384 programs
BLOCK_K = 256  # model-dim columns per loop trip ([16, 256] bf16 = 8 KB a trip per program), or
# the largest power of two under it dividing the model dim (SmolLM2's 576: 64)
WARPS = 4


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def takes(x: jax.Array, w: jax.Array) -> bool:
    """True where the kernels run this projection: one token, a row count and model dim in whole
    blocks."""
    rows, d = w.shape[-2:]
    return (enabled() and x.size == x.shape[-1] and rows % BLOCK_ROWS == 0
            and block_k(d) > 0 and x.dtype in (jnp.bfloat16, jnp.float32))


def block_k(d: int) -> int:
    """Columns a loop trip reads: a power of two (Triton's blocks) dividing d; 0 if none >= 16."""
    return next((k for k in (BLOCK_K, 128, 64, 32, 16) if d % k == 0), 0)


def on_gpu(kernel_fn, xla_fn):
    """kernel_fn where the program is lowered for a GPU, xla_fn elsewhere (both take no args)."""
    return jax.lax.platform_dependent(cuda=kernel_fn, rocm=kernel_fn, default=xla_fn)


def _dot_rows(x_ref, nw_ref, w_ref, d: int, halves: int = 0):
    """(f32 sums of w's block rows against x (times nw), sum of x^2) in one pass over the model
    dim: w_ref's block [R, D] -> ([R], ()), or with halves=2 its [2, R, D] -> ([R], [R], ())
    (Triton slices refs, not loaded values; every load a power of two long)."""
    from jax.experimental import pallas as pl

    bk = block_k(d)

    def trip(j, carry):
        cols = pl.ds(j * bk, bk)
        xk = x_ref[cols].astype(jnp.float32)
        ssq = carry[-1] + jnp.sum(xk * xk)
        if nw_ref is not None:  # x * norm_w rounded to x's dtype, as fused_layout.normed_linear
            xk = (xk * nw_ref[cols].astype(jnp.float32)).astype(x_ref.dtype).astype(jnp.float32)
        ws = [w_ref[:, cols]] if not halves else [w_ref[h, :, cols] for h in range(halves)]
        sums = [acc + jnp.sum(w.astype(jnp.float32) * xk[None, :], axis=1)
                for acc, w in zip(carry[:-1], ws)]
        return (*sums, ssq)

    zeros = jnp.zeros((BLOCK_ROWS,), jnp.float32)
    return jax.lax.fori_loop(0, d // bk, trip, (zeros,) * max(1, halves) + (jnp.float32(0),))


def _scale(ssq, d: int, eps: float):
    return jax.lax.rsqrt(ssq / d + eps)


def _normed_kernel(x_ref, nw_ref, w_ref, o_ref, *, d, eps):
    acc, ssq = _dot_rows(x_ref, nw_ref, w_ref, d)
    o_ref[...] = (acc * _scale(ssq, d, eps)).astype(o_ref.dtype)


def _gated_kernel(x_ref, nw_ref, w_ref, o_ref, *, d, eps):
    gate, up, ssq = _dot_rows(x_ref, nw_ref, w_ref, d, halves=2)
    gate, up = ((v * _scale(ssq, d, eps)).astype(o_ref.dtype).astype(jnp.float32)
                for v in (gate, up))
    o_ref[...] = (gate * jax.nn.sigmoid(gate) * up).astype(o_ref.dtype)


def _residual_kernel(x_ref, w_ref, r_ref, o_ref, *, d):
    y = _dot_rows(x_ref, None, w_ref, d)[0].astype(o_ref.dtype)
    o_ref[...] = (r_ref[...].astype(jnp.float32) + y.astype(jnp.float32)).astype(o_ref.dtype)


def _call(kernel, args, specs, rows: int, out_dtype, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl.pallas_call(
        kernel, grid=(rows // BLOCK_ROWS,), in_specs=specs,
        out_specs=pl.BlockSpec((BLOCK_ROWS,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((rows,), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=2),
        interpret=interpret, name="jaxspec_gemv")(*args)


def _blocks(shape, index_map):
    from jax.experimental import pallas as pl  # imported where a kernel is built (start-up)

    return pl.BlockSpec(shape, index_map)


def _whole(n: int):
    return _blocks((n,), lambda i: (0,))


def normed_gemv(x, norm_w, w, eps: float, interpret: bool = False):
    """x [..., D] (one token), norm_w [D], w [O, D] -> rms_norm(x) @ w.T [..., O] in x's dtype."""
    o, d = w.shape
    kernel = functools.partial(_normed_kernel, d=d, eps=eps)
    specs = [_whole(d), _whole(d), _blocks((BLOCK_ROWS, d), lambda i: (i, 0))]
    out = _call(kernel, (x.reshape(d), norm_w, w), specs, o, x.dtype, interpret)
    return out.reshape(*x.shape[:-1], o)


def gated_normed_gemv(x, norm_w, w_gate_up, eps: float, interpret: bool = False):
    """x [..., D], w_gate_up [2F, D] (gate rows, then up rows) -> silu(gate) * up [..., F]."""
    f2, d = w_gate_up.shape
    f = f2 // 2
    kernel = functools.partial(_gated_kernel, d=d, eps=eps)
    specs = [_whole(d), _whole(d), _blocks((2, BLOCK_ROWS, d), lambda i: (0, i, 0))]
    out = _call(kernel, (x.reshape(d), norm_w, w_gate_up.reshape(2, f, d)), specs, f, x.dtype,
                interpret)
    return out.reshape(*x.shape[:-1], f)


def residual_gemv(x, w, res, interpret: bool = False):
    """x [..., D] (one token), w [O, D], res [..., O] -> res + x @ w.T in res's dtype."""
    o, d = w.shape
    kernel = functools.partial(_residual_kernel, d=d)
    specs = [_whole(d), _blocks((BLOCK_ROWS, d), lambda i: (i, 0)),
             _blocks((BLOCK_ROWS,), lambda i: (i,))]
    out = _call(kernel, (x.reshape(d), w, res.reshape(o)), specs, o, res.dtype, interpret)
    return out.reshape(res.shape)

