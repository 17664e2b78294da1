"""Property: whatever the command line and config hold, the CLI either runs or exits 2 with one
line `error: ...` -- never a traceback, a NaN or a silent clamp. Hypothesis draws the arguments
(config overrides, shorthand flags, prompts) against a tiny checkpoint with a byte tokenizer, so
valid draws really generate."""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import make_tiny_checkpoint, save_byte_tokenizer  # noqa: E402
from jaxspec import generate  # noqa: E402

ODD = ["abc", "", "null", "true", "1e400", "nan", "-inf", "[1, 2]", "{a: 1}", "0x10", "1_000"]
# key: (valid values, invalid values); valid ones are drawn more often, so many draws really run
VALUES = {
    "sampling.temperature": ([0, 0.7, 1, 1e-4, 2.5], [-1, 1e-38, math.inf]),
    "sampling.top_k": ([0, 3, 2**40], [-1, 1.5]),
    "sampling.top_p": ([1.0, 0.5], [0, 1.5]),
    "sampling.min_p": ([0.0, 0.2], [1.0, -0.1]),
    "sampling.seed": ([0, 7], [-1, 2**32]),
    "generation.max_new_tokens": ([1, 3, 5], [0, -2, 10**9]),
    "generation.batch_size": ([1, 2, 10**9], [0]),
    "generation.chat_template": ([True, False], ["maybe"]),
    "generation.system_prompt": (["Be brief.", None], []),
    "speculative.method": (["none", "ngram", "layer_skip"], ["eagle", "medusa", "draft_model",
                                                            "bogus"]),
    "speculative.num_speculative_tokens": ([1, 2, 16], [0, 17]),
    "speculative.ngram.min_ngram": ([1, 2], [0, 20]),
    "speculative.ngram.max_ngram": ([2, 3], [0, 20]),
    "speculative.layer_skip.layers": ([1], [0, 2, 50]),
    "speculative.eagle.draft_confidence": ([0.0], [0.5, 1.0, -0.1]),
    "speculative.lookup.min_ngram": ([0], [1, 2, 9]),
    "speculative.lookup.max_ngram": ([3], [0, 20]),
    "speculative.eagle.checkpoint": ([None], ["/nonexistent/ckpt"]),
    "speculative.draft_model.model": ([None], ["/nonexistent/model"]),
    "speculative.tree.kind": (["chain"], ["static", "dynamic", "bogus"]),
    "speculative.tree.branches": ([3], [0, 100]),
    "speculative.adaptive.decay": ([0.9], [1.5]),
    "speculative.ngram": ([], [2]),  # a section given a value
    "speculative.min_ngram": ([], [2]),  # old keys: a one-line error naming the new one
    "tree.kind": ([], ["static"]),
    "adaptive.enabled": ([], ["true"]),
    "model.dtype": (["float32", "bfloat16"], ["int8"]),
    "model.layout": (["auto", "unrolled", "stacked"], ["packed", "weird"]),
    "sampling.nope": ([], [1]),
    "nope.key": ([], [1]),
}
FLAGS = {
    "--max-new-tokens": (["2", "4"], ["0", "-3", "x"]),
    "--batch-size": (["1", "3"], ["0"]),
    "--temperature": (["0", "0.8"], ["nan", "-1"]),
    "--top-k": (["0", "2"], ["-5"]),
    "--top-p": (["0.9"], ["0"]),
    "--min-p": (["0.1"], ["2"]),
    "--seed": (["1"], ["-1"]),
    "--no-such-flag": ([], ["1"]),
}


def weighted(valid: list, invalid: list) -> st.SearchStrategy:
    return st.sampled_from(valid * 12 + invalid) if valid or invalid else st.nothing()


def yaml_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


override = st.sampled_from(sorted(VALUES)).flatmap(
    lambda key: weighted(
        [yaml_text(v) for v in VALUES[key][0]],
        [yaml_text(v) for v in VALUES[key][1]] + ODD[len(key) % 10 :][:1],  # an odd spelling
    ).map(lambda text: f"{key}={text}")
)
flag = st.sampled_from(sorted(FLAGS)).flatmap(
    lambda name: weighted(*FLAGS[name]).map(lambda value: [name, value])
)
prompt = st.one_of(st.sampled_from(["Hi", "hello hello hello", "é ✓ \x00", ""]),
                   st.text(min_size=1, max_size=12))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_cli"), "llama", seed=1,
                                num_hidden_layers=2, max_position_embeddings=128)
    return save_byte_tokenizer(path)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(overrides=st.lists(override, max_size=3), flags=st.lists(flag, max_size=2),
       prompts=st.lists(prompt, min_size=1, max_size=3), as_json=st.booleans())
def test_every_input_runs_or_is_one_error_line(tiny_dir, capsys, monkeypatch, overrides, flags,
                                               prompts, as_json):
    monkeypatch.setattr(generate, "enable_compilation_cache", lambda: None)
    argv = [f"model.name={tiny_dir}", "generation.max_new_tokens=3", *overrides]
    argv += [part for f in flags for part in f]
    argv += [part for p in prompts for part in ("--prompt", p)]
    if as_json:
        argv.append("--json")
    rc = generate.main(argv)  # any exception but the handled ones fails the test here
    out, err = capsys.readouterr()
    assert rc in (0, 2), (argv, rc, err)
    assert "Traceback" not in err and "nan" not in out.lower().split(), (argv, err)
    if rc == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    else:
        summaries = [line for line in err.splitlines() if line.startswith("[")]
        assert as_json or len(summaries) == len(prompts), (argv, err)


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    method=st.sampled_from(["ngram", "layer_skip", "none"]),
    gamma=st.integers(1, 16),
    ngram=st.tuples(st.integers(1, 3), st.integers(0, 2)).map(lambda t: (t[0], t[0] + t[1])),
    temperature=st.sampled_from(["0", "0.7"]),
    model=st.sampled_from([("float32", "auto"), ("float32", "unrolled"), ("float32", "stacked"),
                           ("bfloat16", "unrolled")]),
    batch_size=st.integers(1, 3),
    num_prompts=st.integers(1, 3),
)
def test_every_valid_speculative_setting_runs(tiny_dir, capsys, monkeypatch, method, gamma, ngram,
                                              temperature, model, batch_size, num_prompts):
    monkeypatch.setattr(generate, "enable_compilation_cache", lambda: None)
    argv = [f"model.name={tiny_dir}", "generation.max_new_tokens=6", f"speculative.method={method}",
            f"speculative.num_speculative_tokens={gamma}", "speculative.layer_skip.layers=1",
            f"speculative.ngram.min_ngram={ngram[0]}",
            f"speculative.ngram.max_ngram={ngram[1]}", f"sampling.temperature={temperature}",
            f"model.dtype={model[0]}", f"model.layout={model[1]}",
            f"generation.batch_size={batch_size}", "--json"]
    argv += [part for i in range(num_prompts) for part in ("--prompt", "ab ab ab " * (i + 1))]
    rc = generate.main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, (argv, err)
    assert len(out.splitlines()) == num_prompts
