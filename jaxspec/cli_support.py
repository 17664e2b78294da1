"""What every jaxspec command line shares: an argument parser whose mistakes are one-line
`JaxspecError`s (printed as `error: ...`, exit 2), and the persistent XLA compilation cache."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from jaxspec.errors import JaxspecError
from jaxspec.paths import cache_root

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage + exit; keep the one-line contract
        raise JaxspecError(f"{message} (see --help)")


def compilation_cache_dir() -> str | None:
    """<jaxspec cache>/xla; None when JAXSPEC_XLA_CACHE=0 turns it off."""
    if os.environ.get("JAXSPEC_XLA_CACHE", "").strip().lower() in ("0", "off", "false", "no"):
        return None
    return str(Path(cache_root(), "xla"))


def enable_compilation_cache() -> str | None:
    """Persist compiled XLA programs so the next run with the same shapes skips compilation."""
    path = compilation_cache_dir()
    if path is None:
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # default 1 s
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor
    return path
