"""Run configuration: frozen keyword-only dataclasses; YAML files and dotted overrides fill them.

    cfg = load_config("configs/smollm2-135m-ngram.yaml", ["speculative.ngram.max_ngram=4"])
    cfg = Config(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))

Every field is type-checked and range-checked on construction, so a Config built in Python is as
valid as one read from YAML. Every mistake is a one-line `JaxspecError` naming the dotted key.

Sections nest: `speculative` holds `lookup`, `tree` and `adaptive`, and one subsection per drafter
method, `speculative.<method>`, whose options class the method registered with
`jaxspec.drafters.register_drafter` (its module validates it). The method list is the registry's:
nothing here names a drafter. Reading it imports `jaxspec.drafters` (lazily: only when a config
names a method or a method's subsection).

sections.py holds the dataclasses, file.py reads YAML and overrides into them.
"""

from jaxspec.config.file import MOVED, load_config
from jaxspec.config.sections import (
    MAX_NGRAM,
    MAX_TREE_NODES,
    SECTIONS,
    AdaptiveConfig,
    ModelLoadConfig,
    SamplingConfig,
    GenerationConfig,
    LookupConfig,
    TreeConfig,
    SpeculativeConfig,
    MeshConfig,
    DistributedConfig,
    ServingConfig,
    Config,
)

__all__ = [
    "MAX_NGRAM",
    "MAX_TREE_NODES",
    "MOVED",
    "SECTIONS",
    "AdaptiveConfig",
    "ModelLoadConfig",
    "SamplingConfig",
    "GenerationConfig",
    "LookupConfig",
    "TreeConfig",
    "SpeculativeConfig",
    "MeshConfig",
    "DistributedConfig",
    "ServingConfig",
    "Config",
    "load_config",
]
