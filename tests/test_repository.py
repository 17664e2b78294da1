"""The repository holds no machine's paths (a checkout directory, a home directory): commands and
records in committed files are relative to the repository root, so they run in any clone. Every
shipped head under checkpoints/ is one a shipped config runs: a retrained head replaces the old one
in place (docs/testing.md, "Shipped heads"), so no superseded binary stays behind. Every file in
scripts/ is a command something names (the docs, BENCHMARKS.md, configs, the package, the tests or
another script): a probe that answered its question leaves, its figures in docs/history/."""

from __future__ import annotations

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
