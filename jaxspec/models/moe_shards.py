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
            `moe.experts_dense`) or one grouped matmul per projection (`grouped`: on TPU the
            Pallas kernel reading each expert in place, on GPU `ragged_dot_general`), pairs
            routed elsewhere weighted zero.

Placement follows the rules table (`sharding.ShardingRules`, set for the trace by
`expert_placement`, as the decode loop does): the experts split over the axis `experts` names
("model" by default), the tokens over the axis `batch` names ("data") where it divides them.
Where both name the same axis (experts over "data"), each device needs every token of its
expert group: the block gathers the tokens over that axis on entry and reduce-scatters the
output back to the rows' own devices (one all-gather of [N, D], one reduce-scatter), so what
leaves the block is placed as the rules place the batch. Axes the rules name for neither hold
copies (the tokens replicated there, as the activations are between layers).

Dimension letters: N tokens, E experts (El on one device), k experts per token, F expert
width, D model dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec import hlo
from jaxspec.models import attention_kernels

EXPERTS_MESH_AXIS = "model"  # sharding.ShardingRules.experts' default names the same axis


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Where the per-shard block puts experts and tokens: mesh axis names (None: not split)."""

    experts: str | None = EXPERTS_MESH_AXIS  # whole experts split over this axis
    tokens: str | None = "data"  # routed tokens (the batch rows) split over this axis


_PLACEMENT: contextvars.ContextVar = contextvars.ContextVar(
    "jaxspec_expert_placement", default=ExpertPlacement())


@contextlib.contextmanager
def expert_placement(rules):
    """Trace under the rules table's placement: `rules` a `sharding.ShardingRules` (its
    `experts` and `batch` axes) or None (the defaults). Trace-time only, like `kernel_mesh`."""
    placement = ExpertPlacement() if rules is None else ExpertPlacement(rules.experts, rules.batch)
    token = _PLACEMENT.set(placement)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


def current_placement() -> ExpertPlacement:
    """The placement `expert_placement` set for the program being traced."""
    return _PLACEMENT.get()
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
                   act=jax.nn.silu, num_experts: int | None = None) -> jax.Array:
    """x [N, D], routed (weights [N, k], experts int32[N, k], global ids) -> [N, D]: the part of
    each token's output from the experts in p (`[El, ...]` leaves, global ids first ..), each
    woken one read once by a loop of data-dependent length. The loop states its expected trip
    count (uniform routing over `num_experts`, all experts: El of them woken as E would be) in
    its name scope, which `hlo.device_bytes` reads."""
    local = p["we_gate"].shape[0]
    combine = combine_matrix(weights.astype(x.dtype), experts, first, local)  # [N, El]
    ids, count = woken_local(experts, first, local)

    def one_expert(i, out):  # out [N, D]
        j = ids[i]
        w = lambda name: jax.lax.dynamic_index_in_dim(p[name], j, keepdims=False).astype(x.dtype)  # noqa: E731
        h = act(x @ w("we_gate").T) * (x @ w("we_up").T)  # [N, F]
        scale = jax.lax.dynamic_index_in_dim(combine, j, axis=1)  # [N, 1]
        return out + (h @ w("we_down").T) * scale

    n, k = experts.shape
    total = num_experts or local
    expected = local * (1.0 - (1.0 - min(k / total, 1.0)) ** n)  # moe.experts_woken's share
    with jax.named_scope(hlo.expected_trips_scope(expected)):
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
    g = lambda r, name: grouped(r, p[name], sizes, platform)  # noqa: E731
    h = act(g(rows, "we_gate")) * g(rows, "we_up")  # [N*k, F]
    out = g(h, "we_down")  # [N*k, D]
    pairs = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    mine = (slot < local).reshape(n, k).astype(x.dtype)
    return jnp.einsum("nkd,nk->nd", pairs, weights.astype(x.dtype) * mine)


def grouped(rows: jax.Array, w: jax.Array, sizes: jax.Array, platform: str = "gpu") -> jax.Array:
    """rows [M, I] sorted by group, w [G, O, I] (torch layout, contracted on its last dim, not
    transposed first), sizes int32[G] -> [M, O]; rows past sum(sizes) come out zero. On TPU
    (and "interpret": the same kernel run on CPU, for tests) the Pallas grouped matmul
    (megablox `gmm`, `transpose_rhs`) reads each expert's [O, I] tiles in place; XLA:TPU's
    `ragged_dot` first copies the whole weight to [G, I, O] (3x the weight bytes a prompt block
    moved, BENCHMARKS). Elsewhere `ragged_dot_general` contracting I."""
    if platform in ("tpu", "interpret"):
        return _gmm(rows, w.astype(rows.dtype), sizes, interpret=platform == "interpret")
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(rows, w.astype(rows.dtype), sizes, dims)


GMM_TILE = 128  # the kernel's row tile: rows pad to a multiple of it


def _gmm(rows: jax.Array, w: jax.Array, sizes: jax.Array, interpret: bool) -> jax.Array:
    """megablox gmm over rows [M, I], w [G, O, I] -> [M, O], rows past sum(sizes) zero."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # TPU-only kernel, loaded on use

    m = rows.shape[0]
    tm = min(GMM_TILE, -(-m // 8) * 8)
    padded = -(-m // tm) * tm
    lhs = jnp.pad(rows, ((0, padded - m), (0, 0)))
    tiling = (tm, min(GMM_TILE, w.shape[2]), min(GMM_TILE, w.shape[1]))
    out = gmm(lhs, w, sizes, preferred_element_type=rows.dtype, tiling=tiling,
              transpose_rhs=True, interpret=interpret)[:m]
    return jnp.where((jnp.arange(m) < sizes.sum())[:, None], out, 0)


def experts_axis(mesh, num_experts: int, axis: str | None = EXPERTS_MESH_AXIS) -> str | None:
    """The mesh axis the experts split over here (`axis`, the rules table's), or None (no mesh,
    no such axis, or it is 1 or does not divide the experts: the block runs as one device)."""
    if mesh is None or axis is None or axis not in mesh.shape:
        return None
    size = mesh.shape[axis]
    return axis if size > 1 and num_experts % size == 0 else None


def run_experts_on_shards(p, x: jax.Array, weights: jax.Array, experts: jax.Array, mesh,
                          axis: str, tokens: str | None = "data", act=jax.nn.silu,
                          path: str | None = None) -> jax.Array:
    """`moe.run_experts` with the experts split over `axis` of `mesh`: each device its own
    experts on its tokens ("looped" for few pairs, else "local"), one psum over `axis` (a
    reduce-scatter back to the rows' devices where `tokens` names `axis` too).
    x [N, D], weights [N, k], experts int32[N, k] -> [N, D]."""
    n = experts.shape[0]
    path = path or ("looped" if n <= LOOPED_MAX_TOKENS else "local")
    platform = mesh.devices.flat[0].platform
    run = (functools.partial(experts_looped, num_experts=p["we_gate"].shape[0])
           if path == "looped" else functools.partial(experts_local, platform=platform))
    split = lambda a: a in mesh.shape and mesh.shape[a] > 1 and n % mesh.shape[a] == 0  # noqa: E731
    rows = tokens if tokens != axis and split(tokens) else None  # tokens split there
    scatter = tokens == axis and split(axis)  # gathered in, reduce-scattered out

    def shard(pe, xs, ws, es):
        first = jax.lax.axis_index(axis) * pe["we_gate"].shape[0]
        out = run(pe, xs, ws, es, first, act)
        if scatter:
            return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
        return jax.lax.psum(out, axis)

    leaves = {name: p[name] for name in EXPERT_LEAVES}
    tok = P(rows, None)
    return jax.shard_map(shard, mesh=mesh, check_vma=False, out_specs=P(axis) if scatter else tok,
                         in_specs=({name: P(axis, None, None) for name in leaves}, tok, tok, tok),
                         )(leaves, x, weights, experts)


def mesh_axis_for(num_experts: int) -> tuple[object, str, str | None] | None:
    """(mesh, experts axis, tokens axis) when the program being traced runs on a mesh whose
    rules-table experts axis splits `num_experts`, else None."""
    mesh = attention_kernels.trace_mesh()
    placement = current_placement()
    axis = experts_axis(mesh, num_experts, placement.experts)
    return None if axis is None else (mesh, axis, placement.tokens)
