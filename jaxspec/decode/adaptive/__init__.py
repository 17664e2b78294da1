"""Adaptive speculation, in one package: each step, each row verifies as many of the γ draft
nodes as its acceptance and the step's measured cost (at its context length) say pay.

    settings.py     the `speculative.adaptive` section (AdaptiveConfig), free of jax
    controller.py   the per-step policy: plan before a step, observe after it (in the loop)
    loop.py         the loop around the fixed-plan step: plans, plain runs, the hand-off
    calibration.py  the measured step-cost curves, per batch size and context length
    host.py         across batches: the curves per batch size, which batches run adaptive

`jaxspec.decode.adaptive.X` also reads the controller's names (`adaptive.Controller`,
`adaptive.cut`, ...), as the former module `jaxspec/decode/adaptive.py` exposed them; loaded on
first use, so `jaxspec.config` reads `settings` without starting jax.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    controller = importlib.import_module("jaxspec.decode.adaptive.controller")
    try:
        return getattr(controller, name)
    except AttributeError:
        raise AttributeError(f"module 'jaxspec.decode.adaptive' has no attribute {name!r}") from None
