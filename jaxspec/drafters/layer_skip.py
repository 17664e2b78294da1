"""Method "layer_skip": the target's first `layers` layers (then its final norm and LM head) draft;
the full model verifies (drafters/draft_model.py, `layer_skip_drafter`). No params of its own."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxspec.drafters.draft_model import ModelDrafter, layer_skip_drafter
from jaxspec.drafters.registry import BuildContext, DrafterOptions, register_drafter


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSkipOptions(DrafterOptions):
    SECTION: ClassVar[str] = "speculative.layer_skip"
    layers: int = 8  # how many target layers the self-draft keeps (checked against the target)

    def _validate(self):
        if self.layers < 1:
            self._fail("layers", "use an integer >= 1")


def build(options: LayerSkipOptions, ctx: BuildContext) -> tuple[ModelDrafter, tuple]:
    return layer_skip_drafter(ctx.target.target, options.layers), ()  # reads the target's params


register_drafter("layer_skip", build, options=LayerSkipOptions, summary=(
    "self-speculation: the target's first layers + final norm + LM head"))
