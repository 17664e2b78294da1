"""Drafters, and the registry of drafting methods (`jaxspec.drafters.registry`).

Each method is one module that declares its options section and registers itself; importing this
package registers the built-in ones. A factory takes `(options, ctx: BuildContext)` and returns
`(drafter, drafter_params)`: a hashable drafter following `jaxspec.drafters.base.Drafter` and the
pytree of arrays it reads (`()` when it has none). `jaxspec.build.build_drafter` builds one from a
config; a method named in the config but not registered is refused with the list of available ones.

    drafter, dparams = jaxspec.build.build_drafter(config.speculative, target)
    register_drafter("my_method", build, options=MyOptions)   # see registry.py
"""

from __future__ import annotations

# the built-in methods: importing each module registers its method
from jaxspec.drafters import (  # noqa: F401
    block,
    dflash,
    draft_model,
    dspark,
    eagle,
    eagle3,
    layer_skip,
    medusa,
    mtp,
    ngram,
    peagle,
    suffix,
)
from jaxspec.drafters.base import CommitContext, DraftContext, Drafter, Proposal
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.drafters.registry import (
    DRAFTERS,
    BuildContext,
    DrafterFactory,
    DrafterOptions,
    available_methods,
    check_method,
    register_drafter,
)

__all__ = [
    "DRAFTERS",
    "BuildContext",
    "CommitContext",
    "DraftContext",
    "Drafter",
    "DrafterFactory",
    "DrafterOptions",
    "NgramDrafter",
    "Proposal",
    "available_methods",
    "check_method",
    "register_drafter",
]
