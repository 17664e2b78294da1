"""The paged serving forward reads each layer's pool through the page table (models/paged_layer.py):

- the XLA path (CPU) equals attention over the gathered contiguous view, with shuffled page
  tables and mixed row lengths, for decode, a chain verify window, a tree mask, a sliding window,
  a soft cap and a prompt chunk; a wrong page offset breaks it (the control);
- the TPU path (JAX's paged flash kernel, Pallas interpret mode) and the GPU path (JAX's Triton
  paged kernel body, interpret mode) equal the same reference on bfloat16-exact pools;
- a PagedTarget's forward reading pages equals one reading the gathered view (Llama and a Gemma
  with sliding layers), and greedy decoding through it is token for token the inner target's;
- the TPU serving programs (decode, tree verify, prefill chunk) exported with
  `jax.export(platforms=["tpu"])` call the kernel once per layer on the pool as stored (read
  from the module text), and the CUDA ones JAX's Triton paged kernel once per layer;
- on a (2, 2) mesh the TPU kernel runs per kv-head shard of the pool under shard_map and
  equals the reference;
- the optimised CPU decode loop (plain and speculative) copies or gathers no pool-sized buffer
  (the view path, the control, does, per layer's k and v).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxspec import hlo
from jaxspec.models import blocks
from jaxspec.models import paged_attention as pa
from jaxspec.models import paged_layer as pl_
from jaxspec.serving.paged_cache import PagedTarget
from tiny import tiny_config, tiny_model

K, NP, P, H, N, B, MP = 2, 16, 8, 32, 4, 3, 4


def pools(dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 2)
    # bfloat16-exact values: the TPU kernel reads K/V in bf16, so the reference is exact too
    return tuple(jax.random.normal(k, (K, NP, P, H)).astype(jnp.bfloat16).astype(dtype)
                 for k in ks)


def shuffled_table(seed=0):
    pages = np.random.default_rng(seed).permutation(NP)[: B * MP]
    return jnp.asarray(pages.reshape(B, MP), jnp.int32)


def tree_mask(parents):
    t = len(parents)
    anc = np.eye(t, dtype=bool)
    for i in range(t):
        j = parents[i]
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return jnp.broadcast_to(jnp.asarray(anc), (B, t, t))


CASES = {  # name: (T, sliding window, tree parents, soft cap)
    "decode": (1, None, None, None),
    "verify": (4, None, None, None),
    "tree": (4, None, (-1, 0, 0, 1), None),
    "sliding": (4, 6, None, None),
    "softcap": (4, None, None, 5.0),
    "prefill chunk": (16, None, None, None),
}


def case(name, seed=0):
    t, window, parents, cap = CASES[name]
    ks = jax.random.split(jax.random.key(seed + 10), 3)
    lens = jnp.array([0, 13, MP * P - t], jnp.int32)  # a fresh row, a mid row, a full row
    # a tree node sits at its depth (its ancestors' count): siblings share positions
    depth = jnp.arange(t) if parents is None else tree_mask(parents)[0].sum(-1) - 1
    positions = lens[:, None] + depth
    q = jax.random.normal(ks[0], (B, t, N, H))
    kw, vw = (jax.random.normal(k, (B, t, K, H)).astype(jnp.bfloat16).astype(jnp.float32)
              for k in ks[1:])
    mask = None if parents is None else tree_mask(parents)
    return q, kw, vw, positions, dict(window=window, window_mask=mask, softcap=cap)


def reference(q, kp, vp, table, kw, vw, positions, kw_args):
    """Attention over each row's pages gathered into a contiguous view."""
    return blocks.masked_attention(q, pa.gather_pages(kp, table), pa.gather_pages(vp, table), kw,
                                   vw, positions[:, 0], positions, scale=0.2, **kw_args)


def paged(q, kp, vp, table, kw, vw, positions, kw_args, impl, interpret=False):
    return pl_.attend(q, pl_.PagedLayer(kp, table), pl_.PagedLayer(vp, table), kw, vw, positions,
                      scale=0.2, impl=impl, interpret=interpret, **kw_args)


