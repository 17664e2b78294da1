"""The ragged paged attention path (`models.paged_attention`): the combined pool layout JAX's TPU
kernel reads, the XLA path against JAX's own reference of that kernel (shuffled page tables,
ragged kv lengths, decode / verify / prefill widths, a sliding window), and the TPU kernel's
presence in a program exported for TPU from this host.

The kernel's numerics in Pallas interpret mode are not checked: in JAX 0.10.2 the TPU
interpreter fails on this kernel on CPU ("'ReshapeTransform' object has no attribute
'indices'"), so the XLA path is held to `ref_ragged_paged_attention`, the kernel's reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxspec import hlo
from jaxspec.models import paged_attention as pa

K, NP, P, H, N, B, MP = 2, 16, 8, 32, 4, 3, 4


def pool(seed=0):
    ks = jax.random.split(jax.random.key(seed), 2)
    k = jax.random.normal(ks[0], (K, NP, P, H), jnp.float32)
    v = jax.random.normal(ks[1], (K, NP, P, H), jnp.float32)
    return k, v


def shuffled_table(seed=0):
    pages = np.random.default_rng(seed).permutation(NP)[: B * MP]
    return jnp.asarray(pages.reshape(B, MP), jnp.int32)


def test_combined_layout_round_trips_and_interleaves_heads():
    k, v = pool()
    kv = pa.combine_kv(k, v)
    assert kv.shape == (NP, P, 2 * K, H)
    back_k, back_v = pa.split_kv(kv)
    np.testing.assert_array_equal(back_k, k)
    np.testing.assert_array_equal(back_v, v)
    # the kernel's convention: combined head 2i is k head i, 2i+1 is v head i
    np.testing.assert_array_equal(kv[3, 5, 2], k[1, 3, 5])
    np.testing.assert_array_equal(kv[3, 5, 3], v[1, 3, 5])


@pytest.mark.parametrize("t,window", [(1, None), (4, None), (8, None), (4, 6)])
def test_ragged_attend_equals_the_kernels_reference(t, window):
    """Decode (T=1), a verify window (γ+1=4), a prefill chunk (8) and a sliding window."""
    k, v = pool(t)
    kv = pa.combine_kv(k, v)
    table = shuffled_table(t)
    lens = jnp.array([t, 13, MP * P], jnp.int32)  # a fresh row, a mid row, a full row
    q = jax.random.normal(jax.random.key(7), (B, t, N, H), jnp.float32)
    ours = pa.ragged_attend(q, kv, lens, table, sm_scale=0.2, sliding_window=window)
    flat, cu, num = pa.ragged_inputs(q, lens)
    ref = ref_ragged_paged_attention(flat, kv, lens, table, cu, num, sm_scale=0.2,
                                     sliding_window=window)
    assert ours.shape == (B, t, N, H)
    np.testing.assert_allclose(ours, ref.reshape(B, t, N, H), atol=2e-5)


def test_ragged_attend_reads_through_the_table():
    """A control for the test above: the same call with the table's rows swapped differs."""
    k, v = pool()
    kv = pa.combine_kv(k, v)
    table = shuffled_table()
    lens = jnp.array([20, 20, 20], jnp.int32)
    q = jnp.broadcast_to(jax.random.normal(jax.random.key(1), (1, 2, N, H)), (B, 2, N, H))
    out = pa.ragged_attend(q, kv, lens, table, sm_scale=0.2)
    swapped = pa.ragged_attend(q, kv, lens, table[::-1], sm_scale=0.2)
    np.testing.assert_allclose(out[0], swapped[2], atol=1e-6)
    assert float(jnp.abs(out[0] - out[1]).max()) > 1e-3


def test_tpu_export_calls_the_ragged_kernel_once():
    q = jnp.zeros((B, 4, N, 128), jnp.bfloat16)  # the kernel's lanes: head dim 128
    kv = jnp.zeros((NP, P, 2 * K, 128), jnp.bfloat16)

    def attend(q, kv, lens, table):
        return pa.ragged_attend(q, kv, lens, table, sm_scale=0.1, backend="tpu")

    checks = [export.DisabledSafetyCheck.custom_call(t) for t in hlo.ATTENTION_TARGETS]
    with pa.tpu_lowering():
        exported = export.export(jax.jit(attend), platforms=["tpu"], disabled_checks=checks)(
            q, kv, jnp.full((B,), 9, jnp.int32), shuffled_table())
    text = exported.mlir_module()
    assert hlo.custom_calls(text).get("tpu_custom_call") == 1
    assert hlo.compiled_attention(text) == "pallas_tpu"
    # the XLA path exported for TPU holds no kernel (what the check above tells apart)
    xla = export.export(jax.jit(lambda *a: pa.ragged_attend(*a, sm_scale=0.1)),
                        platforms=["tpu"])(q, kv, jnp.full((B,), 9, jnp.int32), shuffled_table())
    assert hlo.compiled_attention(xla.mlir_module()) == "xla"


def test_gpu_decode_kernel_in_interpret_mode_equals_the_xla_path():
    k, v = pool(3)
    table = shuffled_table(3)
    lens = jnp.array([1, 13, MP * P], jnp.int32)
    q = jax.random.normal(jax.random.key(5), (B, 1, N, H), jnp.float32)
    ref = pa.ragged_attend(q, pa.combine_kv(k, v), lens, table, sm_scale=0.2)
    out = pa.gpu_decode_attend(q, k, v, lens, table, sm_scale=0.2, interpret=True)
    np.testing.assert_allclose(out, ref, atol=2e-5)


def test_cuda_export_calls_the_triton_paged_kernel():
    k = jnp.zeros((K, NP, P, 64), jnp.bfloat16)
    q = jnp.zeros((B, 1, N, 64), jnp.bfloat16)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in hlo.ATTENTION_TARGETS]
    exported = export.export(
        jax.jit(lambda q, k, v, l, t: pa.gpu_decode_attend(q, k, v, l, t, sm_scale=0.1)),
        platforms=["cuda"], disabled_checks=checks)(
            q, k, k, jnp.full((B,), 9, jnp.int32), shuffled_table())
    assert hlo.compiled_attention(exported.mlir_module()) == "pallas_gpu"


def test_choose_attention_per_backend_and_window():
    from jaxspec.serving.paged_cache import choose_attention

    assert choose_attention("tpu", 1) == choose_attention("tpu", 5) == "pallas_tpu"
    assert choose_attention("cuda", 1) == choose_attention("gpu", 5) == "pallas_gpu"
    assert choose_attention("cpu", 1) == choose_attention("tpu", 5, "float32") == "xla"
    assert choose_attention("tpu", 5, sliding=True) == "xla"
