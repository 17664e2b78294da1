"""Drafters, and the registry that builds one from a `SpeculativeConfig`.

A factory takes `(spec: SpeculativeConfig, target: LoadedModel)` and returns
`(drafter, drafter_params)`: a hashable drafter following `jaxspec.drafters.base.Drafter` and the
pytree of arrays it reads (`()` when it has none). A method named in the config but not registered
here is refused with the list of available ones.

    drafter, dparams = build_drafter(config.speculative, target)
    register_drafter("my_method", lambda spec, target: (MyDrafter(...), my_params))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxspec import kernels
from jaxspec.drafters.base import CommitContext, DraftContext, Drafter, Proposal
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.errors import JaxspecError
from jaxspec.models import llama

if TYPE_CHECKING:  # annotations only: no import of the config or loading at run time
    from jaxspec.config import SpeculativeConfig, TreeConfig
    from jaxspec.loading import LoadedModel

DrafterFactory = Callable[["SpeculativeConfig", "LoadedModel"], tuple[Any, Any]]

DRAFTERS: dict[str, DrafterFactory] = {}

__all__ = [
    "DRAFTERS",
    "CommitContext",
    "DraftContext",
    "Drafter",
    "DrafterFactory",
    "NgramDrafter",
    "Proposal",
    "available_methods",
    "build_drafter",
    "check_method",
    "register_drafter",
    "with_tree",
]


def register_drafter(name: str, factory: DrafterFactory) -> None:
    """Make `speculative.method: name` build its drafter with `factory`."""
    if name == "none":
        raise ValueError("'none' means plain decoding and cannot name a drafter")
    if DRAFTERS.get(name, factory) is not factory:
        raise ValueError(f"drafter method '{name}' is already registered")
    DRAFTERS[name] = factory


def available_methods() -> list[str]:
    return ["none", *DRAFTERS]


def check_method(method: str) -> None:
    """Refuse a method with no registered factory (cheap: call before loading any model)."""
    if method != "none" and method not in DRAFTERS:
        raise JaxspecError(
            f"speculative method '{method}' is not available in this version of jaxspec: "
            f"available methods are {', '.join(available_methods())}"
        )


def build_drafter(
    spec: SpeculativeConfig, target: LoadedModel, tree: TreeConfig | None = None
) -> tuple[Any, Any]:
    """(drafter, drafter_params) for `spec.method`; (None, None) for plain decoding. `tree`
    (the config's tree section) turns a chain drafter into a static or dynamic tree drafter."""
    check_method(spec.method)
    if spec.method == "none":
        return None, None
    drafter, dparams = DRAFTERS[spec.method](spec, target)
    if tree is not None and tree.kind != "chain":
        drafter = with_tree(drafter, tree)
        if tree.kind == "dynamic" and kernels.available() and llama.uses_cpu_kernels(target.params):
            from jaxspec.drafters.eagle import EagleDrafter, pack_for_cpu

            if isinstance(drafter, EagleDrafter):  # its tree levels are multi-row matmuls
                dparams = pack_for_cpu(dparams)
    if spec.lookup_min_ngram:  # prompt lookup first, the method's draft elsewhere
        from jaxspec.drafters.lookup import LookupFirst

        lookup = NgramDrafter(target.cfg.vocab_size, spec.lookup_min_ngram, spec.max_ngram)
        drafter = LookupFirst(drafter, lookup, name=f"{drafter.name}+lookup")
    return drafter, dparams


def with_tree(drafter, tree: TreeConfig):
    """The same drafter proposing the configured tree (Config validated method x kind)."""
    if tree.kind == "dynamic":  # eagle, draft_model
        return dataclasses.replace(
            drafter, tree_top_k=tree.top_k, tree_levels=tree.depth, tree_budget=tree.budget,
            tree_children=tree.children,
        )
    if isinstance(drafter, NgramDrafter):
        return dataclasses.replace(drafter, branches=tree.branches, depth=tree.depth)
    choices = tuple(tuple(p) for p in tree.choices)  # medusa
    return dataclasses.replace(drafter, tree_choices=choices)


def _ngram(spec: SpeculativeConfig, target: LoadedModel) -> tuple[NgramDrafter, tuple]:
    drafter = NgramDrafter(
        vocab_size=target.cfg.vocab_size, min_ngram=spec.min_ngram, max_ngram=spec.max_ngram
    )
    return drafter, ()


register_drafter("ngram", _ngram)


def _layer_skip(spec: SpeculativeConfig, target: LoadedModel) -> tuple[Any, Any]:
    from jaxspec.drafters.draft_model import layer_skip_drafter

    return layer_skip_drafter(target.cfg, spec.layer_skip_layers), ()  # reads the target's params


register_drafter("layer_skip", _layer_skip)


# ---- trained drafters (jaxspec.train): loaded from a shipped checkpoint --------------------------


def _trained(method: str) -> DrafterFactory:
    def factory(spec: SpeculativeConfig, target: LoadedModel) -> tuple[Any, Any]:
        # jaxspec (orbax) or published layouts (EAGLE-3, speculators, Medusa, MTP): jaxspec.formats
        from jaxspec.formats import load_drafter_checkpoint

        drafter, dparams = load_drafter_checkpoint(
            method, spec.checkpoint, target, spec.checkpoint_format, spec.eagle3_layer_ids
        )
        if spec.draft_confidence > 0 and not hasattr(drafter, "min_confidence"):
            raise JaxspecError(
                f"speculative.draft_confidence works with jaxspec's own EAGLE checkpoints only, "
                f"not with the {drafter.name} head in {spec.checkpoint}: set it to 0"
            )
        if spec.draft_confidence > 0:  # eagle (validated in the config)
            drafter = dataclasses.replace(
                drafter, min_confidence=spec.draft_confidence, variable_length=True
            )
        return drafter, dparams

    return factory


register_drafter("eagle", _trained("eagle"))
register_drafter("eagle3", _trained("eagle3"))
register_drafter("medusa", _trained("medusa"))
register_drafter("mtp", _trained("mtp"))



def _draft_model(spec: SpeculativeConfig, target: LoadedModel) -> tuple[Any, Any]:
    if spec.checkpoint is not None:
        return _trained("draft_model")(spec, target)
    if spec.draft_model is None:
        raise JaxspecError(
            "speculative.method: draft_model needs speculative.checkpoint (a distilled draft, e.g. "
            "checkpoints/smollm2-135m-draft) or speculative.draft_model (a model name or path)"
        )
    from jaxspec.drafters.draft_model import draft_model_drafter
    from jaxspec.loading import load_model

    draft = load_model(spec.draft_model, dtype=target.cfg.dtype, layout=target.layout)
    return draft_model_drafter(draft, target), draft.params


register_drafter("draft_model", _draft_model)
