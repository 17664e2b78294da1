"""JAX's own Pallas attention kernels as the cache part of `jaxspec.models.attention.attend`.

Each function reads a cache's valid prefix (slots < lengths[b]) for grouped queries
qg `[B, K, GT, H]` (the G query heads of each kv head times the T window positions, which all
see the same prefix) and returns what attend merges with the window part by log-sum-exp:
(unnormalised out f32[B, K, GT, H], running max f32[B, K, GT], weight sum f32[B, K, GT]).

  cache_part_pallas_tpu  jax.experimental.pallas.ops.tpu.paged_attention's kernel on a zero-copy
                         paged view of our contiguous cache (per-layer `[B, K, S, H]` or a
                         stack `[L, B, K, S, H]` indexed by a traced layer; see below).
  cache_part_pallas_gpu  jax.experimental.pallas.ops.gpu.decode_attention's per-(row, kv head)
                         kernel, vmapped on a per-layer `[B, K, S, H]` cache.
  (cache_part_pallas_gpu_stacked, our own Triton kernel on a stacked cache, is in
  `jaxspec.models.gpu_stacked_attention`.)
  window_part_splash_tpu  jax.experimental.pallas.ops.tpu.splash_attention on a prompt window's
                         causal self-attention (prefill), with its log-sum-exp kept for the merge;
                         GQA as splash's own grouped heads (no K/V repeat).
  window_part_flash_gpu  jax.experimental.pallas.ops.gpu.attention's flash attention (Triton) on
                         a prompt window's causal self-attention (prefill), log-sum-exp kept;
                         K/V repeated to the N query heads (it takes equal heads).
  cache_part_in_row_chunks  a cache-part kernel over more query rows than its blocks take, in
                         chunks of PREFILL_ROWS rows (a prompt chunk over an earlier cache).

Both run on CPU in Pallas interpret mode (`interpret=True`), which is how tests check them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.errors import JaxspecError

# The ("data", "model") mesh the program being traced runs on (None: one device), set by the
# decode loop's jitted entry points (speculate.prefill_jit / decode_jit) while they trace.
_MESH: contextvars.ContextVar = contextvars.ContextVar("jaxspec_kernel_mesh", default=None)


@contextlib.contextmanager
def kernel_mesh(mesh):
    """Trace under `mesh` (a jax.sharding.Mesh, or None): kernel calls run per device by
    `on_head_shards` (trace-time only: the mesh is part of the jitted program's static spec)."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def trace_mesh():
    """The mesh `kernel_mesh` set for the program being traced (None: one device); other
    per-shard blocks (models/moe_shards.py) run under the same mesh."""
    return _MESH.get()


def on_head_shards(fn, args, dims, out_dims):
    """fn(*args) under `jax.shard_map` over the current kernel mesh: each device runs the kernel
    on its own batch rows ("data") and kv heads ("model") with no gather. A Pallas call is a
    custom call GSPMD cannot split, so without this every device would gather the whole cache
    (and q) to run it. Every kernel here is independent per (row, kv head), so the shards' results
    are exactly the whole's.

    args: arrays; dims: per arg (batch dim, heads dim), either None (not split: a traced layer
    index has (None, None)); out_dims: the same per output. An axis that does not divide its dim
    (kv heads replicated over "model", a batch the data axis does not divide) is not split."""
    mesh = _MESH.get()
    if mesh is None or mesh.size == 1:
        return fn(*args)
    def divides(axis, which):  # the axis splits every arg's dim `which` (0: batch, 1: heads)
        sizes = [a.shape[d[which]] for a, d in zip(args, dims) if d[which] is not None]
        return mesh.shape.get(axis, 1) > 1 and all(n % mesh.shape[axis] == 0 for n in sizes)

    split = {"data": "data" if divides("data", 0) else None,
             "model": "model" if divides("model", 1) else None}
    if not any(split.values()):
        return fn(*args)

    def spec(ndim, batch_dim, heads_dim):
        out = [None] * ndim
        if batch_dim is not None:
            out[batch_dim] = split["data"]
        if heads_dim is not None:
            out[heads_dim] = split["model"]
        return P(*out)

    in_specs = tuple(spec(a.ndim, *d) for a, d in zip(args, dims))
    out_specs = tuple(spec(n, *d) for n, *d in out_dims)
    run = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return run(*args)


def _cache_dims(cache) -> tuple[int, int]:
    """(batch dim, kv-heads dim) of a per-layer cache [B, K, S, H] or a stack [L, B, K, S, H]."""
    return (0, 1) if cache.ndim == 4 else (1, 2)


def cache_part_on_mesh(part, qg, k_cache, v_cache, lengths, layer):
    """A cache-part kernel `part(qg, k_cache, v_cache, lengths, layer)` on head shards: qg
    [B, K, GT, H], the cache and lengths [B] split by rows and kv heads, outputs (o [B, K, GT, H],
    m, l [B, K, GT]) likewise."""
    cd = _cache_dims(k_cache)
    args, dims = [qg, k_cache, v_cache, lengths], [(0, 1), cd, cd, (0, None)]
    if layer is not None:
        args.append(jnp.asarray(layer, jnp.int32))
        dims.append((None, None))
    fn = (lambda q, k, v, n, i: part(q, k, v, n, i)) if layer is not None else (
        lambda q, k, v, n: part(q, k, v, n, None))
    return on_head_shards(fn, args, dims, [(4, 0, 1), (3, 0, 1), (3, 0, 1)])


def takes(impl: str, slots: int) -> bool:
    """Whether `impl`'s kernel takes a cache of `slots` slots (its pages / power-of-two blocks
    divide it); attend runs the XLA path otherwise."""
    if impl == "pallas_tpu":
        return slots % 16 == 0
    if impl == "pallas_gpu":
        return slots % 128 == 0
    return False


TPU_BLOCK_SLOTS = 512  # cache slots per step of the TPU kernel's flash loop (pages x page size)
TPU_MAX_ROWS = 256  # query rows per paged-kernel call (longer windows: one call per chunk)
TPU_PAGE_TABLE_ENTRIES = 32768  # int32 page-table entries one call prefetches (128 KiB of SMEM)
_EMPTY = -0.7 * float(jnp.finfo(jnp.float32).max)  # a prefix with no valid slot: weight 0


def tpu_pages(slots: int) -> tuple[int, int]:
    """(page size, pages per compute block) for a cache of `slots` slots: the largest page of
    128/64/32/16 slots dividing it, and about TPU_BLOCK_SLOTS slots per kernel step."""
    page = next((p for p in (128, 64, 32, 16) if slots % p == 0), None)
    if page is None:
        raise ValueError(f"pallas_tpu attention needs a cache capacity divisible by 16, got {slots}")
    per_seq = slots // page
    per_block = max(1, min(per_seq, TPU_BLOCK_SLOTS // page))
    while per_seq % per_block:
        per_block -= 1
    return page, per_block


def tpu_cores() -> int:
    """TensorCores per TPU chip that one program can use (megacore): 2 on v4 and v5p, 1 elsewhere
    (v5e, v6e; and when the program is not traced on a TPU, e.g. exported from a CPU host)."""
    if jax.default_backend() != "tpu":
        return 1
    kind = jax.devices()[0].device_kind.lower()
    return 2 if "v4" in kind or "v5p" in kind or (kind.endswith("v5") and "lite" not in kind) else 1


def tpu_page_table_entries(batch: int, kv_heads: int, slots: int) -> int:
    """Entries of the page table one paged-kernel call scalar-prefetches into SMEM."""
    return batch * kv_heads * (slots // tpu_pages(slots)[0])


def cache_part_pallas_tpu(qg, k_cache, v_cache, lengths, layer, scale, interpret=False):
    """The cache part by the TPU paged-attention kernel, without copying the cache.

    A contiguous cache is already paged: `[B, K, S, H]` (or the whole stack `[L, B, K, S, H]`)
    reshaped to `[1, B*K*S/P, P, H]` (a bitcast) is a table of pages of P slots, and each
    (row, kv head) is one sequence with ONE kv head whose pages are consecutive:
    page_indices[(b, k)] = layer * B*K*S/P + (b*K + k) * S/P + arange(S/P). The query heads of that
    sequence are qg[b, k] (G heads x T window positions: all see lengths[b] slots). The kernel
    DMAs only the pages below lengths[b] into VMEM; the rest of the stack is never read.

    The public `paged_attention` returns the normalised output only, so this launches the same
    kernel (`paged_flash_attention_kernel_inline_seq_dim`) with its running max and weight sum
    kept, which the merge with the window part needs (exact, no second pass over the cache).
    The kernel computes q.k and p.v with K/V rounded to bfloat16 (it dequantises to bf16), so it
    is exact for bf16 caches and bf16-accurate for float32 ones.

    More than TPU_MAX_ROWS query rows (a prompt chunk over an earlier cache) run as one kernel
    call per chunk of TPU_MAX_ROWS rows (`cache_part_in_row_chunks`), each with the same
    per-program page table of B*K*S/P entries (at most TPU_PAGE_TABLE_ENTRIES, the SMEM it is
    prefetched into). On a chip with two TensorCores (`tpu_cores`) the sequences are split
    between them (the kernel's megacore "batch" mode)."""
    b, kv, gt, h = qg.shape
    if gt > TPU_MAX_ROWS:
        def part(x):
            return cache_part_pallas_tpu(x, k_cache, v_cache, lengths, layer, scale, interpret)
        return cache_part_in_row_chunks(part, qg, rows=TPU_MAX_ROWS)
    return _paged_call(qg, k_cache, v_cache, lengths, layer, scale, interpret, tpu_cores())


def _paged_call(qg, k_cache, v_cache, lengths, layer, scale, interpret, cores):
    """One paged-kernel call: B*K sequences of <= TPU_MAX_ROWS query rows (see above)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak

    b, kv, gt, h = qg.shape
    slots = k_cache.shape[-2]
    page, per_block = tpu_pages(slots)
    per_seq = slots // page
    entries = tpu_page_table_entries(b, kv, slots)
    if entries > TPU_PAGE_TABLE_ENTRIES:
        raise JaxspecError(
            f"pallas_tpu attention: batch {b} x {kv} kv heads x {per_seq} pages of {page} slots = "
            f"{entries} page-table entries exceed the {TPU_PAGE_TABLE_ENTRIES} that fit in SMEM: "
            f"lower generation.batch_size or generation.max_context, or set JAXSPEC_ATTENTION=xla")
    seqs = b * kv
    cores = cores if seqs % cores == 0 else 1
    pages = k_cache.size // (h * page)
    k_pages, v_pages = (c.reshape(1, pages, page, h) for c in (k_cache, v_cache))  # bitcasts
    rows = -(-gt // 8) * 8  # query rows per sequence, a multiple of 8 sublanes
    first = 0 if layer is None else layer.astype(jnp.int32) * (seqs * per_seq)
    page_indices = first + jnp.arange(seqs * per_seq, dtype=jnp.int32)  # [B*K * S/P]
    lens = jnp.repeat(lengths.astype(jnp.int32), kv)  # [B*K]
    q = (qg.astype(jnp.float32) * scale).reshape(seqs, gt, h)  # one sequence per (row, head)
    q = jnp.pad(q, ((0, 0), (0, rows - gt), (0, 0)))
    # q, o, and the running max / weight sum (kept lane-broadcast, as the kernel writes them) all
    # in blocks equal to their arrays' last two dims, which Mosaic accepts for any G*T and H;
    # with two cores, core c takes sequences s * 2 + c (the kernel's "batch" megacore mode)
    q_spec = pl.BlockSpec((None, rows, h), lambda core, s, head, *_: (s * cores + core, 0, 0))
    buffer = lambda c: pltpu.VMEM((2, per_block, page, h), c.dtype)  # double-buffered  # noqa: E731
    kernel = functools.partial(
        pak.paged_flash_attention_kernel_inline_seq_dim, pages_per_sequence=per_seq,
        batch_size=seqs, pages_per_compute_block=per_block, mask_value=pak.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None, megacore_mode="batch" if cores > 1 else None,
    )
    o, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # lengths, page indices, buffer index, init flag
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), None,
                      pl.BlockSpec(memory_space=pl.ANY), None],
            out_specs=[q_spec, q_spec, q_spec],
            grid=(cores, seqs // cores, 1),
            scratch_shapes=(buffer(k_pages), None, buffer(v_pages), None,
                            pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32)] * 3,
        interpret=pltpu.InterpretParams() if interpret else False,
    )(lens, page_indices, jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), q,
      k_pages, None, v_pages, None)
    o, m, l = (x.reshape(b, kv, rows, h)[:, :, :gt] for x in (o, m, l))
    m = jnp.maximum(m[..., 0], _EMPTY)  # an empty prefix leaves -inf (and l = 0)
    l = l[..., 0]
    return o * l[..., None], m, l  # the kernel's o is normalised by l


SPLASH_BLOCKS = (512, 256, 128)  # splash attention's q / kv block: the largest dividing the window


def splash_blocks(t: int) -> tuple[int, int]:
    """(padded window, block) for splash attention on a window of t positions: t padded to a
    multiple of 128 (the TPU's lanes; splash's smallest block), then the largest block dividing it."""
    padded = -(-t // 128) * 128
    return padded, next(blk for blk in SPLASH_BLOCKS if padded % blk == 0)


def window_part_splash_tpu(qh, k_win, v_win, scale, interpret=False):
    """A prompt window's causal self-attention by JAX's splash attention (TPU), the part of a
    prefill that the cache part (earlier cache slots) does not cover.

    qh: [B, N, T, H] (head n = kv head n // G, as `attend` groups them); k_win, v_win: [B, K, T, H]
    -> (out f32 [B, N, T, H], normalised; log-sum-exp f32 [B, N, T]) for the log-sum-exp merge.
    Splash's grouped-query mode takes the K kv heads as they are (no repeat to N heads). Its
    static causal mask skips the blocks above the diagonal; nothing T x T is materialised. The
    window is padded to a multiple of 128 positions: a padded key sits after every real query,
    so the causal mask hides it, and padded queries are dropped. A right-padded prompt needs no
    segment ids for the same reason: its pad keys come after every real token of its row."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, n, t, h = qh.shape
    padded, blk = splash_blocks(t)
    pad = ((0, 0), (0, 0), (0, padded - t), (0, 0))
    q = jnp.pad((qh.astype(jnp.float32) * scale).astype(qh.dtype), pad)
    k, v = (jnp.pad(w.astype(qh.dtype), pad) for w in (k_win, v_win))
    # the batch folded into the heads (no vmap over the kernel): head b*N + n of q reads kv head
    # (b*N + n) // G = b*K + n // G, which is row b's kv head of query head n
    mask = sm.MultiHeadMask([sm.CausalMask((padded, padded))] * (b * n))
    kernel = sk.make_splash_mha(
        mask, block_sizes=sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk),
        head_shards=1, q_seq_shards=1, save_residuals=True,
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    out, (lse,) = kernel(*(x.reshape(-1, padded, h) for x in (q, k, v)))  # [B*N, Tp, H], [B*N, Tp]
    out, lse = out.reshape(b, n, padded, h), lse.reshape(b, n, padded)
    return out[:, :, :t].astype(jnp.float32), lse[:, :, :t]


GPU_FLASH_BLOCK = 128  # the GPU flash kernel's q / kv block (its default); windows padded to it
PREFILL_ROWS = 256  # query rows per call of a decode kernel over an earlier cache (GPU prefill)


def window_part_flash_gpu(q, k_win, v_win, scale, interpret=False):
    """A prompt window's causal self-attention by JAX's Pallas GPU flash attention kernel
    (`jax.experimental.pallas.ops.gpu.attention.mha`, Triton), the part of a GPU prefill the cache
    part does not cover.

    q: [B, T, N, H]; k_win, v_win: [B, T, K, H] (the layouts the kernel takes, no transpose) ->
    (out f32 [B, N, T, H] normalised, log-sum-exp f32 [B, N, T]). The kernel takes as many kv
    heads as query heads, so K/V are repeated G times (prompt-sized, not cache-sized). Its causal
    loop stops at the diagonal block. The window is padded to a multiple of GPU_FLASH_BLOCK: a
    padded key sits after every real query (hidden by the causal mask), padded queries are
    dropped; a right-padded prompt's pad keys likewise come after its real tokens."""
    from jax.experimental.pallas.ops.gpu import attention as fa

    t, n = q.shape[1:3]
    g = n // k_win.shape[2]
    padded = -(-t // GPU_FLASH_BLOCK) * GPU_FLASH_BLOCK
    pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
    k, v = (jnp.pad(jnp.repeat(w.astype(q.dtype), g, axis=2), pad) for w in (k_win, v_win))
    blocks = fa.BlockSizes(block_q=GPU_FLASH_BLOCK, block_k=GPU_FLASH_BLOCK)
    # positional: mha is a custom_vjp with non-differentiable arguments 4..13 (jax 0.10: the 8th
    # is backward_pass_impl, "triton"; tests/test_attention_impls.py pins the order)
    out, lse2 = fa.mha(jnp.pad(q, pad), k, v, None, scale, True, blocks, "triton", None, 2, None,
                       interpret, False, True)  # [B, Tp, N, H], [B, N, Tp] (base 2)
    out = out[:, :t].astype(jnp.float32).transpose(0, 2, 1, 3)  # [B, N, T, H]
    return out, lse2[:, :, :t] * jnp.log(2.0).astype(jnp.float32)


def cache_part_in_row_chunks(part, qg, *args, rows: int = PREFILL_ROWS):
    """`part(qg_chunk, *args)` (a cache-part kernel, G*T <= rows) over qg [B, K, GT, H] in chunks
    of `rows` query rows, one after another (lax.map: the cache goes in whole, read-only, once per
    chunk and only its valid blocks) -> the same (out, max, sum) as one call."""
    b, kv, gt, h = qg.shape
    chunks = -(-gt // rows)
    qc = jnp.pad(qg, ((0, 0), (0, 0), (0, chunks * rows - gt), (0, 0)))
    qc = qc.reshape(b, kv, chunks, rows, h).transpose(2, 0, 1, 3, 4)  # [C, B, K, R, H]
    o, m, l = jax.lax.map(lambda x: part(x, *args), qc)
    o = o.transpose(1, 2, 0, 3, 4).reshape(b, kv, chunks * rows, h)[:, :, :gt]
    m, l = (x.transpose(1, 2, 0, 3).reshape(b, kv, chunks * rows)[:, :, :gt] for x in (m, l))
    return o, m, l


GPU_ACC_ELEMS = 64 * 128  # f32 accumulator elements (query rows x head dim) per Triton program
GPU_WARPS = 4


def gpu_rows(head_dim: int) -> int:
    """Query rows one GPU decode-kernel program holds: its f32 accumulator [rows, H] stays at
    GPU_ACC_ELEMS (64 registers a thread at 4 warps), so the tile shrinks as the head dim grows
    (H = 64: 128 rows; H = 128: 64), and never below tl.dot's 16."""
    return max(16, min(PREFILL_ROWS, 1 << (GPU_ACC_ELEMS // head_dim).bit_length() - 1))


def gpu_block_rows(gt: int) -> int:
    """tl.dot's power-of-two rows >= 16 for gt query rows."""
    return max(16, 1 << (gt - 1).bit_length())


def cache_part_pallas_gpu(qg, k_cache, v_cache, lengths, scale, interpret=False):
    """The cache part by Pallas GPU's decode kernel (`decode_attention.attn_forward_kernel`), one
    program per (row, kv head, slot split) on our [B, K, S, H] layout (no transpose); it reads
    slots < lengths[b] only. JAX's wrapper (`decode_attn_unbatched`) stores each split's
    unnormalised output in q's dtype and merges the splits there (bfloat16 for a bf16 cache), so
    this launches the same kernel with f32 outputs and merges in f32. More query rows than
    `gpu_rows(H)` run in row chunks."""
    b, kv, gt, h = qg.shape
    if gt > gpu_rows(h):
        def part(x):
            return cache_part_pallas_gpu(x, k_cache, v_cache, lengths, scale, interpret)
        return cache_part_in_row_chunks(part, qg, rows=gpu_rows(h))
    o, l, m = _gpu_split_parts(qg, k_cache, v_cache, lengths, scale, interpret)
    return _merge_splits(o, m, l, axis=2)


def _gpu_split_parts(qg, k_cache, v_cache, lengths, scale, interpret):
    """The decode kernel's per-split (o [B, K, splits, GT, H], l, m [B, K, splits, GT]) in f32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu import decode_attention as da

    b, kv, gt, h = qg.shape
    slots = k_cache.shape[2]
    block_k = min(128, slots)
    splits = max(1, slots // block_k) if slots % block_k == 0 else 1
    # Split the slots only as far as the GPU needs programs: each split writes its partial output
    # in f32 and the merge reads it back (16 splits of a batch-32, 5-token window: 84 MB a layer).
    while splits % 2 == 0 and b * kv * splits > GPU_PROGRAMS:
        splits //= 2
    if slots % (block_k * splits):
        block_k, splits = slots, 1
    split_len = slots // splits
    block_h = gpu_block_rows(gt)
    kernel = functools.partial(da.attn_forward_kernel, sm_scale=scale, block_k=block_k,
                               block_h=block_h, num_heads=gt)

    def one(q, k, v, start, length):  # q [GT, H]; k, v [S, H] -> per split o, l, m (f32)
        k, v = (x.reshape(splits, split_len, h) for x in (k, v))
        return pl.pallas_call(
            kernel,
            grid=(1, splits),
            in_specs=[pl.BlockSpec((block_h, h), lambda i, j: (i, 0)),
                      pl.BlockSpec((None, split_len, h), lambda i, j: (j, 0, 0)),
                      pl.BlockSpec((None, split_len, h), lambda i, j: (j, 0, 0)),
                      pl.BlockSpec((), lambda i, j: ()), pl.BlockSpec((), lambda i, j: ())],
            out_specs=[pl.BlockSpec((None, block_h, h), lambda i, j: (j, i, 0)),
                       pl.BlockSpec((None, block_h), lambda i, j: (j, i)),
                       pl.BlockSpec((None, block_h), lambda i, j: (j, i))],
            compiler_params=plgpu.CompilerParams(num_warps=GPU_WARPS, num_stages=2),
            out_shape=[jax.ShapeDtypeStruct((splits, gt, h), jnp.float32),
                       jax.ShapeDtypeStruct((splits, gt), jnp.float32),
                       jax.ShapeDtypeStruct((splits, gt), jnp.float32)],
            interpret=interpret,
            name="jaxspec_decode",
        )(q, k, v, start, length)

    # start and length enter unbatched over kv heads (start: one constant): broadcast to [B, K]
    # they were two more kernels a layer on XLA:GPU (one per operand, never shared by layers)
    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    return jax.vmap(per_head, in_axes=(0, 0, 0, None, 0))(
        qg, k_cache.astype(qg.dtype), v_cache.astype(qg.dtype), jnp.int32(0),
        lengths.astype(jnp.int32))  # [B, K, splits, GT(, H)]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gpu_out_takes(qg, k_cache) -> bool:
    """Whether `decode_out_pallas_gpu` takes these shapes (Triton's blocks: powers of two)."""
    _, _, gt, h = qg.shape
    return gt <= gpu_rows(h) and _pow2(gt) and _pow2(h) and _pow2(k_cache.shape[2])


def decode_out_pallas_gpu(qg, k_cache, v_cache, lengths, scale, dtype, interpret=False):
    """One query token's attention output [B, K, GT, H] in `dtype` (slots < lengths): the decode
    kernel's splits merged and normalised by one more Triton program per (row, kv head), where
    XLA:GPU ran that as two kernels (the splits' max, then the weighted sums and the division)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    o, l, m = _gpu_split_parts(qg, k_cache, v_cache, lengths, scale, interpret)
    b, kv, splits, gt, h = o.shape

    def kernel(o_ref, m_ref, l_ref, out_ref):  # o [S, GT, H], m and l [S, GT] -> [GT, H]
        m = m_ref[...]
        a = jnp.exp(m - jnp.max(m, axis=0)[None, :])  # each split's weight (the max's is 1)
        den = jnp.sum(a * l_ref[...], axis=0)
        out = jnp.sum(a[:, :, None] * o_ref[...], axis=0)
        out_ref[...] = (out / den[:, None]).astype(out_ref.dtype)

    rows = pl.BlockSpec((None, None, splits, gt), lambda i, j: (i, j, 0, 0))
    return pl.pallas_call(
        kernel, grid=(b, kv),
        in_specs=[pl.BlockSpec((None, None, splits, gt, h), lambda i, j: (i, j, 0, 0, 0)),
                  rows, rows],
        out_specs=pl.BlockSpec((None, None, gt, h), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv, gt, h), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=GPU_WARPS, num_stages=1),
        interpret=interpret, name="jaxspec_decode_merge")(o, m, l)


def _merge_splits(o, m, l, axis):
    """Per-split (unnormalised out, max, weight sum) -> one, in f32 (log-sum-exp weights)."""
    m_all = m.max(axis=axis)
    a = jnp.exp(m - jnp.expand_dims(m_all, axis))
    o = (jnp.expand_dims(a, -1) * o).sum(axis=axis)
    return o, jnp.maximum(m_all, _EMPTY), (a * l).sum(axis=axis)


GPU_PROGRAMS = 512  # decode-kernel programs (row x kv head x slot split) that fill an H100/H200
