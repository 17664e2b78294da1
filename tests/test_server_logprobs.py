"""The server honours logprobs, n, seed, penalties and logit_bias (issue 44 item 3), with the
`openai` client over loopback: logprobs equal the engine's (which equal a full forward,
tests/test_loop_logprobs.py) in OpenAI's chat and completions shapes, streamed and not; n
returns n seeded rows (reproducible with `seed`); penalties and logit_bias change the greedy
output exactly as the engine's do; echo returns the prompt, its own tokens scored as a full
forward scores them (what lm-eval's loglikelihood tasks read).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from compiles import counting_lowerings  # noqa: E402
from loopback import NAME, openai_client, serving, speculative_byte_engine  # noqa: E402
from tiny import sequence_logits  # noqa: E402

CONTEXT = 128
NEW = 10
PROMPT = "abcabcabc"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return speculative_byte_engine(tmp_path_factory.mktemp("bytes"), CONTEXT)


@pytest.fixture(scope="module")
def client(engine):
    with serving(engine, CONTEXT) as url:
        yield openai_client(url)


def solo(engine, prompt, **kw):
    ids = engine.model.tokenizer.encode(prompt)
    return engine.generate([ids], max_new_tokens=NEW, **kw)[0]


def test_completions_logprobs_equal_the_engines(engine, client):
    ref = solo(engine, PROMPT)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ref.token_ids)
    for got, want, top in zip(lp.token_logprobs, ref.logprobs, lp.top_logprobs):
        assert abs(got - want["logprob"]) < 1e-5
        assert len(top) <= 3 and max(top.values()) == pytest.approx(want["top"][0][1], abs=1e-5)
    streamed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW,
                                         temperature=0, logprobs=2, stream=True)
    chunks = [c for c in streamed if c.choices and c.choices[0].logprobs]
    got = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-5)


def full_log_softmax(engine, ids) -> np.ndarray:
    """f64[T, V]: log_softmax of the target's logits over `ids`, one forward."""
    x = sequence_logits(engine.model.target, engine.model.params, ids)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_echo_returns_the_prompt_with_its_tokens_scored(engine, client):
    ref = solo(engine, PROMPT)
    ids = engine.model.tokenizer.encode(PROMPT)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    logprobs=3, echo=True)
    assert out.choices[0].text == PROMPT + engine.decode_text(ref.token_ids)
    lp, n = out.choices[0].logprobs, len(ids)
    assert len(lp.tokens) == n + len(ref.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing scores it
    want = full_log_softmax(engine, ids)
    for t in range(1, n):  # token t given tokens before it: row t - 1 of the forward
        assert lp.token_logprobs[t] == pytest.approx(want[t - 1, ids[t]], abs=1e-5), t
        assert max(lp.top_logprobs[t].values()) == pytest.approx(want[t - 1].max(), abs=1e-5)
    assert lp.token_logprobs[n:] == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-5)
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == len(ref.token_ids)
    streamed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW,
                                         temperature=0, echo=True, stream=True)
    texts = [c.choices[0].text for c in streamed if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == out.choices[0].text
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                      echo=True)  # echo without logprobs: the text only
    assert plain.choices[0].text == out.choices[0].text and plain.choices[0].logprobs is None


def test_echo_scores_in_chunks_with_one_program(engine, client):
    """Issue 57 item 3: echo with logprobs scores a prompt over several chunks of
    `prompt_scores.SCORE_CHUNK` tokens as one forward does, and after one echo request an echo
    of another length lowers no program (one chunk program whatever the length, which a server
    prepares before /ready: it compiled one per prompt bucket after /ready before)."""
    from jaxspec.engine.prompt_scores import SCORE_CHUNK

    text = "the quick brown fox jumps over the lazy dog " * 2
    ids = engine.model.tokenizer.encode(text)
    assert SCORE_CHUNK < len(ids) < CONTEXT - NEW
    ask = dict(model=NAME, max_tokens=1, temperature=0, logprobs=1)
    client.completions.create(prompt=text, **ask)  # its prefill and decode programs, warm
    client.completions.create(prompt="ab", echo=True, **ask)  # the chunk program, warm
    with counting_lowerings() as lowered:  # another salt: the whole prompt again, no tail
        out = client.completions.create(prompt=text, echo=True, extra_body={"cache_salt": "b"},
                                        **ask)
        assert lowered() == 0, f"{lowered()} programs lowered for an echo of a new length"
    want = full_log_softmax(engine, ids)
    got = out.choices[0].logprobs.token_logprobs[1:len(ids)]
    assert got == pytest.approx([want[t - 1, ids[t]] for t in range(1, len(ids))], abs=1e-5)


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=NEW,
        temperature=0, logprobs=True, top_logprobs=4)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 4 and c.logprob <= 0 for c in content)
    assert all(c.logprob >= c.top_logprobs[-1].logprob - 1e-6 for c in content)
    none = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0)
    assert none.choices[0].logprobs is None