@pytest.mark.parametrize("name", list(CASES))
def test_the_xla_path_equals_the_gathered_view(name):
    kp, vp = pools()
    table = shuffled_table(1)
    q, kw, vw, pos, args = case(name)
    want = reference(q, kp, vp, table, kw, vw, pos, args)
    got = paged(q, kp, vp, table, kw, vw, pos, args, "xla")
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_a_wrong_page_offset_is_caught():
    """The control: a table shifted by one page (every row reads its neighbour page) differs."""
    kp, vp = pools()
    table = shuffled_table(1)
    q, kw, vw, pos, args = case("verify")
    want = reference(q, kp, vp, table, kw, vw, pos, args)
    got = paged(q, kp, vp, jnp.roll(table, 1, axis=1), kw, vw, pos, args, "xla")
    assert float(jnp.abs(got - want)[1:].max()) > 1e-2


@pytest.mark.parametrize("name", ["decode", "verify", "tree", "prefill chunk", "softcap",
                                  "sliding"])
def test_the_tpu_kernel_path_in_interpret_mode_equals_the_gathered_view(name):
    """Sliding-window layers take the XLA loop on TPU too (the kernel has no per-query lower
    bound); the rest run JAX's paged flash kernel on the pool."""
    kp, vp = pools(seed=2)
    table = shuffled_table(2)
    q, kw, vw, pos, args = case(name, seed=2)
    want = reference(q, kp, vp, table, kw, vw, pos, args)
    got = paged(q, kp, vp, table, kw, vw, pos, args, "pallas_tpu", interpret=True)
    # the kernel rounds q to bf16 for its products: bf16 tolerance
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
    wrong = paged(q, kp, vp, jnp.roll(table, 1, axis=1), kw, vw, pos, args, "pallas_tpu",
                  interpret=True)
    assert float(jnp.abs(wrong - want)[1:].max()) > 0.1


@pytest.mark.parametrize("name", ["decode", "verify", "tree"])
def test_the_gpu_kernel_path_in_interpret_mode_equals_the_gathered_view(name):
    kp, vp = pools(seed=3)
    table = shuffled_table(3)
    q, kw, vw, pos, args = case(name, seed=3)
    want = reference(q, kp, vp, table, kw, vw, pos, args)
    got = paged(q, kp, vp, table, kw, vw, pos, args, "pallas_gpu", interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5)


def gemma_target():
    from jaxspec.models import gemma

    cfg = gemma.GemmaConfig(family="gemma3", query_pre_attn_scalar=16.0, vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=5,
                            sliding_layers=(True, False), max_position_embeddings=512)
    return gemma.GemmaTarget(cfg)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_paged_target_reading_pages_equals_one_reading_the_view(family):
    if family == "llama":
        model = tiny_model(layers=2)
        target, params = model.target, model.params
    else:
        target = gemma_target()
        params = target.init_params(jax.random.key(0))
    pages, view = PagedTarget(target, 4), PagedTarget(target, 4, read="view")
    cache = pages.init_cache(params, B, 24)
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(cache.num_pages).reshape(cache.page_table.shape), jnp.int32)
    cache = cache.with_table(table)
    prompt = jnp.asarray(rng.integers(1, 64, (B, 13)), jnp.int32)
    cache = pages.forward(params, prompt, cache).cache.with_lengths(jnp.array([13, 9, 11]))
    tokens = jnp.asarray(rng.integers(1, 64, (B, 4)), jnp.int32)
    mask = tree_mask((-1, 0, 0, 1))
    positions = cache.lengths[:, None] + jnp.array([0, 1, 1, 2])
    outs = [t.forward(params, tokens, cache, positions=positions, window_mask=mask,
                      write_cache=False) for t in (pages, view)]
    np.testing.assert_allclose(outs[0].hidden, outs[1].hidden, atol=1e-4)
    for a, b in zip(jax.tree.leaves(outs[0].window_kv), jax.tree.leaves(outs[1].window_kv)):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("drafter", ["plain", "ngram tree"])
def test_greedy_through_pages_is_the_inner_targets(drafter):
    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.engine.runner import Engine
    from jaxspec.models.base import Model

    inner = tiny_model(eos=(-1,))  # unpacked: the XLA attention on both sides
    model = Model(target=PagedTarget(inner.target, 8), params=inner.params, eos_token_ids=(-1,))
    d, gamma = (None, 0) if drafter == "plain" else (NgramDrafter(64, 1, 3, branches=2, depth=3), 1)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [9, 8, 7]]
    want, got = (Engine(m, d, None, num_speculative_tokens=gamma, max_context=64)
                 .generate(prompts, max_new_tokens=20) for m in (inner, model))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def bf16_target(layers=2):
    cfg = tiny_config(layers=layers, hidden=512, dtype="bfloat16")  # head dim 128: TPU lanes
    model = tiny_model(layers=layers, hidden=512, dtype="bfloat16")
    return PagedTarget(model.target, 16, num_pages=48), model.params, cfg


