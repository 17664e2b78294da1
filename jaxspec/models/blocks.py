"""Building blocks shared by the decoder families: norms, RoPE variants, gated MLPs, soft-capping,
and attention under causal / sliding-window / tree masks.

Every block is a pure function of arrays and static numbers, so a family module reads as its
paper does (`models/gemma.py`, `models/phi3.py`).

Sliding-window visibility (HF `sliding_window_overlay`, the same for Mistral, Qwen2, Phi-3,
Gemma 2 and Gemma 3): a query at position q sees the key at position k iff

    q - window < k <= q          (the query itself and the window - 1 keys before it)

The cache stays full-size (slot s holds position s), so nothing about rollback, trees or
capacity changes: the window is one more term in the mask.

Dimension letters: B batch, T query tokens, S cache slots, N query heads, K kv heads,
G query heads per kv head, H head dim, D model dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked part adds exp(..) = 0
# queries per chunk of `masked_attention` (no score block above [B, K, G*chunk, S] is live)
ATTENTION_CHUNK = 512
NO_WINDOW = 1 << 30  # a window no context reaches (a global layer inside a traced layer loop)


# ---------------------------------------------------------------------------------------- norms


def fixed_order_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in an order that does not depend on the other dims: [..., D] -> [..., 1].

    XLA picks a reduce's summation order from the whole array's shape, so one row's sum could
    differ in its last bit between a one-token step and a verify window: enough to flip a
    near-tied greedy token. Halving with elementwise adds (zero-padded to a power of two) fixes
    the order per row.
    """
    d = x.shape[-1]
    width = 1 << max(d - 1, 0).bit_length()
    if width != d:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - d)])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis, [..., D] -> [..., 1]: the fixed-order sum on the CPU (its
    exactness device, see fixed_order_sum), a plain reduction (one fused kernel) on TPU / GPU,
    chosen by the platform the program is lowered for."""
    plain = lambda v: jnp.sum(v, axis=-1, keepdims=True)  # noqa: E731
    return jax.lax.platform_dependent(x, cpu=fixed_order_sum, default=plain)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, *, offset: float = 0.0) -> jax.Array:
    """RMS norm in float32, scaled by `offset + w`: offset 0 is Llama's `w`, offset 1 Gemma's
    `(1 + w)` (Gemma stores its norm weights centred on zero). Cast back to x's dtype after the
    scale, as HF Gemma does (identical for Llama in float32)."""
    x32 = x.astype(jnp.float32)
    mean_sq = row_sum(x32 * x32) / x.shape[-1]
    y = x32 * jax.lax.rsqrt(mean_sq + eps)
    scale = w.astype(jnp.float32)
    if offset:
        scale = offset + scale
    return (y * scale).astype(x.dtype)


# ----------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(
    head_dim: int,
    theta: float,
    *,
    linear_factor: float = 1.0,
    llama3: tuple[float, float, float, int] | None = None,
) -> jax.Array:  # f32[H/2]
    """Inverse frequencies of rotary embeddings over `head_dim` dims with base `theta`.

    `linear_factor`: positions divided by it (HF `rope_type: linear`, Gemma 3's global layers).
    `llama3`: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of
    Llama 3.1's wavelength-dependent scaling.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelen = 2 * jnp.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    ramped = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_mid, ramped, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x: [B, T, N, H]; positions: int[B, T]; inv_freq f32[H/2] -> [B, T, N, H].
    Half-split (`rotate_half`) convention of HF."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope_heads(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
                     rotated: int) -> jax.Array:
    """x: [B, T, M, H] -> [B, T, M, H] with heads m < `rotated` rotated as `apply_rope` does
    (bit for bit: x1 cos + x2 (-sin) is x1 cos - x2 sin) and the rest passed through (cos 1,
    sin 0). For a fused q/k/v projection `[B, T, N + 2K, H]` (rotated = N + K): one elementwise
    pass over the whole projection, with no concatenate per q and k, so XLA:GPU fuses it into
    the projection's epilogue and the k/v cache writes read it, not three fusions of their own."""
    h = x.shape[-1]
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    cos_full = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    sin_signed = jnp.concatenate([-sin, sin], axis=-1)[:, :, None, :]
    on = (jnp.arange(x.shape[2]) < rotated)[None, None, :, None]  # [1, 1, M, 1]
    cos_full = jnp.where(on, cos_full, 1.0)
    sin_signed = jnp.where(on, sin_signed, 0.0)
    x32 = x.astype(jnp.float32)
    swapped = x32.reshape(*x.shape[:-1], 2, h // 2)[..., ::-1, :].reshape(x.shape)  # [x2, x1]
    return (x32 * cos_full + swapped * sin_signed).astype(x.dtype)


# ------------------------------------------------------------------------------------ MLP, caps


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up (Llama, Qwen, Mistral, Phi-3)."""
    return jax.nn.silu(gate) * up


def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gelu_tanh(gate) * up (Gemma: HF `gelu_pytorch_tanh`)."""
    return jax.nn.gelu(gate, approximate=True) * up


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap): Gemma 2's bound on attention scores and final logits (None: x)."""
    if cap is None:
        return x
    return jnp.tanh(x / cap) * cap


