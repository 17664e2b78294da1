"""Model families, for research code: the target protocol, the KV cache, the family registry and
each family's own forward.

    from jaxspec import models
    cache = models.init_cache(cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim)
    out = models.llama.forward(params, tokens, cache, cfg)   # Llama's own forward
    logits = models.llama.lm_head(params, out.hidden)

Every name is imported on first use (PEP 562). A family is one module (`llama`, `gemma`,
`gemma4`, `phi3`, `qwen3_5`, `qwen3_moe`) with a `Target` and one `register_family` call
(docs/targets.md); `llama` is also reachable as `models.llama`.
"""

from jaxspec.exports import lazy

EXPORTS = {
    # the target protocol
    "Model": "jaxspec.models.base",
    "Target": "jaxspec.models.base",
    "TargetOutput": "jaxspec.models.base",
    # the KV cache: preallocated, per-row lengths, rollback by masking
    "KVCache": "jaxspec.models.cache",
    "init_cache": "jaxspec.models.cache",
    # the family registry
    "Family": "jaxspec.models.registry",
    "register_family": "jaxspec.models.registry",
    "supported_model_types": "jaxspec.models.registry",
    "supported_gguf_architectures": "jaxspec.models.registry",
    # Llama, the reference family (its forward and lm_head: `models.llama.forward`, `.lm_head`)
    "LlamaTarget": "jaxspec.models.llama",
    "ModelConfig": "jaxspec.models.llama",
}

SUBMODULES = ("llama",)

__all__ = sorted([*EXPORTS, *SUBMODULES])
__getattr__, __dir__ = lazy(__name__, EXPORTS, submodules=SUBMODULES)
