"""The accelerator path, measured device-independently on CPU: the compiled decode loop copies and
zero-fills no cache-sized buffer (every layout x drafter), the stacked layout gives the unrolled
layout's tokens, accelerator defaults. The attention op's backends: tests/test_attention_impls.py."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import eagle_like, tiny_model

from jaxspec import hlo
from jaxspec.decode import speculate
from jaxspec.drafters.draft_model import ModelDrafter, layer_skip_drafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.models import llama
from jaxspec.decode.sampling import SamplingParams

# XLA:CPU's YNNPACK library fusion (CPU only, absent on TPU/GPU) takes reductions out of XLA's own
# fusions and materialises their operands; compile as the accelerator compilers fuse.
ACCEL_LIKE = {"xla_cpu_experimental_ynn_fusion_type": ""}
CAPACITY = 200  # distinct from every other dim of the tiny model, so cache buffers are unambiguous


def _model(layout):
    m = tiny_model(seed=0, layers=4, packed=layout == "packed")
    if layout == "stacked":
        m = dataclasses.replace(m, params=llama.stack_layers(m.params))
    return m


def _drafter(m, method):
    if method == "eagle":  # initialised from the same target (its unrolled form)
        return eagle_like(_model("unrolled"))
    return {
        "none": (None, None),
        "ngram": (NgramDrafter(64, 1, 3), None),
        "layer_skip": (layer_skip_drafter(m.target, 2), None),
        "draft_model": (ModelDrafter(model=llama.LlamaTarget(m.cfg), target_vocab=64), m.params),
    }[method]


def decode_hlo(m, drafter, dparams, batch=2, prompt=32, capacity=CAPACITY) -> str:
    """The optimised HLO of the whole jitted decode loop (abstract state: nothing is run)."""
    e = Engine(m, drafter, dparams, num_speculative_tokens=4 if drafter else 0)
    sp = SamplingParams.make()
    args = (m.params, dparams, jnp.zeros((batch, prompt), jnp.int32), jnp.full((batch,), 5, jnp.int32),
            jnp.full((batch,), 8, jnp.int32), sp, jax.random.key(0), jnp.arange(batch, dtype=jnp.int32))
    state = jax.eval_shape(lambda *a: speculate.prefill(e.spec, *a, capacity=capacity), *args)
    lowered = speculate.decode_jit.lower(e.spec, m.params, dparams, state, sp, jnp.int32(1))
    return lowered.compile(compiler_options=ACCEL_LIKE).as_text()


@pytest.mark.parametrize("layout", ["stacked", "unrolled", "packed"])
@pytest.mark.parametrize("method", ["none", *cases.names("hlo")])  # tests/cases.py
def test_decode_loop_copies_no_cache(layout, method):
    """Batch 2, and batch 1 on the accelerators' layouts: there XLA drops the unit batch dim,
    and a layout or fusion choice around it copied whole caches (before session 10: EAGLE 16
    drafter-cache copies a step unrolled, 26 + 10 stacked; n-gram 14 stacked)."""
    m = _model(layout)
    drafter, dparams = _drafter(m, method)
    c = m.cfg
    for b in (2, 1) if layout != "packed" else (2,):
        text = decode_hlo(m, drafter, dparams, batch=b)
        per_layer = (b, c.num_kv_heads, CAPACITY, c.head_dim)
        for shape in (per_layer, (c.num_layers, *per_layer)):  # a layer's cache, the stack
            traffic = hlo.cache_traffic(text, shape)
            assert (b, traffic.copies, traffic.zero_fills) == (b, (), ())


def test_copy_counter_sees_a_cache_through_scan_xs():
    """The pre-fix stacked forward (cache as lax.scan xs/ys) in miniature: the counter must see the
    zero-filled ys buffer and the copies."""
    shape = (4, 2, 2, CAPACITY, 16)

    def step(cache, x):
        def body(h, kv):
            return h + 1.0, kv.at[:, :, 0].set(h)
        return jax.lax.scan(body, x, cache)

    def loop(cache, x):
        return jax.lax.fori_loop(0, 3, lambda i, c: step(*c)[::-1], (cache, x))

    text = jax.jit(loop, donate_argnums=0).lower(jnp.zeros(shape), jnp.zeros((2, 16))).compile(
        compiler_options=ACCEL_LIKE).as_text()
    traffic = hlo.cache_traffic(text, shape[1:])
    assert traffic.copies or traffic.zero_fills


def stack_prefix_slices(text: str, stacked_shapes, n: int) -> list[str]:
    """Buffers in the optimised HLO shaped like the first n layers of a stacked weight
    ([n, ...] of an [L, ...] leaf): what slicing the target's stack for a drafter costs per step."""
    per_layer = {tuple(s[1:]) for s in stacked_shapes}
    out = []
    for name, instrs in hlo.parse(text).items():
        if name.startswith("fused") or "wrapped" in name or "computation" in name:
            continue  # inside a fusion: no buffer of its own
        for ins in instrs:
            if ins.opcode in ("parameter", "get-tuple-element", "tuple", "bitcast"):
                continue
            for dims in re.findall(r"\w+\[([\d,]*)\]", hlo.shape_of(ins.line)):
                shape = tuple(int(d) for d in dims.split(",") if d)
                if len(shape) >= 2 and shape[0] == n and shape[1:] in per_layer:
                    out.append(ins.line.strip()[:120])
    return out


