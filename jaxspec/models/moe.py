"""A routed mixture-of-experts MLP block as pure functions: top-k routing per token and the
experts each token picked, nothing computed for the experts no token woke.

Every token is routed on its own (softmax over the router logits, top-k, optionally renormed:
Qwen3-MoE's `norm_topk_prob`), so a verify window or a draft tree of T entries routes each entry
exactly as a one-token step would: speculation changes which experts a step wakes, never which
expert a token uses. Three ways to run the chosen experts, picked from static shapes:

  "gather"   few (token, expert) pairs (N*k < E: decode and short verify windows): each pair's
             expert weights are gathered and applied, reading N*k experts, never all E;
  "grouped"  many pairs on TPU/GPU (prompts, wide windows): pairs sorted by expert and run as one
             grouped matmul (`jax.lax.ragged_dot`), each expert's weights read once, each pair
             computed once (no E/k-fold dense compute);
  "dense"    many pairs on CPU: every expert on every token, combined by a matrix zero off the
             top k (XLA:CPU's ragged_dot is slower than that, BENCHMARKS.md).

The three agree to float rounding. Traced on a mesh whose experts axis (the rules table's,
`moe_shards.expert_placement`) splits the experts (`attention_kernels.kernel_mesh`, as the decode
loop traces), `run_experts` runs each device's own experts instead (`models/moe_shards.py`: no
expert weight leaves its device).

Params of one block (torch `Linear` layout, contracted on the last dim; E experts, F the expert
width, D the model dim):

    {"router": [E, D], "we_gate": [E, F, D], "we_up": [E, F, D], "we_down": [E, D, F]}
    and, with a shared expert (Qwen3.5-MoE, Qwen3-Next; every token runs it, scaled by
    sigmoid(ws_router . x)): {"ws_gate", "ws_up": [Fs, D], "ws_down": [D, Fs], "ws_router": [1, D]}

`experts_woken` is the expected number of distinct experts N routed tokens wake (what a verify
window costs on a memory-bound step, `decode/adaptive/calibration.py`); `active_weight_bytes` the expert
bytes a step of N tokens reads (roofline, step-cost model). `stack_expert_tensors` turns the
per-expert tensors checkpoints store into the `[E, ...]` leaves.

Dimension letters: N tokens (batch x window, flattened), E experts, k experts per token,
F expert width, D model dim.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.models import moe_shards

Params = dict[str, Any]

LAYER_KEYS = ("router", "we_gate", "we_up", "we_down")
# logical axes: experts split over a mesh axis (the rules table's "experts"); the expert width is
# not split as well (one mesh axis cannot cut two dims of a leaf)
LAYER_AXES = {
    "router": (None, "embed"),
    "we_gate": ("experts", None, "embed"),
    "we_up": ("experts", None, "embed"),
    "we_down": ("experts", "embed", None),
}


def layer_shapes(num_experts: int, expert_width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    e, f, d = num_experts, expert_width, hidden
    return {"router": (e, d), "we_gate": (e, f, d), "we_up": (e, f, d), "we_down": (e, d, f)}


SHARED_AXES = {"ws_gate": ("mlp", "embed"), "ws_up": ("mlp", "embed"), "ws_down": ("embed", "mlp"),
               "ws_router": (None, "embed")}


def shared_shapes(width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The shared expert of width `width` and its one-logit sigmoid gate."""
    f, d = width, hidden
    return {"ws_gate": (f, d), "ws_up": (f, d), "ws_down": (d, f), "ws_router": (1, d)}


def shared_expert(p: Params, x: jax.Array, act=jax.nn.silu) -> jax.Array:
    """x [N, D] -> sigmoid(ws_router . x) * down(act(gate x) * up x) [N, D]: every token's."""
    lin = lambda y, w: jnp.einsum("nd,fd->nf", y, w.astype(y.dtype))  # noqa: E731
    h = lin(act(lin(x, p["ws_gate"])) * lin(x, p["ws_up"]), p["ws_down"])
    gate = jax.nn.sigmoid(lin(x, p["ws_router"]).astype(jnp.float32)).astype(x.dtype)  # [N, 1]
    return h * gate


