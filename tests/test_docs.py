"""Nothing a user copies from the README or docs/ fails: every fenced code block is run or checked.

- ```python blocks run, each file's blocks in order in one fresh process (as a reader would run
  them), with the default model's short name resolving to a tiny random checkpoint with a byte
  tokenizer (same architecture family, seconds to compile);
- ```bash blocks: every `python -m jaxspec.<tool> ...` command runs on that tiny model (export,
  which compiles nothing, on the real one: it checks a shipped head against its target), with
  short settings (`--max-new-tokens` at most 8, one question per category, 3 prompts of a prompts
  file, outputs under a temporary directory); other lines must name a script of the repository;
- ```yaml blocks load as configs through `jaxspec.config.load_config`;
- ```text blocks are shown, not run (say why next to each); any other tag fails.

Also: the generated parts (docs/config.md, the README's layout, docs/testing.md's timing table)
are current, every test module has recorded timings, the README stays under 15 KB, and relative
links resolve.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_tiny_checkpoint, save_byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "yaml", "text"}
# Pages other branches write; linked from the index before they land.
PENDING = {"accelerators.md", "targets.md", "models.md", "reliability.md", "suffix.md"}
FENCE = re.compile(r"^```(\S*)\s*$")


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, code, first line number) of each fenced block."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, body = m.group(1), n, []
        elif lang is not None and line.strip() == "```":
            out.append((lang, "\n".join(body), start))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{path.name}: a code block opened at line {start} is never closed"
    return out


def every_block(lang: str):
    return [(p, code, n) for p in DOCS for (lg, code, n) in blocks(p) if lg == lang]


def block_id(item) -> str:
    return f"{item[0].relative_to(ROOT)}:{item[2]}"


# ---- static checks ----------------------------------------------------------------------------
def test_every_block_has_a_known_language():
    for path in DOCS:
        for lang, _, n in blocks(path):
            assert lang in LANGUAGES, (
                f"{path.name}:{n}: code block tagged {lang!r}: tag it python, bash or yaml (run "
                "by this test) or text (shown only)"
            )


def test_generated_parts_are_current():
    # a fresh process: drafters other tests registered in this one must not enter the reference
    import json
    import subprocess

    code = ("import json, sys; sys.path.insert(0, 'scripts'); import docs; "
            "print(json.dumps({str(p): t for p, t in docs.expected().items()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    for path, text in json.loads(out).items():
        path = Path(path)
        assert path.read_text() == text, f"{path.name} is stale: run python scripts/docs.py"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_bytes()) <= 15_000


def test_benchmarks_holds_current_figures_only():
    """BENCHMARKS.md is the current figures (<= 30 KB, issue 58): a session's measurements go to
    docs/history/ once their headline is there, so the front page stays a page, not a notebook."""
    size = (ROOT / "BENCHMARKS.md").stat().st_size
    assert size <= 30_000, (f"BENCHMARKS.md is {size} bytes: move dated sections to "
                            "docs/history/ and keep their headline figures (<= 30,000 bytes)")


def test_every_test_module_has_recorded_timings():
    """docs/testing.md's table (generated from tests/timings.json) lists every test module, and
    no module that is gone."""
    timings = json.loads((ROOT / "tests" / "timings.json").read_text())
    modules = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    missing, gone = sorted(modules - set(timings["modules"])), sorted(set(timings["modules"]) - modules)
    assert not missing, (f"no recorded timings for {missing}: profile them alone "
                         "(docs/testing.md, 'Where the time goes')")
    assert not gone, f"tests/timings.json lists modules that are gone: {gone}"


def test_relative_links_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            where = (path.parent / target).resolve()
            assert where.exists() or where.name in PENDING, f"{path.name}: link to {target}"


@pytest.mark.parametrize("item", every_block("yaml"), ids=block_id)
def test_yaml_block_is_a_valid_config(item, tmp_path, monkeypatch):
    from jaxspec.config import load_config

    _, code, _ = item
    (tmp_path / "block.yaml").write_text(code)
    monkeypatch.chdir(ROOT)  # relative checkpoint paths, as a reader in the checkout
    load_config(tmp_path / "block.yaml")


# ---- running the blocks -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """Llama-family, 6 heads / 3 kv heads (so the docs' `mesh.model=3` divides them as it does
    SmolLM2's 9 / 3), a context long enough for the longest Spec-Bench question in bytes."""
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_docs"), "llama", seed=3, hidden_size=96,
        num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2,
        max_position_embeddings=8192,
    )
    return save_byte_tokenizer(path)