def test_layer_skip_on_a_stack_slices_no_layers_per_step():
    """layer_skip shares the target's [L, ...] weights: on the stacked layout its forward runs the
    first n layers of the stack in place, so the decode loop holds no [n, ...] slice of any weight
    (slicing the stack would copy n layers of weights every step). Distinct dims (L=5, n=3, D=40,
    F=80) keep weight shapes apart from every other buffer."""
    m = tiny_model(seed=0, layers=5, hidden=40)
    m = dataclasses.replace(m, params=llama.stack_layers(m.params))
    shapes = [x.shape for x in jax.tree.leaves(m.params["layers"])]
    text = decode_hlo(m, layer_skip_drafter(m.target, 3), None)
    assert stack_prefix_slices(text, shapes, 3) == []


@pytest.mark.parametrize("method", ["none", "ngram", "layer_skip"])
def test_stacked_layout_gives_unrolled_tokens(method):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 64, n)] for n in (7, 19, 12)]
    out = {}
    for layout in ("unrolled", "stacked"):
        m = _model(layout)
        drafter, dparams = _drafter(m, method)
        e = Engine(m, drafter, dparams, num_speculative_tokens=3 if drafter else 0)
        out[layout] = [r.token_ids for r in e.generate(prompts, max_new_tokens=24, batch_size=3)]
    assert out["stacked"] == out["unrolled"]


# ---------------------------------------------------------------------------- accelerator defaults


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_auto_dtype_and_layout_follow_the_backend(monkeypatch, backend):
    from jaxspec.kernels import available
    from jaxspec.loading import params as lp

    monkeypatch.setattr(lp.jax, "default_backend", lambda: backend)
    dtype = lp.resolve_dtype("auto")
    layout, why = lp.resolve_layout("auto", dtype)
    assert why.startswith("auto")
    if backend == "cpu":
        assert dtype == "float32" and layout == ("packed" if available() else "unrolled")
    else:
        assert (dtype, layout) == ("bfloat16", "stacked")
    assert lp.resolve_dtype("float32") == "float32"  # explicit choices stay


def test_load_model_auto_dtype_on_this_cpu(tiny_llama_dir):
    from jaxspec.loading import load_model

    m = load_model(tiny_llama_dir, dtype="auto", layout="stacked")
    assert m.cfg.dtype == "float32" and m.stacked
    # the attention impl shows in the metrics (CPU: the XLA reference)
    assert Engine(m).generate([[5, 9]], max_new_tokens=2)[0].metrics["attention"] == "xla"


