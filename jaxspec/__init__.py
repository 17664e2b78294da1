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
"""

from jaxspec.acceptance import accept, accept_row, accept_tree
from jaxspec.build import build_drafter, build_engine, sampling_params
from jaxspec.cache import KVCache, init_cache
from jaxspec.config import Config, load_config
from jaxspec.drafters import DrafterOptions, available_methods, register_drafter
from jaxspec.drafters.base import Drafter, Proposal
from jaxspec.drafters.draft_model import ModelDrafter, draft_model_drafter, layer_skip_drafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.engine import Engine, GenerationResult
from jaxspec.errors import JaxspecError
from jaxspec.loading import LoadedModel, load_model
from jaxspec.models.llama import ModelConfig, forward, lm_head
from jaxspec.sampling import SamplingParams, logits_to_probs
from jaxspec.sharding import MeshPlan, ShardingRules, make_mesh, shard_params
from jaxspec.tree import Window, build_window

__version__ = "0.1.0"

__all__ = [
    "Config", "Drafter", "DrafterOptions", "Engine", "GenerationResult", "JaxspecError", "KVCache", "LoadedModel",
    "MeshPlan", "ModelConfig", "ModelDrafter", "NgramDrafter", "Proposal", "SamplingParams", "ShardingRules",
    "Window", "accept", "accept_row", "accept_tree", "available_methods", "build_window", "build_drafter", "build_engine", "draft_model_drafter",
    "forward", "init_cache", "layer_skip_drafter", "lm_head", "load_config", "load_model",
    "logits_to_probs", "make_mesh", "register_drafter", "sampling_params", "shard_params",
]
