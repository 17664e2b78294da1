"""A user who waits is told why: progress lines on stderr (never stdout), and the Python API keeps
compiled programs in the same persistent XLA cache as the CLI unless JAXSPEC_XLA_CACHE=0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec import progress

ROOT = Path(__file__).resolve().parents[1]


def test_a_step_is_announced_on_stderr_with_its_time(capsys, monkeypatch):
    monkeypatch.setenv("JAXSPEC_PROGRESS", "1")
    with progress.step("compiling"):
        pass
    with pytest.raises(RuntimeError), progress.step("loading"):
        raise RuntimeError("boom")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[0] == "jaxspec: compiling ..."
    assert err.splitlines()[1].startswith("jaxspec: compiling: done in ")
    assert err.splitlines()[3].startswith("jaxspec: loading: failed in ")


def test_progress_is_off_for_a_pipe_unless_asked(capsys, monkeypatch):
    monkeypatch.delenv("JAXSPEC_PROGRESS", raising=False)
    assert not progress.enabled()  # capsys: stderr is not a terminal
    progress.note("hidden")
    monkeypatch.setenv("JAXSPEC_PROGRESS", "0")
    with progress.step("hidden"):
        pass
    assert capsys.readouterr() == ("", "")


# A fresh process: the XLA cache is process-wide state, decided before the first compile.
API_RUN = """
import sys
sys.path.insert(0, {tests!r})
from tiny import tiny_model
from jaxspec import Engine

[result] = Engine(tiny_model(layers=1)).generate([[1, 2, 3]], max_new_tokens=4)
print(len(result.token_ids))
"""


def api_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    base |= {"PYTHONPATH": str(ROOT), "JAXSPEC_CACHE_DIR": str(tmp_path), "JAXSPEC_PROGRESS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", API_RUN.format(tests=str(ROOT / "tests"))],
        env=base | env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "4"  # stdout carries only what the program printed
    return done


def test_the_python_api_compiles_into_the_persistent_cache_and_says_so(tmp_path):
    done = api_run(tmp_path)
    lines = done.stderr.splitlines()
    assert any(line.startswith("jaxspec: compiling decode program") for line in lines)
    assert any("cached afterwards): done in " in line for line in lines), done.stderr
    assert any((tmp_path / "xla").iterdir())


def test_the_cache_is_off_with_jaxspec_xla_cache_0(tmp_path):
    api_run(tmp_path, JAXSPEC_XLA_CACHE="0")
    assert not (tmp_path / "xla").exists()


def test_cli_json_stays_clean_with_progress_on(tmp_path):
    """Progress forced on (as scripts/run_default.sh does): stdout is still only JSON lines."""
    import json

    from conftest import make_tiny_checkpoint, save_byte_tokenizer

    tiny = save_byte_tokenizer(make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=1,
                                                    num_hidden_layers=1))
    done = subprocess.run(
        [sys.executable, "-m", "jaxspec.generate", f"model.name={tiny}", "--prompt", "Hi",
         "--prompt", "Yo", "--max-new-tokens", "3", "--json", "speculative.method=ngram"],
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAXSPEC_PROGRESS": "1"},
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hi", "Yo"]
    progress_lines = [line for line in done.stderr.splitlines() if line.startswith("jaxspec: ")]
    assert any(line.startswith("jaxspec: loading ") for line in progress_lines)
    assert any(line.startswith("jaxspec: compiling decode program") for line in progress_lines)
