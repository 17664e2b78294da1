"""What a benchmark records beside its figures: the machine it ran on (jax and jaxlib versions,
devices, CPU, load) and a JSON encoder for the values a results file holds (arrays, non-finite
floats)."""

from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path
from typing import Any


def json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def machine_facts() -> dict[str, Any]:
    import jax

    from jaxspec import jax_compat  # imports jax: not at this module's head

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jax_compat.jaxlib_version(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
