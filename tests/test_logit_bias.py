"""decode/logit_bias.py against a numpy transcription of vLLM's apply_penalties."""

import numpy as np
import pytest

from jaxspec.decode import logit_bias as lb
from jaxspec.errors import JaxspecError

V = 12


def _vllm_reference(logits, prompt, generated, presence, frequency, repetition, bias):
    out = np.asarray(logits, np.float64).copy()
    counts = np.bincount(np.asarray(generated, int), minlength=V)
    seen = counts > 0
    seen[np.asarray(prompt, int)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    out -= frequency * counts
    out -= presence * (counts > 0)
    return out + bias


def test_adjust_matches_vllm_at_every_position():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, V)).astype(np.float32) * 2  # one row per generated position
    prompt = np.array([1, 2, 2, 9])
    gen = np.array([3, 3, 1, 7, 3, 5], np.int32)
    bias = lb.bias_vector({"4": 5.0, 11: -100}, V)
    counts = lb.counts_along(gen, V)
    mask = np.zeros(V, bool)
    mask[prompt] = True
    got = lb.adjust(logits, counts, mask, 0.5, 0.3, 1.3, bias)
    for t in range(6):
        ref = _vllm_reference(logits[t], prompt, gen[:t], 0.5, 0.3, 1.3, bias)
        np.testing.assert_allclose(got[t], ref, rtol=1e-5, atol=1e-5)
    # neutral settings leave logits unchanged
    np.testing.assert_array_equal(lb.adjust(logits, counts, mask, 0.0, 0.0, 1.0, 0.0), logits)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: lb.bias_vector({"x": 1}, V), "map token ids to numbers"),
        (lambda: lb.bias_vector({"12": 1}, V), r"ids in \[0, 12\)"),
        (lambda: lb.bias_vector({"1": 101}, V), r"\[-100, 100\]"),
        (lambda: lb.check_penalties(presence=2.5), "presence_penalty=2.5"),
        (lambda: lb.check_penalties(repetition=0), "repetition_penalty=0"),
    ],
)
def test_bad_values_name_the_fix(call, match):
    with pytest.raises(JaxspecError, match=match):
        call()
