"""Refit jaxspec.tools.step_model's constants on the H200 measurements: the stacked layout's decode
programs the device ran (docs/device/h200-shapes.json, batch 1 / 8 / 32 of three shapes) compiled
here for h200, their bytes, kernels and host syncs against the measured step times, least squares.

    python scripts/fit_step_model.py     # prints the constants and each point's fit
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxspec.tools import accel_roofline, aot, roofline  # noqa: E402


# The H200 cost curve's points (docs/device/h200-shapes.json): shape -> the MODEL_SHAPES name.
CALIBRATION_SHAPES = {"llama-3.1-8b": "llama3-8b", "llama-3.2-1b": "llama3-1b",
                      "smollm2-135m": "smollm2-135m"}


def calibration_points(batches=(1, 8, 32)) -> list[dict]:
    """The measured H200 decode steps with the same programs compiled here for h200 (the stacked
    layout they ran, capacity fill + 64 as the calibration allotted, bfloat16)."""
    doc = json.loads((Path(__file__).resolve().parents[1] / "docs/device/h200-shapes.json").read_text())
    out = []
    for shape, name in CALIBRATION_SHAPES.items():
        model = roofline.shape_target(name, "bfloat16")
        place = accel_roofline.placement("h200", None, model)
        for c in doc["shapes"][shape]["cost_curve"]:
            if c["width"] != 1 or c["batch"] not in batches:
                continue
            row = accel_roofline.measure(place, model, "stacked", "decode", c["batch"], 1,
                                         c["fill"] + 64, c["fill"])
            out.append(row | {"shape": shape, "measured_ms": c["step_ms"]})
    return out


def fit(points: list[dict], bandwidth: float) -> tuple[float, float, float]:
    """(EFFICIENCY, LAUNCH_US, SYNC_US) by least squares over the points."""
    a = np.array([[1e3 * p["bytes_moved"] / bandwidth, 1e-3 * p["kernels"], 1e-3 * p["host_syncs"]]
                  for p in points])
    y = np.array([p["measured_ms"] for p in points])
    (inv_eff, launch, sync), *_ = np.linalg.lstsq(a, y, rcond=None)
    return 1 / inv_eff, launch, sync


if __name__ == "__main__":
    pts = calibration_points()
    bw = aot.target("h200").bandwidth
    eff, launch, sync = fit(pts, bw)
    print(f"EFFICIENCY = {eff:.3f}  LAUNCH_US = {launch:.2f}  SYNC_US = {sync:.2f}")
    for p in pts:
        t = (1e3 * p["bytes_moved"] / (eff * bw) + 1e-3 * p["kernels"] * launch
             + 1e-3 * p["host_syncs"] * sync)
        print(f"{p['shape']} b{p['batch']}: bytes {p['bytes_moved'] / 1e9:.2f} GB, kernels "
              f"{p['kernels']}, syncs {p['host_syncs']}, measured {p['measured_ms']:.2f} ms, "
              f"fitted {t:.2f} ms")