@pytest.mark.parametrize("program", ["decode", "tree verify", "prefill chunk"])
def test_the_exported_tpu_serving_program_calls_the_paged_kernel_per_layer(program):
    target, params, cfg = bf16_target()
    t = {"decode": 1, "tree verify": 4, "prefill chunk": 64}[program]
    cache = jax.eval_shape(lambda: target.init_cache(params, 4, 128))
    tokens = jax.ShapeDtypeStruct((4, t), jnp.int32)
    p_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)

    def step(params, tokens, cache):
        if program == "tree verify":
            pos = cache.lengths[:, None] + jnp.array([0, 1, 1, 2])
            out = target.forward(params, tokens, cache, positions=pos,
                                 window_mask=tree_mask((-1, 0, 0, 1))[:1].repeat(4, 0),
                                 write_cache=False)
            return out.hidden, out.window_kv
        out = target.forward(params, tokens, cache)
        return out.hidden, out.cache

    exported = export.export(jax.jit(step), platforms=["tpu"])(p_shapes, tokens, cache)
    text = exported.mlir_module()
    assert hlo.compiled_attention(text) == "pallas_tpu"
    assert hlo.attention_kernel_calls(text) == cfg.num_layers
    pool = np.prod(cache.k[0].shape)  # [K, NP, P, H]: 48 pages, not the rows' 4 x 8
    assert all(pool in ops for ops in hlo.attention_kernel_operands(text))
    # the control: the view path's kernel (the contiguous cache's) takes the gathered view
    view = dataclasses.replace(target, read="view")
    exported = export.export(jax.jit(lambda p, x, c: view.forward(p, x, c).hidden),
                             platforms=["tpu"])(p_shapes, tokens, cache)
    assert not any(pool in ops for ops in hlo.attention_kernel_operands(exported.mlir_module()))


@pytest.mark.parametrize("t", [1, 4])
def test_the_exported_cuda_serving_program_calls_the_triton_paged_kernel(t):
    target, params, cfg = bf16_target()
    cache = jax.eval_shape(lambda: target.init_cache(params, 4, 128))
    p_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    checks = [export.DisabledSafetyCheck.custom_call(c) for c in hlo.ATTENTION_TARGETS]
    exported = export.export(jax.jit(lambda p, x, c: target.forward(p, x, c).hidden),
                             platforms=["cuda"], disabled_checks=checks)(
        p_shapes, jax.ShapeDtypeStruct((4, t), jnp.int32), cache)
    text = exported.mlir_module()
    assert hlo.compiled_attention(text) == "pallas_gpu"
    assert hlo.attention_kernel_calls(text) == cfg.num_layers


def pool_copies(read: str, drafter) -> tuple[str, ...]:
    """Pool-sized (and row-view-sized) copies and gathers in the optimised decode loop of a
    standalone paged cache (tests/test_accelerator_path's program: the whole jitted loop)."""
    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.models.base import Model
    from test_accelerator_path import decode_hlo

    inner = tiny_model(layers=2, eos=(-1,))
    model = Model(target=PagedTarget(inner.target, 8, read=read), params=inner.params,
                  eos_token_ids=(-1,))
    d = NgramDrafter(64, 1, 3) if drafter == "ngram" else None
    text = decode_hlo(model, d, None, batch=2, capacity=200)  # 2 rows x 25 pages of 8 slots
    pool, view = (2, 2 * 25, 8, 16), (2, 2, 200, 16)  # [K, NP, P, H], a [B, K, S, H] view
    return hlo.cache_traffic(text, pool).copies + hlo.cache_traffic(text, view).copies


@pytest.mark.parametrize("drafter", ["plain", "ngram"])
def test_the_optimised_cpu_decode_loop_copies_no_pool_sized_buffer(drafter):
    assert pool_copies("pages", drafter) == ()
    gathered = pool_copies("view", drafter)  # the control: the gather path copies views
    assert len(gathered) >= 2 * 2, gathered


def test_the_kernel_on_a_pool_sharded_over_kv_heads_runs_per_head_shard():
    """A (2, 2) mesh of simulated CPU devices (a subprocess: tests/paged_mesh_check.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(here / "paged_mesh_check.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["manual"]
    assert got["diff"] < 3e-2 and got["shifted_diff"] > 0.1, got

