"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): the token mixer of a hybrid model's
linear layers, as pure functions of arrays.

A linear layer carries no KV cache but two pieces of state per row:

  conv  [Kc-1, C]        the last Kc-1 inputs of a depthwise causal convolution (C channels,
                         kernel Kc) run over the mixed q/k/v projection;
  ssm   [Hv, Dk, Dv]     the recurrent state of the gated delta rule (float32), per value head:

      S <- S * exp(g_t)                       (decay, g_t <= 0)
      S <- S + k_t (beta_t (v_t - S^T k_t))^T  (delta rule write, beta_t in (0, 1))
      o_t = S^T q_t                            (q_t, k_t l2-normed, q_t scaled by Dk**-0.5)

A verify window is a tree (a chain is the tree with parents t - 1): entry t starts from its
parent's state (the root from the committed state) and reads the convolution over its own
ancestors. Every entry's state after it is returned, so a commit can keep the state at any
accepted length (`models/hybrid_cache.py`). Contractions over Dk use fixed-order sums, so a
one-token step and a window entry compute the same bits.

Dimension letters: B batch, T window entries, Hk / Hv key / value heads, Dk / Dv their head
dims, C conv channels (2 Hk Dk + Hv Dv), Kc conv kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import blocks

L2_EPS = 1e-6  # FLA / transformers `l2norm` eps


class Dims(NamedTuple):
    """A linear layer's sizes (static)."""

    key_heads: int  # Hk
    value_heads: int  # Hv
    key_dim: int  # Dk
    value_dim: int  # Dv
    conv_kernel: int  # Kc

    @property
    def channels(self) -> int:  # C
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def _sum_last(x: jax.Array) -> jax.Array:  # [..., X] -> [...] in a fixed order
    return blocks.fixed_order_sum(x)[..., 0]


def l2_normalize(x: jax.Array) -> jax.Array:  # [..., D] f32
    return x * jax.lax.rsqrt(_sum_last(x * x)[..., None] + L2_EPS)


def entry_parents(positions: jax.Array, window_mask: jax.Array | None) -> jax.Array:
    """int32[B, T]: each window entry's parent entry (-1: the committed state). window_mask
    bool[B, T, T] ancestors-and-self (None: a causal chain)."""
    b, t = positions.shape
    if window_mask is None:
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) - 1, (b, t))
    is_parent = window_mask & (positions[:, None, :] == positions[:, :, None] - 1)
    return jnp.where(is_parent.any(-1), jnp.argmax(is_parent, -1), -1).astype(jnp.int32)


def conv_inputs(x: jax.Array, conv_state: jax.Array, positions: jax.Array,
                window_mask: jax.Array | None) -> jax.Array:
    """The convolution's inputs per entry, oldest first: x [B, T, C] (the window's projections),
    conv_state [B, Kc-1, C] (the committed inputs before the window) -> [B, T, Kc, C]; entry t's
    lag m is its ancestor at position p_t - m, or the committed input there."""
    b, t, c = x.shape
    kc = conv_state.shape[1] + 1
    depth = positions - positions[:, :1]  # [B, T] (the root at depth 0)
    if window_mask is None:  # causal: shifted copies of [state; x]
        seq = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, Kc-1+T, C]
        return jnp.stack([seq[:, i : i + t] for i in range(kc)], axis=2)
    lags = jnp.arange(kc - 1, -1, -1)  # lag of each kernel tap, oldest first
    want = positions[:, :, None] - lags[None, None, :]  # [B, T, Kc] positions read
    from_win = window_mask[:, :, None, :] & (positions[:, None, None, :] == want[..., None])
    taps = jnp.einsum("btmj,bjc->btmc", from_win.astype(x.dtype), x)
    # lags reaching before the root: the committed input Kc-1 - (lag - depth) slots back
    slot = kc - 1 - (lags[None, None, :] - depth[:, :, None])  # [B, T, Kc]
    before = lags[None, None, :] > depth[:, :, None]
    from_state = before[..., None] & (jnp.arange(kc - 1)[None, None, None, :] == slot[..., None])
    return taps + jnp.einsum("btmi,bic->btmc", from_state.astype(x.dtype),
                             conv_state.astype(x.dtype))


def causal_conv(inputs: jax.Array, weight: jax.Array) -> jax.Array:
    """inputs [B, T, Kc, C] (oldest first), weight [C, Kc] -> silu(conv) [B, T, C], the taps
    summed in one fixed order."""
    w = jnp.swapaxes(weight, 0, 1).astype(jnp.float32)  # [Kc, C]
    acc = inputs[:, :, 0].astype(jnp.float32) * w[0]
    for i in range(1, inputs.shape[2]):
        acc = acc + inputs[:, :, i].astype(jnp.float32) * w[i]
    return jax.nn.silu(acc).astype(inputs.dtype)


def _update(state, q, k, v, g, beta):
    """One delta-rule step for every (B, Hv): state [B, Hv, Dk, Dv]; q, k [B, Hv, Dk];
    v [B, Hv, Dv]; g, beta [B, Hv] -> (new state, output [B, Hv, Dv])."""
    state = state * jnp.exp(g)[..., None, None]
    s_t = jnp.swapaxes(state, -1, -2)  # [B, Hv, Dv, Dk]
    kv_mem = _sum_last(s_t * k[:, :, None, :])  # [B, Hv, Dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = _sum_last(jnp.swapaxes(state, -1, -2) * q[:, :, None, :])
    return state, out