def test_fixed_capacity_engine_gives_the_same_tokens_and_one_capacity():
    m = _model("unrolled")
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(1, 64, n)] for n in (5, 40)]
    plain = [r.token_ids for r in Engine(m).generate(prompts, max_new_tokens=12)]
    fixed = Engine(m, max_context=96)
    assert {fixed.capacity(16, 12), fixed.capacity(64, 12)} == {96}
    assert [r.token_ids for r in fixed.generate(prompts, max_new_tokens=12)] == plain
    from jaxspec.errors import JaxspecError

    with pytest.raises(JaxspecError, match="max_context=96"):
        fixed.generate([list(range(1, 60))], max_new_tokens=40)


def test_compare_greedy_tells_a_near_tie_from_a_real_difference(tiny_llama_dir):
    from jaxspec.tools.greedy_check import compare_greedy
    from jaxspec.loading import load_model

    m = load_model(tiny_llama_dir)
    prompt = [5, 9, 17, 33, 2]
    plain = Engine(m, chat_template=False).generate([prompt], max_new_tokens=8)[0].token_ids
    assert compare_greedy(m, prompt, plain, plain)[0]
    other = plain[:3] + [(plain[3] + 1) % m.cfg.vocab_size] + plain[4:]
    same, tie, gap = compare_greedy(m, prompt, plain, other, margin=1e9)
    assert not same and tie and gap > 0
    assert compare_greedy(m, prompt, plain, other, margin=0.0)[1] is False


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_batch_one_step_copies_no_cache(layout):
    """At batch 1 the size-1 batch dim leaves XLA free to re-lay the cache out: a loop over cache
    blocks inside the stacked layer loop made it copy the whole stack (found by the roofline)."""
    from jaxspec.tools import roofline

    target = _model("unrolled").target
    for window in (1, 5):
        r = roofline.measure(target, layout, "verify", 1, window, capacity=512, valid=256)
        assert (r.cache_copies, r.zero_fills) == (0, 0)


# ------------------------------------------------- the kernels in every shipped config's programs

CONFIGS = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
KERNEL = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}


def _tiny_checkpoint(method, path, target, fmt="auto", eagle3_layer_ids="input"):
    """An untrained drafter of `method` for the tiny target (the shipped checkpoints are sized
    for SmolLM2): the config's method, tree, lookup and adaptive settings stay as shipped."""
    from jaxspec.train import block as block_train
    from jaxspec.train import methods

    if method == "draft_model":  # the target itself as the draft model
        return ModelDrafter(model=target.target, target_vocab=64), target.params
    m = {"eagle": methods.Eagle(hidden_layers=(1, 2, 2), input_scale=1.0),
         "medusa": methods.Medusa(num_heads=3),
         "block": block_train.Block(hidden_layers=(1, 2, 2), input_scale=1.0, block_size=6,
                                    extra_mlp=16)}[method]
    params, frozen = m.init(target, np.arange(0, 64, 2, dtype=np.int32), jax.random.key(7))
    return m.drafter(target.target), m.runtime(params, frozen)


@functools.lru_cache(maxsize=2)
def _device_engine(config_name):
    """(config, the engine it builds on a device) on a tiny random target in the device's
    defaults (the config's dtype there: "auto" is bfloat16; the stacked layout)."""
    from jaxspec.config import load_config
    from jaxspec.drafters import registry

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / config_name)
    dtype = {"auto": "bfloat16"}.get(config.model.dtype, config.model.dtype)
    layers = 10 if config.speculative.method == "layer_skip" else 4  # the config skips from 8
    cfg = dataclasses.replace(_model("unrolled").cfg, dtype=dtype, num_layers=layers)
    params = llama.stack_layers(llama.init_params(cfg, jax.random.key(0), scale=0.3))
    target = dataclasses.replace(_model("unrolled"), cfg=cfg, params=params)
    spec = config.speculative
    drafter = dparams = None
    if spec.method != "none":
        ctx = registry.BuildContext(target=target, spec=spec, load_checkpoint=_tiny_checkpoint,
                                    load_model=lambda *a, **k: target)
        drafter, dparams = registry.get(spec.method).factory(spec.options, ctx)
        if spec.lookup.min_ngram:
            from jaxspec.drafters.lookup import LookupFirst

            drafter = LookupFirst(drafter, NgramDrafter(64, spec.lookup.min_ngram,
                                                        spec.lookup.max_ngram), name="lookup")
    adaptive = spec.adaptive if spec.adaptive.enabled and drafter else None
    if adaptive is not None:  # flat costs: an export measures nothing
        nodes = getattr(drafter, "num_nodes", None) or spec.num_speculative_tokens
        adaptive = dataclasses.replace(adaptive, step_costs=[1.0] * (nodes + 1), draft_cost=0.0)
    e = Engine(target, drafter, dparams,
               num_speculative_tokens=spec.num_speculative_tokens if drafter else 0,
               adaptive=adaptive)
    return config, e


