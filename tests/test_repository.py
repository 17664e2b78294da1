"""The repository holds no machine's paths (a checkout directory, a home directory): commands and
records in committed files are relative to the repository root, so they run in any clone. Every
shipped head under checkpoints/ is one a shipped config runs: a retrained head replaces the old one
in place (docs/testing.md, "Shipped heads"), so no superseded binary stays behind. Every file in
scripts/ is a command something names (the docs, BENCHMARKS.md, configs, the package, the tests or
another script): a probe that answered its question leaves, its figures in docs/history/. And no
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


# A function a reader takes in at once (issue 58).
MAX_FUNCTION_LINES = 80


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
    assert over == {}, f"split these by purpose: {over}"


def test_a_long_function_is_found(tmp_path):
    package = tmp_path / "jaxspec"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (package / "m.py").write_text(f"class C:\n    def f(self):\n{body}\n\n\ndef g():\n    pass\n"
                                  .replace("\n    x", "\n        x"))
    assert long_functions(package) == {"jaxspec/m.py:C.f": 82}


def strings_in(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from strings_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings_in(value)
    elif isinstance(node, str):
        yield node


def test_every_shipped_head_is_run_by_a_shipped_config():
    import yaml

    shipped = {p.name for p in (ROOT / "checkpoints").iterdir() if p.is_dir()}
    named = {s.rstrip("/").split("/")[1] for path in (ROOT / "configs").glob("*.yaml")
             for s in strings_in(yaml.safe_load(path.read_text()))
             if s.startswith("checkpoints/")}
    assert shipped, "no heads found under checkpoints/"
    assert shipped <= named, f"heads no shipped config (configs/*.yaml) runs: {sorted(shipped - named)}"
    assert named <= shipped, f"configs name heads that are not shipped: {sorted(named - shipped)}"


def test_every_script_is_a_command_something_names():
    scripts = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.is_file())
    names = [p for p in committed_text_files()
             if "history" not in p.relative_to(ROOT).parts]
    text = {p: p.read_text(errors="replace") for p in names}
    unnamed = [s for s in scripts
               if not any(s in body for p, body in text.items() if p.name != s)]
    assert unnamed == [], f"scripts no doc, config, test or module names: {unnamed}"