def delta_rule(q, k, v, g, beta, state0, parents, *, keep_states: bool, chain: bool,
               ring=None, ring_slots=None, ring_valid=None, snap=None, snap_index=None):
    """The gated delta rule over a window: q, k [B, T, Hv, Dk] (normed, q scaled); v [B, T, Hv, Dv];
    g, beta [B, T, Hv]; state0 [B, Hv, Dk, Dv] f32; parents int32[B, T] (-1: state0).

    Returns (outputs [B, T, Hv, Dv] f32, states): keep_states -> every entry's state after it
    [B, T, Hv, Dk, Dv]; with `ring` ([B, R, Hv, Dk, Dv]) the states are written into it in entry
    order at ring_slots int32[B, T] where ring_valid bool[B, T] (a long prompt keeps only what
    the ring holds) and the ring is returned instead; with `snap` ([NS, Hv, Dk, Dv], a chain and
    a ring only) entry t's state is also kept at snap_index[:, t] (>= NS: not kept) and
    (ring, snap) is returned. chain: parents are t - 1 (the running state is carried, not every
    entry's)."""
    b, t = parents.shape
    rows = jnp.arange(b)
    xs = (jnp.swapaxes(q, 0, 1), jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1),
          jnp.swapaxes(g, 0, 1), jnp.swapaxes(beta, 0, 1))
    if chain:
        def body(carry, inp):
            state, ring_c, snap_c = carry
            (qt, kt, vt, gt, bt), i = inp
            state, out = _update(state, qt, kt, vt, gt, bt)
            if ring_c is not None:
                slot = ring_slots[:, i]
                keep = ring_valid[:, i][:, None, None, None]
                ring_c = ring_c.at[rows, slot].set(jnp.where(keep, state, ring_c[rows, slot]))
            if snap_c is not None:  # distinct in-range slots per step; the rest dropped
                snap_c = snap_c.at[snap_index[:, i]].set(state.astype(snap_c.dtype), mode="drop")
            return (state, ring_c, snap_c), (out, state if keep_states else None)

        (_, ring, snap), (outs, states) = jax.lax.scan(body, (state0, ring, snap),
                                                       (xs, jnp.arange(t)))
        states = None if states is None else jnp.swapaxes(states, 0, 1)
        if snap is not None:
            return jnp.swapaxes(outs, 0, 1), (ring, snap)
        return jnp.swapaxes(outs, 0, 1), (ring if ring is not None else states)

    # a tree: every entry's state is carried, each entry starts from its parent's
    def tree_body(all_states, inp):
        (qt, kt, vt, gt, bt), i = inp
        par = parents[:, i]
        start = jnp.where((par < 0)[:, None, None, None], state0,
                          all_states[rows, jnp.maximum(par, 0)])
        state, out = _update(start, qt, kt, vt, gt, bt)
        return all_states.at[:, i].set(state), out

    init = jnp.zeros((b, t, *state0.shape[1:]), state0.dtype)
    states, outs = jax.lax.scan(tree_body, init, (xs, jnp.arange(t)))
    return jnp.swapaxes(outs, 0, 1), states


def gated_rms_norm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Norm then gate (HF `RMSNormGated`): w * rms_norm(x) * silu(gate), per head; x [..., Dv]."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(_sum_last(x32 * x32)[..., None] / x.shape[-1] + eps)
    y = w.astype(jnp.float32) * y.astype(x.dtype).astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def project(lp: dict, y: jax.Array, dims: Dims, linear):
    """The layer's input projections of the normed y [B, T, D] -> (mixed q/k/v [B, T, C], gate z
    [B, T, Hv, Dv], decay g [B, T, Hv] f32, beta [B, T, Hv] f32)."""
    b, t, _ = y.shape
    mixed = linear(y, lp["in_qkv"])
    z = linear(y, lp["in_z"]).reshape(b, t, dims.value_heads, dims.value_dim)
    beta = jax.nn.sigmoid(linear(y, lp["in_b"]).astype(jnp.float32))
    a = linear(y, lp["in_a"]).astype(jnp.float32)
    dt = jax.nn.softplus(a + lp["dt_bias"].astype(jnp.float32))
    g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * dt
    return mixed, z, g, beta


def grouped_channels(dims: Dims) -> np.ndarray:
    """int[C]: the stored channel behind each of ours. Checkpoints order the mixed q/k/v
    channels all q, all k, all v; ours are grouped by key head (its q Dk, its k Dk, then the
    v of its Hv/Hk value heads), so a mesh axis splitting the channels into whole key-head
    groups leaves each device the q, k and v of its own heads (no regather per layer)."""
    hk, dk, rep, dv = dims.key_heads, dims.key_dim, dims.value_heads // dims.key_heads, dims.value_dim
    kd = hk * dk
    return np.concatenate([np.r_[h * dk : (h + 1) * dk, kd + h * dk : kd + (h + 1) * dk,
                                 2 * kd + h * rep * dv : 2 * kd + (h + 1) * rep * dv]
                           for h in range(hk)])


def split_heads(conv_out: jax.Array, dims: Dims):
    """conv output [B, T, C] (channels grouped by key head, `grouped_channels`) -> q, k
    [B, T, Hv, Dk] (l2-normed, q scaled, key heads repeated over their value heads) and v
    [B, T, Hv, Dv], float32."""
    b, t, _ = conv_out.shape
    dk, rep = dims.key_dim, dims.value_heads // dims.key_heads
    x = conv_out.astype(jnp.float32).reshape(b, t, dims.key_heads, 2 * dk + rep * dims.value_dim)
    q, k = x[..., :dk], x[..., dk : 2 * dk]  # [B, T, Hk, Dk]
    v = x[..., 2 * dk :].reshape(b, t, dims.value_heads, dims.value_dim)
    q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
    q = l2_normalize(q) / (dims.key_dim**0.5)
    return q, l2_normalize(k), v
