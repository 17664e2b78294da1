"""Every `python -m jaxspec.*` entry point answers `--help` at once: its arguments are parsed before
jax, transformers or torch are imported (those take seconds to load).

The entry points are found, not listed: every module under jaxspec/ with a `__main__` block, and
every package's `__main__.py`, so a new command is covered when it is added.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("jax", "transformers", "torch", "flax", "optax", "orbax")

# Runs the module as `python -m` does, with --help, then reports which heavy packages it loaded.
PROBE = """
import json, runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    code = None
except SystemExit as e:
    code = e.code
loaded = sorted(m for m in {heavy!r} if m in sys.modules)
print("\\nPROBE " + json.dumps({{"code": code, "loaded": loaded}}))
"""


def entry_points() -> list[str]:
    out = []
    for path in sorted((ROOT / "jaxspec").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if path.name == "__main__.py":
            out.append(".".join(rel.parts[:-1]))
        elif re.search(r"^if __name__ == .__main__.:", path.read_text(), re.MULTILINE):
            out.append(".".join(rel.parts))
    return out


def test_the_known_entry_points_are_found():
    found = set(entry_points())
    for name in ("generate", "train", "export", "bench", "tools.roofline"):
        assert f"jaxspec.{name}" in found


@pytest.mark.parametrize("module", entry_points())
def test_help_loads_no_heavy_package(module):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), module],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.rsplit("PROBE ", 1)[1])
    assert report["code"] in (0, None), done.stderr[-2000:]
    assert "usage:" in done.stdout
    # The work --help does, counted: no jax, transformers, torch ... (an import of jax alone
    # is 1-2 s of a user's wait), whatever the machine's load.
    assert report["loaded"] == [], f"{module} --help imported {report['loaded']}"


def test_import_jaxspec_is_light_and_every_export_resolves():
    code = (
        "import json, sys, jaxspec\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "missing = [n for n in jaxspec.__all__ if getattr(jaxspec, n, None) is None]\n"
        "for ns in (jaxspec.decode, jaxspec.models, jaxspec.drafters, jaxspec.serving):\n"
        "    missing += [f'{ns.__name__}.{n}' for n in ns.__all__ if getattr(ns, n, None) is None]\n"
        "print(json.dumps([heavy, missing, len(jaxspec.__all__)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    heavy, missing, count = json.loads(done.stdout.splitlines()[-1])
    assert heavy == []  # `import jaxspec` itself loads nothing heavy (the exports are lazy)
    # every public name, top level and namespaces, resolves where its export list says
    assert missing == [] and count >= 20


OLD_NAMES = """
import importlib, json, warnings
import jaxspec
from jaxspec import exports

def resolve(path):
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)

found = []
warnings.simplefilter("always")
for old, new in [*((f"jaxspec.{n}", p) for n, p in jaxspec._MOVED.items()),
                 *exports.RENAMED_MODULES.items()]:
    module = old in exports.RENAMED_MODULES
    get = (lambda: importlib.import_module(old)) if module else (lambda: getattr(jaxspec, old[8:]))
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        value = get()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        get()
    same = value is (importlib.import_module(new) if module else resolve(new))
    said = [str(w.message) for w in first if w.category is DeprecationWarning]
    found.append([old, same, said, len(again)])
print(json.dumps(found))
"""


def test_old_names_resolve_to_the_new_objects_with_one_warning():
    """Names that left the top level and renamed modules keep working for one release: the very
    object of the new path, one DeprecationWarning naming that path, and only once."""
    done = subprocess.run([sys.executable, "-c", OLD_NAMES], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert len(found) >= 25
    for old, same, said, again in found:
        assert same, f"{old} does not resolve to its new object"
        assert len(said) == 1 and old in said[0] and "moved to jaxspec." in said[0], (old, said)
        assert again == 0, f"{old} warned twice"


def test_generate_help_lists_the_methods_and_the_shipped_configs():
    from jaxspec import catalog
    from jaxspec.drafters import available_methods, registry
    from jaxspec.generate import make_parser

    # jaxspec's own methods (a test in this process may have registered one of its own)
    shipped = sorted(m for m in available_methods() if m == "none"
                     or registry.get(m).factory.__module__.startswith("jaxspec."))
    assert catalog.registered_methods() == [m for m in shipped if m != "none"]
    text = make_parser().format_help()
    methods = text.split("methods (speculative.method):", 1)[1].split("\n\n", 1)[0]
    assert sorted(re.findall(r"\w+", methods.replace("(plain decoding)", ""))) == shipped
    configs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml"))
    assert configs and all(re.search(rf"^  {re.escape(c)} +\w+$", text, re.M) for c in configs)


def test_a_script_beside_a_clone_named_jaxspec_gets_the_package_or_the_fix(tmp_path):
    """The import trap: a folder named `jaxspec` (a clone) beside the script is imported first.
    Installed elsewhere, the installed package is what the script gets; not installed (no
    site-packages: `-S`), one ImportError that names the fix."""
    (tmp_path / "jaxspec").symlink_to(ROOT, target_is_directory=True)
    script = tmp_path / "use.py"
    script.write_text("import jaxspec\nprint(jaxspec.__file__, 'Engine' in jaxspec.__all__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    installed = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                               text=True, timeout=60, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-2000:]
    where, has_engine = installed.stdout.split()
    assert Path(where).parent.name == "jaxspec" and Path(where).parent != tmp_path / "jaxspec"
    assert has_engine == "True"
    bare = subprocess.run([sys.executable, "-S", str(script)], env=env, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert bare.returncode == 1
    last = bare.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: 'jaxspec' here is the jaxspec checkout"), bare.stderr
    assert f"pip install -e {tmp_path / 'jaxspec'}" in last