def exported_programs(e, platform, capacity, batch=1, prompt=32):
    """(prefill, decode) programs of `e` exported for `platform` (StableHLO text)."""
    from jax import export

    checks = [export.DisabledSafetyCheck.custom_call(t) for t in hlo.ATTENTION_TARGETS]
    spec = e.spec_for(batch)
    sp = SamplingParams.make()
    args = (e.model.params, e.drafter_params, jnp.zeros((batch, prompt), jnp.int32),
            jnp.ones((batch,), jnp.int32), jnp.full((batch,), 8, jnp.int32), sp,
            jax.random.key(0), jnp.zeros((batch,), jnp.int32))
    prefill = export.export(speculate.prefill_jit, platforms=[platform], disabled_checks=checks)(
        spec, *args, capacity=capacity)
    state = jax.eval_shape(lambda *a: speculate.prefill(spec, *a, capacity=capacity), *args)
    if spec.adaptive is not None:  # the controller's state (flat costs: nothing is measured)
        state = dataclasses.replace(state, adaptive=spec.adaptive.init(
            batch, [1.0] * (spec.adaptive.gamma + 1)))
    decode = export.export(speculate.decode_jit, platforms=[platform], disabled_checks=checks)(
        spec, e.model.params, e.drafter_params, state, sp, jnp.int32(1))
    return prefill.mlir_module(), decode.mlir_module()


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("config_name", CONFIGS)
def test_every_shipped_config_compiles_the_kernels_on_the_device(config_name, platform):
    """Each shipped config's prefill and decode programs, exported for TPU / CUDA as a device run
    would build them (the config's dtype there: "auto" is bfloat16; the stacked layout; the
    engine's capacity for the device), hold the attention kernel; float32 configs hold none (the
    exact XLA path). The capacity before rounding (prompt bucket + bucket(max_new) + nodes + 1)
    is no kernel size, and exports without any kernel."""
    from jaxspec.models import attention

    backend = {"tpu": "tpu", "cuda": "gpu"}[platform]
    config, e = _device_engine(config_name)
    dtype = e.model.cfg.dtype
    capacity = e.capacity(32, 8, backend=backend)
    assert capacity % attention.KERNEL_SLOTS == 0
    want = KERNEL[platform] if dtype == "bfloat16" else "xla"
    for text in exported_programs(e, platform, capacity):
        assert hlo.compiled_attention(text) == want
        assert (hlo.attention_kernel_calls(text) > 0) == (want != "xla")
    if want != "xla" and config_name == CONFIGS[0]:  # the old, unrounded capacity: no kernel
        raw = e.capacity(32, 8, backend="cpu")
        assert raw % 16 and all(hlo.compiled_attention(t) == "xla"
                                for t in exported_programs(e, platform, raw))


# ----------------------------------------------------------------------------- loading peak

_PEAK_SCRIPT = """
import sys, numpy as np, jax
from jaxspec.loading.params import assemble, place, expected_shapes
from jaxspec.models.llama import ModelConfig

def status(key):
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key))

cfg = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_layers=8,
                  num_heads=8, num_kv_heads=4, head_dim=128, max_position_embeddings=512)
params = assemble(cfg, {k: np.ones(s, np.float32) for k, s in expected_shapes(cfg).items()},
                  source="test")
# compile every program first (XLA's own memory is not the load's): a first load, released
# (with glibc's threshold fixed its buffers go back to the OS)
jax.block_until_ready(place(params, "bfloat16", "stacked"))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the present
before = status("VmRSS")
jax.block_until_ready(place(params, "bfloat16", "stacked"))
print(status("VmHWM") - before)
"""


