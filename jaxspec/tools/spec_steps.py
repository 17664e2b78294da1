"""The decode loop's step compiled for an accelerator target, for plain decoding and each
speculative method (`python -m jaxspec.tools.roofline --target T --method ngram,eagle3,dflash`):
the exact program `speculate.decode_jit` runs (draft, verify, accept on the device, commit),
read per step from its generation loop's body: kernels, host syncs, bytes moved, predicted
milliseconds, and the ratio to the plain loop's step compiled the same way. On a placement's
mesh the inputs are placed as the engine places them (target by the rules; an EAGLE-style
head as `MeshPlan(shard_drafter=True)` shards it, other drafters replicated) and the bytes are
one chip's.

Drafters come with abstract params of a deployed head's shapes, in the target's dtype (nothing
is trained or run): n-gram prompt lookup (chain of γ, and a static tree), an EAGLE-3 head (one
layer over three taps, a 32k draft vocabulary as Llama-3.1-8B's published heads) and a DFlash
head (one bidirectional layer, block γ + 1).
"""

from __future__ import annotations

# Imported inside functions: each method's drafter modules load only when that method's step is
# compiled (the roofline's --help and its plain programs import none of them).

import dataclasses
import re

import jax
import jax.numpy as jnp

from jaxspec import hlo, sharding
from jaxspec.decode import speculate
from jaxspec.decode.sampling import SamplingParams
from jaxspec.decode.state import LoopSpec, traits
from jaxspec.errors import JaxspecError
from jaxspec.models import attention_kernels, base
from jaxspec.tools import accel_roofline, aot, step_model, step_programs

METHODS = ("plain", "ngram", "ngram_tree", "eagle3", "dflash")
DEFAULT_GAMMA = {"ngram": 4, "ngram_tree": 4, "eagle3": 3, "dflash": 4}
EAGLE3_DRAFT_VOCAB = 32000


def _abstract(fn, dtype):
    """fn()'s pytree as ShapeDtypeStructs, floating leaves in `dtype` (never run)."""
    cast = lambda x: jax.ShapeDtypeStruct(  # noqa: E731
        x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype)
    return jax.tree.map(cast, jax.eval_shape(fn))


