"""Run by tests/test_sharding.py in a subprocess with 8 simulated CPU devices (the flag must be set
before jax starts): sharded generation against one device, shardings inside and after the loop,
collectives in the compiled decode step. Prints one JSON object on the last line.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_check.py parity,inside,collectives,loading,smollm2,copies,kernels,cli
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # tiny, this jaxspec

import jax
import jax.numpy as jnp
import numpy as np
from tiny import TinyModel, dflash_like

from jaxspec import hlo
from jaxspec.decode import speculate
from jaxspec.decode.sampling import SamplingParams
from jaxspec.drafters import NgramDrafter
from jaxspec.drafters.draft_model import ModelDrafter, layer_skip_drafter
from jaxspec.engine.runner import Engine
from jaxspec.models import decoder, llama
from jaxspec.sharding import MeshPlan, make_mesh
from jaxspec.tools import roofline
from jaxspec.train import methods

V = 64
PROMPTS = [[1, 2, 3, 4, 5], list(range(3, 20)), [7, 8, 9], list(range(10, 40)),
           [5, 6, 5, 6, 5], [9] * 12, [2, 4, 8, 16, 32], list(range(40, 60))]
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def model(layers=2, heads=8, kv_heads=4, seed=0) -> TinyModel:
    """Head counts that a model axis of 1, 2, 4 or 8 divides (SmolLM2's 9 / 3 would not)."""
    cfg = llama.ModelConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=512,
    )
    return TinyModel(cfg, llama.init_params(cfg, jax.random.key(seed), scale=0.3))


def drafters(target):
    """(name, drafter, dparams, shard_drafter) for each method under test."""
    draft = model(layers=2, seed=1)
    eagle = methods.Eagle(hidden_layers=(0, 1, 1), input_scale=1.0)  # taps of a 2-layer target
    params, frozen = eagle.init(target, np.arange(0, V, 2, dtype=np.int32), jax.random.key(7))
    return [
        ("plain", None, None, False),
        ("ngram", NgramDrafter(V, 1, 3), (), False),
        ("draft_model", ModelDrafter(model=llama.LlamaTarget(draft.cfg), target_vocab=V), draft.params, False),
        ("draft_model_sharded", ModelDrafter(model=llama.LlamaTarget(draft.cfg), target_vocab=V), draft.params, True),
        ("eagle", eagle.drafter(target.cfg), eagle.runtime(params, frozen), False),
        ("eagle_sharded", eagle.drafter(target.cfg), eagle.runtime(params, frozen), True),
        ("dflash", *dflash_like(target), False),
    ]


# Meshes per method: every method on (2, 4) (both axes at once); each one-axis mesh with plain
# and one drafter of each kind (EAGLE on the model-only mesh, where the kv heads are replicated
# and its hidden-state taps are gathered; ngram on the data-only mesh); the shard_drafter
# variants on (2, 4).
MESHES = {
    "plain": ((1, 8), (2, 4), (8, 1)),
    "ngram": ((2, 4), (8, 1)),
    "draft_model": ((2, 4),),
    "draft_model_sharded": ((2, 4),),
    "eagle": ((1, 8), (2, 4)),
    "eagle_sharded": ((2, 4),),
    "dflash": ((2, 4),),  # its per-layer context caches [B, K, S, Hd] by rows
}


def generate(target, drafter, dparams, plan=None):
    eng = Engine(target, drafter, dparams, num_speculative_tokens=3 if drafter else 0, mesh=plan)
    res = eng.generate(PROMPTS, max_new_tokens=12, batch_size=len(PROMPTS))
    return [r.token_ids for r in res]


def spec_str(sharding) -> str:
    return str(tuple(sharding.spec))


