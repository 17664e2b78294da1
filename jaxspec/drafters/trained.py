"""Options and loading shared by the methods whose drafter is read from a checkpoint directory
(eagle, eagle3, medusa, mtp; draft_model optionally): `speculative.<method>.checkpoint` and its
layout. The reading itself is `BuildContext.load_checkpoint` (jaxspec.formats, filled in by
jaxspec.build), so the drafter modules import no loading code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxspec.drafters.registry import BuildContext, DrafterOptions
from jaxspec.errors import JaxspecError

# checkpoint_format (jaxspec.formats.FORMATS): auto = detected from meta.json / config.json
CheckpointFormat = Literal[
    "auto", "jaxspec", "eagle3", "speculators", "medusa", "medusa_fd", "mtp", "dflash", "dspark",
    "peagle"
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointOptions(DrafterOptions):
    # drafter checkpoint dir (repo-relative checkpoints/... works) or Hub id org/name[@revision]
    checkpoint: str | None = None
    checkpoint_format: CheckpointFormat = "auto"  # its layout (jaxspec.formats); auto: detected


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowOptions(CheckpointOptions):
    # the drafter's attention reads only the last this many positions of the context (a sliding
    # window, as heads trained at short context define it); null: as the checkpoint's config says
    sliding_window: int | None = None

    def _validate(self):
        super()._validate()
        if self.sliding_window is not None and self.sliding_window < 1:
            self._fail("sliding_window", "use an integer >= 1, or null (the checkpoint's own)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3LayoutOptions(WindowOptions):
    # EAGLE-3 checkpoints naming their tapped layers: id i is the input of layer i (input: vLLM)
    # or its output (output: SGLang / SpecForge). Without ids both tap layers 2, L//2, L-3.
    eagle3_layer_ids: Literal["input", "output"] = "input"


def load(method: str, options: CheckpointOptions, ctx: BuildContext) -> tuple[Any, Any]:
    """(drafter, dparams) from `options.checkpoint` for `method`."""
    if options.checkpoint is None:
        raise JaxspecError(
            f"{options.SECTION}.checkpoint is required for method '{method}': point it to a "
            f"drafter checkpoint directory (jaxspec, EAGLE-3, speculators, Medusa or MTP layout)"
        )
    layer_ids = options.eagle3_layer_ids if isinstance(options, Eagle3LayoutOptions) else "input"
    drafter, dparams = ctx.load_checkpoint(
        method, options.checkpoint, ctx.target, options.checkpoint_format, layer_ids
    )
    if isinstance(options, WindowOptions) and options.sliding_window is not None:
        if not hasattr(drafter, "with_sliding_window"):
            raise JaxspecError(
                f"{options.SECTION}.sliding_window: the {drafter.name} head in "
                f"{options.checkpoint} takes no attention window: drop it")
        drafter = drafter.with_sliding_window(options.sliding_window)
    return drafter, dparams
