"""Every shipped config's device programs, exported for TPU and CUDA with `jax.export` on this
CPU (nothing compiles for the CPU, so XLA:CPU's flags do not matter: this module runs in the
suite's parallel part): the attention kernel is in every bf16 program, float32 programs hold
none, and EAGLE's own layer attends on the kernel in a bf16 target.

Configs whose device programs are the same (the tiny target stands in for each config's model,
so the model section drops out: e.g. a Gemma 3 config and its SmolLM2 twin with the same
speculative section) are exported once: `config_groups` groups them by what the programs are
built from (dtype and the speculative section), and a test checks that every shipped config is in
a group."""

from __future__ import annotations

import dataclasses
import json
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

from jaxspec.drafters.draft_model import ModelDrafter
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.models import decoder, llama
from jaxspec import hlo
from jaxspec.tools import programs


def _model():
    return tiny_model(seed=0, layers=4)


# ------------------------------------------------- the kernels in every shipped config's programs

CONFIGS = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def config_groups() -> dict[str, tuple[str, ...]]:
    """Shipped configs grouped by what their device programs are built from here (the model's
    dtype and the speculative section; the model itself is the tiny stand-in): {first: all}."""
    from jaxspec.config import load_config

    groups: dict[tuple, list[str]] = {}
    for name in CONFIGS:
        config = load_config(Path(__file__).resolve().parents[1] / "configs" / name)
        groups.setdefault((config.model.dtype, repr(config.speculative)), []).append(name)
    return {names[0]: tuple(names) for names in groups.values()}


GROUPS = config_groups()
KERNEL = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}


def _tiny_checkpoint(method, path, target, fmt="auto", eagle3_layer_ids="input"):
    """An untrained drafter of `method` for the tiny target (the shipped checkpoints are sized
    for SmolLM2): the config's method, tree, lookup and adaptive settings stay as shipped."""
    from jaxspec.train import block as block_train
    from jaxspec.train import dflash as dflash_train
    from jaxspec.train import dspark as dspark_train
    from jaxspec.train import methods
    from jaxspec.train import peagle as peagle_train

    if method == "draft_model":  # the target itself as the draft model
        return ModelDrafter(model=target.target, target_vocab=64), target.params
    m = {"eagle": methods.Eagle(hidden_layers=(1, 2, 2), input_scale=1.0),
         "medusa": methods.Medusa(num_heads=3),
         "block": block_train.Block(hidden_layers=(1, 2, 2), input_scale=1.0, block_size=6,
                                    extra_mlp=16),
         "dflash": dflash_train.DFlash(hidden_layers=(1, 2), block_size=8, intermediate_size=32),
         "dspark": dspark_train.DSpark(hidden_layers=(1, 2), block_size=8, intermediate_size=32,
                                       markov_rank=4),
         "eagle3": methods.Eagle3(hidden_layers=(1, 2, 2)),
         "peagle": peagle_train.PEagle(hidden_layers=(1, 2, 2)),
         }[method]
    params, frozen = m.init(target, np.arange(0, 64, 2, dtype=np.int32), jax.random.key(7))
    return m.drafter(target.target), m.runtime(params, frozen)


@functools.cache  # one engine per group (each group's tests run together)
def _device_engine(config_name):
    """(config, the engine it builds on a device) on a tiny random target in the device's
    defaults (the config's dtype there: "auto" is bfloat16; the stacked layout)."""
    from jaxspec.config import load_config
    from jaxspec.drafters import registry

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / config_name)
    dtype = {"auto": "bfloat16"}.get(config.model.dtype, config.model.dtype)
    layers = 10 if config.speculative.method == "layer_skip" else 4  # the config skips from 8
    cfg = dataclasses.replace(_model().cfg, dtype=dtype, num_layers=layers)
    params = decoder.stack_layers(llama.init_params(cfg, jax.random.key(0), scale=0.3))
    target = dataclasses.replace(_model(), cfg=cfg, params=params)
    spec = config.speculative
    drafter = dparams = None
    if spec.method != "none":
        ctx = registry.BuildContext(target=target, spec=spec, load_checkpoint=_tiny_checkpoint,
                                    load_model=lambda *a, **k: target)
        drafter, dparams = registry.get(spec.method).factory(spec.options, ctx)
        if spec.lookup.min_ngram:
            from jaxspec.drafters.prompt_lookup_first import LookupFirst

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
    """(prefill, decode) programs of `e` exported for `platform` (StableHLO text), as
    `python -m jaxspec.tools.programs` lists them."""
    rows = programs.generation_programs(e, platform, batch=batch, prompt=prompt, max_new_tokens=8,
                                        spec=e.spec_for(batch), capacity=capacity)
    return [r["text"] for r in rows]


def test_every_shipped_config_is_in_an_exported_group():
    assert sorted(n for names in GROUPS.values() for n in names) == CONFIGS
    assert len(GROUPS) < len(CONFIGS)  # twins exported once (gemma3-270m-* = smollm2-135m-*)


@pytest.mark.parametrize("config_name", sorted(GROUPS), ids=[
    "+".join(n.removesuffix(".yaml") for n in GROUPS[k]) for k in sorted(GROUPS)])
def test_every_shipped_config_compiles_the_kernels_on_the_device(config_name):
    """Each shipped config's prefill and decode programs, exported for TPU and CUDA as a device
    run would build them (the config's dtype there: "auto" is bfloat16; the stacked layout; the
    engine's capacity for the device), hold the attention kernel; float32 configs hold none (the
    exact XLA path). The capacity before rounding (prompt bucket + bucket(max_new) + nodes + 1)
    is no kernel size, and exports without any kernel."""
    from jaxspec.models import attention

    config, e = _device_engine(config_name)
    dtype = e.model.cfg.dtype
    for platform in ("tpu", "cuda"):
        backend = {"tpu": "tpu", "cuda": "gpu"}[platform]
        capacity = e.capacity(32, 8, backend=backend)
        assert capacity % attention.KERNEL_SLOTS == 0
        want = KERNEL[platform] if dtype == "bfloat16" else "xla"
        for text in exported_programs(e, platform, capacity):
            assert hlo.compiled_attention(text) == want, platform
            assert (hlo.attention_kernel_calls(text) > 0) == (want != "xla"), platform
        if want != "xla" and config_name == sorted(GROUPS)[0]:  # unrounded capacity: no kernel
            raw = e.capacity(32, 8, backend="cpu")
            assert raw % 16 and all(hlo.compiled_attention(t) == "xla"
                                    for t in exported_programs(e, platform, raw))


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


def test_the_programs_tool_lists_what_a_device_run_compiles(capsys):
    """`python -m jaxspec.tools.programs` on the real SmolLM2 config: a TPU run's prefill and
    decode, loaded as the device loads it (bfloat16, stacked), hold the TPU kernel, read from the
    exported programs; a bad config is one line, exit 2."""
    from jaxspec.tools.programs import main

    assert main(["--config", "configs/smollm2-135m.yaml", "--platform", "tpu", "--json",
                 "--prompt", "40", "--max-new-tokens", "16"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["prefill", "decode"]
    for r in rows:
        assert r["attention"] == "pallas_tpu" and r["kernel_calls"] > 0
        assert r["dtype"] == "bfloat16" and r["prompt_bucket"] == 48  # prepare.prompt_bucket(40)
        assert r["capacity"] % 128 == 0 and r["cache"][-2] == r["capacity"]
    assert main(["--config", "configs/smollm2-135m.yaml", "--platform", "tpu",
                 "speculative.method=nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "nope" in err and "\n" not in err