def inside_loop(target, drafter, dparams, plan):
    """Shardings of the cache, the tokens and the drafter state inside a compiled while_loop."""
    eng = Engine(target, drafter, dparams, num_speculative_tokens=3 if drafter else 0, mesh=plan)
    sp = SamplingParams.make()
    state = eng.prefill(PROMPTS, 12, sp, 0, list(range(len(PROMPTS))), len(PROMPTS))
    seen = {}

    def record(name):
        return lambda s: seen.__setitem__(name, spec_str(s))

    def run(tparams, dparams, state):
        def body(s):
            s = speculate.decode_step(eng.spec, tparams, dparams, s, sp)
            jax.debug.inspect_array_sharding(s.cache.k[0], callback=record("cache"))
            jax.debug.inspect_array_sharding(s.tokens, callback=record("tokens"))
            if s.drafter_state is not None:
                leaf = jax.tree.leaves(s.drafter_state)[0]
                jax.debug.inspect_array_sharding(leaf, callback=record("drafter_state"))
            return s

        return jax.lax.fori_loop(0, 2, lambda i, s: body(s), state)

    after = jax.jit(run)(eng.model.params, eng.drafter_params, state)
    wq = eng.model.params["layers"][0]["wq"]
    wk = eng.model.params["layers"][0]["wk"]
    return {
        "inside": seen,
        "after": {"cache": spec_str(after.cache.k[0].sharding), "tokens": spec_str(after.tokens.sharding)},
        "wq_shard": list(wq.sharding.shard_shape(wq.shape)),
        "wk_shard": list(wk.sharding.shard_shape(wk.shape)),
        "cache_shard": list(after.cache.k[0].sharding.shard_shape(after.cache.k[0].shape)),
    }


def count_collectives(hlo: str) -> dict[str, int]:
    return {op: len(re.findall(rf"= [^=\n]*? {op}(-start)?\(", hlo)) for op in COLLECTIVES}


def decode_collectives(layers: int, shape, drafter_name="plain") -> dict[str, int]:
    """Collectives in the optimised HLO of one compiled decode loop."""
    target = model(layers=layers)
    _, drafter, dparams, shard = next(d for d in drafters(target) if d[0] == drafter_name)
    plan = MeshPlan(make_mesh(*shape), shard_drafter=shard)
    eng = Engine(target, drafter, dparams, num_speculative_tokens=3 if drafter else 0, mesh=plan)
    sp = SamplingParams.make()
    state = eng.prefill(PROMPTS, 12, sp, 0, list(range(len(PROMPTS))), len(PROMPTS))
    lowered = speculate.decode_jit.lower(
        eng.spec, eng.model.params, eng.drafter_params, state, sp, jnp.int32(4)
    )
    return count_collectives(lowered.compile(compiler_options=roofline.READ_ONLY_CPU).as_text())


# XLA:CPU's YNNPACK fusion (CPU only) materialises reduction operands; compile as the
# accelerator compilers fuse, and read-only (as tests/test_accelerator_path.py does for one device)
ACCEL_LIKE = roofline.compile_options()
# A CPU engine's capacity is prompt bucket + bucket(max_new) + nodes + 1 (odd, divisible by no
# block size: once the unrolled XLA path read it in one pass and XLA:CPU copied every layer's
# cache 4x a step); 256 is a device's (kernel_capacity). Both distinct from every model dim.
COPY_CAPACITIES = (201, 256)
COPY_MESHES = ((1, 4), (2, 4))  # 4 kv heads: one whole kv head per device on both
COPY_METHODS = ("plain", "ngram", "layer_skip", "draft_model", "draft_model_sharded", "eagle",
                "eagle_sharded")


