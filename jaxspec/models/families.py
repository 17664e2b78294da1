"""Every target family module, imported once so each registers itself (`models/registry.py`):
the loaders import this and read the registry, never a family's name. A new family is one
module in `models/` plus its line here.
"""

from __future__ import annotations

from jaxspec.models import (  # noqa: F401  (imported for their register_family calls)
    gemma,
    gemma4,
    llama,
    phi3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
