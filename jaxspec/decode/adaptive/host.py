"""The host side of adaptive speculation: the step-cost curves per batch size (given, or measured
by an explicit calibration) and the online learner across batches -- which batches run the
adaptive program and which the plain one.

    host = AdaptiveHost(settings, model, spec, drafter)
    host.calibrate(batch, dparams)     # measures (announced) or reads the cached curves
    host.runs_adaptive(batch)          # False: this batch runs the plain program
    host.record(fetched_state, rows, tokens_per_row)   # after each batch

State kept across batches: `observed_acceptance` (per position, averaged over adaptive batches),
`off_batches` (batches run plain since the last adaptive one) and `last_runs` (each size's last
adaptive batch: its window histogram, tokens per row and priced steps). Every choice reads
earlier batches only, so it is lossless (controller.py). Used by jaxspec.engine.runner.Engine; the serving
scheduler can hold one of its own.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from jaxspec.decode.adaptive import calibration, controller
from jaxspec.decode.adaptive.settings import AdaptiveConfig
from jaxspec.decode.drafter import traits
from jaxspec.errors import JaxspecError

REPROBE_BATCHES = 8  # a switched-off size re-measures acceptance every 8th batch
# why a batch runs the program it does (`AdaptiveHost.decide`, the metric adaptive_host_reason):
# pays        speculation can pay (at this context, at the acceptance seen there)
# reprobe     it would not, but every REPROBE_BATCHES-th batch re-measures acceptance
# acceptance  plain: at the acceptance seen, no window pays even at the shortest context
# context     plain: that acceptance would pay at the shortest calibrated context, not this one
HOST_REASONS = ("pays", "reprobe", "acceptance", "context")


class AdaptiveHost:
    def __init__(self, settings: AdaptiveConfig, model, spec, drafter):
        self.settings = settings
        self.model = model
        self.spec = spec  # the adaptive LoopSpec (its controller: gamma, the loop's settings)
        self.drafter = drafter
        self.costs: dict[int, dict[int, list[float]]] = {}  # batch -> {fill: [γ+1]}
        # per-position acceptance (accepted / reached), halved into the previous value after
        # each adaptive batch (None: none yet; starts from switch_off_acceptance)
        self.observed_acceptance: list[float] | None = None
        self.off_batches = 0  # batches run switched off (every REPROBE_BATCHES-th re-measures)
        # batch size -> (window_hist, decode tokens per row, spent) of the last adaptive batch of
        # that size; "any": of the last adaptive batch of any size
        self.last_runs: dict[int | str, tuple[list[int], list[int], float]] = {}
        # batch 1, per context bucket (the calibrated fill nearest a request's prompt length):
        # decayed (hits, reached) per draft position, and requests run plain since the last
        # adaptive one there
        self.by_context: dict[float, tuple[list[float], list[float]]] = {}
        self.off_by_bucket: dict[float, int] = {}

    @property
    def fills(self) -> tuple[int, ...] | None:
        """The context lengths the curves are measured at (None: calibration.FILLS)."""
        lengths = self.settings.context_lengths
        return tuple(sorted(int(n) for n in lengths)) if lengths else None

    def _at(self) -> dict:
        """The calibration's `fills` keyword where context lengths are set (else its default)."""
        return {"fills": self.fills} if self.fills else {}

    @property
    def measures(self) -> bool:
        """Whether the curves are calibrated on this machine (else given by the settings)."""
        s = self.settings
        return s.step_costs is None or s.draft_cost == "auto"

    def calibrate(self, batch: int, dparams: Any) -> dict[int, list[float]]:
        """{fill: step cost with c = 0..γ draft nodes} at this batch size, rows holding `fill`
        committed tokens, in steps of the plain program; once per host and batch size.
        Measured (no step_costs given, draft_cost "auto"): the adaptive loop's own step with c
        nodes, timed whole (`calibration.loop_costs`). Else the verify of 1 + c entries
        (measured per fill, or given) + the drafter's work with c nodes (measured per fill with
        draft_cost "auto", else draft_cost per node); with c = 0 a drafter with commit_plain
        runs the plain program's step itself (speculate.decode's plain runs): measured verify
        cost[0] is 1 there. A given curve (one list) holds for every context (fill 0); a dict
        gives one per fill. A cached calibration whose plain step this machine no longer matches
        (`calibration.loop_drifted`) is measured again; every measurement announces itself."""
        if batch not in self.costs:
            s = self.settings
            if s.step_costs is None and s.draft_cost == "auto":
                model, spec = self.model, self.spec
                at = self._at()
                again = s.recalibrate or calibration.loop_drifted(model, spec, dparams, batch, **at)
                costs = calibration.loop_costs(model, spec, dparams, batch, recalibrate=again, **at)
            else:
                costs = self._summed_costs(batch, dparams)
            self.costs[batch] = {  # more nodes: never cheaper
                f: list(itertools.accumulate(curve, max)) for f, curve in sorted(costs.items())
            }
        return self.costs[batch]

    def curves(self, batch: int) -> dict[int, list[float]]:
        """This size's curves; given ones are computed here, measured ones need `calibrate`."""
        if batch not in self.costs:
            if self.measures:
                raise JaxspecError(
                    f"adaptive step costs at batch {batch} are not calibrated yet: call "
                    f"Engine.calibrate({batch}) first (generate and stream do)"
                )
            self.calibrate(batch, None)
        return self.costs[batch]

    def _summed_costs(self, batch: int, dparams) -> dict[int, list[float]]:
        """The curves from a verify curve (measured or given) + the drafter's work."""
        s, g = self.settings, self.spec.adaptive.gamma
        src = s.step_costs
        if src is None and self.spec.num_nodes != g:  # a verify curve by width: chains only
            raise JaxspecError(
                "adaptive trees are priced by the loop's own steps: set "
                "speculative.adaptive.draft_cost=auto or give step_costs (one per depth 0..D)"
            )
        # a calibration this machine has drifted away from is measured again (both curves)
        at = self._at()
        again = s.recalibrate or (src is None and calibration.drifted(self.model, batch, **at))
        if src is None:
            verify = calibration.step_costs(self.model, batch, g, recalibrate=again, **at)
        else:
            verify = src(batch) if callable(src) else src
            verify = {int(f): list(c) for f, c in verify.items()} if isinstance(
                verify, dict) else {0: list(verify)}
        for curve in verify.values():
            if len(curve) != g + 1 or min(curve) <= 0:
                raise JaxspecError(
                    f"adaptive step_costs {curve!r} must be {g + 1} positive numbers (window "
                    f"1..{g + 1} entries): give one per window width"
                )
        if src is None and traits(self.drafter).commit_plain:  # c* = 0: a plain run,
            verify = {f: [1.0, *c[1:]] for f, c in verify.items()}  # plain's own step
        if s.draft_cost == "auto":
            draft = calibration.draft_costs(
                self.model, self.drafter, dparams, batch, g, recalibrate=again, **at
            )
            if set(draft) != set(verify):  # given verify costs: the drafter's at each fill
                fills, rows = controller.cost_table(draft)
                draft = {f: [float(np.interp(f, fills, col)) for col in zip(*rows)]
                         for f in verify}
        else:
            draft = {f: [k * float(s.draft_cost) for k in range(g + 1)] for f in verify}
        return {f: [v + d for v, d in zip(curve, draft[f])] for f, curve in verify.items()}

    def runs_adaptive(self, batch: int, contexts=None) -> bool:
        """Whether a batch of this size runs the adaptive program (else the plain one); contexts:
        the rows' committed tokens at the start (their prompt lengths), None: unknown
        (`decide`)."""
        return self.decide(batch, contexts)[0]

    def decide(self, batch: int, contexts=None) -> tuple[bool, str]:
        """(runs adaptive, why: one of HOST_REASONS).

        Up to controller.PER_REQUEST_MAX_BATCH rows (batch 1: the row is the request) with its
        context known, the request's own length decides (`per_context`): this size's cost curve
        read at that length, at the acceptance earlier requests of about that length saw. Without
        a context only the curves decide, at `switch_off_acceptance`: whether speculation can pay
        at any context. Larger batches step in lockstep over rows of different requests, so
        earlier batches decide too: the cost curve at the acceptance they measured
        (`observed_acceptance`; before any: `prior`, where the loop's estimates start), and the
        last adaptive batch of this size must have beaten plain by the cost model
        (`realized_gain`). Every REPROBE_BATCHES-th batch that would run plain runs adaptive
        instead (per context bucket where the context decides), so the estimate can recover."""
        curves = self.curves(batch)  # per context: the loop reads the one it is at
        s = self.settings
        if batch <= controller.PER_REQUEST_MAX_BATCH and contexts:
            return self.per_context(batch, max(int(n) for n in contexts))
        if batch <= controller.PER_REQUEST_MAX_BATCH:
            pays = max(controller.best_gain(c, s.switch_off_acceptance)
                       for c in curves.values()) > 1.0
        else:
            acc = self.observed_acceptance or s.prior
            pays = max(controller.best_gain(c, acc) for c in curves.values()) > 1.0
            pays = pays and self.realized_gain(batch) > 1.0
        if pays:
            return True, "pays"
        if (self.off_batches + 1) % REPROBE_BATCHES == 0:
            return True, "reprobe"
        return False, "acceptance"

    def per_context(self, batch: int, context: int) -> tuple[bool, str]:
        """A request of `context` committed tokens: its curve (linear between the calibrated
        fills, clamped outside) at the acceptance seen near this length (`acceptance_at`).
        "context" where the same acceptance would pay at the shortest calibrated context, else
        "acceptance"; a bucket kept plain re-probes every REPROBE_BATCHES-th request."""
        curves = self.curves(batch)
        fills, rows = controller.cost_table(curves)
        curve = [float(np.interp(context, fills, col)) for col in zip(*rows)]
        acc = self.acceptance_at(batch, context)
        if controller.best_gain(curve, acc) > 1.0:
            return True, "pays"
        bucket = self.bucket(batch, context)
        if (self.off_by_bucket.get(bucket, 0) + 1) % REPROBE_BATCHES == 0:
            return True, "reprobe"
        return False, "context" if controller.best_gain(rows[0], acc) > 1.0 else "acceptance"

    def bucket(self, batch: int, context: int) -> float:
        """The calibrated fill nearest `context` (log scale): where its acceptance is kept."""
        fills = [max(float(f), 1.0) for f in controller.cost_table(self.curves(batch))[0]]
        return min(fills, key=lambda f: abs(np.log(f) - np.log(max(context, 1))))

    def acceptance_at(self, batch: int, context: int) -> list[float] | float:
        """Per-position acceptance seen at the bucket nearest `context` (a decayed count of hits
        over reached positions, `switch_off_acceptance` worth `prior_weight` observations);
        unseen there: the nearest shorter bucket's (a drafter reads a longer context no
        better), else `switch_off_acceptance` (whether it could pay at all). Prompt lookup: always
        `switch_off_acceptance`: its acceptance is whether a prompt repeats itself, not its
        length, and its loop costs little where nothing matches."""
        s = self.settings
        if traits(self.drafter).drafts_from_tokens:
            return s.switch_off_acceptance
        seen = [f for f in self.by_context if f <= self.bucket(batch, context)]
        if not seen:
            return s.switch_off_acceptance
        hits, reached = self.by_context[max(seen)]
        w = s.prior_weight
        return [(h + w * s.switch_off_acceptance) / (r + w) for h, r in zip(hits, reached)]

    def realized_gain(self, batch: int) -> float:
        """The speedup over plain, by this size's cost model, of the steps the last adaptive batch
        of this size ran, each priced in the loop at its context (`AdaptiveState.spent`); before
        one of this size: the last of any size, its window histogram priced with this size's
        curve at the smallest fill; before any at all: 2.0, i.e. try."""
        if batch in self.last_runs:
            _, tokens, spent = self.last_runs[batch]
            return max(tokens, default=0) / spent if spent > 0 else 1.0
        run = self.last_runs.get("any")
        if run is None:
            return 2.0
        curve = next(iter(self.curves(batch).values()))
        return controller.realized_gain(curve, run[0], run[1])

    def record(self, astate, rows: int, batch: int, tokens: list[int], contexts=None) -> None:
        """After a batch of `batch` rows, `rows` of them real: its fetched AdaptiveState (None:
        it ran the plain program), each real row's decode tokens, and (batch 1) the rows'
        contexts as `decide` was given them: the acceptance seen at that length."""
        per_request = batch <= controller.PER_REQUEST_MAX_BATCH and contexts
        if per_request:
            bucket = self.bucket(batch, max(int(n) for n in contexts))
        if astate is None:
            self.off_batches += 1
            if per_request:
                self.off_by_bucket[bucket] = self.off_by_bucket.get(bucket, 0) + 1
            return
        self.off_batches = 0  # a re-probe starts the count again
        reached = np.asarray(astate.reached[:rows]).sum(axis=0)
        hits = np.asarray(astate.hits[:rows]).sum(axis=0)
        if per_request:  # older requests weigh half as much as each newer one
            self.off_by_bucket[bucket] = 0
            old_h, old_r = self.by_context.get(bucket, ([0.0] * len(hits), [0.0] * len(hits)))
            self.by_context[bucket] = ([0.5 * o + float(h) for o, h in zip(old_h, hits)],
                                       [0.5 * o + float(r) for o, r in zip(old_r, reached)])
        prev = self.observed_acceptance or [self.settings.switch_off_acceptance] * len(hits)
        self.observed_acceptance = [  # averaged with earlier batches: one prompt without a
            0.5 * (p + h / r) if r else p for h, r, p in zip(hits, reached, prev)
        ]  # single match must not switch speculation off for the next
        hist = np.asarray(astate.window_hist).tolist()
        self.last_runs[batch] = self.last_runs["any"] = (hist, tokens, float(astate.spent))