def test_loading_the_stacked_layout_peaks_at_weights_plus_one_layer():
    """A 168 MB (bf16) model loaded from float32 host tensors into the stacked layout: the
    process's peak memory grows by at most the final params + one layer + 5% (stacking after
    placing every per-layer tensor grew it by ~1.7x the params). glibc's large-allocation
    threshold is fixed so freed tensors leave the resident set."""
    import os
    import subprocess
    import sys

    from jaxspec.loading.params import expected_shapes, load_peak_bytes

    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072", "JAX_PLATFORMS": "cpu"}
    grew = int(subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], env=env, check=True,
                              capture_output=True, text=True).stdout.split()[-1])
    cfg = llama.ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048,
                            num_layers=8, num_heads=8, num_kv_heads=4, head_dim=128,
                            max_position_embeddings=512)
    final = load_peak_bytes(cfg, "bfloat16")["final"]
    layer = sum(2 * int(np.prod(s)) for k, s in expected_shapes(cfg).items()
                if k.startswith("layers.0."))
    assert grew <= 1.05 * final + layer, (grew, final, layer)


def test_llama3_8b_stacked_load_fits_weights_plus_one_tensor():
    """By shape arithmetic (nothing read): Llama-3-8B in bf16 peaks at its 16.06 GB of weights +
    one tensor (a 117 MB MLP matrix) while stacking, under the 16 GiB of a v5e only with headroom
    for nothing else, and not at ~2x as before."""
    from jaxspec.loading.params import load_peak_bytes

    cfg = llama.ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                            max_position_embeddings=8192, tie_word_embeddings=False)
    got = load_peak_bytes(cfg, "bfloat16")
    assert got["final"] == 16_060_522_496 and got["largest_tensor"] == 14336 * 4096 * 2
    assert got["peak"] <= 1.01 * got["final"]


def test_bf16_logits_are_not_rounded_to_bf16():
    """A bf16 model's LM head accumulates and returns f32: logits differ from their bf16 rounding
    (a head that rounded first would give only bf16-representable values)."""
    m = _model("unrolled")
    cfg = dataclasses.replace(m.cfg, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), m.params)
    hidden = jax.random.normal(jax.random.key(1), (2, 3, cfg.hidden_size), jnp.bfloat16)
    logits = llama.lm_head(params, hidden)
    assert logits.dtype == jnp.float32
    assert np.any(np.asarray(logits) != np.asarray(logits.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_eagle_drafter_attends_on_the_kernel_in_a_bf16_target(platform):
    """The EAGLE config on a bf16 target (the device default), exported for TPU / CUDA: the
    drafter's own layer runs in bf16 and its attention is a kernel call, told apart from the
    target's by its operand, the drafter's one-layer cache [B, K, S, H] (the target's stacked
    cache is num_layers times that). A float32 drafter layer (as trained) attends on XLA."""
    config, e = _device_engine("smollm2-135m-eagle.yaml")
    backend = {"tpu": "tpu", "cuda": "gpu"}[platform]
    capacity = e.capacity(32, 8, backend=backend)
    assert e.drafter.cfg.dtype == "bfloat16"
    assert all(w.dtype == jnp.bfloat16 for w in jax.tree.leaves(e.drafter_params["layer"]))
    c = e.drafter.cfg
    drafter_cache = c.num_kv_heads * capacity * c.head_dim  # batch 1
    _, decode = exported_programs(e, platform, capacity)
    sizes = [max(ops) for ops in hlo.attention_kernel_operands(decode) if ops]
    assert drafter_cache in sizes, (sizes, drafter_cache)
    assert e.model.cfg.num_layers * drafter_cache in sizes  # the target's, for comparison
