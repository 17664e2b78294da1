"""The public namespaces' lazy export lists (PEP 562), and the old names that keep working for one
release.

A namespace's `__init__` lists `name -> defining module` and calls `lazy(__name__, EXPORTS)`: a
name is imported on first use, so `import jaxspec` and every `python -m jaxspec.<tool> --help`
start without loading jax. An old name (a module renamed in issue 58, a top-level name that moved
to a namespace) resolves to the new object with one DeprecationWarning naming the new path, once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# Modules renamed to say what they are: old dotted path -> new one (issue 58; gone next release).
RENAMED_MODULES = {
    "jaxspec.drafters.eagle": "jaxspec.drafters.eagle_head",
    "jaxspec.drafters.ngram": "jaxspec.drafters.prompt_lookup",
    "jaxspec.drafters.lookup": "jaxspec.drafters.prompt_lookup_first",
    "jaxspec.drafters.block": "jaxspec.drafters.parallel_block",
    "jaxspec.drafters.dflash_net": "jaxspec.drafters.dflash_forward",
}

_warned: set[str] = set()


def warn_moved(old: str, new: str) -> None:
    """One DeprecationWarning per old name and process."""
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{old} moved to {new}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=3)


def lazy(namespace: str, exports: dict[str, str], moved: dict[str, str] | None = None,
         submodules: tuple[str, ...] = ()):
    """`(__getattr__, __dir__)` for a namespace module: `exports` maps a public name to the module
    defining it; `submodules` are public submodules (`jaxspec.models.llama`); `moved` maps an old
    name to the dotted path of its new home (warned once)."""
    module = sys.modules[namespace]
    moved = moved or {}

    def __getattr__(name: str):
        if name in exports or name in submodules:
            if name in submodules:
                value = importlib.import_module(f"{namespace}.{name}")
            else:
                value = getattr(importlib.import_module(exports[name]), name)
            setattr(module, name, value)  # later lookups skip __getattr__
            return value
        if name in moved:
            home, _, attr = moved[name].rpartition(".")
            warn_moved(f"{namespace}.{name}", moved[name])
            return getattr(importlib.import_module(home), attr)
        raise AttributeError(f"module {namespace!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(module), *exports, *submodules})

    # A name its defining module shares (`decode.prefill`, the function in decode/prefill.py):
    # importing that submodule binds the package attribute to the module, so the export is
    # pinned by a property of the namespace's module type instead (the module stays importable
    # as `import jaxspec.decode.prefill` and in sys.modules).
    pinned = {n: _pinned(n, exports[n]) for n in exports if exports[n] == f"{namespace}.{n}"}
    if pinned:
        module.__class__ = type("Namespace", (types.ModuleType,), pinned)
    return __getattr__, __dir__


def _pinned(name: str, source: str) -> property:
    def get(_module):
        return getattr(importlib.import_module(source), name)

    def bind(_module, _value):  # the import system binding the submodule: the export stays
        pass

    return property(get, bind)


class _RenamedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of an old module path get the new module itself (one object: a monkeypatch
    through either path is seen by both), with the warning."""

    def __init__(self):
        self._real_specs = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in RENAMED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = RENAMED_MODULES[spec.name]
        warn_moved(spec.name, new)
        module = importlib.import_module(new)
        self._real_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # the import system stamped the old name's spec on the module: give it its own back
        module.__spec__ = self._real_specs.pop(module.__spec__.name, module.__spec__)


def install_renamed_modules() -> None:
    if not any(isinstance(f, _RenamedModules) for f in sys.meta_path):
        sys.meta_path.append(_RenamedModules())