def embed_scale(hidden_size: int, dtype) -> jax.Array:
    """Gemma's embedding multiplier sqrt(D), rounded to the compute dtype first as HF does
    (sqrt(3072) is 55.4256 in float32 and 55.5 in bfloat16)."""
    return jnp.asarray(math.sqrt(hidden_size), jnp.float32).astype(dtype)


# ---------------------------------------------------------------------------------------- masks


def sliding_window_visible(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array:
    """bool[..., T, S]: k_pos in (q_pos - window, q_pos]. q_pos: int[..., T]; k_pos: int[..., S];
    window: an int or a traced int32 scalar (NO_WINDOW: plain causal)."""
    q = q_pos[..., :, None]
    k = k_pos[..., None, :]
    return (k <= q) & (k > q - window)


def causal_mask(batch: int, t: int) -> jax.Array:  # bool[B, T, T]
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def window_part_mask(positions: jax.Array, window_mask: jax.Array | None, window) -> jax.Array:
    """bool[B, T, T]: window entry t sees entry j where `window_mask` (None: causal) allows it and
    j's position lies within t's sliding window (tree nodes share depths, hence positions)."""
    b, t = positions.shape
    mask = causal_mask(b, t) if window_mask is None else window_mask
    if window is None:
        return mask
    return mask & (positions[:, None, :] > positions[:, :, None] - window)


def cache_part_mask(positions: jax.Array, lengths: jax.Array, slots, window) -> jax.Array:
    """bool[B, T, S]: cache slot s is visible to window entry t iff it is committed
    (s < lengths[b]) and within the query's sliding window. slots: the cache's slot count (slot s
    holds position s), or the positions int32[B, S] of a span of slots cut out of it."""
    if isinstance(slots, int):
        slots = jnp.arange(slots, dtype=jnp.int32)[None]
    s = slots[:, None, :]  # [B|1, 1, S]
    valid = s < lengths[:, None, None]
    if window is None:
        return jnp.broadcast_to(valid, (*positions.shape, s.shape[-1]))
    return valid & (s > positions[:, :, None] - window)


def window_span_start(lengths: jax.Array, slots: int, span: int) -> jax.Array:  # int32[B]
    """First slot of the `span` cache slots before each row's length: queries at positions
    >= lengths[b] under a sliding window of span + 1 see only committed slots in
    [lengths[b] - span, lengths[b]), so [start, start + span) holds all they can see (clamped
    into the cache: a short row's span starts at slot 0 and its slots past the length are masked)."""
    return jnp.clip(lengths - span, 0, slots - span).astype(jnp.int32)


def _cache_span(k_cache, v_cache, lengths, span: int):
    """Each row's `span` slots before its length: k, v [B, K, span, H] and their slots [B, span]."""
    start = window_span_start(lengths, k_cache.shape[2], span)
    cut = jax.vmap(lambda c, s: jax.lax.dynamic_slice_in_dim(c, s, span, axis=1))
    slot_pos = start[:, None] + jnp.arange(span, dtype=jnp.int32)
    return cut(k_cache, start), cut(v_cache, start), slot_pos


# ------------------------------------------------------------------------------------ attention


def masked_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_win: jax.Array,
    v_win: jax.Array,
    lengths: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    window=None,
    window_mask: jax.Array | None = None,
    softcap: float | None = None,
    chunk: int = ATTENTION_CHUNK,
    window_span: int | None = None,
) -> jax.Array:
    """Attention of a window over a cache's committed slots and the window itself, under an
    optional sliding window and score soft-cap: the XLA path for sliding-window and soft-capped
    layers, any backend.

    q: [B, T, N, H]; k_cache, v_cache: [B, K, S, H]; k_win, v_win: [B, T, K, H] (the window's own
    keys, not yet in the cache); lengths int32[B]; positions int32[B, T] of the window entries
    (>= lengths, as every forward places them); window: int, traced int32 or None; window_mask
    bool[B, T, T] (None: causal) -> [B, T, N*H]. window_span: a static bound of a traced
    `window` when it is finite (a stacked layer loop's sliding width; a wider traced window, e.g.
    NO_WINDOW, reads the whole cache).

    The cache part (a fixed [S] reduce) and the window part ([T]) are softmaxed together by a
    shared max, so a row's result does not depend on the window's length beyond its own keys.
    A sliding window reads only the `window - 1` cache slots before each row's length (a prompt
    chunk's cost is O(window), not O(context)); long windows (prompts) run in query chunks of
    `chunk`, each reading the window keys from its sliding window's start to its causal edge.
    """
    bound = window if isinstance(window, int) else window_span
    span = None if bound is None else max(bound - 1, 1)  # the cache slots a window can reach
    if span is None or span >= k_cache.shape[2]:
        return _masked_attention_chunks(q, k_cache, v_cache, k_win, v_win, lengths, positions,
                                        scale, window, window_mask, softcap, chunk, None)

    def near(kc, vc):  # the span of slots the window reaches
        kc, vc, slot_pos = _cache_span(kc, vc, lengths, span)
        return _masked_attention_chunks(q, kc, vc, k_win, v_win, lengths, positions, scale,
                                        window, window_mask, softcap, chunk, slot_pos)

    if isinstance(window, int):
        return near(k_cache, v_cache)
    whole = lambda kc, vc: _masked_attention_chunks(  # noqa: E731
        q, kc, vc, k_win, v_win, lengths, positions, scale, window, window_mask, softcap, chunk,
        None)
    return jax.lax.cond(window <= bound, near, whole, k_cache, v_cache)


