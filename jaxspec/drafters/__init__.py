"""Drafters: one module per drafting method, the drafter protocol, and the registry of methods.

    from jaxspec import drafters
    drafters.available_methods()             # the registered method names
    drafter = drafters.NgramDrafter(vocab_size, max_ngram=3)
    drafters.register_drafter("my_method", build, options=MyOptions)   # see registry.py

Each method is one module that declares its options section and registers itself; importing this
package registers the built-in ones. A factory takes `(options, ctx: BuildContext)` and returns
`(drafter, drafter_params)`: a hashable drafter following `Drafter` (the protocol,
`jaxspec.decode.drafter`) and the pytree of arrays it reads (`()` when it has none).
`jaxspec.build_drafter` builds one from a config; a method named in the config but not registered
is refused with the list of available ones.

The modules, by what each is: `prompt_lookup` (n-gram prompt lookup, method `ngram`) and
`prompt_lookup_first` (lookup first, another drafter elsewhere: `speculative.lookup`);
`draft_model` and `layer_skip` (a smaller model, the target's own first layers); `eagle_head`
(jaxspec's own EAGLE-style feature head, method `eagle`) and `eagle3` (the published EAGLE-3
layout); `parallel_block` (jaxspec's own block drafter, all γ drafts in one forward, method
`block`); `dflash` (the published DFlash drafters) over `dflash_forward` (their network);
`dspark`, `peagle`, `medusa`, `mtp`, `suffix`.
"""

from __future__ import annotations

# the built-in methods: importing each module registers its method
from jaxspec.drafters import (  # noqa: F401
    dflash,
    draft_model,
    dspark,
    eagle3,
    eagle_head,
    layer_skip,
    medusa,
    mtp,
    parallel_block,
    peagle,
    prompt_lookup,
    suffix,
)
from jaxspec.drafters.base import CommitContext, DraftContext, Drafter, Proposal
from jaxspec.drafters.draft_model import ModelDrafter, draft_model_drafter, layer_skip_drafter
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.drafters.prompt_lookup_first import LookupFirst
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
    "LookupFirst",
    "ModelDrafter",
    "NgramDrafter",
    "Proposal",
    "available_methods",
    "check_method",
    "draft_model_drafter",
    "layer_skip_drafter",
    "register_drafter",
]