def decode_copies(layout: str, name: str, shape, capacity: int) -> dict:
    """Cache-sized copies and zero-fills per step in the optimised HLO of the whole decode loop
    (draft, verify, commit) on a mesh, one row per device (batch = data size: XLA is free to
    re-lay out a unit batch dim, which is where copies appeared). Counted at one layer's cache
    shape per device, so any buffer as large as a layer's cache shard (the target's, a draft
    model's, EAGLE's, or a gathered whole) with the slot count among its dims counts."""
    target = model(layers=2)
    if name == "layer_skip":
        drafter, dparams, shard = layer_skip_drafter(target.target, 1), None, False
    else:
        _, drafter, dparams, shard = next(d for d in drafters(target) if d[0] == name)
    if layout == "stacked":
        target = dataclasses.replace(target, params=decoder.stack_layers(target.params))
    plan = MeshPlan(make_mesh(*shape), shard_drafter=shard)
    eng = Engine(target, drafter, dparams, num_speculative_tokens=3 if drafter else 0, mesh=plan)
    batch = shape[0]
    spec = eng.spec_for(batch)
    sp = SamplingParams.make()
    args = (eng.model.params, eng.drafter_params, jnp.zeros((batch, 32), jnp.int32),
            jnp.full((batch,), 5, jnp.int32), jnp.full((batch,), 8, jnp.int32), sp,
            jax.random.key(0), jnp.arange(batch, dtype=jnp.int32))
    state = jax.eval_shape(lambda *a: speculate.prefill(spec, *a, capacity=capacity), *args)
    lowered = speculate.decode_jit.lower(spec, eng.model.params, eng.drafter_params, state, sp,
                                         jnp.int32(4))
    text = lowered.compile(compiler_options=ACCEL_LIKE).as_text()
    c = target.cfg
    per_device = (batch // shape[0], c.num_kv_heads // shape[1], capacity, c.head_dim)
    traffic = hlo.cache_traffic(text, per_device)
    gathers = [x for x in traffic.copies if x.endswith(":all-gather")]
    return {"copies": len(traffic.copies), "zero_fills": len(traffic.zero_fills),
            "cache_gathers": len(gathers), "examples": list(traffic.copies[:4])}


COPY_LAYOUTS = ("unrolled", "stacked")  # what a mesh takes (packed is refused: sharding._refuse_packed)


def copy_cases() -> tuple:
    """(layout, method, mesh, capacity) for decode_copies: every pair, not every product (each
    compile reads a whole decode loop). At the odd CPU capacity each method twice, on both meshes
    and both layouts, the layouts by turns so every (layout, mesh) pair is there too; the device
    capacity for plain decoding on both meshes, both layouts. A copy that one pair of settings
    makes (a layout's cache write with a method's cache, a mesh's split with a method's) is seen;
    test_sharding checks the cover."""
    odd, device = COPY_CAPACITIES
    cases = []
    for i, name in enumerate(COPY_METHODS):
        turn = COPY_LAYOUTS[i % 2:] + COPY_LAYOUTS[:i % 2]
        cases += [(layout, name, shape, odd) for layout, shape in zip(turn, COPY_MESHES)]
    return tuple(cases) + tuple((layout, "plain", shape, device)
                                for layout, shape in zip(COPY_LAYOUTS, COPY_MESHES))


def copies() -> dict:
    """decode_copies for every case of copy_cases()."""
    return {f"{layout} {name} {shape[0]}x{shape[1]} S={capacity}":
            decode_copies(layout, name, shape, capacity)
            for layout, name, shape, capacity in copy_cases()}


def bf16_model(layout: str, layers: int = 2) -> TinyModel:
    """model() in bfloat16 (what takes the kernels on a device), unrolled or stacked."""
    m = model(layers=layers)
    cfg = dataclasses.replace(m.cfg, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), m.params)
    if layout == "stacked":
        params = decoder.stack_layers(params)
    return TinyModel(cfg, params)


