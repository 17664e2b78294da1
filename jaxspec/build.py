"""Config -> Engine: load the target, build its drafter through the registry, set the prompt format.

    config = load_config("configs/smollm2-135m-ngram.yaml")
    engine = build_engine(config)
    results = engine.generate(prompts, max_new_tokens=config.generation.max_new_tokens,
                              sampling=sampling_params(config), seed=config.sampling.seed)
"""

from __future__ import annotations

from jaxspec import drafters
from jaxspec.config import Config
from jaxspec.distributed import mesh_plan
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams


def build_engine(config: Config, target=None) -> Engine:
    """Load `config.model` (or reuse an already loaded `target`) and build its drafter.

    The speculative method is checked before the (slow) model load, so a method that is not
    available fails at once.
    """
    from jaxspec.loading import load_model  # heavy (transformers, gguf): only when building
    from jaxspec.sharding import check_batch

    spec = config.speculative
    drafters.check_method(spec.method)
    plan = mesh_plan(config.mesh)  # checked against the devices before the load
    if plan is not None:
        check_batch(config.generation.batch_size, plan.mesh)
    if target is None:
        m = config.model
        target = load_model(m.name, dtype=m.dtype, layout=m.layout, mesh=plan)
    drafter, drafter_params = drafters.build_drafter(spec, target, config.tree)
    return Engine(
        target,
        drafter,
        drafter_params,
        num_speculative_tokens=spec.num_speculative_tokens if drafter is not None else 0,
        chat_template=config.generation.chat_template,
        system_prompt=config.generation.system_prompt,
        mesh=plan,
        max_context=config.generation.max_context or None,
        adaptive=config.adaptive.options() if config.adaptive.enabled and drafter else None,
    )


def sampling_params(config: Config) -> SamplingParams:
    s = config.sampling
    return SamplingParams.make(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p
    )
