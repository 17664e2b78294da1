"""The repository holds no machine's paths (a checkout directory, a home directory): commands and
records in committed files are relative to the repository root, so they run in any clone. And no
function in jaxspec/ is longer than a reader takes in at once (80 lines)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("jaxspec", "scripts", "docs", "configs", "checkpoints", "tests", "notebooks", "data")
MACHINE_PATH = re.compile("/" + "(?:work|root)/")  # split: this file does not match itself
TEXT = {".py", ".md", ".sh", ".json", ".yaml", ".yml", ".txt", ".ipynb", ".toml", ".cc", ".h"}


def committed_text_files():
    yield from (p for p in ROOT.glob("*") if p.is_file() and p.suffix in TEXT)
    for tree in TREES:
        for path in (ROOT / tree).rglob("*"):
            if path.is_file() and path.suffix in TEXT and "__pycache__" not in path.parts:
                yield path


def test_no_machine_paths_in_the_repository():
    found = [f"{p.relative_to(ROOT)}:{n}" for p in committed_text_files()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert found == []


# A function a reader takes in at once (issue 58). Functions still over, in the parts other
# branches are rewriting: emptied once those land.
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS_ALLOWED = {
    "jaxspec/serving/http.py:make_app",
    "jaxspec/serving/http.py:make_app.respond",
    "jaxspec/serving/scheduler.py:Scheduler.__init__",
}


def long_functions(package: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """`path:Qualified.name` -> lines (def to last line, docstring included) of every function
    longer than `limit` under `package`."""
    found = {}

    def visit(node, path: str, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > limit:
                    found[f"{path}:{name}"] = lines
                visit(child, path, name + ".")
            else:
                visit(child, path, prefix)

    for file in sorted(package.rglob("*.py")):
        visit(ast.parse(file.read_text()), file.relative_to(package.parent).as_posix(), "")
    return found


def test_no_function_over_80_lines():
    over = long_functions(ROOT / "jaxspec")
    assert set(over) - LONG_FUNCTIONS_ALLOWED == set(), f"split these by purpose: {over}"
    # an allowed one that got short (or moved) leaves the list
    assert LONG_FUNCTIONS_ALLOWED <= set(over), LONG_FUNCTIONS_ALLOWED - set(over)


def test_a_long_function_is_found(tmp_path):
    package = tmp_path / "jaxspec"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (package / "m.py").write_text(f"class C:\n    def f(self):\n{body}\n\n\ndef g():\n    pass\n"
                                  .replace("\n    x", "\n        x"))
    assert long_functions(package) == {"jaxspec/m.py:C.f": 82}