def test_n_rows_are_seeded_and_reproducible(client):
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=1.0, n=4, seed=7)
    first = client.completions.create(**ask)
    again = client.completions.create(**ask)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert texts == [c.text for c in again.choices]  # seed: reproducible
    assert len(set(texts)) > 1  # seeds seed + i: distinct samples
    one = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=1.0,
                                    seed=8)
    assert one.choices[0].text == texts[1]  # row i is the request with seed + i
    # usage counts every row: NEW tokens each for a row cut by length, 1..NEW (its EOS
    # included) for one that stopped (its text is not byte-exact: invalid UTF-8 is replaced)
    reasons = [c.finish_reason for c in first.choices]
    cut, stopped = reasons.count("length"), reasons.count("stop")
    assert cut + stopped == 4, reasons
    assert NEW * cut + stopped <= first.usage.completion_tokens <= NEW * (cut + stopped), (
        first.usage, reasons)


def test_n_streamed_equals_n_returned_whole(client):
    """n with stream: each choice's chunks carry its index; joined per index they are the n
    seeded rows a non-streamed request returns; each ends with a finish reason; the usage comes
    once, in a chunk without choices."""
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=1.0, n=3, seed=5)
    whole = client.completions.create(**ask)
    texts, reasons, usage = ["", "", ""], [None] * 3, []
    for c in client.completions.create(stream=True, logprobs=1, **ask):
        usage += [c.usage] if c.usage else []
        for choice in c.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
                assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) > 0
    assert texts == [c.text for c in whole.choices] and len(set(texts)) > 1
    assert reasons == [c.finish_reason for c in whole.choices]
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, n=2, seed=3,
        temperature=1.0, stream=True)
    roles = [ch.delta.role for c in chat for ch in c.choices if ch.delta.role]
    assert roles == ["assistant", "assistant"]  # the first chunk of each choice


def test_best_of_returns_the_likeliest_of_its_seeded_candidates(client):
    """best_of=3 runs the rows n=3 runs (seeds seed + i) and returns the one whose tokens have the
    highest summed logprob; usage counts all three."""
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=1.0, seed=11)
    rows = client.completions.create(n=3, logprobs=0, **ask)
    summed = [sum(c.logprobs.token_logprobs) for c in rows.choices]
    assert len({c.text for c in rows.choices}) > 1 and len(set(summed)) == 3
    best = client.completions.create(extra_body={"best_of": 3}, **ask)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # not asked for
    assert best.choices[0].text == rows.choices[summed.index(max(summed))].text
    assert best.usage.completion_tokens == rows.usage.completion_tokens
    two = client.completions.create(n=2, extra_body={"best_of": 3}, logprobs=0, **ask)
    assert [c.text for c in two.choices] == [
        rows.choices[i].text for i in sorted(range(3), key=lambda i: -summed[i])[:2]]


def test_penalties_and_logit_bias_are_honoured(engine, client):
    setting = dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"100": 8.0})
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    extra_body={"repetition_penalty": 1.3}, **setting)
    ref = solo(engine, PROMPT, penalties=(1.0, 0.5, 1.3, {"100": 8.0}))
    assert out.choices[0].text == engine.decode_text(ref.token_ids)
    assert out.choices[0].text != engine.decode_text(solo(engine, PROMPT).token_ids)


@pytest.mark.parametrize("body, word", [
    ({"n": 17}, "'n'=17 is out of range"),
    ({"logprobs": 21}, "'logprobs'=21 is out of range"),
    ({"logprobs": 6}, "it records 5 top logprobs"),
    ({"presence_penalty": 3}, "presence_penalty=3"),
    ({"logit_bias": {"999": 1}}, "out of range"),
    ({"best_of": 17}, "'best_of'=17 is out of range"),
    ({"n": 3, "best_of": 2}, "'best_of'=2 is out of range: use n"),
    ({"best_of": 2, "stream": True}, "with 'stream': true is not supported"),
])
def test_bad_fields_are_one_line_400s(client, body, word):
    with pytest.raises(openai.BadRequestError, match=word):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, extra_body=body)
