"""Small-batch projections of the fused layout as Pallas (Triton) GEMV kernels on a GPU, each
with the elementwise work around it folded in, so a decode layer at batch 1 launches fewer kernels.

XLA:GPU runs a one-token projection as a split-K GEMM fusion (partial sums in f32, summed by the
next kernel) and keeps the RMS norm before it, the SiLU * up between gate/up and down, and each
residual add as kernels of their own: 15 kernels a layer, and a one-token step is launch bound on
an H100/H200. Here one Triton program reads a block of BLOCK_ROWS output rows of a weight whole
(a loop over the model dim, `block_k` columns a trip) against up to TOKENS token rows (a Triton
dot, f32 sums; token rows past x's are masked padding), and

  normed_gemv         rms_norm(x) @ w.T: each token's norm scale (its sum of squares, taken in
                      the same loop) multiplies the f32 sums, as `fused_layout.normed_linear`
                      does: the q/k/v projection;
  gated_normed_gemv   silu(gate) * up of rms_norm(x) @ w_gate_up.T: each program reads the same
                      output rows of both halves, so the MLP's activation never leaves the chip;
  residual_gemv       res + x @ w.T: the attention output and down projections with their
                      residual adds.

Used only where a program is lowered for CUDA (`lax.platform_dependent`), at batch x window <=
TOKENS, bfloat16 or float32 weights; every other case (and JAXSPEC_GPU_GEMV=0) runs the XLA path,
which these match up to the sums' order (tests run both on the CPU in Pallas interpret mode).
Rounding: as the XLA path, f32 sums rounded once to x's dtype, then the elementwise op; a decode
step and a verify window run the same dot, so their projections round alike.
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
TOKENS = 16  # token rows (batch x window) one kernel takes: Triton's smallest dot
WARPS = 4


def enabled() -> bool:
    """JAXSPEC_GPU_GEMV: "1" (default) the kernels, "0" the XLA path; anything else refused."""
    value = os.environ.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: set it to 0 (XLA's projections) or 1 (the "
                         "GPU kernels, the default)")
    return value == "1"


def takes(x: jax.Array, w: jax.Array) -> bool:
    """True where the kernels run this projection: at most TOKENS rows (batch x window), a weight
    row count and model dim in whole blocks."""
    rows, d = w.shape[-2:]
    return (enabled() and x.size // x.shape[-1] <= TOKENS and rows % BLOCK_ROWS == 0
            and block_k(d) > 0 and x.dtype in (jnp.bfloat16, jnp.float32))


def block_k(d: int) -> int:
    """Columns a loop trip reads: a power of two (Triton's blocks) dividing d; 0 if none >= 16."""
    return next((k for k in (BLOCK_K, 128, 64, 32, 16) if d % k == 0), 0)


def on_gpu(kernel_fn, xla_fn):
    """kernel_fn where the program is lowered for a GPU, xla_fn elsewhere (both take no args)."""
    return jax.lax.platform_dependent(cuda=kernel_fn, rocm=kernel_fn, default=xla_fn)


def _dot_rows(x_ref, nw_ref, w_ref, d: int, halves: int = 0):
    """(f32 sums of each token row of x (times nw) against w's block rows [TOKENS, R], each
    token's sum of x^2 [TOKENS]) in one pass over the model dim: w_ref's block [R, D], or with
    halves=2 its [2, R, D] -> two sums (Triton slices refs, not loaded values). The sums are
    Triton dots (f32 accumulation) whatever the token count, so one token and a window round
    alike; token rows past x's are padding, never stored."""
    from jax.experimental import pallas as pl

    bk = block_k(d)
    exact = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def trip(j, carry):
        cols = pl.ds(j * bk, bk)
        x32 = x_ref[:, cols].astype(jnp.float32)  # [TOKENS, bk]
        ssq = carry[-1] + jnp.sum(x32 * x32, axis=1)
        if nw_ref is not None:  # x * norm_w rounded to x's dtype, as fused_layout.normed_linear
            x32 = x32 * nw_ref[cols].astype(jnp.float32)[None, :]
        xk = x32.astype(x_ref.dtype)
        ws = [w_ref[:, cols]] if not halves else [w_ref[h, :, cols] for h in range(halves)]
        sums = [acc + jax.lax.dot_general(xk, w, (((1,), (1,)), ((), ())), precision=exact,
                                          preferred_element_type=jnp.float32)
                for acc, w in zip(carry[:-1], ws)]
        return (*sums, ssq)

    zeros = jnp.zeros((TOKENS, BLOCK_ROWS), jnp.float32)
    return jax.lax.fori_loop(0, d // bk, trip,
                             (zeros,) * max(1, halves) + (jnp.zeros((TOKENS,), jnp.float32),))


def _scale(ssq, d: int, eps: float):
    return jax.lax.rsqrt(ssq / d + eps)[:, None]  # [TOKENS, 1]


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

    m = args[0].shape[0]  # token rows (<= TOKENS: one block, the rest masked)
    return pl.pallas_call(
        kernel, grid=(rows // BLOCK_ROWS,), in_specs=specs,
        out_specs=pl.BlockSpec((TOKENS, BLOCK_ROWS), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((m, rows), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=2),
        interpret=interpret, name="jaxspec_gemv")(*args)


def _blocks(shape, index_map):
    from jax.experimental import pallas as pl  # imported where a kernel is built (start-up)

    return pl.BlockSpec(shape, index_map)


def _tokens(d: int):
    return _blocks((TOKENS, d), lambda i: (0, 0))


def _vector(d: int):
    return _blocks((d,), lambda i: (0,))


def normed_gemv(x, norm_w, w, eps: float, interpret: bool = False):
    """x [..., D] (<= TOKENS rows), norm_w [D], w [O, D] -> rms_norm(x) @ w.T [..., O] in x's
    dtype."""
    o, d = w.shape
    kernel = functools.partial(_normed_kernel, d=d, eps=eps)
    specs = [_tokens(d), _vector(d), _blocks((BLOCK_ROWS, d), lambda i: (i, 0))]
    out = _call(kernel, (x.reshape(-1, d), norm_w, w), specs, o, x.dtype, interpret)
    return out.reshape(*x.shape[:-1], o)


def gated_normed_gemv(x, norm_w, w_gate_up, eps: float, interpret: bool = False):
    """x [..., D], w_gate_up [2F, D] (gate rows, then up rows) -> silu(gate) * up [..., F]."""
    f2, d = w_gate_up.shape
    f = f2 // 2
    kernel = functools.partial(_gated_kernel, d=d, eps=eps)
    specs = [_tokens(d), _vector(d), _blocks((2, BLOCK_ROWS, d), lambda i: (0, i, 0))]
    out = _call(kernel, (x.reshape(-1, d), norm_w, w_gate_up.reshape(2, f, d)), specs, f,
                x.dtype, interpret)
    return out.reshape(*x.shape[:-1], f)


def residual_gemv(x, w, res, interpret: bool = False):
    """x [..., D] (<= TOKENS rows), w [O, D], res [..., O] -> res + x @ w.T in res's dtype."""
    o, d = w.shape
    kernel = functools.partial(_residual_kernel, d=d)
    specs = [_tokens(d), _blocks((BLOCK_ROWS, d), lambda i: (i, 0)),
             _blocks((TOKENS, BLOCK_ROWS), lambda i: (0, i))]
    out = _call(kernel, (x.reshape(-1, d), w, res.reshape(-1, o)), specs, o, res.dtype,
                interpret)
    return out.reshape(res.shape)
