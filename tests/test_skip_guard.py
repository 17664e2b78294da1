"""No skip hides in CI (tests/skip_guard.py), proven on planted modules: pytest runs in a subprocess
on a tiny module that skips, with the guard loaded alone (`-p skip_guard`, no conftest).

- a module that skips at collection (module-level `pytest.skip` or `importorskip` of a package
  that does not exist) fails the run under CI=true, and passes (skipped) without it: the control;
- a test that skips while it runs fails under CI=true too;
- a skip listed in EXPECTED_SKIPS (module and reason) passes under CI=true, at collection and at
  run time, and the same module skipping for another reason fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

MODULE_SKIP = "import pytest\npytest.skip('{reason}', allow_module_level=True)\n\n" \
              "def test_never_runs():\n    assert False\n"
MODULE_IMPORTORSKIP = "import pytest\npytest.importorskip('jaxspec_no_such_package')\n\n" \
                      "def test_never_runs():\n    assert False\n"
RUNTIME_SKIP = "import pytest\n\ndef test_skips():\n    pytest.skip('{reason}')\n\n" \
               "def test_runs():\n    assert 1 + 1 == 2\n"


def _run(tmp_path: Path, name: str, source: str, ci: bool) -> subprocess.CompletedProcess:
    """pytest on one planted module beside one that passes (so a clean run exits 0), rootdir
    tmp_path (no conftest; an empty ini, so the project's addopts stay out)."""
    (tmp_path / name).write_text(source)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_sibling.py").write_text("def test_passes():\n    assert 2 * 2 == 4\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no third-party plugin: a ~1 s start
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "skip_guard", "-p", "no:cacheprovider",
         "-rs", "-q", name, "test_sibling.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("source", [MODULE_SKIP.format(reason="needs a thing"), MODULE_IMPORTORSKIP],
                         ids=["skip", "importorskip"])
def test_a_module_skipped_at_collection_fails_in_ci(tmp_path, source):
    control = _run(tmp_path, "test_planted.py", source, ci=False)
    assert control.returncode == 0, control.stdout + control.stderr
    assert "1 passed, 1 skipped" in control.stdout
    failed = _run(tmp_path, "test_planted.py", source, ci=True)
    assert failed.returncode != 0, failed.stdout
    assert "unexpected skip in CI" in failed.stdout
    assert "test_planted.py skipped at collection" in failed.stdout
    assert "1 error" in failed.stdout


def test_a_test_skipped_while_it_runs_fails_in_ci(tmp_path):
    source = RUNTIME_SKIP.format(reason="no device here")
    control = _run(tmp_path, "test_planted.py", source, ci=False)
    assert control.returncode == 0 and "2 passed, 1 skipped" in control.stdout, control.stdout
    failed = _run(tmp_path, "test_planted.py", source, ci=True)
    assert failed.returncode == 1, failed.stdout
    assert "1 failed, 2 passed" in failed.stdout
    assert "unexpected skip in CI" in failed.stdout


def test_an_expected_skip_passes_in_ci_and_only_for_its_reason(tmp_path):
    from suite_plan import EXPECTED_SKIPS

    module, fragment = EXPECTED_SKIPS[0]
    for template in (MODULE_SKIP, RUNTIME_SKIP):
        listed = _run(tmp_path, module, template.format(reason=fragment), ci=True)
        assert listed.returncode == 0 and "skipped" in listed.stdout, listed.stdout
        other = _run(tmp_path, module, template.format(reason="another reason"), ci=True)
        assert other.returncode != 0 and "unexpected skip in CI" in other.stdout, other.stdout
