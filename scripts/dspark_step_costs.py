"""The step-cost curve a confidence-scheduled DSpark config prices its verify lengths with,
measured on this machine by jaxspec's calibration (jaxspec/decode/adaptive/calibration.py).

    python scripts/dspark_step_costs.py [--config configs/smollm2-135m-dspark-scheduled.yaml]
                                        [--batches 1 8] [--recalibrate]

A scheduled step drafts the whole block (γ drafts: the drafter ignores the cut) and verifies
k = 0..γ of them in the narrowest compiled window (1 + k entries). So its cost in plain steps is
verify(k) + draft(γ): `calibration.step_costs` (the target's window of 1 + k entries over a
1-entry plain step, rows at 128 tokens) plus `calibration.draft_costs` (the DSpark head's
propose + commit over the same plain step, timed in the same rounds). Prints, per batch size, the
pieces and the curve as the config's `speculative.dspark.step_costs` mapping takes it.
"""

from __future__ import annotations

import argparse

from jaxspec.build import build_engine
from jaxspec.config import load_config
from jaxspec.decode.adaptive import calibration


def curve(engine, batch: int, recalibrate: bool) -> tuple[list[float], float]:
    """([verify cost of k = 0..γ drafts], the block's drafting cost), in plain steps, fill 128."""
    g = engine.spec.num_speculative_tokens
    fill = calibration.FILLS[0]
    verify = calibration.step_costs(engine.model, batch, g, recalibrate=recalibrate,
                                    fills=(fill,))[fill]
    draft = calibration.draft_costs(engine.model, engine.drafter, engine.drafter_params, batch,
                                    g, recalibrate=recalibrate, fills=(fill,))[fill]
    return verify, draft[g]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2-135m-dspark-scheduled.yaml")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--recalibrate", action="store_true", help="measure even if cached")
    a = ap.parse_args()
    engine = build_engine(load_config(a.config, ["sampling.temperature=0"]))
    curves = {}
    for b in a.batches:
        verify, draft = curve(engine, b, a.recalibrate)
        curves[b] = [round(v + draft, 3) for v in verify]
        print(f"batch {b}: verify k=0..{len(verify) - 1} {[round(v, 3) for v in verify]}, "
              f"drafting the block {draft:.3f}")
    body = ", ".join(f"{b}: {c}" for b, c in curves.items())
    print(f"speculative.dspark.step_costs: {{{body}}}")


if __name__ == "__main__":
    main()
