"""What every jaxspec command line shares: an argument parser whose mistakes are one-line
`JaxspecError`s (printed as `error: ...`, exit 2), and the persistent XLA compilation cache."""

from __future__ import annotations

import argparse

from jaxspec import xla_cache
from jaxspec.errors import JaxspecError

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage + exit; keep the one-line contract
        raise JaxspecError(f"{message} (see --help)")


def compilation_cache_dir() -> str | None:
    """<jaxspec cache>/xla; None when JAXSPEC_XLA_CACHE=0 turns it off (`jaxspec.xla_cache`)."""
    return xla_cache.directory()


def enable_compilation_cache() -> str | None:
    """Persist compiled XLA programs so the next run with the same shapes skips compilation."""
    return xla_cache.enable()
