"""jax's internals are named in one module (jaxspec/jax_compat.py), so a newer jax can move them
without breaking an import elsewhere: no other module of jaxspec imports a private jax path (a
planted import is seen caught), each helper works on the installed jax, and each degrades to
"not available" where a jax has no such internal (the import made to fail)."""

from __future__ import annotations

import ast
import importlib
import logging
from pathlib import Path

import jax

from jaxspec import jax_compat

ROOT = Path(__file__).resolve().parents[1] / "jaxspec"


def private_imports(source: str) -> list[str]:
    """The private jax modules `source` imports (import statements and importlib strings)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]  # jax._src.x / jax.lib.y used as attributes
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith("jax.") and " " not in node.value else []
        found += [n for n in names if n.startswith(jax_compat.PRIVATE_PREFIXES)
                  and n.split(".")[:2] != ["jax", "libs"]]
    return found


def test_no_module_but_jax_compat_names_a_private_jax_path():
    offenders = {}
    for path in ROOT.rglob("*.py"):
        if path.name == "jax_compat.py" and path.parent == ROOT:
            continue
        hits = private_imports(path.read_text())
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert offenders == {}, f"private jax paths outside jaxspec/jax_compat.py: {offenders}"
    planted = ("from jax._src import config\nimport jax.interpreters.pxla\n"
               "x = jax.lib.xla_bridge\nname = 'jax._src.compiler'\n")
    assert len(private_imports(planted)) >= 4, private_imports(planted)


def test_the_helpers_work_on_the_installed_jax():
    assert jax_compat.compilation_cache_internals() is not None  # xla_cache heals through it
    assert jax_compat.reset_compilation_cache() is True
    assert jax_compat.jaxlib_version() == jax.__version__  # jax and jaxlib move together
    assert jax_compat.topology_factories() <= {"cpu", "cuda", "rocm", "tpu"}  # the platforms registered so far (test order decides which)
    before = jax.config.jax_enable_compilation_cache
    with jax_compat.compilation_cache_disabled():
        assert jax.config.jax_enable_compilation_cache is False
    assert jax.config.jax_enable_compilation_cache == before
    assert logging.getLogger(jax_compat.COMPILER_LOGGER).name in logging.root.manager.loggerDict


def test_a_jax_without_the_internals_degrades(monkeypatch):
    real = importlib.import_module

    def no_private(name, package=None):
        if name.startswith(("jax._src", "jax.experimental.compilation_cache")):
            raise ImportError(f"No module named {name!r} (a newer jax)")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_private)
    assert jax_compat.compilation_cache_internals() is None
    assert jax_compat.reset_compilation_cache() is False
    assert jax_compat.topology_factories() == set()
    before = jax.config.jax_enable_compilation_cache
    with jax_compat.compilation_cache_disabled():  # the global flag, restored after
        assert jax.config.jax_enable_compilation_cache is False
    assert jax.config.jax_enable_compilation_cache == before
    from jaxspec import xla_cache

    assert xla_cache.drop_unreadable_entries() is False  # jax's own behaviour stays
