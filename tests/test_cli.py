"""`python -m jaxspec.generate`: argument handling, prompt files, and real runs on SmolLM2-135M.

Bad inputs that fail before a model is loaded run in-process through `main` (what `__main__`
calls); the rest run as subprocesses, as a user would. The real runs share one shape (batch 1,
prompts in the same length bucket, 8 new tokens), so the persistent XLA cache that the first run
fills serves the others (and later test runs: the subprocesses inherit the suite's
JAX_COMPILATION_CACHE_DIR, the cache scripts/test.sh keeps between runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec import cli_support, generate
from jaxspec.drafters import registry

ROOT = Path(__file__).resolve().parents[1]
NGRAM = str(ROOT / "configs" / "smollm2-135m-ngram.yaml")
FIELDS = {
    "prompt", "text", "token_ids", "num_prompt_tokens", "num_generated_tokens",
    "time_to_first_token_s", "decode_tokens_per_s", "metrics",
}


def user_cache_root() -> str:
    """A user's jaxspec cache directory (tokenizers, kernels, calibration; conftest points
    JAXSPEC_CACHE_DIR at a fresh one per session). Compiled programs go to the suite's XLA
    cache, which JAX_COMPILATION_CACHE_DIR names and jaxspec keeps when set."""
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "jaxspec"))


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAXSPEC_CACHE_DIR=user_cache_root())
    return subprocess.run(
        [sys.executable, "-m", "jaxspec.generate", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def assert_one_line_error(rc: int, stderr: str, *fragments: str) -> None:
    assert rc == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture
def run_main(capsys, monkeypatch):
    """main(argv) in-process -> (rc, stdout, stderr); no persistent cache in the test process."""
    monkeypatch.setattr(generate, "enable_compilation_cache", lambda: None)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")  # main() sets it for its process

    def run(*argv: str):
        rc = generate.main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture
def prompts_file(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "prompts.jsonl"
        path.write_text(text)
        return str(path)

    return write


# ---- bad input, caught before any model is loaded ------------------------------------------
@pytest.mark.parametrize(
    "argv, fragments",
    [
        ([], ["no prompt given", "--prompt"]),
        (["--prompt", "hi", "sampling.temprature=0.5"], ["sampling.temprature", "temperature, top_k"]),
        (["--prompt", "hi", "--config", "missing.yaml"], ["missing.yaml", "does not exist"]),
        (["--prompt", "hi", "--temperature", "-1"], ["sampling.temperature", ">= 0"]),
        (["--prompt", "hi", "--top-p", "0"], ["sampling.top_p", "[1e-06, 1]"]),
        (["--prompt", "hi", "--top-p", "1.5"], ["sampling.top_p", "[1e-06, 1]"]),
        (["--prompt", "hi", "--max-new-tokens", "many"], ["--max-new-tokens", "invalid int"]),
        (["--prompt", "hi", "--max-new-tokens", "0"], ["generation.max_new_tokens"]),
        (["--prompt", "hi", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
        (["--prompt", "hi", "temperature=0.5"], ["section.key=value"]),
        (["--prompt", "hi", "speculative.method=beam"], ["speculative.method", "ngram"]),
        (["--prompt"], ["--prompt", "expected one argument"]),
    ],
)
def test_bad_arguments(run_main, argv, fragments):
    rc, out, err = run_main(*argv)
    assert_one_line_error(rc, err, *fragments)
    assert out == ""


def test_unknown_key_in_config_file(run_main, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("speculative:\n  method: ngram\n  gamma: 4\n")
    rc, _, err = run_main("--prompt", "hi", "--config", str(cfg))
    assert_one_line_error(rc, err, "speculative.gamma", "num_speculative_tokens", "bad.yaml")


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("", ["has no prompts"]),
        ("\n  \n", ["has no prompts"]),
        ('{"turns": ["ok"]}\n{"turns": ["broken"\n', ["line 2", "invalid JSON"]),
        ('{"turns": ["ok"]}\n\n{"question": "x"}\n', ["line 3", '"turns"', '"prompt"']),
        ('{"turns": []}\n', ["line 1"]),
        ("[1, 2]\n", ["line 1"]),
    ],
)
def test_bad_prompts_file(run_main, prompts_file, text, fragments):
    rc, _, err = run_main("--prompts-file", prompts_file(text))
    assert_one_line_error(rc, err, *fragments)


def test_missing_prompts_file(run_main, tmp_path):
    rc, _, err = run_main("--prompts-file", str(tmp_path / "nope.jsonl"))
    assert_one_line_error(rc, err, "nope.jsonl", "does not exist")


def test_missing_model_file(run_main, tmp_path):
    rc, _, err = run_main("--prompt", "hi", "--model", str(tmp_path / "model.gguf"))
    assert_one_line_error(rc, err, "model.gguf")
    rc, _, err = run_main("--prompt", "hi", f"model.name={tmp_path}")  # a dir with no model
    assert_one_line_error(rc, err, str(tmp_path))


def test_unavailable_method(run_main, monkeypatch):
    monkeypatch.setattr(registry, "DRAFTERS", {"ngram": registry.DRAFTERS["ngram"]})
    rc, _, err = run_main("--prompt", "hi", "speculative.method=eagle")
    assert_one_line_error(rc, err, "'eagle' is not available", "none, ngram")


# ---- parsing -------------------------------------------------------------------------------
def test_prompts_file_formats(prompts_file):
    path = prompts_file(
        '{"question_id": 81, "category": "writing", "turns": ["first turn", "second turn"]}\n'
        "\n"
        '{"prompt": "plain prompt"}\n'
    )
    assert generate.read_prompts_file(path) == ["first turn", "plain prompt"]


def test_layering_and_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sampling:\n  temperature: 0.2\n  top_k: 7\ngeneration:\n  max_new_tokens: 64\n")
    args, config, prompts = generate.parse(
        [
            "--config", str(cfg), "--prompt", "a", "sampling.temperature=0.5",
            "--prompt", "b", "--temperature", "0.9", "--top-p", "0.8", "--min-p", "0.05",
            "--seed", "3", "--batch-size", "2", "--no-chat-template", "--json",
            "speculative.method=ngram", "--model", "smollm2",
        ]
    )
    assert prompts == ["a", "b"] and args.json
    assert config.sampling.temperature == 0.9  # flag beats positional override beats file
    assert config.sampling.top_k == 7 and config.sampling.top_p == 0.8
    assert config.sampling.min_p == 0.05 and config.sampling.seed == 3
    assert config.generation.max_new_tokens == 64 and config.generation.batch_size == 2
    assert config.generation.chat_template is False
    assert config.speculative.method == "ngram" and config.model.name == "smollm2"


def test_compilation_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXSPEC_XLA_CACHE", raising=False)
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    assert cli_support.compilation_cache_dir() == str(tmp_path / "xla")
    monkeypatch.delenv("JAXSPEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli_support.compilation_cache_dir() == str(tmp_path / "jaxspec" / "xla")
    monkeypatch.setenv("JAXSPEC_XLA_CACHE", "0")
    assert cli_support.compilation_cache_dir() is None


# ---- real runs on SmolLM2-135M (subprocesses) -----------------------------------------------
PROMPT = "Name three colors."


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "spec_bench.jsonl"
    path.write_text(
        '{"question_id": 1, "category": "writing", "turns": ["Name three fruits.", "More?"]}\n'
        "\n"
        '{"prompt": "Name three animals."}\n'
    )
    return cli(
        "--config", NGRAM, "--prompt", PROMPT, "--prompts-file", str(path),
        "--max-new-tokens", "8", "--json",
    )


def test_json_output(json_run):
    assert json_run.returncode == 0, json_run.stderr
    assert "Traceback" not in json_run.stderr
    rows = [json.loads(line) for line in json_run.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == [PROMPT, "Name three fruits.", "Name three animals."]
    for r in rows:
        assert set(r) == FIELDS
        assert r["num_generated_tokens"] == len(r["token_ids"]) and 2 <= len(r["token_ids"]) <= 8
        assert all(isinstance(t, int) for t in r["token_ids"])
        assert r["num_prompt_tokens"] > 0 and r["text"].strip()
        assert r["time_to_first_token_s"] > 0 and r["decode_tokens_per_s"] > 0
        m = r["metrics"]
        assert m["method"] == "ngram" and m["num_speculative_tokens"] == 4
        assert m["layout"] in ("packed", "unrolled") and m["layout_note"].startswith("auto")
        assert 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"]
        assert 0.0 <= m["acceptance_rate"] <= 1.0


def test_stream_matches_json(json_run, run_main, smollm2, monkeypatch):
    """Streaming the same prompt (greedy) prints the text the JSON run reported for it. In-process
    on the session's SmolLM2 (the CLI's load: layout auto, float32), through `main`: the real
    process is the JSON run's (one SmolLM2 process start and load less)."""
    import jaxspec.loading

    monkeypatch.setattr(jaxspec.loading, "load_model", lambda *a, **k: smollm2)
    rc, out, err = run_main("--config", NGRAM, "--prompt", PROMPT, "--max-new-tokens", "8")
    assert rc == 0, err
    assert "Traceback" not in err
    assert out.strip()
    first = json.loads(json_run.stdout.splitlines()[0])
    assert out == first["text"] + "\n"
    # and one summary line on stderr: tokens, speed, acceptance, accepted length, layout
    summary = [line for line in err.splitlines() if line.startswith("[")]
    assert len(summary) == 1, err
    assert f"[{first['num_generated_tokens']} tokens, " in summary[0]
    assert "tok/s, ngram: acceptance" in summary[0] and "tokens/step, layout" in summary[0]


def test_prompt_longer_than_context(run_main, smollm2, monkeypatch):
    """In-process on the loaded model (the one-line error of a real process: the next test)."""
    import jaxspec.loading

    monkeypatch.setattr(jaxspec.loading, "load_model", lambda *a, **k: smollm2)
    rc, _, err = run_main("--config", NGRAM, "--prompt", "word " * 9000, "--max-new-tokens", "8")
    assert_one_line_error(rc, err, "exceeds the model's context", "8192")


def test_bad_input_in_a_real_process():
    run = cli("--prompt", "hi", "sampling.top_p=2")
    assert_one_line_error(run.returncode, run.stderr, "sampling.top_p")