def route(router: jax.Array, x: jax.Array, top_k: int, norm_topk: bool):
    """router [E, D], x [N, D] -> (weights [N, k] in x's dtype, experts int32[N, k]), highest
    first: `top_k_of` the softmax of the router logits (float32)."""
    logits = jax.lax.dot_general(x, router.astype(x.dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [N, E]
    weights, experts = top_k_of(jax.nn.softmax(logits, axis=-1), top_k, norm_topk)
    return weights.astype(x.dtype), experts


def top_k_of(probs: jax.Array, top_k: int, norm_topk: bool):
    """probs f32[N, E] -> (weights f32[N, k], experts int32[N, k]): the k largest, renormed to
    sum 1 when `norm_topk` (Qwen3-MoE's norm_topk_prob; Gemma 4 always)."""
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_gather(p: Params, x: jax.Array, experts: jax.Array, act=jax.nn.silu) -> jax.Array:
    """Each (token, slot) pair through its own expert: x [N, D], experts int32[N, k] ->
    [N, k, D]. Reads the N*k chosen experts' weights (a gather), none of the others."""
    wg, wu, wd = p["we_gate"][experts], p["we_up"][experts], p["we_down"][experts]  # [N, k, ...]
    h = act(jnp.einsum("nd,nkfd->nkf", x, wg.astype(x.dtype))) * jnp.einsum(
        "nd,nkfd->nkf", x, wu.astype(x.dtype))
    return jnp.einsum("nkf,nkdf->nkd", h, wd.astype(x.dtype))


def experts_grouped(p: Params, x: jax.Array, experts: jax.Array, act=jax.nn.silu) -> jax.Array:
    """The same as `experts_gather` by one grouped matmul per projection: the N*k pairs sorted
    by expert, `ragged_dot` over the [E, ...] weights with each expert's pair count, then put
    back in (token, slot) order. x [N, D], experts int32[N, k] -> [N, k, D]."""
    n, k = experts.shape
    e = p["we_gate"].shape[0]
    flat = experts.reshape(-1)  # [N*k], pair j = token j // k, slot j % k
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]  # [N*k, D], sorted by expert
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E]
    platform = jax.default_backend()
    g = lambda r, name: moe_shards.grouped(r, p[name], sizes, platform)  # noqa: E731
    h = act(g(rows, "we_gate")) * g(rows, "we_up")  # [N*k, F], weights read in their layout
    out = g(h, "we_down")  # [N*k, D]
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return unsorted.reshape(n, k, -1)


def experts_dense(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array,
                  act=jax.nn.silu) -> jax.Array:
    """Every expert on every token, combined by a [N, E] matrix zero off each token's top k:
    x [N, D] -> [N, D]. E/k times the pairs' FLOPs, but each expert's weights read once in plain
    dense matmuls (XLA:CPU runs these far faster than its `ragged_dot`); with the experts split
    over a mesh axis, each device runs its own and the combine is one all-reduce of [N, D]."""
    n, e = x.shape[0], p["we_gate"].shape[0]
    combine = jnp.zeros((n, e), x.dtype).at[jnp.arange(n)[:, None], experts].add(weights)
    h = act(jnp.einsum("nd,efd->nef", x, p["we_gate"].astype(x.dtype))) * jnp.einsum(
        "nd,efd->nef", x, p["we_up"].astype(x.dtype))
    return jnp.einsum("ne,nef,edf->nd", combine, h, p["we_down"].astype(x.dtype))


def path_for(tokens: int, top_k: int, num_experts: int) -> str:
    """The experts path a block of `tokens` routed tokens takes (static): "gather" while the
    pairs are fewer than the experts, else "grouped" on accelerators and "dense" on CPU (where
    `ragged_dot` measured 5-6x slower than the dense path at 64-256 tokens, BENCHMARKS.md)."""
    if tokens * top_k < num_experts:
        return "gather"
    return "dense" if jax.default_backend() == "cpu" else "grouped"


def run_experts(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array, *,
                act=jax.nn.silu, path: str | None = None) -> jax.Array:
    """x [N, D], routed (weights [N, k], experts int32[N, k]) -> [N, D]: each token the weighted
    sum of its experts' gated outputs (act(gate) * up, then down). "gather" and "grouped" sum
    the slots in router order; "dense" combines by a matrix. `path`: "gather" | "grouped" |
    "dense" | "looped" (None: on a mesh whose experts axis splits them, `moe_shards` per device; else
    `path_for` the token count)."""
    on_mesh = moe_shards.mesh_axis_for(p["we_gate"].shape[0]) if path is None else None
    if on_mesh is not None:  # traced on a mesh splitting the experts: each device its own
        mesh, axis, tokens = on_mesh
        return moe_shards.run_experts_on_shards(p, x, weights, experts, mesh, axis, tokens,
                                                act=act)
    path = path or path_for(x.shape[0], experts.shape[1], p["we_gate"].shape[0])
    weights = weights.astype(x.dtype)
    if path == "looped":  # each woken expert read once, in place (moe_shards, one device)
        return moe_shards.experts_looped(p, x, weights, experts, 0, act)
    if path == "dense":
        return experts_dense(p, x, weights, experts, act)
    run = experts_gather if path == "gather" else experts_grouped
    pairs = run(p, x, experts, act)  # [N, k, D]
    out = pairs[:, 0] * weights[:, :1]
    for slot in range(1, experts.shape[1]):  # a fixed order, whatever the path
        out = out + pairs[:, slot] * weights[:, slot : slot + 1]
    return out


