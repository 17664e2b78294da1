"""jaxspec: speculative decoding for JAX — lossless, jitted, batched, on real checkpoints.

    import jaxspec
    model = jaxspec.load_model("smollm2-135m")
    engine = jaxspec.Engine(model, jaxspec.NgramDrafter(model.cfg.vocab_size), num_speculative_tokens=4)
    [result] = engine.generate(["Summarise: ..."], sampling=jaxspec.Sampling(max_tokens=128))
    result.text, result.metrics["mean_accepted_length"]

Or from a config: `jaxspec.build_engine(jaxspec.load_config("configs/smollm2-135m-ngram.yaml"))`.

The top level is for users: load a model, build an engine, generate or stream, the sampling
type, the drafter and family registries, errors, config, meshes. Research code imports the
namespaces (docs/api.md): `jaxspec.decode` (the loop, prefill, acceptance, trees, sampling),
`jaxspec.models` (the target protocol, the KV cache, the families), `jaxspec.drafters`,
`jaxspec.serving`.

The names below are imported on first use (PEP 562), so `import jaxspec` and every
`python -m jaxspec.<tool> --help` start without loading jax or transformers.
"""

from __future__ import annotations

from jaxspec import exports as _exports

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    # load a model, build an engine, generate / stream
    "load_model": "jaxspec.loading",
    "LoadedModel": "jaxspec.loading",
    "Engine": "jaxspec.engine.runner",
    "GenerationResult": "jaxspec.engine.runner",
    "build_engine": "jaxspec.build",
    "build_drafter": "jaxspec.build",
    # the one sampling type
    "Sampling": "jaxspec.decode.sampling_settings",
    # drafters and their registry
    "NgramDrafter": "jaxspec.drafters.prompt_lookup",
    "draft_model_drafter": "jaxspec.drafters.draft_model",
    "layer_skip_drafter": "jaxspec.drafters.draft_model",
    "DrafterOptions": "jaxspec.drafters",
    "available_methods": "jaxspec.drafters",
    "register_drafter": "jaxspec.drafters",
    # the family registry
    "Family": "jaxspec.models.registry",
    "register_family": "jaxspec.models.registry",
    # config, errors, meshes
    "Config": "jaxspec.config",
    "load_config": "jaxspec.config",
    "JaxspecError": "jaxspec.errors",
    "MeshPlan": "jaxspec.sharding",
    "make_mesh": "jaxspec.sharding",
}
# the namespaces for research code (docs/api.md)
_NAMESPACES = ("decode", "models", "drafters", "serving")

# Names that left the top level (issue 58): they keep working for one release, with a warning.
_MOVED = {
    "accept": "jaxspec.decode.accept",
    "accept_row": "jaxspec.decode.accept_row",
    "accept_tree": "jaxspec.decode.accept_tree",
    "Window": "jaxspec.decode.Window",
    "build_window": "jaxspec.decode.build_window",
    "SamplingParams": "jaxspec.decode.SamplingParams",
    "logits_to_probs": "jaxspec.decode.logits_to_probs",
    "Drafter": "jaxspec.drafters.Drafter",
    "Proposal": "jaxspec.drafters.Proposal",
    "ModelDrafter": "jaxspec.drafters.ModelDrafter",
    "KVCache": "jaxspec.models.KVCache",
    "init_cache": "jaxspec.models.init_cache",
    "Model": "jaxspec.models.Model",
    "Target": "jaxspec.models.Target",
    "TargetOutput": "jaxspec.models.TargetOutput",
    "LlamaTarget": "jaxspec.models.LlamaTarget",
    "ModelConfig": "jaxspec.models.ModelConfig",
    "forward": "jaxspec.models.llama.forward",
    "lm_head": "jaxspec.models.llama.lm_head",
    "ShardingRules": "jaxspec.sharding.ShardingRules",
    "shard_params": "jaxspec.sharding.shard_params",
    "sampling_params": "jaxspec.build.sampling_params",
}

__all__ = sorted([*_EXPORTS, *_NAMESPACES])
__getattr__, __dir__ = _exports.lazy(__name__, _EXPORTS, _MOVED, _NAMESPACES)
_exports.install_renamed_modules()  # old module paths (jaxspec.drafters.eagle, ...) keep working