PRELUDE = """
import jaxspec.loading as _loading

_resolve = _loading.resolve
_loading.resolve = lambda name, **kw: _resolve({tiny!r} if str(name) == "smollm2-135m" else name,
                                              **kw)
"""


def workdir(tmp_path: Path) -> Path:
    """A reader's checkout: configs/, checkpoints/, data/, scripts/ (links), outputs kept apart."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("configs", "checkpoints", "data", "scripts"):
        (work / name).symlink_to(ROOT / name)
    return work


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}  # the run's XLA cache is shared


def with_prelude(code: str, tiny: Path) -> str:
    """The prelude goes after leading `import os` / `os.environ` lines (those must precede jax)."""
    lines = code.splitlines()
    head = 0
    while head < len(lines) and (
        not lines[head].strip() or lines[head].startswith(("import os", "os.environ", "#"))
    ):
        head += 1
    return "\n".join([*lines[:head], PRELUDE.format(tiny=str(tiny)), *lines[head:]])


PYTHON_DOCS = [p for p in DOCS if any(lg == "python" for lg, _, _ in blocks(p))]


def python_code(path: Path) -> str:
    return "\n\n".join(c for lg, c, _ in blocks(path) if lg == "python")


def sets_the_environment(path: Path) -> bool:
    """Whether the page's code sets os.environ before jax starts (a device count, say): such a
    page runs in a process of its own."""
    return "os.environ[" in python_code(path)


# The pages that set nothing share one process (one jax start, not one per page; the programs
# one page compiles serve the next), each page's code in fresh globals, so a page that uses a name
# it never defines or imports still fails as it would for a reader; a page that sets the
# environment gets a process of its own.
PYTHON_GROUPS = {"pages": [p for p in PYTHON_DOCS if not sets_the_environment(p)]} | {
    p.name: [p] for p in PYTHON_DOCS if sets_the_environment(p)}

PYTHON_RUNNER = """
import json, sys, traceback
failures = []
for name, code in json.loads(sys.argv[1]):
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        failures.append([name, traceback.format_exc()[-3000:]])
print("RESULT " + json.dumps(failures))
"""


@pytest.mark.parametrize("group", list(PYTHON_GROUPS))
def test_python_blocks_run(group, tiny, tmp_path):
    pages = PYTHON_GROUPS[group]
    if len(pages) == 1 and sets_the_environment(pages[0]):
        code = with_prelude(python_code(pages[0]), tiny)
        done = subprocess.run([sys.executable, "-c", code], cwd=workdir(tmp_path), env=env(),
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{pages[0].name}:\n{done.stderr[-4000:]}"
        return
    assert len(pages) > 1, pages  # the shared process holds several pages
    sources = json.dumps([(p.name, python_code(p)) for p in pages])
    done = subprocess.run([sys.executable, "-c", PRELUDE.format(tiny=str(tiny)) + PYTHON_RUNNER,
                           sources], cwd=workdir(tmp_path), env=env(), capture_output=True,
                          text=True, timeout=1800)
    assert "RESULT " in done.stdout, done.stderr[-4000:]
    failures = json.loads(done.stdout.rsplit("RESULT ", 1)[1])
    assert failures == [], "\n".join(f"{name}:\n{trace}" for name, trace in failures)


def commands(code: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def shortened(argv: list[str], out: Path) -> list[str]:
    """Short settings: at most 8 new tokens, one question per category of two categories (the
    Spec-Bench tools: every category is test_bench.py's and test_ngram_ceiling.py's, and 13 of
    them here were 13 prompt shapes to compile for the same command line), the first 3 prompts of
    a prompts file, outputs under `out`."""
    argv = list(argv)
    if "--prompts-file" in argv:
        i = argv.index("--prompts-file") + 1
        rows = [r for r in (ROOT / argv[i]).read_text().splitlines() if r.strip()][:3]
        out.mkdir(parents=True, exist_ok=True)
        (out / "prompts.jsonl").write_text("\n".join(rows) + "\n")
        argv[i] = str(out / "prompts.jsonl")
    if "--n-per-category" in argv and "--data" not in argv:
        rows = (ROOT / "data" / "spec_bench_dev.jsonl").read_text().splitlines()
        firsts = {}
        for row in rows:
            if row.strip():
                firsts.setdefault(json.loads(row)["category"], row)
        out.mkdir(parents=True, exist_ok=True)
        (out / "two_categories.jsonl").write_text("\n".join(list(firsts.values())[:2]) + "\n")
        argv += ["--data", str(out / "two_categories.jsonl")]
    for flag, cap in (("--max-new-tokens", 8), ("--n-per-category", 1)):
        if flag in argv:
            i = argv.index(flag) + 1
            argv[i] = str(min(int(argv[i]), cap))
    if "--out" in argv:
        i = argv.index("--out") + 1
        argv[i] = str(out / argv[i])
    if argv[0] == "jaxspec.generate" and "--max-new-tokens" not in argv:
        argv += ["--max-new-tokens", "8"]
    return argv


RUNNER = """
import json, runpy, sys, time, traceback
failures = []
for argv in json.loads(sys.argv[1]):
    sys.argv = list(argv)
    start = time.perf_counter()
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException:
        code = traceback.format_exc()
    print(f"TIMING {time.perf_counter() - start:6.1f} s  {' '.join(argv)}", file=sys.stderr)
    if code != 0:
        failures.append([" ".join(argv), code])
