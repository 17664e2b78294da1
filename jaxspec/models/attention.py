"""One attention op: a window of queries over a KV cache's valid prefix plus the window itself.

    out = attend(q, k_cache, v_cache, k_win, v_win, lengths, layer=i, window_mask=m)

The window's own keys/values are passed separately (not yet in the cache), so the cache is only
read here and written once, in place, by the caller; query t of row b sees cache slots
s < lengths[b] and window positions u with window_mask[b, t, u] (causal by default; a tree's
ancestor mask fits the same argument). Softmax runs over both parts together.

Backends (`impl`):
  "xla"        the reference, any backend. It loops over the cache in blocks of `block` slots up
               to the batch's longest valid prefix (online softmax), so it reads only valid
               blocks and an empty cache (prefill) one block only, per-layer or stacked (a stack's
               blocks are sliced at the traced layer inside the loop; tests/test_accelerator_path
               checks XLA copies no cache for it). Per-layer caches `[B, K, S, H]` are contracted
               with dot_general (XLA's canonical batch order: no transpose of the cache). A stacked
               cache `[L, B, K, S, H]` with a traced `layer` is read as multiply + reduce, which XLA
               fuses with the layer's dynamic slice: a dot would first copy the layer's cache out
               of the stack, every layer, every step (see jaxspec.hlo).
  "pallas_tpu" the cache part by `jax.experimental.pallas.ops.tpu.paged_attention`'s kernel on a
               zero-copy paged view of the cache (per-layer or the stack at a traced layer), which
               DMAs only pages below lengths[b]; merged with the window part by log-sum-exp
               (see jaxspec.models.attention_kernels). Any window mask (chains and trees).
  "pallas_gpu" per-layer caches: the cache part by `jax.experimental.pallas.ops.gpu.
               decode_attention`'s per-(row, kv head) kernel, which stops at lengths[b] (reads only
               valid slots); a stack: our own Pallas (Triton) flash-decoding kernel, which takes the
               whole stack and loads layer `layer`'s valid blocks by address (no copy). Merged the
               same way.
  "auto"       by backend (`resolve_impl`): for bfloat16 caches TPU "pallas_tpu", GPU
               "pallas_gpu"; else "xla". The environment variable
               JAXSPEC_ATTENTION=xla (or another impl) overrides "auto", e.g. to force the
               reference path on a device.
Both Pallas impls run on CPU in interpret mode (`interpret=True`), which is how tests check them.

Prefill (a causal window with more than PALLAS_MAX_QUERIES query rows per kv head, `_attend_prefill`):
the window's own causal attention runs on JAX's flash kernels, on "pallas_tpu" splash attention and
on "pallas_gpu" Pallas's Triton flash attention (`ops.gpu.attention.mha`); the earlier cache (none
at an engine prefill) on the same decode kernels as above, in query-row chunks; merged by
log-sum-exp. On "xla" prefill windows are split into query chunks of `chunk` queries, so no score
block larger than `[B, K, G*chunk, block]` (cache part) and `[B, K, G*chunk, T]` (window part)
float32 is ever live, never the full capacity; a causal chunk reads only the window keys up to its
last query (about half the window part's work at long prompts).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from jaxspec.models import attention_kernels, gpu_stacked_attention

IMPLS = ("auto", "xla", "pallas_tpu", "pallas_gpu")
ENV_OVERRIDE = "JAXSPEC_ATTENTION"  # overrides impl="auto" (e.g. JAXSPEC_ATTENTION=xla)
PALLAS_MAX_QUERIES = 256  # query rows (G heads x T positions) per kv head a Pallas kernel takes
PREFILL_CHUNK = 512  # queries per chunk for long windows
CACHE_BLOCK = 512  # cache slots per step of the XLA path's loop over the valid prefix
MIN_CACHE_BLOCK = 8  # smaller caches are read in one pass
KERNEL_SLOTS = 128  # capacities on TPU/GPU are multiples of this (kernel_capacity)
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked part adds exp(..) = 0


def causal_mask(batch: int, t: int) -> jax.Array:  # bool[B, T, T]
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def resolve_impl(impl: str = "auto", *, cache_dtype=None, backend: str | None = None) -> str:
    """The implementation `attend` runs for `impl`. "auto" (unless JAXSPEC_ATTENTION names another
    impl): for a bfloat16 cache (the accelerator default) "pallas_tpu" on TPU and "pallas_gpu" on
    GPU; a float32 cache keeps the exact XLA path (the TPU kernel rounds K/V to bfloat16, the GPU
    one may use tf32), and every other backend runs "xla". Each impl takes per-layer caches and
    stacks."""
    if impl == "auto":
        impl = os.environ.get(ENV_OVERRIDE, "") or "auto"
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} (argument or ${ENV_OVERRIDE}): use one of {IMPLS}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    if cache_dtype is None or jnp.dtype(cache_dtype) != jnp.bfloat16:
        return "xla"
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "xla")


def cache_block_size(slots: int, block: int | None = CACHE_BLOCK) -> int | None:
    """Slots per block of the XLA path's loop over a per-layer cache of `slots` slots (None: one
    pass). At least two blocks: a dot on the whole per-layer cache made XLA:CPU copy the cache
    at batch 1 (its layout is free there), four times per layer and step. A block that divides
    `slots` is kept; any other capacity (a CPU capacity is prompt bucket + bucket(max_new) +
    nodes + 1, e.g. 81 or 1089) gets a power-of-two block and a last block clamped to end at the
    last slot (`cache_block_start`), its slots already covered by the block before masked."""
    if not block or slots < 2 * MIN_CACHE_BLOCK:
        return None
    block = min(block, slots // 2)
    if slots % block == 0:
        return block
    return 1 << (block.bit_length() - 1)  # the largest power of two <= block


def cache_blocks(slots: int) -> int:
    """How many blocks the XLA path's loop has over `slots` slots (the last may be clamped)."""
    block = cache_block_size(slots)
    return -(-slots // block) if block else 1


def cache_block_start(j, block: int, slots: int):
    """First slot of block j: j * block, the last block clamped to end at slot `slots` - 1 (its
    slots below j * block belong to block j - 1 and are masked)."""
    return jnp.minimum(j * block, slots - block)


def cache_loop_trips(valid: int, slots: int) -> int:
    """Trips of the XLA path's loop over a per-layer cache's blocks for `valid` slots (block 0 runs
    before the loop)."""
    block = cache_block_size(slots)
    return max(-(-valid // block) - 1, 0) if block else 0


def kernel_capacity(slots: int, backend: str | None = None) -> int:
    """A cache capacity of at least `slots` that the attention kernels take on `backend`
    (default: JAX's): on TPU and GPU rounded up to a multiple of KERNEL_SLOTS (TPU pages of 128
    slots, the GPU kernels' 128-slot blocks), so every prefill, decode and verify program runs the
    kernels; other backends keep `slots` (the XLA path takes any capacity)."""
    backend = backend or jax.default_backend()
    if backend not in ("tpu", "gpu", "cuda", "rocm"):
        return slots
    return -(-slots // KERNEL_SLOTS) * KERNEL_SLOTS


def attend(q, k_cache, v_cache, k_win, v_win, lengths, *, layer=None, window_mask=None,
           impl: str = "auto", chunk: int = PREFILL_CHUNK, block: int | None = CACHE_BLOCK,
           interpret: bool = False, window_in_cache: bool = False):
    """q: [B, T, N, H]; k_cache, v_cache: [B, K, S, H] (or [L, B, K, S, H] with `layer`, an int32
    scalar); k_win, v_win: [B, T, K, H]; lengths: int32[B]; window_mask: bool[B, T, T] or None
    (causal) -> [B, T, N*H] in q's dtype.

    impl "auto" (with no JAXSPEC_ATTENTION override) is chosen by the platform the program is
    lowered for (`lax.platform_dependent`), not by the host's backend: a program exported for
    TPU or CUDA from a CPU host holds that device's kernels, and jaxspec.hlo reads which ones
    from the lowered program."""
    run = functools.partial(_attend, q, k_cache, v_cache, k_win, v_win, lengths, layer=layer,
                            window_mask=window_mask, chunk=chunk, block=block,
                            interpret=interpret, window_in_cache=window_in_cache)
    if impl == "auto" and not os.environ.get(ENV_OVERRIDE):
        dt = k_cache.dtype
        on = lambda backend: functools.partial(  # noqa: E731
            run, impl=resolve_impl("auto", cache_dtype=dt, backend=backend), dots=True)
        return jax.lax.platform_dependent(
            tpu=on("tpu"), cuda=on("gpu"), rocm=on("gpu"),
            default=functools.partial(run, impl="xla", dots=False))
    return run(impl=resolve_impl(impl, cache_dtype=k_cache.dtype),
               dots=jax.default_backend() != "cpu")


def _attend(q, k_cache, v_cache, k_win, v_win, lengths, *, layer, window_mask, impl: str,
            dots: bool, chunk: int, block: int | None, interpret: bool,
            window_in_cache: bool = False):
    """attend on a resolved impl; dots: the stacked XLA path contracts with dots (TPU/GPU: the
    matrix units) rather than the multiply + reduce fusion XLA:CPU wants. window_in_cache: the
    window's k/v are already written at lengths.. (a writing forward); a causal window on the
    kernels then reads them from the cache and runs no window part (`_attend_written`)."""
    b, t, n, h = q.shape
    tw = k_win.shape[1]  # window keys (== t, except inside a prefill chunk)
    prefill = _prefill_kernel(impl, q, k_cache, k_win, window_mask)  # a prompt on the kernels
    if prefill:
        return _attend_prefill(prefill, q, k_cache, v_cache, k_win, v_win, lengths, layer,
                               interpret)
    if t > chunk:  # prefill: one query chunk at a time (the last one may be shorter)
        outs = []  # a Python loop: straight-line chunks, each [B, K, G, C, S + T] at most
        for start in range(0, t, chunk):
            size = min(chunk, t - start)
            keys = tw  # window keys this chunk reads
            if window_mask is None:  # causal, built per chunk (never a [T, T] block): the
                keys = min(tw, start + size)  # keys past the chunk's last query are skipped
                rows = start + jnp.arange(size)[:, None]
                mc = jnp.broadcast_to(rows >= jnp.arange(keys)[None, :], (b, size, keys))
            else:
                mc = window_mask[:, start : start + size]
            outs.append(_attend(q[:, start : start + size], k_cache, v_cache, k_win[:, :keys],
                                v_win[:, :keys], lengths, layer=layer, window_mask=mc, impl=impl,
                                dots=dots, chunk=chunk, block=block, interpret=interpret))
        return jnp.concatenate(outs, axis=1)  # [B, T, N*H]
    causal = window_mask is None
    if window_mask is None:
        window_mask = causal_mask(b, t)
    impl = resolve_impl(impl, cache_dtype=k_cache.dtype)
    kv = k_win.shape[2]
    g = n // kv
    scale = h**-0.5
    qg = q.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)  # [B,K,GT,H]
    # the window part: tiny (T keys), any mask
    kw, vw = (w.astype(q.dtype).transpose(0, 2, 1, 3) for w in (k_win, v_win))  # [B, K, T, H]
    slots = k_cache.shape[-2]
    # prefill chunks, and capacities the kernels' block sizes do not divide, keep the XLA path
    pallas_fits = slots > 0 and g * t <= PALLAS_MAX_QUERIES and attention_kernels.takes(impl, slots)
    if window_in_cache and pallas_fits and (
            (t == 1 and impl in ("pallas_tpu", "pallas_gpu"))
            or (causal and impl == "pallas_gpu" and g * t <= attention_kernels.gpu_rows(h))):
        return _attend_written(qg, k_cache, v_cache, lengths, layer, impl, scale, interpret,
                               q.shape, q.dtype)
    # the stacked XLA path takes q as it comes ([B, T, K, G, H], a bitcast of the projection) and
    # regroups it inside each fusion that reads it: a dot (or a loop carry) wants qg laid out on
    # its own, which XLA:CPU materialised three times per layer (transpose, re-layout, copy)
    stacked_xla = layer is not None and slots > 0 and not pallas_fits and not dots
    q5 = q.reshape(b, t, kv, g, h)
    if stacked_xla:
        s_win = _scores_fused(q5, kw) * scale
    else:
        dims = (((3,), (3,)), ((0, 1), (0, 1)))
        s_win = jax.lax.dot_general(qg, kw, dims, preferred_element_type=jnp.float32) * scale
    wmask = jnp.broadcast_to(window_mask[:, None, None], (b, 1, g, t, tw)).reshape(b, 1, g * t, tw)
    s_win = jnp.where(wmask, s_win, _NEG)  # [B, K, GT, Tw]
    if pallas_fits and impl in ("pallas_tpu", "pallas_gpu"):  # per device on a mesh
        o_c, m_c, l_c = attention_kernels.cache_part_on_mesh(
            functools.partial(_cache_kernel, impl=impl, scale=scale, interpret=interpret),
            qg, k_cache, v_cache, lengths, layer)
    elif slots == 0:  # no cache (a training forward): the window is everything
        o_c = jnp.zeros((b, kv, g * t, h), jnp.float32)
        m_c = jnp.full((b, kv, g * t), _NEG, jnp.float32)
        l_c = jnp.zeros((b, kv, g * t), jnp.float32)
    else:
        o_c, m_c, l_c = _cache_part_xla(q5 if stacked_xla else qg, k_cache, v_cache, lengths,
                                        layer, scale, block, dots)
    return merge_cache_and_window(o_c, m_c, l_c, s_win, vw, q.shape, q.dtype)


def _attend_written(qg, k_cache, v_cache, lengths, layer, impl, scale, interpret, q_shape, dtype):
    """A causal window whose own k/v are already in the cache at slots lengths[b]..: the kernel
    reads them with the cache and its (o, l) are the answer, so no window scores, mask or
    log-sum-exp merge with a window part run (two kernels a layer at one token on a GPU, six
    at five). One token: the impl's kernel on slots < lengths + 1; GPU, T tokens: our kernel,
    row t reading slots < lengths + t + 1 (`gpu_stacked_attention.cache_part_pallas_gpu_stacked`,
    causal=T; a per-layer cache goes in as a stack of one). -> [B, T, N*H]."""
    b, t, n, h = q_shape
    kv = qg.shape[1]
    if (t == 1 and impl == "pallas_gpu" and layer is None
            and attention_kernels.gpu_out_takes(qg, k_cache)):  # the splits merged in one kernel
        run = lambda q_, k_, v_, n_: (attention_kernels.decode_out_pallas_gpu(  # noqa: E731
            q_, k_, v_, n_, scale, dtype, interpret),)
        (o,) = attention_kernels.on_head_shards(
            run, [qg, k_cache, v_cache, lengths + 1], [(0, 1), (0, 1), (0, 1), (0, None)],
            [(4, 0, 1)])
        return o.reshape(b, kv, n // kv, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n * h)
    if t == 1:  # one token: any kernel on lengths + 1 (JAX's GPU kernel: fewer partial sums)
        part = functools.partial(_cache_kernel, impl=impl, scale=scale, interpret=interpret)
        o_c, _, l_c = attention_kernels.cache_part_on_mesh(
            part, qg, k_cache, v_cache, lengths + 1, layer)
    else:
        def part(q_, k_, v_, n_, i_):  # per-layer caches: a stack of one at layer 0
            if i_ is None:
                k_, v_, i_ = k_[None], v_[None], jnp.int32(0)
            return gpu_stacked_attention.cache_part_pallas_gpu_stacked(
                q_, k_, v_, n_, i_, scale, interpret, causal=t)
        o_c, _, l_c = attention_kernels.cache_part_on_mesh(
            part, qg, k_cache, v_cache, lengths, layer)
    o = (o_c / l_c[..., None]).astype(dtype)  # [B, K, G*T, H]: a query always sees itself
    return o.reshape(b, kv, n // kv, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n * h)


def merge_cache_and_window(o_c, m_c, l_c, s_win, vw, q_shape, dtype) -> jax.Array:
    """Attention over the cache and the window, from the cache part's unnormalised sum o_c
    [B, K, GT, H] with running max m_c and weight sum l_c [B, K, GT], and the window's masked
    scores s_win [B, K, GT, T] over its values vw [B, K, T, H]; merged by log-sum-exp (a query
    always sees itself, so the window part is never empty). Returns [B, T, N*H] in `dtype`,
    q_shape = (B, T, N, H) of the query the rows (g, t) were grouped from."""
    b, t, n, h = q_shape
    kv = o_c.shape[1]
    m = jnp.maximum(m_c, s_win.max(-1))  # [B, K, GT]
    p_win = jnp.exp(s_win - m[..., None])
    a_c = jnp.exp(m_c - m)
    denom = a_c * l_c + p_win.sum(-1)
    pv = (((3,), (2,)), ((0, 1), (0, 1)))
    o = a_c[..., None] * o_c + jax.lax.dot_general(p_win, vw.astype(jnp.float32), pv)
    o = (o / denom[..., None]).astype(dtype)  # [B, K, GT, H]
    return o.reshape(b, kv, n // kv, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n * h)


def _cache_kernel(qg, k_cache, v_cache, lengths, layer, *, impl, scale, interpret):
    """The cache part on impl's kernel (per-layer cache or a stack at `layer`)."""
    if impl == "pallas_tpu":
        return attention_kernels.cache_part_pallas_tpu(
            qg, k_cache, v_cache, lengths, layer, scale, interpret)
    if layer is None:
        return attention_kernels.cache_part_pallas_gpu(
            qg, k_cache, v_cache, lengths, scale, interpret)
    return gpu_stacked_attention.cache_part_pallas_gpu_stacked(
        qg, k_cache, v_cache, lengths, layer, scale, interpret)


def _prefill_kernel(impl, q, k_cache, k_win, window_mask) -> str | None:
    """The kernel impl ("pallas_tpu" / "pallas_gpu") that runs a causal window too long for the
    decode kernels alone (more than PALLAS_MAX_QUERIES query rows per kv head: a prompt, or a
    prompt chunk over an earlier cache), or None: the XLA path. A tree mask or a zero-slot cache
    (training: the kernels have no gradient) keeps the XLA path."""
    _, t, n, _ = q.shape
    g = n // k_win.shape[2]
    slots = k_cache.shape[-2]
    if window_mask is not None or k_win.shape[1] != t or g * t <= PALLAS_MAX_QUERIES or slots == 0:
        return None
    impl = resolve_impl(impl, cache_dtype=k_cache.dtype)
    takes = impl in ("pallas_tpu", "pallas_gpu") and attention_kernels.takes(impl, slots)
    return impl if takes else None


def _attend_prefill(impl, q, k_cache, v_cache, k_win, v_win, lengths, layer, interpret):
    """A causal window (a prompt) on the kernels: its own causal attention by JAX's flash kernel
    (TPU: splash attention; GPU: Pallas's Triton flash attention), blocks above the diagonal
    skipped; the earlier cache's valid slots (slots < lengths[b]; none at an engine prefill) by the
    decode kernels in query-row chunks; merged exactly by log-sum-exp. No score block of either
    part is materialised in HBM."""
    b, t, n, h = q.shape
    kv = k_win.shape[2]
    g = n // kv
    scale = h**-0.5
    qh = q.transpose(0, 2, 1, 3)  # [B, N, T, H]; head n = kv head n // G, so this is [B, K, G*T, H]
    qg = qh.reshape(b, kv, g * t, h)
    kw, vw = (w.transpose(0, 2, 1, 3) for w in (k_win, v_win))  # [B, K, T, H]
    # every kernel on its own rows and heads on a mesh (attention_kernels.on_head_shards): head n
    # of [B, N, T, H] is kv head n // G, so splitting N and K into equal blocks pairs them
    heads = [(4, 0, 1), (3, 0, 1)]
    if impl == "pallas_tpu":
        o_w, lse_w = attention_kernels.on_head_shards(
            lambda q_, k_, v_: attention_kernels.window_part_splash_tpu(q_, k_, v_, scale,
                                                                        interpret),
            [qh, kw, vw], [(0, 1)] * 3, heads)
    else:  # q, k_win, v_win as [B, T, heads, H]
        o_w, lse_w = attention_kernels.on_head_shards(
            lambda q_, k_, v_: attention_kernels.window_part_flash_gpu(q_, k_, v_, scale,
                                                                       interpret),
            [q, k_win, v_win], [(0, 2)] * 3, heads)
    cache_part = lambda: attention_kernels.cache_part_on_mesh(  # noqa: E731
        functools.partial(_cache_kernel, impl=impl, scale=scale, interpret=interpret),
        qg, k_cache, v_cache, lengths, layer)
    o_w, lse_w = o_w.reshape(b, kv, g * t, h), lse_w.reshape(b, kv, g * t)

    def with_cache():  # the earlier cache's part, merged by log-sum-exp
        o_c, m_c, l_c = cache_part()
        m = jnp.maximum(m_c, lse_w)  # the window part is never empty (a query sees itself)
        a_c, a_w = jnp.exp(m_c - m), jnp.exp(lse_w - m)
        return (a_c[..., None] * o_c + a_w[..., None] * o_w) / (a_c * l_c + a_w)[..., None]

    # an empty cache (an engine prefill) runs no cache-part kernel and writes none of its f32
    # [B, K, G*T, H] partial outputs: the window part is the whole answer
    o = jax.lax.cond(jnp.max(lengths) > 0, with_cache, lambda: o_w)
    return o.astype(q.dtype).reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n * h)


def _scores_fused(q5, keys):
    """q5 [B, T, K, G, H] . keys [B, K, S, H] -> f32 [B, K, G*T, S] as one multiply + reduce
    fusion: q's regrouping to [B, K, G*T, H] happens inside it (nothing q-sized is copied), and
    a keys operand sliced out of a stack is read in place. Every reduced dim <= 32, or XLA:CPU
    splits the reduce and materialises the product."""
    b, t, kv, g, h = q5.shape
    f = _factors(h)
    qc = q5.astype(jnp.float32).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, 1, *f)
    kc = keys.astype(jnp.float32).reshape(b, kv, 1, keys.shape[2], *f)
    return jnp.sum(qc * kc, axis=tuple(range(-len(f), 0)))


def _cache_part_xla(qg, k_cache, v_cache, lengths, layer, scale, block=None, dots=False):
    """-> (unnormalised out f32[B, K, GT, H], max f32[B, K, GT], weight sum f32[B, K, GT]).

    qg: [B, K, G*T, H]; for a stack (`layer` given) q as it comes, [B, T, K, G, H] (see attend).

    block: slots per step of a loop that stops after the batch's longest valid prefix (an online
    softmax over blocks, as flash decoding does): only blocks below max(lengths) are read, and an
    empty cache (prefill) only the first block. None: one pass over every slot."""
    slots = k_cache.shape[-2]
    block = cache_block_size(slots, block)
    if block is None:
        return _cache_block(qg, k_cache, v_cache, lengths, layer, scale, 0, slots, dots)

    def body(j, carry):
        o, m, l = carry
        start = cache_block_start(j, block, slots)  # the last block may overlap the one before
        o_b, m_b, l_b = _cache_block(qg, k_cache, v_cache, lengths, layer, scale, start,
                                     block, dots, first_slot=j * block)
        m_new = jnp.maximum(m, m_b)
        a, a_b = jnp.exp(m - m_new), jnp.exp(m_b - m_new)
        return a[..., None] * o + a_b[..., None] * o_b, m_new, a * l + a_b * l_b

    # block 0 outside the loop starts the carry (no zero-filled accumulators; an empty cache gives
    # o = 0, m = _NEG, l = 0); the loop runs over the other blocks holding any valid slot
    first = _cache_block(qg, k_cache, v_cache, lengths, layer, scale, 0, block, dots)
    n = (jnp.max(lengths) + block - 1) // block
    return jax.lax.fori_loop(1, n, body, first)


def _cache_block(qg, k_cache, v_cache, lengths, layer, scale, start, size, dots=False,
                 first_slot=None):
    """Slots start..start+size of the cache (one layer's, or layer `layer` of a stack). dots: a
    stack's block is sliced out and contracted with dots, as a per-layer cache is (TPU/GPU).
    first_slot: slots below it are masked (a clamped last block's overlap with the one before)."""
    b, kv, h = k_cache.shape[-4], k_cache.shape[-3], k_cache.shape[-1]
    whole = size == k_cache.shape[-2]
    slot = start + jnp.arange(size)  # [Sb]
    valid = slot[None, :] < lengths[:, None]
    if first_slot is not None:
        valid = valid & (slot >= first_slot)[None, :]
    valid = valid[:, None, None]  # [B, 1, 1, Sb]
    if layer is not None and dots:  # the layer's block, [B, K, Sb, H]: a slice of the stack
        at, size5 = (layer, 0, 0, start, 0), (1, b, kv, size, h)
        k_cache, v_cache = (jax.lax.dynamic_slice(c, at, size5)[0] for c in (k_cache, v_cache))
        layer, start, whole = None, 0, True
    if layer is None:
        k_b, v_b = (c if whole else jax.lax.dynamic_slice_in_dim(c, start, size, axis=2)
                    for c in (k_cache, v_cache))  # [B, K, Sb, H]
        dims = (((3,), (3,)), ((0, 1), (0, 1)))
        s = jax.lax.dot_general(qg, k_b.astype(qg.dtype), dims,
                                preferred_element_type=jnp.float32) * scale
    else:  # multiply + reduce: fused with the layer's slice of the stack, nothing copied
        k_b, v_b = (jax.lax.dynamic_slice(c, (layer, 0, 0, start, 0), (1, b, kv, size, h))[0]
                    for c in (k_cache, v_cache))
        s = _scores_fused(qg, k_b) * scale  # qg is [B, T, K, G, H] here -> [B, K, GT, Sb]
    gt = s.shape[2]
    red = _factors(size)  # reduce as [.., *red] with every reduced dim <= 32: XLA:CPU then fuses
    axes = tuple(range(-len(red), 0))  # the mask into the reduce (a split reduce materialises s)
    valid = valid.reshape(*valid.shape[:-1], *red)
    s = jnp.where(valid, s.reshape(*s.shape[:-1], *red), _NEG)
    m = s.max(axes)
    m_safe = jnp.where(m > 0.5 * _NEG, m, 0.0)  # a block with no valid slot: exp(_NEG - 0) = 0
    p = jnp.exp(s - m_safe.reshape(*m.shape, *(1,) * len(red)))  # masked slots: 0
    l = p.sum(axes)
    p = p.reshape(*p.shape[:-len(red)], size)
    if layer is None:
        pv = (((3,), (2,)), ((0, 1), (0, 1)))
        o = jax.lax.dot_general(p.astype(v_b.dtype), v_b, pv, preferred_element_type=jnp.float32)
    else:
        f = _factors(size)
        pc = p.reshape(b, kv, gt, *f, 1)
        vc = v_b.astype(jnp.float32).reshape(b, kv, 1, *f, h)
        o = jnp.sum(pc * vc, axis=tuple(range(-len(f) - 1, -1)))  # [B, K, GT, H]
    return o, m, l


def _factors(n: int, most: int = 32) -> tuple[int, ...]:
    """n as a product of dims <= most where it factors so (2048 -> (2, 32, 32))."""
    dims = []
    while n > most:
        c = next(c for c in range(most, 0, -1) if n % c == 0)
        if c == 1:
            break
        dims.append(c)
        n //= c
    return (n, *dims)
