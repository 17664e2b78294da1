"""Config -> Engine: load the target, build its drafter through the registry, set the prompt format.

This is the top of the import path: it hands drafter factories the loaders (jaxspec.formats for
drafter checkpoints, jaxspec.loading for draft models), so no drafter module imports loading code.

    config = load_config("configs/smollm2-135m-ngram.yaml")
    engine = build_engine(config)
    results = engine.generate(prompts, max_new_tokens=config.generation.max_new_tokens,
                              sampling=sampling_params(config), seed=config.sampling.seed)
"""

from __future__ import annotations

from typing import Any

from jaxspec import drafters
from jaxspec.config import Config, SpeculativeConfig
from jaxspec.distributed import mesh_plan
from jaxspec.drafters import registry
from jaxspec.decode.drafter import traits
from jaxspec.engine.runner import Engine
from jaxspec.decode.sampling import SamplingParams
from jaxspec.drafters.prompt_lookup_first import LookupFirst
from jaxspec.formats import load_drafter_checkpoint
from jaxspec.sharding import check_batch
from jaxspec.validate import check_tree_ranks


def build_engine(config: Config, target=None) -> Engine:
    """Load `config.model` (or reuse an already loaded `target`) and build its drafter.

    The speculative method is checked before the (slow) model load, so a method that is not
    available fails at once.
    """
    from jaxspec.loading import load_model  # heavy (transformers, gguf): only when building
    spec = config.speculative
    drafters.check_method(spec.method)
    plan = mesh_plan(config.mesh)  # checked against the devices before the load
    if plan is not None:
        check_batch(config.generation.batch_size, plan.mesh)
    if target is None:
        m = config.model
        target = load_model(m.name, dtype=m.dtype, layout=m.layout, mesh=plan)
    drafter, drafter_params = build_drafter(spec, target)
    return Engine(
        target,
        drafter,
        drafter_params,
        num_speculative_tokens=spec.num_speculative_tokens if drafter is not None else 0,
        chat_template=config.generation.chat_template,
        system_prompt=config.generation.system_prompt,
        mesh=plan,
        max_context=config.generation.max_context or None,
        adaptive=spec.adaptive,  # the config section itself (on when enabled)
        logprobs=config.generation.logprobs,
        logprobs_mode=config.generation.logprobs_mode,
    )


def build_drafter(spec: SpeculativeConfig, target) -> tuple[Any, Any]:
    """(drafter, drafter_params) for `spec.method` with its options (`spec.options`), its tree
    (`spec.tree`) and prompt lookup first (`spec.lookup`); (None, None) for plain decoding.
    target: a LoadedModel (cfg, params, layout)."""
    if spec.method == "none":
        return None, None
    method = registry.get(spec.method)
    ctx = registry.BuildContext(
        target=target, spec=spec, load_checkpoint=_load_checkpoint, load_model=_load_model
    )
    drafter, dparams = method.factory(spec.options, ctx)
    if spec.tree.choices:  # ranks beyond what the drafter ranks: one line, not a top_k traceback
        d2t = dparams.get("d2t") if isinstance(dparams, dict) else None
        check_tree_ranks(spec.tree.choices, len(d2t) if d2t is not None else target.target.vocab_size)
    if spec.lookup.min_ngram:  # prompt lookup first, the method's draft elsewhere
        lookup = drafters.NgramDrafter(
            target.target.vocab_size, spec.lookup.min_ngram, spec.lookup.max_ngram
        )
        drafter = LookupFirst(drafter, lookup, name=f"{drafter.name}+lookup")
    if spec.tree.kind != "chain" and not traits(drafter).tree_nodes:
        raise RuntimeError(f"method {spec.method!r} registered tree kind {spec.tree.kind} but built a chain")
    return drafter, dparams


def _load_checkpoint(method, path, target, fmt="auto", eagle3_layer_ids="input"):
    return load_drafter_checkpoint(method, path, target, fmt, eagle3_layer_ids)


def _load_model(name, **kwargs):
    from jaxspec.loading import load_model  # heavy (transformers, gguf): only for a draft model

    return load_model(name, **kwargs)


def sampling_params(config: Config) -> SamplingParams:
    s = config.sampling
    return SamplingParams.make(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p
    )
