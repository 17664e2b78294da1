"""A user who waits is told why, wherever stderr goes: progress on stderr (never stdout), a live
line on a terminal, timestamped lines with a status every few seconds elsewhere, off with
--quiet / JAXSPEC_PROGRESS=0 / the `jaxspec` logger silenced; compile messages say what the
persistent cache answered; the Python API keeps compiled programs in the same cache as the CLI
unless JAXSPEC_XLA_CACHE=0."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxspec import progress

ROOT = Path(__file__).resolve().parents[1]
STAMPED = re.compile(r"^\d\d:\d\d:\d\d jaxspec: ")


@pytest.fixture(autouse=True)
def progress_on():
    """Each test starts from progress's defaults (an in-process CLI run with --quiet earlier in
    the same worker turns it off for the process, as it should for a CLI)."""
    progress.set_quiet(False)
    level = progress.LOG.level
    progress.LOG.setLevel(logging.INFO)
    yield
    progress.LOG.setLevel(level)


def test_a_step_is_announced_on_stderr_with_its_time(capsys, monkeypatch):
    monkeypatch.delenv("JAXSPEC_PROGRESS")  # on by default, even for a pipe
    with progress.step("compiling"):
        pass
    with pytest.raises(RuntimeError), progress.step("loading"):
        raise RuntimeError("boom")
    out, err = capsys.readouterr()
    assert out == ""
    lines = [STAMPED.sub("", line) for line in err.splitlines()]
    assert all(STAMPED.match(line) for line in err.splitlines()), err
    assert lines[0] == "compiling ..."
    assert lines[1].startswith("compiling: done in ")
    assert lines[3].startswith("loading: failed in ")


def test_a_long_step_off_a_terminal_prints_its_status_every_few_seconds(capsys, monkeypatch):
    monkeypatch.delenv("JAXSPEC_PROGRESS")
    monkeypatch.setattr(progress, "TICK_S", 0.02)
    monkeypatch.setattr(progress, "QUIET_TICK_S", 0.25)
    with progress.step("compiling") as started:
        started.update("program 1 of 2")
        time.sleep(1.0)
    lines = [STAMPED.sub("", line) for line in capsys.readouterr().err.splitlines()]
    assert lines[1].startswith("compiling: program 1 of 2 (")
    ticks = [line for line in lines if "s so far)" in line]
    assert 2 <= len(ticks) <= 5, lines  # one per 0.25 s of silence, not one per 0.02 s tick
    assert lines[-1].startswith("compiling: done in ")


def test_a_silent_step_speaks_only_when_long(capsys, monkeypatch):
    """The CLI's config reading: a bad config's error must stay the only line it prints."""
    monkeypatch.delenv("JAXSPEC_PROGRESS")
    monkeypatch.setattr(progress, "TICK_S", 0.02)
    monkeypatch.setattr(progress, "QUIET_TICK_S", 0.2)
    progress.start("quick", announce=False)()
    assert capsys.readouterr().err == ""
    slow = progress.start("slow", announce=False)
    time.sleep(0.5)
    slow()
    lines = [STAMPED.sub("", line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0].startswith("slow: 0 s so far") and lines[-1].startswith("slow: done in ")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_one_live_line(monkeypatch):
    monkeypatch.delenv("JAXSPEC_PROGRESS")
    monkeypatch.setattr(progress, "TICK_S", 0.02)
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    with progress.step("loading"):
        time.sleep(0.2)
    text = screen.getvalue()
    assert text.startswith("jaxspec: loading ...\n")  # no timestamps on a terminal
    assert "\r\033[Kjaxspec: loading: 0 s so far" in text  # redrawn in place
    assert text.endswith("\r\033[Kjaxspec: loading: done in " + text.rsplit("done in ", 1)[1])
    assert text.count("\n") == 2  # the live line never leaves a line behind


def test_quiet_the_environment_and_the_logger_each_turn_it_off(capsys, monkeypatch):
    from jaxspec import generate

    monkeypatch.delenv("JAXSPEC_PROGRESS")
    try:
        generate.parse(["--quiet", "--prompt", "Hi"])  # the CLI's flag, read before any step
        progress.note("hidden by --quiet")
    finally:
        progress.set_quiet(False)
    monkeypatch.setenv("JAXSPEC_PROGRESS", "0")
    with progress.step("hidden by JAXSPEC_PROGRESS=0"):
        pass
    monkeypatch.delenv("JAXSPEC_PROGRESS")
    logger = logging.getLogger("jaxspec")
    level = logger.level
    logger.setLevel(logging.WARNING)  # what a Python user does to silence it
    try:
        with progress.step("hidden by the logger"):
            pass
    finally:
        logger.setLevel(level)
    progress.note("shown")
    err = capsys.readouterr().err
    assert "hidden" not in err and err.endswith("jaxspec: shown\n")


def test_no_tqdm_ipywidgets_warning_once_jaxspec_is_imported():
    """In a Jupyter kernel without ipywidgets, transformers' tqdm.auto warns at import."""
    code = ("import jaxspec.progress, warnings\n"
            "warnings.warn('IProgress not found. Please update jupyter and ipywidgets.')\n"
            "warnings.warn('a warning that stays')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert "IProgress" not in done.stderr and "a warning that stays" in done.stderr


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
    lines = [STAMPED.sub("", line) for line in done.stderr.splitlines()]
    assert any(line.startswith("decode programs (plain, batch 1") for line in lines)
    assert any("compiling program 1 of 2 (jit_prefill; not in the cache)" in line
               for line in lines), done.stderr
    assert any(line.endswith(" s") and "compiled 2 programs (kept in the cache" in line
               for line in lines), done.stderr
    assert any((tmp_path / "xla").iterdir())


def test_the_cache_is_off_with_jaxspec_xla_cache_0(tmp_path):
    done = api_run(tmp_path, JAXSPEC_XLA_CACHE="0")
    assert not (tmp_path / "xla").exists()
    assert "compiled (the persistent cache is off)" in done.stderr
    assert "from the cache" not in done.stderr


def test_cli_says_what_the_cache_answered_and_json_stays_clean(tmp_path):
    """Progress on by default with stderr a pipe: stdout is still only JSON lines; the first run
    compiles, the second loads the same programs from the cache and says so (and never
    "compiling")."""
    import json

    from conftest import make_tiny_checkpoint, save_byte_tokenizer

    tiny = save_byte_tokenizer(make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=1,
                                                    num_hidden_layers=1))
    env = {k: v for k, v in os.environ.items() if k != "JAXSPEC_PROGRESS"}  # kept kernels stay
    env |= {"PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}

    def cli(*extra):
        done = subprocess.run(
            [sys.executable, "-m", "jaxspec.generate", f"model.name={tiny}", "--prompt", "Hi",
             "--prompt", "Yo", "--max-new-tokens", "3", "--json",
             *extra],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(line) for line in done.stdout.splitlines()]
        assert [r["prompt"] for r in rows] == ["Hi", "Yo"]
        return [STAMPED.sub("", ln) for ln in done.stderr.splitlines() if STAMPED.match(ln)]

    cold = cli()
    assert any(line.startswith("loading ") for line in cold)
    assert any("compiling program 2 of 2 (jit_decode; not in the cache)" in line for line in cold)
    assert any("compiled 2 programs (kept in the cache for the next run) in " in line
               for line in cold), cold
    warm = cli()
    assert any("loaded 2 programs from the cache in " in line for line in warm), warm
    assert not any("compil" in line for line in warm), warm
