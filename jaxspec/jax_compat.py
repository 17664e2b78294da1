"""jax's private internals, in one module.

The rest of jaxspec imports only public jax (`jax`, `jax.numpy`, `jax.lax`, `jax.tree`, `jax.sharding`, `jax.ffi`,
`jax.monitoring`, `jax.experimental.*`), so a new jax release can move an internal and break
only this module, each function here degrading to "not available" rather than failing the
import (tests/test_jax_compat.py checks both: no private import elsewhere, and the fallbacks).

    compilation_cache_internals()  the persistent cache's module (its read wrapped by xla_cache)
    reset_compilation_cache()      forget "no cache" decided before the directory was set
    compilation_cache_disabled()   a block compiling with the persistent cache off
    topology_factories()           the platforms jax can describe compile-only devices for
    COMPILER_LOGGER                the logger reporting persistent-cache hits and misses
    jaxlib_version()               the installed jaxlib's version
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata

# The logger jax's compiler reports each persistent-cache lookup to (DEBUG records read by
# engine/cache_watch.py); a logger name, so a jax that moved it reports no lookups (the
# progress line then says so) instead of failing.
COMPILER_LOGGER = "jax._src.compiler"

PRIVATE_PREFIXES = ("jax._src", "jax.interpreters", "jax.lib", "jaxlib", "jax.core")  # only here


def _private(name: str):
    """A jax internal module, or None where this jax has no such module."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def compilation_cache_internals():
    """jax's persistent compilation cache module (`get_executable_and_time`, `_cache`), or None."""
    return _private("jax._src.compilation_cache")


def reset_compilation_cache() -> bool:
    """Make the persistent cache re-read its settings (a program compiled before the cache
    directory was set fixed "no cache"); False where this jax has no reset."""
    public = _private("jax.experimental.compilation_cache.compilation_cache")
    reset = getattr(public, "reset_cache", None) or getattr(
        compilation_cache_internals(), "reset_cache", None)
    if reset is None:
        return False
    reset()
    return True


@contextlib.contextmanager
def compilation_cache_disabled():
    """Compile inside the block with the persistent cache off (a compile-only client cannot
    load entries); through jax's config context where it has one, else the global flag."""
    import jax

    config = _private("jax._src.config")
    scoped = getattr(config, "enable_compilation_cache", None)
    if scoped is not None:
        with scoped(False):
            yield
        return
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def topology_factories() -> set[str]:
    """Platforms whose compile-only topologies jax can build now (a plugin registered); empty
    where this jax keeps no such table."""
    bridge = _private("jax._src.xla_bridge")
    return set(getattr(bridge, "_topology_factories", {}) or {})


def jaxlib_version() -> str | None:
    """The installed jaxlib's version (None: not installed as a distribution)."""
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        lib = _private("jax.lib")
        return getattr(lib, "__version__", None)
