"""Not the package: the root of a jaxspec checkout (the package is jaxspec/ below).

A script run beside a clone folder named `jaxspec` imports that folder first, as it would any
directory of that name. Without this file Python made it an empty namespace package, and the
script failed with "cannot import name 'Engine' from 'jaxspec' (unknown location)". With it:
when jaxspec is installed (a wheel, or this checkout with `pip install -e`), the installed package
is imported instead; when it is not, the import fails with one line that names the fix.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _installed_spec(name: str, here: str):
    """The spec of an installed `name` found anywhere but this folder's parent, else None."""
    parent = os.path.dirname(here)
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != parent]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is not None and spec.origin not in (None, "namespace"):
        return spec
    for finder in sys.meta_path:  # an editable install's finder (setuptools' __editable__)
        if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, None)
        if spec is not None and spec.origin and not spec.origin.startswith(here + os.sep):
            return spec
    return None


def _import_the_package() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    spec = _installed_spec(__name__, here)
    if spec is None:
        raise ImportError(
            f"'{__name__}' here is the jaxspec checkout {here}, not an installed package: install "
            f"it (pip install -e {here}, or bash {here}/scripts/setup.sh main and run with "
            f"{here}/.venv/bin/python), or run your script from another directory"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module  # what the import statement returns
    spec.loader.exec_module(module)


if __name__ == "jaxspec":  # only the folder named like the package shadows it
    _import_the_package()