print("RESULT " + json.dumps(failures))
"""


def bash_commands(out: Path) -> list[tuple[list[str], dict[str, str], str]]:
    """(argv for runpy, environment, where) of every jaxspec command in the docs' bash blocks."""
    found = []
    for path, code, n in every_block("bash"):
        for line in commands(code):
            words = shlex.split(line)
            extra = {}
            while words and re.match(r"^[A-Z_]+=", words[0]):
                key, _, value = words.pop(0).partition("=")
                extra[key] = value
            where = f"{path.name}:{n}: {line}"
            if words[:2] == ["python", "-m"] and words[2].startswith("jaxspec."):
                found.append((shortened(words[2:], out), extra, where))
            elif words[0] in ("bash", "python") and words[1].startswith("scripts/"):
                assert (ROOT / words[1]).is_file(), where
            else:
                raise AssertionError(f"{where}: not a jaxspec command nor a repository script: "
                                     "tag the block text if it is not meant to run")
    return found


# Tools that read a shipped drafter checkpoint against its real target and compile nothing run
# on the real default model.
REAL_MODEL = ("jaxspec.export",)
# Commands another module runs as written (its own check of their output beside), with the docs'
# text: not run a second time here (a process start and a SmolLM2 load each).
RUN_ELSEWHERE = {"test_formats.py::test_shipped_medusa_exports_exactly": "MEDUSA_EXPORT_COMMAND"}


def commands_run_elsewhere() -> list[list[str]]:
    """The argv prefixes (module after `-m`, up to the --out value) of RUN_ELSEWHERE's commands."""
    import test_formats

    return [shlex.split(getattr(test_formats, name))[2:] for name in RUN_ELSEWHERE.values()]


def test_bash_blocks_run(tiny, tmp_path):
    found = bash_commands(tmp_path / "out")
    assert found, "no jaxspec command found in the docs"
    elsewhere = commands_run_elsewhere()
    left = [f for f in found if not f[1] and f[0][:-1] in elsewhere]
    assert len(left) == len(elsewhere), "a RUN_ELSEWHERE command left the docs: drop it there"
    found = [f for f in found if f not in left]
    # commands on the tiny model without an environment of their own share one process; every
    # other command gets one
    shared = [a for a, e, _ in found if not e and a[0] not in REAL_MODEL]
    groups = [(shared, {}, True)] + [([a], e, a[0] not in REAL_MODEL) for a, e, _ in found
                                     if e or a[0] in REAL_MODEL]
    work = workdir(tmp_path)
    for argvs, extra, on_tiny in groups:
        prelude = PRELUDE.format(tiny=str(tiny)) if on_tiny else ""
        done = subprocess.run(
            [sys.executable, "-c", prelude + RUNNER, json.dumps(argvs)],
            cwd=work, env=env(**extra), capture_output=True, text=True, timeout=1200,
        )
        print("\n".join(line for line in done.stderr.splitlines() if line.startswith("TIMING")))
        assert "RESULT " in done.stdout, done.stderr[-4000:]
        failures = json.loads(done.stdout.rsplit("RESULT ", 1)[1])
        assert failures == [], f"{failures}\n{done.stderr[-4000:]}"
