"""Routed experts per shard over a mesh: each device runs the experts it holds for the tokens
routed to them, and one all-reduce of the [N, D] output combines the devices. No expert weight
moves between devices.

Under GSPMD alone, `moe.experts_gather` on experts split over a mesh axis gathers each (token,
slot) pair's expert from whichever device holds it, so every device reads (and receives) about
all N*k pairs' experts, not its share (2.4-9.9x its share on a v5e 1x4, session 28). Here the
block runs under `jax.shard_map` over the mesh the program is traced on
(`attention_kernels.trace_mesh`): each device sees its E/M experts (global ids `first` ..
`first + E/M - 1`), every token's routing, and its own batch rows where the data axis splits them.

Per device, two ways (static shapes, picked by the token count):

  "looped"  up to LOOPED_MAX_TOKENS tokens (decode, verify windows, trees): a loop over the
            distinct local experts the tokens woke (a data-dependent trip count, 0..E/M), each
            read once and run on every token, weighted by a combine matrix zero off the token's
            picks. A device reads only its woken experts: on average experts_woken(N) / M.
  "local"   more tokens (prompts): every local expert on every token (CPU, as
            `moe.experts_dense`) or one grouped matmul per projection (`ragged_dot_general`,
            accelerators; XLA:TPU's kernel copies the torch-layout weights to [E, in, out]
            first, cheap beside a prompt's FLOPs), pairs routed elsewhere weighted zero.

The experts axis is the rules table's (`sharding.ShardingRules.experts`, "model" by default:
`EXPERTS_MESH_AXIS`); other mesh axes split the tokens where they divide them.

Dimension letters: N tokens, E experts (El on one device), k experts per token, F expert
width, D model dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.models import attention_kernels

EXPERTS_MESH_AXIS = "model"  # sharding.ShardingRules.experts' default names the same axis
EXPERT_LEAVES = ("we_gate", "we_up", "we_down")
# The loop runs every token through each woken expert: N flops per weight byte, memory-bound
# below an accelerator's FLOPs/byte (v5e ~240, H200 ~200 in bf16); past it, grouped matmuls.
LOOPED_MAX_TOKENS = 128


def combine_matrix(weights: jax.Array, experts: jax.Array, first, local: int) -> jax.Array:
    """(weights [N, k], experts int32[N, k]) -> [N, El]: each token's router weight on each of
    the `local` experts first .. first + El - 1 (zero where the token did not pick it)."""
    n, k = experts.shape
    slot = experts - first
    slot = jnp.where((slot >= 0) & (slot < local), slot, local)  # local: out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k))
    return jnp.zeros((n, local), weights.dtype).at[rows, slot].add(weights, mode="drop")


def woken_local(experts: jax.Array, first, local: int) -> tuple[jax.Array, jax.Array]:
    """(ids int32[El], count int32[]): the distinct local experts (0-based on this device) any
    token picked, ascending, then padding; `count` of them are real."""
    slot = experts.reshape(-1) - first
    slot = jnp.where((slot >= 0) & (slot < local), slot, local)
    woken = jnp.zeros((local,), bool).at[slot].set(True, mode="drop")
    ids = jnp.nonzero(woken, size=local, fill_value=0)[0].astype(jnp.int32)
    return ids, woken.sum().astype(jnp.int32)


def experts_looped(p, x: jax.Array, weights: jax.Array, experts: jax.Array, first=0,
                   act=jax.nn.silu) -> jax.Array:
    """x [N, D], routed (weights [N, k], experts int32[N, k], global ids) -> [N, D]: the part of
    each token's output from the experts in p (`[El, ...]` leaves, global ids first ..), each
    woken one read once by a loop of data-dependent length."""
    local = p["we_gate"].shape[0]
    combine = combine_matrix(weights.astype(x.dtype), experts, first, local)  # [N, El]
    ids, count = woken_local(experts, first, local)

    def one_expert(i, out):  # out [N, D]
        j = ids[i]
        w = lambda name: jax.lax.dynamic_index_in_dim(p[name], j, keepdims=False).astype(x.dtype)  # noqa: E731
        h = act(x @ w("we_gate").T) * (x @ w("we_up").T)  # [N, F]
        scale = jax.lax.dynamic_index_in_dim(combine, j, axis=1)  # [N, 1]
        return out + (h @ w("we_down").T) * scale

    return jax.lax.fori_loop(0, count, one_expert, jnp.zeros_like(x))


def experts_local(p, x: jax.Array, weights: jax.Array, experts: jax.Array, first=0,
                  act=jax.nn.silu, platform: str = "cpu") -> jax.Array:
    """The same as `experts_looped` reading every local expert once: the dense path on CPU
    (`platform`: the mesh's devices', which a program compiled here for an accelerator is not
    the host's), else one grouped matmul per projection over the pairs routed here (the others sorted past
    the groups, where `ragged_dot` writes zeros)."""
    local = p["we_gate"].shape[0]
    if platform == "cpu":  # every local expert on every token (moe.experts_dense)
        combine = combine_matrix(weights.astype(x.dtype), experts, first, local)  # [N, El]
        h = act(jnp.einsum("nd,efd->nef", x, p["we_gate"].astype(x.dtype))) * jnp.einsum(
            "nd,efd->nef", x, p["we_up"].astype(x.dtype))
        return jnp.einsum("ne,nef,edf->nd", combine, h, p["we_down"].astype(x.dtype))
    n, k = experts.shape
    slot = experts.reshape(-1) - first  # [N*k]
    slot = jnp.where((slot >= 0) & (slot < local), slot, local)
    order = jnp.argsort(slot, stable=True)
    rows = x[order // k]  # [N*k, D]
    sizes = jnp.bincount(slot, length=local).astype(jnp.int32)  # [El], others past the groups
    h = act(grouped(rows, p["we_gate"], sizes)) * grouped(rows, p["we_up"], sizes)  # [N*k, F]
    out = grouped(h, p["we_down"], sizes)  # [N*k, D]
    pairs = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    mine = (slot < local).reshape(n, k).astype(x.dtype)
    return jnp.einsum("nkd,nk->nd", pairs, weights.astype(x.dtype) * mine)


def grouped(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """rows [M, I] sorted by group, w [G, O, I] (torch layout, contracted on its last dim, not
    transposed first), sizes int32[G] -> [M, O]; rows past sum(sizes) come out zero."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(rows, w.astype(rows.dtype), sizes, dims)


