"""Run by tests/test_sharding.py in a subprocess with 8 simulated CPU devices (the flag must be set
before jax starts): sharded generation against one device, shardings inside and after the loop,
collectives in the compiled decode step. Prints one JSON object on the last line.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_check.py parity,inside,collectives,loading,smollm2
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # tiny, this jaxspec

import jax
import jax.numpy as jnp
import numpy as np
from tiny import TinyModel

from jaxspec import speculate
from jaxspec.drafters import NgramDrafter
from jaxspec.drafters.draft_model import ModelDrafter
from jaxspec.engine import Engine
from jaxspec.models import llama
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import MeshPlan, make_mesh
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
    return count_collectives(lowered.compile().as_text())


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
    return out


def run_mode(mode: str) -> dict:
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
    out = {}
    for mode in modes.split(","):
        try:
            out[mode] = run_mode(mode)
        except Exception:  # noqa: BLE001 (reported to the test that reads this mode)
            out[mode] = {"error": traceback.format_exc()[-3000:]}
        jax.clear_caches()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