def kernel_shards(layout: str, platform: str, shape=(2, 4), batch: int = 2,
                  capacity: int = 512, prompt: int = 256) -> dict:
    """The decode (and prefill) programs of plain decoding on a mesh, exported for `platform`
    ("tpu" / "cuda") in bf16, a prompt long enough for the prefill kernels (G*T > 256 rows per
    kv head): per attention kernel call, its largest operand's element count
    against the cache's (one layer's, or the stack's) global and per-device sizes. Under
    shard_map a kernel's operands are its device's shard; a call on global operands means GSPMD
    gathers them to every device first (a custom call has no partitioning rule)."""
    from jax import export

    target = bf16_model(layout)
    plan = MeshPlan(make_mesh(*shape))
    eng = Engine(target, mesh=plan)
    spec = eng.spec_for(batch)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in hlo.ATTENTION_TARGETS]
    sp = SamplingParams.make()
    params = plan.place_target(target.params, target.target)
    args = (params, None, jnp.zeros((batch, prompt), jnp.int32), jnp.ones((batch,), jnp.int32),
            jnp.full((batch,), 8, jnp.int32), sp, jax.random.key(0), jnp.zeros((batch,), jnp.int32))
    state = jax.eval_shape(lambda *a: speculate.prefill(spec, *a, capacity=capacity), *args)
    prefill = export.export(speculate.prefill_jit, platforms=[platform], disabled_checks=checks)(
        spec, *args, capacity=capacity).mlir_module()
    decode = export.export(speculate.decode_jit, platforms=[platform], disabled_checks=checks)(
        spec, params, None, state, sp, jnp.int32(1)).mlir_module()
    c = target.cfg
    layer = batch * c.num_kv_heads * capacity * c.head_dim
    whole = layer * (c.num_layers if layout == "stacked" else 1)
    out = {"cache_global": whole, "cache_per_device": whole // (shape[0] * shape[1])}
    for name, text in (("prefill", prefill), ("decode", decode)):
        ops = hlo.attention_kernel_operands(text)
        out[name] = {"calls": len(ops), "largest": sorted({max(o) for o in ops if o}),
                     "attention": hlo.compiled_attention(text)}
    return out


def kernels_on_mesh() -> dict:
    """kernel_shards per layout x platform on (2, 4); and the TPU kernel (interpret mode) run on
    the mesh against the XLA path: the same values."""
    out = {f"{layout} {platform}": kernel_shards(layout, platform)
           for layout in ("unrolled", "stacked") for platform in ("tpu", "cuda")}
    out["interpret"] = interpret_on_mesh()
    return out


def interpret_on_mesh() -> dict:
    """attend on the GPU Pallas kernels in interpret mode under shard_map on a (2, 4) mesh (cache,
    q and window sharded by rows and kv heads) vs the XLA path on one device: max |diff| per impl,
    for a per-layer cache and a stack at a traced layer."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxspec.models import attention, attention_kernels

    mesh = make_mesh(2, 4)
    b, t, n, kv, s, h, layers = 2, 3, 8, 4, 128, 16, 2
    ks = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32)
    kc = jax.random.normal(ks[1], (layers, b, kv, s, h), jnp.float32)
    vc = jax.random.normal(ks[2], (layers, b, kv, s, h), jnp.float32)
    kw = jax.random.normal(ks[3], (b, t, kv, h), jnp.float32)
    vw = jax.random.normal(ks[4], (b, t, kv, h), jnp.float32)
    lengths = jnp.array([37, 100], jnp.int32)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    qs, kws, vws = put(q, P("data", None, "model")), put(kw, P("data", None, "model")), put(
        vw, P("data", None, "model"))
    kcs, vcs = put(kc, P(None, "data", "model")), put(vc, P(None, "data", "model"))
    ls = put(lengths, P("data"))
    out = {}
    for impl in ("pallas_gpu",):  # TPU interpret mode (InterpretParams) hangs under shard_map
        for stacked in (False, True):
            def run(q, kc, vc, kw, vw, ln, impl=impl, stacked=stacked):
                with attention_kernels.kernel_mesh(mesh):
                    if stacked:
                        return attention.attend(q, kc, vc, kw, vw, ln, layer=jnp.int32(1),
                                                impl=impl, interpret=True)
                    return attention.attend(q, kc[1], vc[1], kw, vw, ln, impl=impl,
                                            interpret=True)
            got = jax.jit(run)(qs, kcs, vcs, kws, vws, ls)
            want = attention.attend(q, kc[1], vc[1], kw, vw, lengths, impl="xla")
            out[f"{impl} {'stacked' if stacked else 'per-layer'}"] = float(
                jnp.max(jnp.abs(got - want)))
    return out


def write_checkpoint(path: Path, target: TinyModel) -> None:
    """A Llama HF checkpoint dir (config.json + model.safetensors) holding `target`'s params."""
    from safetensors.numpy import save_file

    from jaxspec.loading.safetensors_dir import GLOBAL_NAMES, LAYER_NAMES

    c = target.cfg
    glob = {v: k for k, v in GLOBAL_NAMES.items()}
    per_layer = {v: k for k, v in LAYER_NAMES.items()}
    p = target.params
    tensors = {glob[k]: np.asarray(p[k]) for k in ("embed", "final_norm", "lm_head")}
    for i, layer in enumerate(p["layers"]):
        tensors |= {f"model.layers.{i}.{per_layer[k]}": np.asarray(w) for k, w in layer.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": False, "hidden_act": "silu",
    }))