def experts_axis(mesh, num_experts: int) -> str | None:
    """The mesh axis the experts split over here, or None (no mesh, or the axis is 1 or does
    not divide the experts: the block runs as one device would)."""
    if mesh is None or EXPERTS_MESH_AXIS not in mesh.shape:
        return None
    size = mesh.shape[EXPERTS_MESH_AXIS]
    return EXPERTS_MESH_AXIS if size > 1 and num_experts % size == 0 else None


def run_experts_on_shards(p, x: jax.Array, weights: jax.Array, experts: jax.Array, mesh,
                          axis: str, act=jax.nn.silu, path: str | None = None) -> jax.Array:
    """`moe.run_experts` with the experts split over `axis` of `mesh`: each device its own
    experts on its tokens ("looped" for few pairs, else "local"), one psum over `axis`.
    x [N, D], weights [N, k], experts int32[N, k] -> [N, D]."""
    n = experts.shape[0]
    path = path or ("looped" if n <= LOOPED_MAX_TOKENS else "local")
    platform = mesh.devices.flat[0].platform
    run = experts_looped if path == "looped" else functools.partial(experts_local,
                                                                     platform=platform)
    others = tuple(a for a in mesh.axis_names if a != axis and mesh.shape[a] > 1)
    rows = others if others and n % _size(mesh, others) == 0 else None  # tokens split there

    def shard(pe, xs, ws, es):
        first = jax.lax.axis_index(axis) * pe["we_gate"].shape[0]
        return jax.lax.psum(run(pe, xs, ws, es, first, act), axis)

    leaves = {name: p[name] for name in EXPERT_LEAVES}
    tok = P(rows, None)
    return jax.shard_map(shard, mesh=mesh, check_vma=False, out_specs=tok,
                         in_specs=({name: P(axis, None, None) for name in leaves}, tok, tok, tok),
                         )(leaves, x, weights, experts)


def _size(mesh, axes) -> int:
    out = 1
    for a in axes:
        out *= mesh.shape[a]
    return out


def mesh_axis_for(num_experts: int) -> tuple[object, str] | None:
    """(mesh, axis) when the program being traced runs on a mesh whose experts axis splits
    `num_experts`, else None."""
    mesh = attention_kernels.trace_mesh()
    axis = experts_axis(mesh, num_experts)
    return None if axis is None else (mesh, axis)