def _masked_attention_chunks(q, k_cache, v_cache, k_win, v_win, lengths, positions, scale, window,
                             window_mask, softcap, chunk, slot_pos):
    """masked_attention over the cache slots given (slot_pos int32[B, S'] their positions; None:
    slot s is position s), long windows in query chunks. A causal chunk of rows [r0, r1) reads
    window keys [r0 - window + 1, r1) only (a causal window's entry j sits at lengths + j)."""
    b, t, n, h = q.shape
    slots = k_cache.shape[2] if slot_pos is None else slot_pos
    mask = window_part_mask(positions, window_mask, window)  # [B, T, T]
    if t <= chunk:
        return _masked_attention_rows(q, k_cache, v_cache, k_win, v_win, lengths, positions, mask,
                                      scale, window, softcap, slots)
    outs = []
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        keys = slice(0, t)
        if window_mask is None:  # causal: keys past the chunk's last row are never seen
            first = max(start - window + 1, 0) if isinstance(window, int) else 0
            keys = slice(first, end)
        outs.append(_masked_attention_rows(
            q[:, start:end], k_cache, v_cache, k_win[:, keys], v_win[:, keys], lengths,
            positions[:, start:end], mask[:, start:end, keys], scale, window, softcap, slots))
    return jnp.concatenate(outs, axis=1)


def _masked_attention_rows(q, k_cache, v_cache, k_win, v_win, lengths, q_pos, win_mask, scale,
                           window, softcap, slots):
    """q: [B, C, N, H] (C query rows at q_pos [B, C]); win_mask bool[B, C, Tw]; slots: the cache's
    slot count or its slots' positions [B, S] (cache_part_mask) -> [B, C, N*H]."""
    b, c, n, h = q.shape
    kv = k_win.shape[2]
    g = n // kv
    qg = q.reshape(b, c, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * c, h)
    batch = ((0, 1), (0, 1))
    s_cache = jax.lax.dot_general(qg, k_cache.astype(qg.dtype), (((3,), (3,)), batch),
                                  preferred_element_type=jnp.float32)  # [B, K, GC, S]
    kw = k_win.astype(qg.dtype).transpose(0, 2, 1, 3)  # [B, K, Tw, H]
    s_win = jax.lax.dot_general(qg, kw, (((3,), (3,)), batch),
                                preferred_element_type=jnp.float32)  # [B, K, GC, Tw]
    s_cache = soft_cap(s_cache * scale, softcap)
    s_win = soft_cap(s_win * scale, softcap)
    m_cache = cache_part_mask(q_pos, lengths, slots, window)  # [B, C, S]

    def per_query(mask):  # [B, C, X] -> [B, 1, G*C, X], query rows ordered (g, c)
        x = mask.shape[-1]
        return jnp.broadcast_to(mask[:, None, None], (b, 1, g, c, x)).reshape(b, 1, g * c, x)

    s_cache = jnp.where(per_query(m_cache), s_cache, _NEG)
    s_win = jnp.where(per_query(win_mask), s_win, _NEG)
    m = jnp.maximum(s_cache.max(-1), s_win.max(-1))  # [B, K, GC]; a query always sees itself
    p_cache = jnp.exp(s_cache - m[..., None])
    p_win = jnp.exp(s_win - m[..., None])
    denom = p_cache.sum(-1) + p_win.sum(-1)
    pv = (((3,), (2,)), batch)
    vw = v_win.astype(jnp.float32).transpose(0, 2, 1, 3)  # [B, K, Tw, H]
    o = jax.lax.dot_general(p_cache, v_cache.astype(jnp.float32), pv)
    o = o + jax.lax.dot_general(p_win, vw, pv)  # [B, K, GC, H]
    o = (o / denom[..., None]).astype(q.dtype)
    return o.reshape(b, kv, g, c, h).transpose(0, 3, 1, 2, 4).reshape(b, c, n * h)
