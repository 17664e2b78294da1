"""The `speculative.adaptive` section: adaptive speculation's one settings object.

It lives beside the controller that reads it (jaxspec/decode/adaptive/controller.py) and stays free of jax, so
`jaxspec.config` (which re-exports it) reads a config without importing jax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

from jaxspec.options import Section, matches


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveConfig(Section):
    """Adaptive speculation (jaxspec/decode/adaptive/): per-row draft length from live acceptance and
    the measured step-cost curve (jaxspec/decode/adaptive/calibration.py); plain steps where speculation loses.

    This section is the one settings object of adaptive speculation: `Engine(adaptive=...)`
    takes it as it is (validated here, once), the loop's controller reads its in-loop fields
    (adaptive.LOOP_SETTINGS) and the engine's host policy the rest."""

    SECTION: ClassVar[str] = "speculative.adaptive"
    enabled: bool = False
    decay: float = 0.9  # weight of the past in each row's running acceptance estimate
    prior: float = 0.6  # acceptance estimate a row starts from
    probe_every: int = 16  # a row running plain re-probes every this many steps (0: never)
    probe_length: int = 1  # draft nodes a probe verifies
    # step costs: "auto" = measured (the loop's whole step with 0..γ nodes per batch size,
    # jaxspec/decode/adaptive/calibration.py); a number: a measured verify + this many plain steps per node
    draft_cost: float | Literal["auto"] = "auto"
    switch_off_acceptance: float = 0.8  # batch runs plain if even this acceptance cannot pay
    prior_weight: float = 2.0  # observations the prior is worth (1 / (1 - decay): a plain EMA)
    # batch > 1: steps after which a batch whose estimates say no window beats
    # the plain program runs the rest as plain decoding, drafter untouched (0: never)
    handoff_after: int = 8
    # a row on plain steps tries one node where it pays at the estimate + this many standard
    # errors (0: only the probes every probe_every steps)
    explore: float = 1.0
    recalibrate: bool = False  # measure the step-cost curve again (CLI: --recalibrate)
    # a given verify cost curve instead of a measured one: γ+1 numbers (plain steps for windows
    # of 1..γ+1 entries), or {fill: curve}; in Python also a function batch size -> either.
    # null: measured
    step_costs: object = None
    # context lengths (committed tokens per row) the step costs are measured at, e.g.
    # [1024, 4096, 8192, 32768]: a window's cost grows with the context its attention reads, and
    # the loop reads the curve at each step's context. null: 128 and 1024
    context_lengths: object = None

    def _validate(self):
        if not 0.0 <= self.decay < 1.0:
            self._fail("decay", "use a number in [0, 1)")
        if not 0.0 <= self.prior <= 1.0:
            self._fail("prior", "use a number in [0, 1]")
        if self.probe_every < 0:
            self._fail("probe_every", "use an integer >= 0 (0: never re-probe)")
        if self.probe_length < 1:
            self._fail("probe_length", "use an integer >= 1")
        if self.draft_cost != "auto" and not (
            math.isfinite(self.draft_cost) and self.draft_cost >= 0
        ):
            self._fail("draft_cost", 'use "auto" (measured) or a finite number >= 0')
        if not 0.0 <= self.switch_off_acceptance <= 1.0:
            self._fail("switch_off_acceptance", "use a number in [0, 1]")
        if not (math.isfinite(self.prior_weight) and self.prior_weight > 0):
            self._fail("prior_weight", "use a finite number > 0 (observations the prior is worth)")
        if self.handoff_after < 0:
            self._fail("handoff_after", "use an integer >= 0 (0: never hand off)")
        if not (math.isfinite(self.explore) and self.explore >= 0):
            self._fail("explore", "use a finite number >= 0 (standard errors; 0: probes only)")
        lengths = self.context_lengths
        if isinstance(lengths, str):  # a command-line override: "[1024, 8192]" or "1024,8192"
            text = lengths.strip().strip("[]")
            try:
                lengths = [int(n) for n in text.split(",")] if text else []
            except ValueError:
                pass
            object.__setattr__(self, "context_lengths", lengths)
        if lengths is not None and not (
            isinstance(lengths, (list, tuple)) and lengths
            and all(matches(n, int) and n >= 1 for n in lengths)
        ):
            self._fail("context_lengths", "use a list of integers >= 1 (committed tokens), or "
                       "null (128 and 1024)")
        costs = self.step_costs
        curve = lambda c: isinstance(c, (list, tuple)) and all(matches(x, float) for x in c)
        if not (costs is None or callable(costs) or curve(costs) or (
            isinstance(costs, dict) and all(matches(f, float) and curve(c) for f, c in costs.items())
        )):
            self._fail("step_costs", "use a list of numbers (one per window width), a mapping "
                       "fill -> such a list, or null (measured)")
