"""The persistent XLA compilation cache, on by default for the CLI and the Python API alike.

Compiled programs are kept in `xla/` under the jaxspec cache directory ($JAXSPEC_CACHE_DIR, else
$XDG_CACHE_HOME/jaxspec, else ~/.cache/jaxspec), so a second run with the same shapes loads its
programs instead of compiling them. `JAXSPEC_XLA_CACHE=0` turns it off. A cache directory set
before (`jax.config.update("jax_compilation_cache_dir", ...)` or JAX_COMPILATION_CACHE_DIR) is
kept: jaxspec only fills in a default.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxspec.paths import cache_root

OFF = ("0", "off", "false", "no")


def directory() -> str | None:
    """<jaxspec cache>/xla; None when JAXSPEC_XLA_CACHE=0 turns it off."""
    if os.environ.get("JAXSPEC_XLA_CACHE", "").strip().lower() in OFF:
        return None
    return str(Path(cache_root(), "xla"))


def enable() -> str | None:
    """Turn the cache on (idempotent); returns the directory in use, None when it is off."""
    path = directory()
    if path is None:
        return None
    import jax

    from jaxspec import jax_compat  # imports jax: not at this module's head

    drop_unreadable_entries()  # a damaged entry is replaced, not re-read on every run
    current = jax.config.jax_compilation_cache_dir
    if current:  # the user's (or an earlier call's) choice stands
        restore_access_times(current)
        return current
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # default 1 s
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor
    jax_compat.reset_compilation_cache()  # a program compiled before this call fixed "no cache"
    restore_access_times(path)
    return path


def drop_unreadable_entries() -> bool:
    """Make an unreadable persistent-cache entry (truncated by a killed writer, damaged on
    disk) be deleted when jax fails to read it, so the recompiled program is stored again; jax
    alone warns, recompiles and never replaces an entry that exists, on every run. Wraps jax's
    cache read; False where this jax has no such function (then jax's behaviour stays)."""
    from jaxspec import jax_compat  # imports jax: not at this module's head

    cc = jax_compat.compilation_cache_internals()
    if cc is None:
        return False
    read = getattr(cc, "get_executable_and_time", None)
    if read is None or getattr(read, "_jaxspec_heals", False):
        return read is not None

    def get_executable_and_time(cache_key, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except Exception:
            cache = getattr(cc, "_cache", None)
            root = getattr(cache, "path", None)
            if root is not None:
                Path(root, f"{cache_key}-cache").unlink(missing_ok=True)
            raise

    get_executable_and_time._jaxspec_heals = True
    cc.get_executable_and_time = get_executable_and_time
    return True


def restore_access_times(path: str) -> int:
    """Give every entry of a size-limited cache its access-time file; returns how many were missing.

    With `jax_compilation_cache_max_size` set, JAX writes an entry and then its `-atime` file,
    and every later write reads all of them to pick what to evict: a process interrupted between
    the two writes (Ctrl-C while compiling) leaves an entry without one, and from then on every
    write to that cache fails with FileNotFoundError. The restored entries count as just used.
    """
    import time

    import jax

    if jax.config.jax_compilation_cache_max_size == -1 or not Path(path).is_dir():
        return 0
    now = time.time_ns().to_bytes(8, "little")
    restored = 0
    for entry in Path(path).glob("*-cache"):
        atime = entry.with_name(entry.name[: -len("-cache")] + "-atime")
        if not atime.exists():
            atime.write_bytes(now)
            restored += 1
    return restored