def device_bytes() -> dict[str, int]:
    """Bytes of live device buffers per device (a global array and the single-device arrays it
    was assembled from share buffers: each buffer counted once)."""
    out: dict[str, int] = {}
    seen = set()
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            key = (str(shard.device), shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                out[key[0]] = out.get(key[0], 0) + shard.data.nbytes
    return out


def loading(tmp: Path) -> dict:
    """Peak bytes per device while `load_model(..., mesh=plan)` builds each leaf, against the
    final per-device bytes and the largest tensor; and the old path (load, then shard)."""
    from jaxspec.loading import load_model

    target = model(layers=4)
    write_checkpoint(tmp / "ckpt", target)
    del target
    plan = MeshPlan(make_mesh(2, 4))
    real = jax.make_array_from_callback
    out = {}
    for layout in ("unrolled", "stacked"):
        peak: dict[str, int] = {}

        def tracked(*args, peak=peak, **kw):
            arr = real(*args, **kw)
            for d, n in device_bytes().items():
                peak[d] = max(peak.get(d, 0), n)
            return arr

        jax.make_array_from_callback = tracked
        try:
            m = load_model(tmp / "ckpt", layout=layout, mesh=plan)
        finally:
            jax.make_array_from_callback = real
        final = device_bytes()
        leaves = jax.tree.leaves(m.params)
        sharded = all(len(x.sharding.device_set) == 8 for x in leaves)
        plain = load_model(tmp / "ckpt", layout=layout)
        same = all(bool((np.asarray(a) == np.asarray(b)).all())
                   for a, b in zip(leaves, jax.tree.leaves(plain.params)))
        out[layout] = {
            "peak": max(peak.values()), "final": max(final.values()),
            "largest_tensor": max(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves),
            "largest_layer_tensor": max(int(np.prod(x.shape[1:] if layout == "stacked" else x.shape))
                                        * x.dtype.itemsize for x in jax.tree.leaves(m.params["layers"])),
            "total": sum(x.nbytes for x in leaves), "sharded": sharded, "same_values": same,
            "tokens_match": generate(m, None, None, plan) == generate(plain, None, None),
        }
        del m, plain, leaves
    # the old path: everything on the default device first, then sharded
    m = load_model(tmp / "ckpt", layout="unrolled")  # noqa: F841 (kept alive for the count)
    out["load_then_shard_peak"] = max(device_bytes().values())
    return out


def smollm2() -> dict:
    """SmolLM2-135M (9 heads, 3 kv heads, GGUF) loaded straight onto a (2, 3) mesh, one whole kv
    head per device, against one device: greedy tokens of two chat prompts. Plain decoding: the
    drafters on meshes are `parity`'s (an n-gram engine here took 29 s to compile, plain 11 s)."""
    from jaxspec.loading import load_model

    prompts = ["What is JAX?", "Name three colors."]
    one = load_model("smollm2-135m", layout="unrolled")
    single = [r.token_ids for r in Engine(one).generate(prompts, max_new_tokens=16, batch_size=2)]
    del one
    plan = MeshPlan(make_mesh(2, 3))
    m = load_model("smollm2-135m", layout="auto", mesh=plan)
    wk = m.params["layers"][0]["wk"]
    eng = Engine(m, mesh=plan)
    sharded = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, batch_size=2)]
    return {"same": sharded == single, "layout": m.layout, "wk_shard": list(wk.sharding.shard_shape(wk.shape))}


