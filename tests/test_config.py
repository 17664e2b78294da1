"""Config dataclasses, YAML + dotted overrides, and the drafter registry."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxspec import drafters
from jaxspec.build import sampling_params
from jaxspec.config import (
    METHODS,
    Config,
    SamplingConfig,
    SpeculativeConfig,
    load_config,
)
from jaxspec.limits import MAX_SPECULATIVE_TOKENS
from jaxspec.errors import JaxspecError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults():
    c = load_config()
    assert c == Config()
    assert c.model.name == "smollm2-135m" and c.model.dtype == "auto"
    assert c.model.layout == "auto"
    assert (c.sampling.temperature, c.sampling.top_k, c.sampling.top_p, c.sampling.min_p) == (
        0.0, 0, 1.0, 0.0,
    )
    assert c.generation.max_new_tokens == 128 and c.generation.chat_template
    assert c.speculative.method == "none" and c.speculative.layer_skip_layers == 8


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_parse(name):
    c = load_config(CONFIGS / name)
    assert c.model.name == "smollm2-135m"


def test_shipped_config_values():
    ngram = load_config(CONFIGS / "smollm2-135m-ngram.yaml").speculative
    assert (ngram.method, ngram.min_ngram, ngram.max_ngram) == ("ngram", 2, 3)
    skip = load_config(CONFIGS / "smollm2-135m-layerskip.yaml").speculative
    assert (skip.method, skip.num_speculative_tokens, skip.layer_skip_layers) == ("layer_skip", 3, 8)


def test_yaml_then_overrides(tmp_path):
    path = write(tmp_path, "sampling:\n  temperature: 0.5\n  top_k: 20\nspeculative:\n  method: ngram\n")
    c = load_config(path, ["sampling.temperature=0.7", "speculative.num_speculative_tokens=6"])
    assert c.sampling.temperature == 0.7 and c.sampling.top_k == 20
    assert c.speculative.method == "ngram" and c.speculative.num_speculative_tokens == 6


def test_override_scalars():
    c = load_config(
        None,
        [
            "sampling.top_p=1",  # int -> float
            "sampling.min_p=1e-3",  # PyYAML reads this as a string
            "generation.chat_template=false",
            "generation.system_prompt=You are terse.",
            "model.name=2024",  # str field keeps the raw text
            "speculative.draft_model=null",
            "speculative.checkpoint= /ckpt/eagle ",
        ],
    )
    assert c.sampling.top_p == 1.0 and isinstance(c.sampling.top_p, float)
    assert c.sampling.min_p == pytest.approx(1e-3)
    assert c.generation.chat_template is False
    assert c.generation.system_prompt == "You are terse."
    assert c.model.name == "2024"
    assert c.speculative.draft_model is None
    assert c.speculative.checkpoint == "/ckpt/eagle"


def test_empty_file_and_empty_section(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "sampling:\n")) == Config()


def test_frozen_and_keyword_only():
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.sampling.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingConfig(0.5)  # type: ignore[misc]


def expect_error(fragments, *args, **kwargs):
    with pytest.raises(JaxspecError) as e:
        load_config(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_unknown_key_lists_valid(tmp_path):
    expect_error(["sampling.temprature", "temperature, top_k, top_p, min_p, seed"],
                 None, ["sampling.temprature=0.7"])
    expect_error(["unknown key 'model.path'", "name, dtype, layout", "c.yaml"],
                 write(tmp_path, "model:\n  path: x\n"))


def test_unknown_section_lists_valid(tmp_path):
    expect_error(["'decoding'", "model, sampling, generation, speculative"],
                 write(tmp_path, "decoding:\n  x: 1\n"))
    expect_error(["'decoding'"], None, ["decoding.x=1"])


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("sampling.temperature=hot", ["sampling.temperature", "expected a number"]),
        ("sampling.top_k=1.5", ["sampling.top_k", "an integer"]),
        ("generation.batch_size=true", ["generation.batch_size", "an integer"]),
        ("generation.chat_template=maybe", ["generation.chat_template", "true or false"]),
        ("model.dtype=float64", ["model.dtype", "float32, bfloat16"]),
        ("model.layout=scan", ["model.layout", "auto, unrolled, packed, stacked"]),
    ],
)
def test_wrong_type(override, fragments):
    expect_error(fragments, None, [override])


def test_wrong_type_in_yaml(tmp_path):
    expect_error(["generation.max_new_tokens", "an integer"],
                 write(tmp_path, "generation:\n  max_new_tokens: [1, 2]\n"))


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["sampling.temperature=-0.1"], ["sampling.temperature", ">= 0"]),
        (["sampling.temperature=.inf"], ["sampling.temperature"]),
        (["sampling.top_p=0"], ["sampling.top_p", "(0, 1]"]),
        (["sampling.top_p=1.5"], ["sampling.top_p", "(0, 1]"]),
        (["sampling.min_p=1"], ["sampling.min_p"]),
        (["sampling.top_k=-1"], ["sampling.top_k"]),
        (["sampling.seed=-1"], ["sampling.seed"]),
        (["generation.max_new_tokens=0"], ["generation.max_new_tokens"]),
        (["generation.batch_size=0"], ["generation.batch_size"]),
        (["speculative.method=ngram", "speculative.num_speculative_tokens=0"],
         ["num_speculative_tokens", f"1..{MAX_SPECULATIVE_TOKENS}"]),
        (["speculative.method=ngram", f"speculative.num_speculative_tokens={MAX_SPECULATIVE_TOKENS + 1}"],
         ["num_speculative_tokens"]),
        (["speculative.min_ngram=0"], ["min_ngram"]),
        (["speculative.min_ngram=4", "speculative.max_ngram=3"], ["min_ngram", "max_ngram"]),
        (["speculative.max_ngram=17"], ["max_ngram", "16"]),
        (["speculative.layer_skip_layers=0"], ["layer_skip_layers"]),
        (["speculative.method=eagle", "speculative.draft_confidence=1.0"], ["draft_confidence", "[0, 1)"]),
        (["speculative.method=eagle", "speculative.draft_confidence=-0.1"], ["draft_confidence"]),
        (["speculative.method=ngram", "speculative.draft_confidence=0.3"],
         ["draft_confidence", "'eagle' only", "'ngram'"]),
        (["speculative.method=eagle", "speculative.lookup_min_ngram=4"], ["lookup_min_ngram", "max_ngram (3)"]),
        (["speculative.method=eagle", "speculative.lookup_min_ngram=-1"], ["lookup_min_ngram"]),
        (["speculative.method=ngram", "speculative.lookup_min_ngram=2"], ["lookup_min_ngram", "'ngram'"]),
        (["model.name= "], ["model.name"]),
    ],
)
def test_out_of_range(overrides, fragments):
    expect_error(fragments, None, overrides)


def test_gamma_unchecked_for_plain_decoding():
    assert load_config(None, ["speculative.num_speculative_tokens=0"]).speculative.method == "none"


def test_unknown_method_lists_valid():
    expect_error(["speculative.method='lookahead'", ", ".join(METHODS)],
                 None, ["speculative.method=lookahead"])


def test_override_syntax():
    expect_error(["section.key=value"], None, ["temperature=0.7"])
    expect_error(["section.key=value"], None, ["sampling.temperature"])


def test_file_errors(tmp_path):
    expect_error(["does not exist", "nope.yaml"], tmp_path / "nope.yaml")
    expect_error(["cannot read"], tmp_path)  # a directory
    expect_error(["not valid YAML"], write(tmp_path, "sampling: [1,\n"))
    expect_error(["must be a mapping of sections"], write(tmp_path, "- 1\n- 2\n"))
    expect_error(["section 'sampling' must be a mapping"], write(tmp_path, "sampling: 3\n"))


def test_direct_construction_validates():
    with pytest.raises(JaxspecError, match="sampling.top_p"):
        SamplingConfig(top_p=2.0)
    with pytest.raises(JaxspecError, match="speculative.method"):
        SpeculativeConfig(method="medusa2")  # type: ignore[arg-type]
    assert SamplingConfig(temperature=1).temperature == 1.0


def test_sampling_params_from_config():
    sp = sampling_params(load_config(None, ["sampling.temperature=0.7", "sampling.top_k=5"]))
    assert float(sp.temperature) == pytest.approx(0.7) and int(sp.top_k) == 5


# ---- drafter registry ----------------------------------------------------------------------
FAKE_TARGET = SimpleNamespace(cfg=SimpleNamespace(vocab_size=1000))


def test_ngram_is_registered():
    spec = SpeculativeConfig(method="ngram", min_ngram=2, max_ngram=4)
    drafter, dparams = drafters.build_drafter(spec, FAKE_TARGET)
    assert isinstance(drafter, drafters.NgramDrafter)
    assert (drafter.vocab_size, drafter.min_ngram, drafter.max_ngram) == (1000, 2, 4)
    assert dparams == ()
    assert drafters.build_drafter(SpeculativeConfig(), FAKE_TARGET) == (None, None)


def test_registered_methods_are_config_methods():
    assert set(drafters.DRAFTERS) <= set(METHODS) - {"none"}


def test_unregistered_method_is_refused(monkeypatch):
    monkeypatch.setattr(drafters, "DRAFTERS", {"ngram": drafters.DRAFTERS["ngram"]})
    with pytest.raises(JaxspecError) as e:
        drafters.build_drafter(SpeculativeConfig(method="eagle"), FAKE_TARGET)
    assert "'eagle' is not available" in str(e.value)
    assert "none, ngram" in str(e.value)
    drafters.check_method("none")


def test_register_drafter(monkeypatch):
    monkeypatch.setattr(drafters, "DRAFTERS", dict(drafters.DRAFTERS))

    def factory(spec, target):
        return ("drafter", target.cfg.vocab_size), {"w": 1}

    drafters.DRAFTERS.pop("medusa", None)  # a fresh name for this test (the copy is restored)
    drafters.register_drafter("medusa", factory)
    drafters.register_drafter("medusa", factory)  # the same factory again is harmless
    assert "medusa" in drafters.available_methods()
    out = drafters.build_drafter(SpeculativeConfig(method="medusa"), FAKE_TARGET)
    assert out == (("drafter", 1000), {"w": 1})
    with pytest.raises(ValueError, match="already registered"):
        drafters.register_drafter("medusa", lambda spec, target: (None, None))
    with pytest.raises(ValueError):
        drafters.register_drafter("none", factory)
