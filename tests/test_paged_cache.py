"""The device-side paged KV cache (models/paged_attention.py, serving/paged_cache.py).

Writes go through the page table and nowhere else (a row without pages writes nothing, so it
cannot touch another row's); the gathered view of a row is its contiguous cache whatever pages
it was given; the serving scheduler really runs the pool (read from its state) and a request's
pages follow its length, not max_context; JAX's TPU paged-attention kernel reads the pool as is
(interpret mode on CPU against the gather reference, and `jax.export` for TPU); a PagedTarget on
its own (its own pages per row) decodes token for token as its inner target. Greedy identity
through paged serving (plain, ngram, EAGLE, a tree; staggered arrivals), leaks and preemption
are tests/test_serving.py's, which run on this cache.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import export

from jaxspec.models.cache import init_cache
from jaxspec.engine.runner import Engine
from jaxspec.models import decoder
from jaxspec.models import paged_attention as pa
from jaxspec.serving import Sampling
from jaxspec.serving.pages import pages_for
from jaxspec.serving.scheduler import Scheduler
from test_serving import Sink, run
from tiny import tiny_model

K, H, P = 2, 16, 4


def random_window(rng, b, t):
    return jnp.asarray(rng.normal(size=(b, t, K, H)), jnp.float32)


def test_writes_land_only_in_the_rows_own_pages():
    rng = np.random.default_rng(0)
    cache = pa.init_paged_cache(1, 2, 6, P, 3, K, H, jnp.float32)
    table = np.full((2, 3), 6, np.int32)
    table[1, :2] = [4, 1]  # row 1 holds pages 4 and 1 (slots 0..7); row 0 none
    cache = cache.with_table(jnp.asarray(table))
    new = random_window(rng, 2, 6)
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]], jnp.int32)  # 8: no page
    out = pa.write_window(cache, ((new,), (new,)), positions)
    pool = np.asarray(out.k[0])  # [K, NP, P, H]
    written = {4, 1}
    assert not np.any(pool[:, [p for p in range(6) if p not in written]])
    np.testing.assert_array_equal(pool[:, 4, 3], np.asarray(new[1, 0]).reshape(K, H))
    np.testing.assert_array_equal(pool[:, 1, :], np.asarray(new[1, 1:5]).transpose(1, 0, 2))


def test_the_view_of_shuffled_pages_is_the_contiguous_cache():
    rng = np.random.default_rng(1)
    b, mp, t = 3, 4, 13
    cache = pa.init_paged_cache(2, b, 16, P, mp, K, H, jnp.float32)
    table = jnp.asarray(rng.permutation(16)[: b * mp].reshape(b, mp), jnp.int32)
    cache = cache.with_table(table)
    contiguous = init_cache(2, b, mp * P, K, H)
    k_new = (random_window(rng, b, t), random_window(rng, b, t))
    v_new = (random_window(rng, b, t), random_window(rng, b, t))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    paged = pa.view(pa.write_window(cache, (k_new, v_new), positions))
    flat = decoder.write_window(contiguous, (k_new, v_new), positions)
    for got, want in zip((*paged.k, *paged.v), (*flat.k, *flat.v)):
        np.testing.assert_array_equal(np.asarray(got)[:, :, :t], np.asarray(want)[:, :, :t])


def test_the_scheduler_runs_a_paged_pool_sized_by_pages_not_rows():
    target = tiny_model(packed=True)
    engine = Engine(target, None, None, num_speculative_tokens=0, max_context=64)
    sched = Scheduler(engine, slots=3, max_context=64, steps_per_call=2, kv_pages=10, page_size=8)
    sink = Sink()
    sched.enqueue(sched.new_request([1, 2, 3], Sampling(max_tokens=3), sink))
    sched.run_once()
    assert sched.kv_layout == "paged"
    cfg = target.target.cfg
    pool = sched.state.cache.k[0]  # [K, NP, P, H]: no axis of rows or max_context
    assert pool.shape == (cfg.num_kv_heads, 10, 8, cfg.head_dim)
    assert sched.kv_bytes()["kv_cache_bytes"] == 10 * sched.kv_bytes()["kv_page_bytes"]
    while sched.busy:
        sched.run_once()
    assert sink.done.metrics["kv_layout"] == "paged"


def test_a_requests_pages_follow_its_length():
    engine = Engine(tiny_model(packed=True), None, None, num_speculative_tokens=0,
                    max_context=128)
    sched = Scheduler(engine, slots=2, max_context=128, steps_per_call=2, page_size=8)
    short, long = [1, 2, 3], [int(t) % 60 + 1 for t in range(70)]
    done = run(sched, [(0, short, Sampling(max_tokens=4)), (0, long, Sampling(max_tokens=30))])
    held = [c.metrics["kv_pages"] for c in done]
    # a row holds what it has plus one call's growth (2 steps + the window), in whole pages
    assert held[0] == pages_for(3 + 4, 8)
    assert held[1] == pages_for(70 + 30, 8)
    assert held[0] < held[1] < pages_for(128, 8)


def _kernel_args(rng, dtype, b=3, mp=4, pages=12, page=16, heads=4, head_dim=128):
    kp = jnp.asarray(rng.normal(size=(K, pages, page, head_dim)), dtype)
    vp = jnp.asarray(rng.normal(size=(K, pages, page, head_dim)), dtype)
    q = jnp.asarray(rng.normal(size=(b, heads, head_dim)), dtype)
    table = jnp.asarray(rng.permutation(pages)[: b * mp].reshape(b, mp), jnp.int32)
    lengths = jnp.asarray([5, 40, 64][:b], jnp.int32)
    return q, kp, vp, lengths, table


def _reference(q, kp, vp, lengths, table):
    """Decode attention through the page table, by the gather view (no scale: the kernel's)."""
    kv, vv = (pa.gather_pages(x, table).astype(jnp.float32) for x in (kp, vp))
    b, n, h = q.shape
    qg = q.astype(jnp.float32).reshape(b, K, n // K, h)
    s = jnp.einsum("bkgh,bksh->bkgs", qg, kv)
    s = jnp.where(jnp.arange(kv.shape[2]) < lengths[:, None, None, None], s, -1e30)
    return jnp.einsum("bkgs,bksh->bkgh", jax.nn.softmax(s, -1), vv).reshape(b, n, h)


def test_the_tpu_paged_kernel_reads_the_pool_as_laid_out():
    from jax.experimental.pallas import tpu as pltpu

    args = _kernel_args(np.random.default_rng(2), jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        out = pa.tpu_decode_attention(*args, pages_per_compute_block=2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(_reference(*args)),
                               atol=3e-2)


def test_jax_export_for_tpu_lowers_the_paged_kernel_on_the_pool():
    args = _kernel_args(np.random.default_rng(3), jnp.bfloat16)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    exp = export.export(jax.jit(pa.tpu_decode_attention), platforms=("tpu",))(*shapes)
    text = exp.mlir_module()
    assert exp.platforms == ("tpu",)
    assert "tpu_custom_call" in text
    # the pool goes in as it is stored: [K, NP, P, H] bf16, no transpose before the kernel
    assert "tensor<2x12x16x128xbf16>" in text and "stablehlo.transpose" not in text


@pytest.mark.patches_traced_code
@pytest.mark.parametrize("broken", ["no table on write", "no table on read"])
def test_the_view_test_catches_a_cache_ignoring_its_table(monkeypatch, broken):
    if broken == "no table on write":
        monkeypatch.setattr(pa, "slot_pages", lambda table, pos, n, p: (
            jnp.where(pos // p < table.shape[1], pos // p, n), pos % p))
    else:
        monkeypatch.setattr(pa, "gather_pages", lambda pages, table: jnp.swapaxes(
            pages[:, : table.size].reshape(pages.shape[0], *table.shape, *pages.shape[2:]),
            0, 1).reshape(table.shape[0], pages.shape[0], -1, pages.shape[-1]))
    with pytest.raises(AssertionError):
        test_the_view_of_shuffled_pages_is_the_contiguous_cache()


@pytest.mark.parametrize("drafter", ["plain", "ngram tree"])
def test_a_paged_target_alone_decodes_as_its_inner_target(drafter):
    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.models.base import Model
    from jaxspec.serving.paged_cache import PagedTarget

    inner = tiny_model(packed=True, eos=(-1,))
    paged = Model(target=PagedTarget(inner.target, 8), params=inner.params, eos_token_ids=(-1,))
    d, gamma = (None, 0) if drafter == "plain" else (NgramDrafter(64, 1, 3, branches=2, depth=3), 1)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [9, 8, 7]]
    want, got = (Engine(m, d, None, num_speculative_tokens=gamma, max_context=64)
                 .generate(prompts, max_new_tokens=20) for m in (inner, paged))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(len(r.token_ids) == 20 for r in got)
