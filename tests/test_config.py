"""Config dataclasses, YAML + dotted overrides, and the drafter registry."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from jaxspec import drafters
from jaxspec.build import build_drafter, sampling_params
from jaxspec.config import (
    Config,
    SamplingConfig,
    SpeculativeConfig,
    load_config,
)
from jaxspec.drafters import registry
from jaxspec.drafters.layer_skip import LayerSkipOptions
from jaxspec.drafters.prompt_lookup import NgramOptions
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
    assert c.speculative.method == "none" and c.speculative.options is None
    assert c.speculative.tree.kind == "chain" and not c.speculative.adaptive.enabled
    assert load_config(None, ["speculative.method=layer_skip"]).speculative.options.layers == 8


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_parse(name):
    c = load_config(CONFIGS / name)
    assert c.model.name == name.split("-")[0] + "-" + name.split("-")[1].removesuffix(".yaml")


def test_shipped_config_values():
    ngram = load_config(CONFIGS / "smollm2-135m-ngram.yaml").speculative
    assert ngram.method == "ngram" and ngram.options == NgramOptions(min_ngram=2, max_ngram=3)
    skip = load_config(CONFIGS / "smollm2-135m-layerskip.yaml").speculative
    assert (skip.method, skip.num_speculative_tokens, skip.options.layers) == ("layer_skip", 3, 8)
    lookup = load_config(CONFIGS / "smollm2-135m-eagle-lookup.yaml").speculative
    assert (lookup.lookup.min_ngram, lookup.lookup.max_ngram) == (2, 4)
    assert lookup.options.checkpoint == "checkpoints/smollm2-135m-eagle"


def test_nested_sections_from_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "speculative:\n  method: ngram\n  ngram:\n    max_ngram: 5\n"
                           "  tree:\n    kind: static\n    depth: 2\n")
    spec = load_config(path, ["speculative.ngram.min_ngram=2", "speculative.tree.branches=2"]).speculative
    assert spec.options == NgramOptions(min_ngram=2, max_ngram=5)
    assert (spec.tree.kind, spec.tree.branches, spec.tree.depth) == ("static", 2, 2)
    # another method's section is validated, then dropped (the chosen method's is kept)
    spec = load_config(path, ["speculative.method=layer_skip", "speculative.layer_skip.layers=3",
                              "speculative.tree.kind=chain"]).speculative
    assert spec.options == LayerSkipOptions(layers=3)
    expect_error(["speculative.ngram.max_ngram='x'", "an integer"], path,
                 ["speculative.method=layer_skip", "speculative.ngram.max_ngram=x"])


def test_to_dict_is_the_yaml_layout(tmp_path):
    c = load_config(CONFIGS / "smollm2-135m-ngram-tree.yaml")
    d = c.to_dict()
    assert d["speculative"]["ngram"] == {"min_ngram": 2, "max_ngram": 3}
    assert d["speculative"]["tree"]["kind"] == "static" and "options" not in d["speculative"]
    assert load_config(write(tmp_path, yaml.safe_dump(d))) == c


@pytest.mark.parametrize(
    "override, new",
    [
        ("tree.kind=static", "speculative.tree.kind"),
        ("adaptive.enabled=true", "speculative.adaptive.enabled"),
        ("speculative.min_ngram=2", "speculative.ngram.min_ngram"),
        ("speculative.lookup_min_ngram=2", "speculative.lookup.min_ngram"),
        ("speculative.layer_skip_layers=4", "speculative.layer_skip.layers"),
        ("speculative.draft_confidence=0.3", "speculative.eagle.draft_confidence"),
        ("speculative.checkpoint=x", "speculative.<method>.checkpoint"),
        ("speculative.draft_model=x", "speculative.draft_model.model"),
    ],
)
def test_old_keys_name_the_new_one(tmp_path, override, new):
    expect_error([new], None, [override])
    section, key = override.split("=")[0].split(".")
    moved = new if section == "speculative" else f"speculative.{section}"
    expect_error([moved, "c.yaml"], write(tmp_path, f"{section}:\n  {key}: 1\n"))


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
            "speculative.draft_model.model=null",
            "speculative.eagle.checkpoint= /ckpt/eagle ",
        ],
    )
    assert c.sampling.top_p == 1.0 and isinstance(c.sampling.top_p, float)
    assert c.sampling.min_p == pytest.approx(1e-3)
    assert c.generation.chat_template is False
    assert c.generation.system_prompt == "You are terse."
    assert c.model.name == "2024"
    assert load_config(None, ["speculative.method=draft_model", "speculative.draft_model.model=null"]
                       ).speculative.options.model is None
    assert load_config(None, ["speculative.method=eagle", "speculative.eagle.checkpoint= /ckpt/eagle "]
                       ).speculative.options.checkpoint == "/ckpt/eagle"


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
        (["sampling.top_p=0"], ["sampling.top_p", "[1e-06, 1]"]),
        (["sampling.top_p=1.5"], ["sampling.top_p", "[1e-06, 1]"]),
        (["sampling.min_p=1"], ["sampling.min_p"]),
        (["sampling.top_k=-1"], ["sampling.top_k"]),
        (["sampling.seed=-1"], ["sampling.seed"]),
        (["generation.max_new_tokens=0"], ["generation.max_new_tokens"]),
        (["generation.batch_size=0"], ["generation.batch_size"]),
        (["speculative.method=ngram", "speculative.num_speculative_tokens=0"],
         ["num_speculative_tokens", f"1..{MAX_SPECULATIVE_TOKENS}"]),
        (["speculative.method=ngram", f"speculative.num_speculative_tokens={MAX_SPECULATIVE_TOKENS + 1}"],
         ["num_speculative_tokens"]),
        (["speculative.ngram.min_ngram=0"], ["speculative.ngram.min_ngram"]),
        (["speculative.ngram.min_ngram=4", "speculative.ngram.max_ngram=3"], ["min_ngram", "max_ngram"]),
        (["speculative.ngram.max_ngram=17"], ["speculative.ngram", "max_ngram", "16"]),
        (["speculative.layer_skip.layers=0"], ["speculative.layer_skip.layers"]),
        (["speculative.method=eagle", "speculative.eagle.draft_confidence=1.0"],
         ["speculative.eagle.draft_confidence", "[0, 1)"]),
        (["speculative.method=eagle", "speculative.eagle.draft_confidence=-0.1"], ["draft_confidence"]),
        (["speculative.eagle.checkpoint_format=gguf"], ["speculative.eagle.checkpoint_format", "auto"]),
        (["speculative.method=eagle", "speculative.lookup.min_ngram=4"],
         ["speculative.lookup.min_ngram", "max_ngram (3)"]),
        (["speculative.method=eagle", "speculative.lookup.min_ngram=-1"], ["speculative.lookup.min_ngram"]),
        (["speculative.method=ngram", "speculative.lookup.min_ngram=2"], ["speculative.lookup", "'ngram'"]),
        (["speculative.lookup.min_ngram=2"], ["speculative.lookup", "'none'"]),
        (["model.name= "], ["model.name"]),
    ],
)
def test_out_of_range(overrides, fragments):
    expect_error(fragments, None, overrides)


def test_gamma_unchecked_for_plain_decoding():
    assert load_config(None, ["speculative.num_speculative_tokens=0"]).speculative.method == "none"


def test_unknown_method_lists_valid():
    expect_error(["speculative.method='lookahead'", ", ".join(registry.available_methods())],
                 None, ["speculative.method=lookahead"])


def test_override_syntax():
    expect_error(["section.key=value"], None, ["temperature=0.7"])
    expect_error(["section.key=value"], None, ["sampling.temperature"])


def test_file_errors(tmp_path):
    expect_error(["does not exist", "nope.yaml"], tmp_path / "nope.yaml")
    expect_error(["not a regular file", "plain file"], tmp_path)  # a directory
    expect_error(["not valid YAML"], write(tmp_path, "sampling: [1,\n"))
    expect_error(["must be a mapping of sections"], write(tmp_path, "- 1\n- 2\n"))
    expect_error(["section 'sampling' must be a mapping"], write(tmp_path, "sampling: 3\n"))


def test_direct_construction_validates():
    with pytest.raises(JaxspecError, match="sampling.top_p"):
        SamplingConfig(top_p=2.0)
    with pytest.raises(JaxspecError, match="speculative.method"):
        SpeculativeConfig(method="medusa2")
    with pytest.raises(JaxspecError, match="speculative.ngram.max_ngram"):
        NgramOptions(min_ngram=1, max_ngram=99)
    with pytest.raises(JaxspecError, match="does not fit method 'eagle'"):
        SpeculativeConfig(method="eagle", options=NgramOptions())
    spec = SpeculativeConfig(method="ngram", options=NgramOptions(max_ngram=5))
    assert spec.options.max_ngram == 5 and SpeculativeConfig(method="ngram").options == NgramOptions()
    assert SamplingConfig(temperature=1).temperature == 1.0


def test_sampling_params_from_config():
    sp = sampling_params(load_config(None, ["sampling.temperature=0.7", "sampling.top_k=5"]))
    assert float(sp.temperature) == pytest.approx(0.7) and int(sp.top_k) == 5


# ---- drafter registry ----------------------------------------------------------------------
FAKE_TARGET = SimpleNamespace(target=SimpleNamespace(vocab_size=1000))


def test_ngram_is_registered():
    spec = SpeculativeConfig(method="ngram", options=NgramOptions(min_ngram=2, max_ngram=4))
    drafter, dparams = build_drafter(spec, FAKE_TARGET)
    assert isinstance(drafter, drafters.NgramDrafter)
    assert (drafter.vocab_size, drafter.min_ngram, drafter.max_ngram) == (1000, 2, 4)
    assert dparams == ()
    assert build_drafter(SpeculativeConfig(), FAKE_TARGET) == (None, None)


def test_builtin_methods_register_their_options():
    for name, method in registry.DRAFTERS.items():
        assert method.options is None or method.options.SECTION == f"speculative.{name}"
    assert {"ngram", "draft_model", "layer_skip", "eagle", "eagle3", "medusa", "mtp"} <= set(
        registry.DRAFTERS
    )


def test_unregistered_method_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "DRAFTERS", {"ngram": registry.DRAFTERS["ngram"]})
    with pytest.raises(JaxspecError) as e:
        drafters.check_method("eagle")
    assert "'eagle' is not available" in str(e.value)
    assert "none, ngram" in str(e.value)
    drafters.check_method("none")
    expect_error(["speculative.method='eagle'", "none, ngram"], None, ["speculative.method=eagle"])


def test_register_drafter(monkeypatch):
    monkeypatch.setattr(registry, "DRAFTERS", dict(registry.DRAFTERS))

    def factory(options, ctx):
        return ("drafter", ctx.target.target.vocab_size), {"w": 1}

    drafters.register_drafter("fake", factory)
    drafters.register_drafter("fake", factory)  # the same factory again is harmless
    assert "fake" in drafters.available_methods()
    out = build_drafter(SpeculativeConfig(method="fake"), FAKE_TARGET)
    assert out == (("drafter", 1000), {"w": 1})
    with pytest.raises(ValueError, match="already registered"):
        drafters.register_drafter("fake", lambda options, ctx: (None, None))
    with pytest.raises(ValueError):
        drafters.register_drafter("none", factory)
    with pytest.raises(ValueError, match="expected 'speculative.other'"):
        drafters.register_drafter("other", factory, options=NgramOptions)
