"""Bad input is refused with a one-line error naming the fix, wherever it enters: prompt token
ids, temperatures too small to compute, draft-vocabulary maps, non-finite weights; and the layout
that ran (with the reason when "auto" fell back) is reported."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec import kernels
from jaxspec.config import load_config
from jaxspec.drafters.draft_vocab import check_d2t
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.limits import MIN_TEMPERATURE
from jaxspec.loading.params import assemble, resolve_layout
from jaxspec.models import llama
from jaxspec.decode.sampling import SamplingParams
from tiny import tiny_model


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model(seed=0, layers=1, packed=True))  # vocabulary of 64


def test_prompt_token_ids_in_range_run(engine):
    assert len(engine.generate([[1, 2, 63]], max_new_tokens=3)[0].token_ids) == 3


@pytest.mark.parametrize("ids,fragment", [
    ([1, 2, 64], "token id 64 is out of range"),
    ([1, 2, 999], "token id 999 is out of range"),
    ([1, 2, -1], "token id -1 is out of range"),
    ([1, 2.5], "sequence of integers"),
    (["a"], "sequence of integers"),
    ([], "empty prompt"),
])
def test_bad_prompt_token_ids_are_refused(engine, ids, fragment):
    with pytest.raises(JaxspecError, match=fragment):
        engine.generate([ids], max_new_tokens=3)


@pytest.mark.parametrize("t", [1e-38, 1e-10, MIN_TEMPERATURE / 2])
def test_temperature_below_the_minimum_is_refused(t):
    with pytest.raises(JaxspecError, match=f"temperature={t!r} is invalid: use 0 for greedy"):
        SamplingParams.make(temperature=t)
    with pytest.raises(JaxspecError, match="sampling.temperature=.* use 0 for greedy"):
        load_config(None, [f"sampling.temperature={t}"])


def test_the_minimum_temperature_gives_finite_probabilities(engine):
    sp = SamplingParams.make(temperature=MIN_TEMPERATURE)
    out = engine.generate([[5, 6, 7]], max_new_tokens=6, sampling=sp)[0].token_ids
    greedy = engine.generate([[5, 6, 7]], max_new_tokens=6)[0].token_ids
    assert out == greedy  # this close to 0, sampling is the argmax; before, 1e-38 gave NaN


@pytest.mark.parametrize("d2t,fragment", [
    ([0, 3, 3, 5], "target id 3 appears 2 times"),
    ([0, 3, 64], "target id 64, outside the target vocabulary"),
    ([-1, 3], "target id -1, outside"),
    ([[0, 1]], "1-D integer array"),
    ([0.0, 1.0], "1-D integer array"),
    ([], "1-D integer array"),
])
def test_malformed_draft_vocabulary_maps_are_refused(d2t, fragment):
    with pytest.raises(JaxspecError, match=fragment):
        check_d2t(np.asarray(d2t), 64, "drafter.ckpt")


def test_a_valid_draft_vocabulary_map_passes():
    assert check_d2t(np.asarray([5, 0, 63]), 64, "x").tolist() == [5, 0, 63]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused(bad):
    cfg = tiny_model(layers=1).cfg
    flat = {"embed": np.zeros((64, 64), np.float32), "final_norm": np.ones(64, np.float32),
            "lm_head": np.zeros((64, 64), np.float32)}
    for k, shape in llama.param_shapes(cfg)["layers"][0].items():
        flat[f"layers.0.{k}"] = np.zeros(shape, np.float32)
    assemble(cfg, flat, source="ok.safetensors")
    flat["layers.0.w_up"][3, 4] = bad
    with pytest.raises(JaxspecError, match="tensor layers.0.w_up holds NaN or inf"):
        assemble(cfg, flat, source="bad.safetensors")


def test_auto_layout_says_why_it_fell_back(monkeypatch, engine):
    if kernels.available():
        assert resolve_layout("auto", "float32") == (
            "packed", "auto: float32 on one CPU device with the CPU kernels")
    assert resolve_layout("auto", "bfloat16")[0] == "unrolled"
    assert "float32 only" in resolve_layout("auto", "bfloat16")[1]
    monkeypatch.setenv("JAXSPEC_CPU_KERNELS", "0")
    layout, why = resolve_layout("auto", "float32")
    assert layout == "unrolled" and why.startswith("auto fell back") and "JAXSPEC_CPU_KERNELS" in why
    assert resolve_layout("unrolled", "float32") == ("unrolled", "requested")


def test_metrics_name_the_layout_that_ran(engine):
    m = engine.generate([[1, 2, 3]], max_new_tokens=2)[0].metrics
    assert m["layout"] == ("packed" if kernels.available() else "unrolled")


def test_stream_returns_its_result_with_metrics(engine):
    pieces = engine.stream([1, 2, 3], max_new_tokens=5)
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            result = done.value
            break
    assert result.num_generated_tokens == 5
    assert result.metrics["num_steps"] == 4 and result.decode_tokens_per_s > 0
    assert result.token_ids == engine.generate([[1, 2, 3]], max_new_tokens=5)[0].token_ids