def parity() -> dict:
    """{"same": {"method (mesh)": tokens equal one device's}, "one_device": {"plain" and
    "ngram": one device's tokens}} (the two-process test's reference: not computed twice)."""
    target = model()
    out = {}
    singles = {}
    for name, drafter, dparams, shard in drafters(target):
        base = name.removesuffix("_sharded")  # a sharded drafter must give the same tokens
        if base not in singles:
            singles[base] = generate(target, drafter, dparams)
        for shape in MESHES[name]:
            plan = MeshPlan(make_mesh(*shape), shard_drafter=shard)
            out[f"{name} {shape}"] = generate(target, drafter, dparams, plan) == singles[base]
    return {"same": out, "one_device": {name: singles[name] for name in ("plain", "ngram")}}


# Bad meshes on the command line: (the arguments after `--prompt hi`, a fragment of the one
# error line). Run in this 8-device process through `generate.main` (what `python -m
# jaxspec.generate` calls) rather than one fresh process each (five jax starts, two of them loading
# SmolLM2 to read its head counts); test_cli.py runs a bad input in a real process.
CLI_ERRORS = (
    (("mesh.model=16",), "mesh data=1 x model=16 needs 16 devices but 8 are available"),
    (("mesh.data=0",), "mesh.data=0 is invalid: use an integer >= 1"),
    (("distributed.num_processes=2", "distributed.process_id=2"),
     "distributed.process_id=2 is invalid: use 0..1"),
    (("mesh.data=2", "--batch-size", "3"),
     "batch of 3 rows does not divide over mesh data=2: use a batch_size that is a multiple of 2"),
    (("mesh.model=4",), "mesh model=4 cannot split num_heads=9 into whole heads"),
)


def cli_errors() -> dict:
    """{the arguments: [exit status, what the CLI wrote to stderr]} for each of CLI_ERRORS."""
    import contextlib
    import io

    from jaxspec import generate

    out = {}
    for argv, _ in CLI_ERRORS:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = generate.main(["--prompt", "hi", *argv])
        out[" ".join(argv)] = [rc, err.getvalue()]
    return out


def run_mode(mode: str) -> dict:
    if mode == "cli":
        return cli_errors()
    if mode == "parity":
        return parity()
    if mode == "inside":
        target = model()
        named = {d[0]: d for d in drafters(target)}
        _, drafter, dparams, _ = named["draft_model_sharded"]
        return inside_loop(target, drafter, dparams, MeshPlan(make_mesh(2, 4), shard_drafter=True))
    if mode == "collectives":  # plain on both meshes, ngram's switch of widths on (2, 4)
        return {
            f"{layers} {shape[0]}x{shape[1]} {name}": decode_collectives(layers, shape, name)
            for name, shapes in (("plain", ((1, 8), (2, 4))), ("ngram", ((2, 4),)))
            for shape in shapes
            for layers in (2, 4)
        }
    if mode == "smollm2":
        return smollm2()
    if mode == "copies":
        return copies()
    if mode == "kernels":
        return kernels_on_mesh()
    if mode == "loading":
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            return loading(Path(tmp))
    raise SystemExit(f"unknown mode {mode}")


def main(modes: str) -> dict:
    """Every mode in one process (one jax start for all of test_sharding's mesh checks); a mode
    that raises reports its traceback under "error", so the other modes' tests still run."""
    import traceback

    assert jax.device_count() == 8, jax.devices()
    out, seconds = {}, {}
    for mode in modes.split(","):
        start = time.perf_counter(), time.process_time()
        try:
            out[mode] = run_mode(mode)
        except Exception:  # noqa: BLE001 (reported to the test that reads this mode)
            out[mode] = {"error": traceback.format_exc()[-3000:]}
        jax.clear_caches()
        seconds[mode] = [round(time.perf_counter() - start[0], 1),
                         round(time.process_time() - start[1], 1)]
    print("mesh_check seconds per mode (wall, cpu):", json.dumps(seconds), file=sys.stderr)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
