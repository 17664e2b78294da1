"""The package builds as a wheel under its PyPI name and runs from a fresh virtual environment.

Built with `python -m build --no-isolation` (this environment's setuptools: no download) from a
copy of the sources, so the work tree gets no build/ or egg-info; installed with `--no-deps` into a
fresh venv, where `python -m jaxspec.generate --help` needs only the standard library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("build")


def run(*argv, cwd, env=None):
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{argv}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "jaxspec", src / "jaxspec",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src),
        cwd=src)
    [whl] = out.glob("*.whl")
    return whl


def test_the_wheel_has_the_distribution_name_and_the_package(wheel):
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert name != "jaxspec"  # PyPI's jaxspec is an X-ray spectral fitting library
    assert wheel.name.startswith(name.replace("-", "_") + "-")
    files = set(zipfile.ZipFile(wheel).namelist())
    for path in ("jaxspec/__init__.py", "jaxspec/generate.py", "jaxspec/kernels/panel_matmul.cc",
                 "jaxspec/drafters/prompt_lookup.py", "jaxspec/train/__main__.py"):
        assert path in files


def test_installed_wheel_runs_from_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
        "--quiet", str(wheel), cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = run(str(python), "-c", "import jaxspec; print(jaxspec.__file__)", cwd=tmp_path, env=env)
    assert str(venv) in where.stdout  # the installed copy, not the work tree
    done = run(str(python), "-m", "jaxspec.generate", "--help", cwd=tmp_path, env=env)
    assert "usage: python -m jaxspec.generate" in done.stdout


def install_cell() -> str:
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    [cell] = [c for c in nb.cells if c.cell_type == "code" and "JAXSPEC_SOURCE" in c.source]
    return cell.source


def test_the_notebooks_install_cell_installs_the_wheel_into_a_fresh_venv(wheel, tmp_path):
    """The first cell of the notebooks, run as Colab would run it, with JAXSPEC_SOURCE = the wheel.
    The venv reuses this environment's packages (a .pth file), so pip finds jax & co. installed
    (as on Colab) and installs only jaxspec, offline."""
    import site

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv), cwd=tmp_path)
    python = venv / "bin" / "python"
    purelib = run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                  cwd=tmp_path).stdout.strip()
    Path(purelib, "reuse.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    script = tmp_path / "install_cell.py"
    script.write_text(install_cell())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = run(str(python), str(script), cwd=tmp_path, env=env | {"JAXSPEC_SOURCE": str(wheel)})
    assert f"from {purelib}/jaxspec" in done.stdout, done.stdout
    pinned = (tmp_path / "jaxspec-constraints.txt").read_text()
    assert "jax==" in pinned and "jaxlib==" in pinned  # the preinstalled jax is held in place
