"""jaxspec: speculative decoding for JAX — lossless, jitted, batched, on real checkpoints.

    import jaxspec
    model = jaxspec.load_model("smollm2-135m")
    engine = jaxspec.Engine(model, jaxspec.NgramDrafter(model.cfg.vocab_size), num_speculative_tokens=4)
    [result] = engine.generate(["Summarise: ..."], max_new_tokens=128)
    result.text, result.metrics["mean_accepted_length"]

Or from a config: `jaxspec.build_engine(jaxspec.load_config("configs/smollm2-135m-ngram.yaml"))`.
The pieces are usable alone: `models.llama.forward`, `cache.KVCache`, `acceptance.accept`
(chains) and `acceptance.accept_tree` (draft trees), `tree.build_window`,
`sampling.logits_to_probs`, the drafters, `speculate.decode`.

The names below are imported on first use (PEP 562), so `import jaxspec` and every
`python -m jaxspec.<tool> --help` start without loading jax or transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "accept": "jaxspec.decode.acceptance",
    "accept_row": "jaxspec.decode.acceptance",
    "accept_tree": "jaxspec.decode.acceptance",
    "build_drafter": "jaxspec.build",
    "build_engine": "jaxspec.build",
    "sampling_params": "jaxspec.build",
    "KVCache": "jaxspec.models.cache",
    "init_cache": "jaxspec.models.cache",
    "Config": "jaxspec.config",
    "load_config": "jaxspec.config",
    "DrafterOptions": "jaxspec.drafters",
    "available_methods": "jaxspec.drafters",
    "register_drafter": "jaxspec.drafters",
    "Drafter": "jaxspec.decode.drafter",
    "Proposal": "jaxspec.decode.drafter",
    "ModelDrafter": "jaxspec.drafters.draft_model",
    "draft_model_drafter": "jaxspec.drafters.draft_model",
    "layer_skip_drafter": "jaxspec.drafters.draft_model",
    "NgramDrafter": "jaxspec.drafters.ngram",
    "Engine": "jaxspec.engine.runner",
    "GenerationResult": "jaxspec.engine.runner",
    "JaxspecError": "jaxspec.errors",
    "LoadedModel": "jaxspec.loading",
    "load_model": "jaxspec.loading",
    "Model": "jaxspec.models.base",
    "Target": "jaxspec.models.base",
    "TargetOutput": "jaxspec.models.base",
    "Family": "jaxspec.models.registry",
    "register_family": "jaxspec.models.registry",
    "LlamaTarget": "jaxspec.models.llama",
    "ModelConfig": "jaxspec.models.llama",
    "forward": "jaxspec.models.llama",
    "lm_head": "jaxspec.models.llama",
    "SamplingParams": "jaxspec.decode.sampling",
    "logits_to_probs": "jaxspec.decode.sampling",
    "MeshPlan": "jaxspec.sharding",
    "ShardingRules": "jaxspec.sharding",
    "make_mesh": "jaxspec.sharding",
    "shard_params": "jaxspec.sharding",
    "Window": "jaxspec.decode.tree",
    "build_window": "jaxspec.decode.tree",
}

__all__ = [
    "Config", "Drafter", "DrafterOptions", "Engine", "Family", "GenerationResult", "JaxspecError",
    "KVCache", "LlamaTarget", "LoadedModel", "MeshPlan", "Model", "ModelConfig", "ModelDrafter", "NgramDrafter", "Proposal",
    "SamplingParams", "ShardingRules", "Target", "TargetOutput", "Window", "accept", "accept_row", "accept_tree",
    "available_methods", "build_drafter", "build_engine", "build_window", "draft_model_drafter",
    "forward", "init_cache", "layer_skip_drafter", "lm_head", "load_config", "load_model",
    "logits_to_probs", "make_mesh", "register_drafter", "register_family", "sampling_params", "shard_params",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
