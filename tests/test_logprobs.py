"""decode/logprobs.py against numpy float64 references; serving/logprob_shapes.py against the
`openai` client's own response types."""

import numpy as np
import pytest
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs

from jaxspec.decode import logprobs as lp
from jaxspec.decode.sampling import SamplingParams, logits_to_probs
from jaxspec.errors import JaxspecError
from jaxspec.serving import logprob_shapes

V = 40


def _logits(seed, shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 3.0


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_raw_logprobs_match_log_softmax_and_ignore_temperature():
    logits = _logits(0, (3, 5, V))  # [B, T, V]
    tokens = np.random.default_rng(1).integers(0, V, size=(3, 5)).astype(np.int32)
    ref = _log_softmax(logits)
    for t in (0.0, 0.7):
        chosen, ids, vals = lp.scored(logits, tokens, 4, SamplingParams.make(temperature=t))
        np.testing.assert_allclose(
            chosen, np.take_along_axis(ref, tokens[..., None], -1)[..., 0], atol=1e-5
        )
        order = np.argsort(-ref, axis=-1, kind="stable")[..., :4]
        np.testing.assert_array_equal(ids, order)
        np.testing.assert_allclose(vals, np.take_along_axis(ref, order, -1), atol=1e-5)


def test_processed_logprobs_are_the_sampling_law():
    logits = _logits(2, (4, V))
    sp = SamplingParams.make(temperature=0.6, top_k=7)
    tokens = np.argsort(-logits, axis=-1)[:, 3].astype(np.int32)  # inside the top-7: finite
    chosen, _ids, vals = lp.scored(logits, tokens, 7, sp, mode="processed")
    probs = np.asarray(logits_to_probs(logits, sp), np.float64)
    ref = _log_softmax(logits / 0.6)
    kept = np.argsort(-logits, axis=-1)[:, :7]
    renorm = np.take_along_axis(ref, kept, -1)
    renorm = renorm - np.log(np.exp(renorm).sum(-1, keepdims=True))
    np.testing.assert_allclose(vals, renorm, atol=1e-5)
    np.testing.assert_allclose(
        np.exp(chosen), np.take_along_axis(probs, tokens[:, None], -1)[:, 0], rtol=1e-5
    )
    assert not np.allclose(
        chosen, np.take_along_axis(_log_softmax(logits), tokens[:, None], -1)[:, 0]
    )
    cut = np.argsort(-logits, axis=-1)[:, -1].astype(np.int32)
    assert np.all(np.isneginf(lp.scored(logits, cut, 0, sp, mode="processed")[0]))


def test_bad_arguments_name_the_fix():
    logits = _logits(3, (2, V))
    toks = np.zeros(2, np.int32)
    with pytest.raises(JaxspecError, match="use one of raw, processed"):
        lp.scored(logits, toks, 1, mode="tempered")
    with pytest.raises(JaxspecError, match="pass sp="):
        lp.scored(logits, toks, 1, mode="processed")
    with pytest.raises(JaxspecError, match=r"in \[0, 40\]"):
        lp.scored(logits, toks, V + 1)


def _piece(i):
    return "é" if i == 5 else f"t{i}"


def test_openai_shapes_parse_with_the_client_types():
    tokens, chosen = [5, 7], [-0.1, -2.5]
    ids, vals = [[5, 1, 2], [3, 7, 9]], [[-0.1, -3.0, -4.0], [-1.0, -2.5, -5.0]]
    chat = ChoiceLogprobs.model_validate(
        logprob_shapes.chat_logprobs(_piece, tokens, chosen, ids, vals, top_logprobs=2)
    )
    assert [c.token for c in chat.content] == ["é", "t7"]
    assert chat.content[0].bytes == [0xC3, 0xA9]
    assert [[t.token for t in c.top_logprobs] for c in chat.content] == [["é", "t1"], ["t3", "t7"]]
    assert chat.content[1].logprob == -2.5
    comp = Logprobs.model_validate(
        logprob_shapes.completion_logprobs(_piece, tokens, chosen, ids, vals, logprobs=1, offset=4)
    )
    assert comp.tokens == ["é", "t7"] and comp.token_logprobs == [-0.1, -2.5]
    assert comp.top_logprobs == [{"é": -0.1}, {"t3": -1.0}]
    assert comp.text_offset == [4, 5]


def test_path_scored_reads_each_token_where_its_parent_node_sits():
    # a tree window of 5 nodes; accepted path root(0) -> 2 -> 4, then a resampled token
    logits = _logits(4, (1, 5, V))
    path = np.array([[0, 2, 4]], np.int32)
    window_tokens = np.array([[9, 11, 12, 13, 14]], np.int32)
    path_tokens = np.take_along_axis(window_tokens, path, 1)  # [[9, 12, 14]]
    num_acc, next_token = np.array([2], np.int32), np.array([30], np.int32)
    chosen, ids, _ = lp.path_scored(logits, path, path_tokens, num_acc, next_token, 2)
    ref = _log_softmax(logits[0])
    want = [ref[0, 12], ref[2, 14], ref[4, 30]]  # emitted 12, 14, 30 predicted by nodes 0, 2, 4
    np.testing.assert_allclose(chosen[0], want, atol=1e-5)
    np.testing.assert_array_equal(ids[0, 1], np.argsort(-ref[2], kind="stable")[:2])
    # one accepted: slot 1 is the resampled token, read at node path[1]
    chosen, _, _ = lp.path_scored(logits, path, path_tokens, np.array([1]), next_token, 0)
    np.testing.assert_allclose(chosen[0, :2], [ref[0, 12], ref[2, 30]], atol=1e-5)
