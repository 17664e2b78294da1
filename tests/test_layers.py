"""Imports run one way: no circle among jaxspec's modules (module- and function-level imports
alike) and no import from a lower layer up to a higher one, in the layer order that
docs/architecture.md states (`LAYERS` below is read from it). Parsed with `ast`: nothing is
imported, so the test costs no jax start. And modules stay small (`test_modules_stay_small`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def layer_order(text: str) -> list[list[str]]:
    """The units of each layer, lowest first: the numbered list under "## Layers", each line
    `N. `unit` `unit` ...`, a unit a top-level module or package of jaxspec."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\d+\. (.*)$", section, re.M)
    return [re.findall(r"`([\w.]+)`", row) for row in rows]


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `package` (a package is its
    __init__)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(module: str, node: ast.AST, is_package: bool, known) -> list[str]:
    """The jaxspec modules an import statement loads (the longest known prefix of each name)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix
                 for a in node.names]
    out = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith("jaxspec"):
            out.append(name)
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules its imports load: every import statement, at any depth (function
    bodies too), plus the packages above each imported module that the importer is not inside
    (importing `a.b.c` runs `a/__init__` and `a/b/__init__` first)."""
    known = module_names(package)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in imported(module, node, is_package, known):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    step = ".".join(parts[:i])
                    inside = module == step or module.startswith(step + ".")
                    if step in known and not inside:
                        graph[module].add(step)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def unit_of(module: str, units: dict[str, int]) -> str | None:
    """The layered unit a module belongs to: the longest listed prefix of its dotted name."""
    name = module
    while name:
        if name in units:
            return name
        name = name.rpartition(".")[0]
    return None


def upward(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Imports from a unit to a unit of a higher layer."""
    rank = {f"jaxspec.{u}" if u != "jaxspec" else u: i for i, row in enumerate(layers) for u in row}
    out = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = unit_of(module, rank), unit_of(target, rank)
            if a != b and rank[b] > rank[a]:
                out.append(f"{module} -> {target}")
    return out


GRAPH = import_graph(ROOT / "jaxspec")
LAYERS = layer_order(ARCHITECTURE.read_text())


def test_no_import_circles():
    assert circles(GRAPH) == []


def test_no_upward_imports():
    assert upward(GRAPH, LAYERS) == []


def test_every_module_has_a_layer():
    rank = {f"jaxspec.{u}" if u != "jaxspec" else u for row in LAYERS for u in row}
    assert [m for m in sorted(GRAPH) if unit_of(m, dict.fromkeys(rank)) is None] == []
    listed = [u for row in LAYERS for u in row]
    assert len(listed) == len(set(listed)), "a unit listed twice"


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "jaxspec" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "jaxspec"


@pytest.mark.parametrize("files, expected", [
    # a function-level import closes the circle
    ({"__init__.py": "", "low.py": "def f():\n    from jaxspec import high\n",
      "high.py": "from jaxspec.low import f\n"}, [["jaxspec.high", "jaxspec.low"]]),
    # through a package's __init__: importing a.x runs a/__init__, which imports a.y
    ({"__init__.py": "", "a/__init__.py": "from jaxspec.a import y\n", "a/x.py": "",
      "a/y.py": "from jaxspec.b import z\n", "b/__init__.py": "",
      "b/z.py": "from jaxspec.a.x import *\n"},
     [["jaxspec.a", "jaxspec.a.y", "jaxspec.b.z"]]),
    # relative imports resolve
    ({"__init__.py": "", "p/__init__.py": "", "p/m.py": "from . import n\n",
      "p/n.py": "from .m import q\n"}, [["jaxspec.p.m", "jaxspec.p.n"]]),
    ({"__init__.py": "", "p/__init__.py": "", "p/m.py": "from jaxspec.p import n\n",
      "p/n.py": "import os\n"}, []),
])
def test_planted_circles_are_found(tmp_path, files, expected):
    assert circles(import_graph(plant(tmp_path, files))) == expected


def test_planted_upward_import_is_found(tmp_path):
    package = plant(tmp_path, {"__init__.py": "", "models/__init__.py": "",
                               "models/cache.py": "def f():\n    from jaxspec.decode import x\n",
                               "decode/__init__.py": "", "decode/x.py": ""})
    layers = layer_order("## Layers\n\n1. `models`\n2. `decode`\n3. `jaxspec`\n")
    assert upward(import_graph(package), layers) == [
        "jaxspec.models.cache -> jaxspec.decode", "jaxspec.models.cache -> jaxspec.decode.x"]


# The size bounds the house keeps (issue 39): a module a reader takes in at once, the scheduler
# a loop over its parts, the fixed-plan loop apart from adaptive speculation's.
MAX_MODULE_LINES = 500
MAX_LINES = {"jaxspec/serving/scheduler.py": 300, "jaxspec/decode/speculate.py": 420}


def test_modules_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in (ROOT / "jaxspec").rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES.get(name, MAX_MODULE_LINES)}
    assert over == {}, f"split these modules by purpose: {over}"
    assert set(MAX_LINES) <= set(sizes), "a bounded module moved: update MAX_LINES"


LAZY_MARKER = "# Imported inside functions:"


def unexplained_function_level_imports(package: Path) -> list[str]:
    """`module:line` of every import of a jaxspec module inside a function that gives no reason:
    none on its line or the line above, and no `# Imported inside functions: <why>` line in its
    module (a command-line module's one reason for all of them, say)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if LAZY_MARKER in text:
            continue
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and not sub.level:
                    names = [sub.module or ""]
                elif isinstance(sub, ast.Import):
                    names = [a.name for a in sub.names]
                else:
                    continue
                said = "#" in lines[sub.lineno - 1] or lines[sub.lineno - 2].strip().startswith("#")
                if any(n.split(".")[0] == "jaxspec" for n in names) and not said:
                    out.append(f"{path.relative_to(package.parent)}:{sub.lineno}")
    return sorted(set(out))


def test_function_level_imports_say_why():
    """An import inside a function hides a dependency from the module's head: only where import
    cost (jax, torch, transformers before a command's --help) or a registration order needs it,
    and then it says so."""
    assert unexplained_function_level_imports(ROOT / "jaxspec") == []


def test_an_unexplained_function_level_import_is_found(tmp_path):
    package = plant(tmp_path, {"__init__.py": "", "a.py": "def f():\n    from jaxspec import b\n",
                               "b.py": "def g():\n    from jaxspec import a  # registers a\n",
                               "c.py": f"{LAZY_MARKER} the CLI's --help\ndef h():\n    import jaxspec.a\n"})
    assert unexplained_function_level_imports(package) == ["jaxspec/a.py:2"]