def _eagle3(model: base.Target, gamma: int):
    from jaxspec.drafters import eagle3
    from jaxspec.train import methods

    cfg = model.layer_config
    d, n, kh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
    v = min(EAGLE3_DRAFT_VOCAB, cfg.vocab_size)
    h, f = cfg.head_dim, cfg.intermediate_size
    layer = {"input_norm": (d,), "hidden_norm": (d,), "wq": (n * h, 2 * d),
             "wk": (kh * h, 2 * d), "wv": (kh * h, 2 * d), "wo": (d, n * h), "mlp_norm": (d,),
             "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
    dparams = _abstract(lambda: {
        "fc": jnp.zeros((d, 3 * d)), "layer": {k: jnp.zeros(s) for k, s in layer.items()},
        "norm": jnp.zeros((d,)), "lm_head": jnp.zeros((v, d)),
        "d2t": jnp.zeros((v,), jnp.int32)}, jnp.dtype(model.dtype))
    drafter = methods.Eagle3().drafter(cfg)
    drafter = dataclasses.replace(drafter, cfg=dataclasses.replace(drafter.cfg, dtype=model.dtype))
    assert isinstance(drafter, eagle3.Eagle3Drafter)
    return drafter, dparams


def _dflash(model: base.Target, gamma: int):
    from jaxspec.drafters import dflash_forward as dflash_net
    from jaxspec.drafters.dflash import DFlashDrafter

    cfg = model.layer_config
    spec = dflash_net.make_spec(cfg, cfg.num_layers, num_layers=1, block_size=gamma + 1,
                                mask_token_id=cfg.vocab_size - 1,
                                target_layer_ids=(1, cfg.num_layers - 2))
    dparams = _abstract(lambda: dflash_net.init_params(spec, jax.random.key(0)),
                        jnp.dtype(model.dtype))
    return DFlashDrafter(spec, cfg.vocab_size), dparams


def drafter_for(model: base.Target, method: str, gamma: int):
    """(drafter, abstract dparams) of `method` for this target; plain: (None, None)."""
    from jaxspec.drafters.prompt_lookup import NgramDrafter

    if method == "plain":
        return None, None
    if method == "ngram":
        return NgramDrafter(model.vocab_size, 1, 3), None
    if method == "ngram_tree":
        return NgramDrafter(model.vocab_size, 1, 3, branches=2, depth=gamma), None  # 2 paths
    if method == "eagle3":
        return _eagle3(model, gamma)
    if method == "dflash":
        return _dflash(model, gamma)
    raise JaxspecError(f"unknown --method {method!r}: use one of {', '.join(METHODS)}")


def _plan(mesh, drafter) -> sharding.MeshPlan | None:
    """The engine's MeshPlan of `mesh` (None: one chip): an EAGLE-style head (a decoder layer
    of the target's shape, `traits.model_cfg`) sharded by the target's rules (shard_drafter:
    each chip reads its share of the head), any other drafter replicated."""
    if mesh is None:
        return None
    own_layer = drafter is not None and traits(drafter).model_cfg is not None
    return sharding.MeshPlan(mesh, shard_drafter=own_layer)


def loop_spec(model: base.Target, drafter, gamma: int, write_chains: bool = True,
              mesh=None) -> LoopSpec:
    """The LoopSpec an engine builds for this drafter (engine/runner.py) on the accelerator (a
    chain's window written in place: `LoopSpec.write_chains`), on `mesh` (a jax Mesh or None:
    the engine's MeshPlan of it, `_plan`), greedy."""
    windows = (1, 2, *(traits(drafter).verify_windows if drafter is not None else ()))
    return LoopSpec(target=model, drafter=drafter,
                    num_speculative_tokens=gamma if drafter is not None else 0,
                    eos_ids=(0,), windows=windows, write_chains=write_chains,
                    mesh=_plan(mesh, drafter))


def _placed(p, model: base.Target, drafter, params, dparams, state, small):
    """The loop's inputs on the placement's chips: one chip, or on its mesh as the engine puts
    them (params by the rules, the drafter's by `_plan`, the state by `state_shardings`)."""
    if p.mesh is None:
        one = jax.sharding.SingleDeviceSharding(p.devices[0])
        return [None if t is None else aot.on(t, one) for t in (params, dparams, state, small)]
    sharding.check_batch(state.lengths.shape[0], p.mesh)
    rep = jax.sharding.NamedSharding(p.mesh, jax.sharding.PartitionSpec())
    plan = _plan(p.mesh, drafter)
    own = None if drafter is None else traits(drafter).model_cfg
    heads = (plan.head_shardings(dparams, own) if plan.shard_drafter and isinstance(dparams, dict)
             and "layer" in dparams else rep)
    return [aot.on(params, sharding.target_shardings(model, params, p.mesh)),
            None if dparams is None else aot.on(dparams, heads),
            aot.on(state, sharding.state_shardings(state, state.lengths.shape[0], p.mesh)),
            aot.on(small, rep)]


def body_bytes(text: str, unknown_trip: int = 1) -> int:
    """hlo.device_bytes of one trip of the entry's outermost while loop (the generation loop's
    step): the module read with that body as its entry."""
    comps = hlo.parse(text)
    loop = next(i for i in comps[step_model._entry(text)] if i.opcode == "while")
    body = hlo._BODY.search(loop.line).group(1)
    lines = [re.sub(r"^ENTRY\s+", "", ln) for ln in text.splitlines()]
    lines = [f"ENTRY {ln}" if re.match(rf"^%?{re.escape(body)}\s", ln) else ln for ln in lines]
    return hlo.device_bytes("\n".join(lines), unknown_trip=unknown_trip)


def _vocab_sizes(model: base.Target, dparams) -> set[int]:
    """The target's vocabulary size and a draft head's own (EAGLE-3's 32k draft vocabulary)."""
    head = dparams.get("lm_head") if isinstance(dparams, dict) else None
    return {model.vocab_size} | ({head.shape[0]} if head is not None else set())


def measure_step(p, model: base.Target, layout: str, method: str, gamma: int, batch: int,
                 capacity: int, valid: int, temperature: float = 0.0,
                 write_chains: bool = True) -> dict:
    """The loop's step for `method` compiled for placement `p` (accel_roofline.Placement), read:
    greedy (a greedy program) unless `temperature` > 0 (a sampled one). vocab_scans: kernels
    that scan a vocabulary to draw (step_model.vocabulary_scans; greedy: none). write_chains
    False: a chain's window read-only and compacted after (the program before session 30)."""
    drafter, dparams = drafter_for(model, method, gamma)
    spec = loop_spec(model, drafter, gamma, write_chains, p.mesh)
    params = step_programs.abstract_params(model, layout)
    sp = SamplingParams.make(temperature)
    prompt = min(valid, capacity // 2)
    args = (params, dparams, jnp.zeros((batch, prompt), jnp.int32),
            jnp.full((batch,), prompt, jnp.int32), jnp.full((batch,), 64, jnp.int32), sp,
            jax.random.key(0), jnp.arange(batch, dtype=jnp.int32))
    state = jax.eval_shape(lambda *a: speculate.prefill(spec, *a, capacity=capacity), *args)
    placed = _placed(p, model, drafter, params, dparams, state, (sp, jnp.int32(1)))
    with attention_kernels.kernel_mesh(p.mesh):
        compiled = aot.compile_for(p.target, speculate.decode_jit, spec, *placed[:3],
                                   *placed[3])
    text = compiled.as_text()
    kernels, syncs = step_model.loop_step(text)
    if p.target.platform == "tpu":
        kernels, syncs = None, 0
    moved = body_bytes(text)  # per chip
    window = spec.num_nodes + 1
    cache = step_programs.abstract_cache(model, params, batch, capacity)
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    # per chip: the target's minimum times one chip's share of params + cache, the drafter's
    # params by its placement (replicated: whole)
    share = 1.0 if p.mesh is None else accel_roofline._chip_share(placed[0], placed[2].cache)
    need = step_programs.min_bytes(model, params, cache, batch, window, valid, window) * share
    if dparams is not None:
        need += nbytes(dparams) * (1.0 if p.mesh is None else accel_roofline._chip_share(placed[1]))
    return {
        "target": p.target.name, "program": "step", "method": method, "batch": batch,
        "gamma": gamma if drafter is not None else 0, "window": window, "layout": layout,
        "capacity": capacity, "valid": valid, "chips": p.chips, "min_bytes": int(need),
        "bytes_moved": moved,
        "bytes_ratio": round(moved / need, 3), "kernels": kernels, "host_syncs": syncs,
        "vocab_scans": len(step_model.vocabulary_scans(text, _vocab_sizes(model, dparams))),
        "attention": hlo.compiled_attention(text), "collectives": step_model.collectives(text),
        "floor_ms": round(step_model.floor_ms(need, p.target.bandwidth), 4),
        "predicted_ms": round(step_model.predicted_ms(
            moved, p.target.bandwidth, kernels or 1, syncs), 4),
    }


def rows(p, model: base.Target, layout: str, methods, batches, capacity: int, fill: float,
         gamma: int | None = None) -> list[dict]:
    """The plain step and each method's at each batch, with `vs_plain` (predicted step over the
    plain step's at the same batch). A program the target's compiler refuses (e.g. over the
    chip's memory) is a row with its one-line `error`; the other rows still come."""
    out = []
    for b in batches:
        plain = None
        for m in ["plain", *(m for m in methods if m != "plain")]:
            try:
                r = measure_step(p, model, layout, m, 0 if m == "plain" else
                                 gamma or DEFAULT_GAMMA[m], b, capacity, int(capacity * fill))
            except (jax.errors.JaxRuntimeError, JaxspecError) as e:  # the compiler refused it
                out.append({"target": p.target.name, "program": "step", "method": m, "batch": b,
                            "error": str(e).split("\n")[0][:240]})
                continue
            plain = r if m == "plain" else plain
            vs = None if plain is None else round(r["predicted_ms"] / plain["predicted_ms"], 3)
            out.append(r | {"vs_plain": vs})
    return out


def format_rows(out: list[dict]) -> str:
    head = ("| target | method | batch | γ | window | bytes moved | ratio | kernels | host syncs | "
            "attention | floor ms | predicted ms | vs plain |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    lines = [f"| {r['target']} | {r['method']} | {r['batch']} | {r['gamma']} | {r['window']} | "
             f"{r['bytes_moved'] / 1e9:.2f} GB | {r['bytes_ratio']:.2f} | {r['kernels'] or '-'} | "
             f"{r['host_syncs']} | {r['attention']} | {r['floor_ms']:.2f} | "
             f"{r['predicted_ms']:.2f} | {r['vs_plain'] or '-'} |" if "error" not in r else
             f"| {r['target']} | {r['method']} | {r['batch']} | compile failed: {r['error']} |"
             for r in out]
    return "\n".join([head, *lines])
