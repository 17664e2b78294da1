"""Where jaxspec keeps its caches (built kernels, converted tokenizers, compiled XLA programs,
step-cost calibrations): $JAXSPEC_CACHE_DIR, else $XDG_CACHE_HOME/jaxspec, else ~/.cache/jaxspec."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("JAXSPEC_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "jaxspec")