def moe_block(p: Params, x: jax.Array, *, top_k: int, norm_topk: bool,
              path: str | None = None) -> jax.Array:
    """The routed SwiGLU MLP (Qwen3-MoE): x [..., D] -> [..., D], each token routed on its own
    by `route` and run through its top-k experts (`run_experts`), plus the shared expert where
    the block has one (`ws_*` leaves)."""
    shape = x.shape
    xs = x.reshape(-1, shape[-1])  # [N, D]
    weights, experts = route(p["router"], xs, top_k, norm_topk)
    out = run_experts(p, xs, weights, experts, path=path)
    if "ws_gate" in p:  # the shared expert (Qwen3.5-MoE), beside the routed ones
        out = out + shared_expert(p, xs)
    return out.reshape(shape)


def experts_woken(tokens: int, top_k: int, num_experts: int) -> float:
    """Expected distinct experts `tokens` tokens wake when each picks top_k of num_experts
    uniformly: E * (1 - (1 - k/E)^N). One token wakes k; a window of many wakes up to E."""
    if num_experts <= 0 or top_k <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** max(tokens, 0))


def active_weight_bytes(tokens: int, top_k: int, num_experts: int, expert_bytes: float) -> float:
    """Expected bytes of routed-expert weights one MoE layer reads for a step of `tokens` routed
    tokens (batch x window): `experts_woken` x one expert's bytes (gate, up and down). A
    memory-bound step's expert traffic: one decode token reads k experts, a wide verify window
    up to all E (the step-cost model and the roofline's active bytes use this)."""
    return experts_woken(tokens, top_k, num_experts) * expert_bytes


def window_cost_ratio(window: int, batch: int, top_k: int, num_experts: int,
                      expert_share: float) -> float:
    """Predicted memory-bound cost of a verify window of `window` tokens per row over a plain
    one-token step, batch `batch`: the expert bytes grow with the experts woken, the rest
    (attention, embeddings, dense layers: share 1 - expert_share of a plain step's bytes) stays.
    expert_share: the routed experts' share of a plain step's weight bytes (0..1)."""
    plain = experts_woken(batch, top_k, num_experts)
    if plain <= 0:
        return 1.0
    grown = experts_woken(batch * window, top_k, num_experts) / plain
    return (1.0 - expert_share) + expert_share * grown


_PER_EXPERT = re.compile(r"(.*\bwe_(?:gate|up|down))\.(\d+)")


def stack_expert_tensors(flat: dict, num_experts: int, width: int, source: str) -> dict:
    """`<prefix>we_gate.j` per-expert tensors -> `<prefix>we_gate` [E, ...] (and up, down); a
    fused `<prefix>we_gate_up` [E, 2F, D] split into gate and up. Every expert must be present."""
    out, per_expert = {}, {}
    for name, w in flat.items():
        m = _PER_EXPERT.fullmatch(name)
        if m:
            per_expert.setdefault(m.group(1), {})[int(m.group(2))] = w
        elif name.endswith("we_gate_up"):
            w = np.asarray(w)
            stem = name[: -len("_gate_up")]
            out[stem + "_gate"], out[stem + "_up"] = w[:, :width], w[:, width:]
        else:
            out[name] = w
    for name, experts in per_expert.items():
        if sorted(experts) != list(range(num_experts)):
            raise JaxspecError(f"{source}: {name} has experts {sorted(experts)[:4]}..., config "
                               f"implies 0..{num_experts - 1}: the checkpoint is incomplete")
        out[name] = np.stack([np.asarray(experts[j]) for j in range(num_experts)])
    return out


def unstack_expert_tensors(params: dict) -> dict:
    """The inverse of `stack_expert_tensors` for a flat dict: `we_gate` [E, ...] -> `we_gate.j`."""
    out = {}
    for name, w in params.items():
        if re.fullmatch(r"(.*\b)?we_(gate|up|down)", name):
            out |= {f"{name}.{j}": np.asarray(w[j]) for j in range(w.shape[0])}
        else:
            out[name] = w
    return out
