"""Logits and greedy-token parity with Hugging Face transformers (PyTorch, CPU, float32).

Error measure everywhere: max |ours - theirs| / max |theirs| over the compared logits.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import kernels
from jaxspec.loading import load_model
from jaxspec.models import decoder, llama
from jaxspec.loading.gguf_file import open_gguf
from jaxspec.loading.tokenizer import load_gguf_tokenizer, quiet, tokenizer_from_metadata
from jaxspec.models.llama import forward_logits

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # see conftest.import_torch

TOL = 1e-4
_forward = jax.jit(forward_logits, static_argnums=3)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def hf_logits(model, tokens) -> np.ndarray:  # [B, T, V]
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens))).logits.float().numpy()


def full_logits(m, tokens, capacity=64) -> np.ndarray:
    tokens = jnp.asarray(tokens, jnp.int32)
    cache = m.init_cache(tokens.shape[0], capacity)
    logits, _ = _forward(m.params, tokens, cache, m.cfg)
    return np.asarray(logits)


def incremental_logits(m, tokens, chunks, capacity=64) -> np.ndarray:
    """Prefill then decode in `chunks` (sizes summing to T), committing each into the cache."""
    tokens = jnp.asarray(tokens, jnp.int32)
    b = tokens.shape[0]
    cache = m.init_cache(b, capacity)
    out, start = [], 0
    for n in chunks:
        logits, cache = _forward(m.params, tokens[:, start : start + n], cache, m.cfg)
        cache = cache.commit(jnp.full((b,), n))
        out.append(np.asarray(logits))
        start += n
    assert start == tokens.shape[1]
    return np.concatenate(out, axis=1)


# ---------------------------------------------------------------- tiny random HF checkpoints

TINY_CHECKPOINTS = [
    "tiny_llama_dir",
    "tiny_qwen2_dir",
    "tiny_qwen3_dir",
    "tiny_mistral_dir",
    "tiny_llama_sharded_dir",
]


# "auto" is what configs load: the packed CPU-kernel layout where it builds, else unrolled.
@pytest.mark.parametrize("layout", ["unrolled", "auto"])
@pytest.mark.parametrize("fixture", TINY_CHECKPOINTS)
def test_tiny_checkpoint_logits_match_transformers(fixture, layout, request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m = load_model(path, layout=layout)
    assert m.layout == ("packed" if layout == "auto" and kernels.available() else "unrolled")
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 40))
    ref = hf_logits(hf, tokens)

    err_full = rel_err(full_logits(m, tokens), ref)
    err_incr = rel_err(incremental_logits(m, tokens, [17, 1, 1, 6, 1, 5, 9]), ref)
    print(f"{fixture}: full {err_full:.2e}, incremental {err_incr:.2e}")
    assert err_full < TOL
    assert err_incr < TOL


def test_stacked_layout_matches_unrolled(tiny_llama_dir):
    unrolled = load_model(tiny_llama_dir, layout="unrolled")
    stacked = load_model(tiny_llama_dir, layout="stacked")
    assert isinstance(stacked.params["layers"], dict)
    assert stacked.params["layers"]["wq"].shape[0] == stacked.cfg.num_layers
    tokens = np.random.default_rng(1).integers(0, unrolled.cfg.vocab_size, (1, 12))
    np.testing.assert_allclose(
        full_logits(stacked, tokens), full_logits(unrolled, tokens), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("layout", ["unrolled", "stacked", "auto"])
def test_deferred_cache_write_matches_writing_first(tiny_llama_dir, layout):
    """forward(write_cache=False) + write_window (what a variable-width verify does) == forward."""
    m = load_model(tiny_llama_dir, layout=layout)
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, m.cfg.vocab_size, (2, 11)), jnp.int32)
    window = jnp.asarray(rng.integers(0, m.cfg.vocab_size, (2, 4)), jnp.int32)
    cache = _forward(m.params, prompt, m.init_cache(2, 32), m.cfg)[1].commit(jnp.asarray([11, 7]))
    written = llama.forward(m.params, window, cache, m.cfg)
    deferred = llama.forward(m.params, window, cache, m.cfg, write_cache=False)
    np.testing.assert_allclose(deferred.hidden, written.hidden, rtol=1e-5, atol=1e-5)
    late = decoder.write_window(deferred.cache, deferred.window_kv, cache.positions(4))
    exact = m.layout == "packed"  # the kernel reads the window from its own inputs either way
    for a, b in zip(jax.tree.leaves(late), jax.tree.leaves(written.cache)):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:  # XLA's two attention forms round differently; later layers' k/v inherit that
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bfloat16_load_is_close(tiny_qwen2_dir):
    m32 = load_model(tiny_qwen2_dir)
    m16 = load_model(tiny_qwen2_dir, dtype="bfloat16")
    assert m16.cfg.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(m16.params)} == {jnp.dtype(jnp.bfloat16)}
    tokens = np.random.default_rng(2).integers(0, m32.cfg.vocab_size, (1, 12))
    assert rel_err(full_logits(m16, tokens), full_logits(m32, tokens)) < 5e-2


# ---------------------------------------------------------------- the real SmolLM2 GGUF


SMOLLM2_CAPACITY = 128


def chat_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    ids = chat_ids(smollm2.tokenizer, "Name a colour.")
    assert 25 <= len(ids) <= 40
    ref = hf_logits(smollm2_hf, [ids])
    # Capacity and the one-token step are shared with the greedy test: each new shape of a
    # 30-layer model costs ~10 s of XLA compile on this CPU.
    err_full = rel_err(full_logits(smollm2, [ids], SMOLLM2_CAPACITY), ref)
    n = len(ids)
    err_incr = rel_err(incremental_logits(smollm2, [ids], [1] * n, SMOLLM2_CAPACITY), ref)
    print(f"smollm2 ({n} tokens): full {err_full:.2e}, incremental {err_incr:.2e}")
    assert err_full < TOL
    assert err_incr < TOL


def test_smollm2_prompt_logprobs_match_transformers(smollm2, smollm2_hf):
    """What `echo` with logprobs returns (Engine.prompt_logprobs): each prompt token's
    log-probability given the ones before it, and the top 20, as transformers computes them."""
    from jaxspec.engine.runner import Engine

    ids = chat_ids(smollm2.tokenizer, "Name a colour.")
    got = Engine(smollm2).prompt_logprobs(ids)
    with torch.no_grad():
        ref = torch.log_softmax(torch.as_tensor(hf_logits(smollm2_hf, [ids])[0], dtype=torch.float64),
                                -1).numpy()
    assert len(got) == len(ids) - 1
    chosen = np.array([g["logprob"] for g in got])
    np.testing.assert_allclose(chosen, ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    top = np.array([[v for _, v in g["top"]] for g in got])
    np.testing.assert_allclose(top, -np.sort(-ref[:-1], axis=-1)[:, :20], atol=1e-4)


TOKENIZER_STRINGS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnewlines  ",
    "Ünïcödé — 你好, мир! 🙂 naïve café",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "1234567890 3.14159 1e-5",
]


def _same_tokenizer(ours, ref):
    for s in TOKENIZER_STRINGS:
        a, b = ours(s)["input_ids"], ref(s)["input_ids"]
        assert a == b, s
        assert ours.decode(a) == ref.decode(b), s
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
    ]
    for msgs in (messages, messages[1:2]):
        a = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        b = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert a == b
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


def test_smollm2_tokenizer_matches_transformers(smollm2, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    path = Path(smollm2.source_path)
    with quiet():
        ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert ref.chat_template and "<|im_start|>" in ref.chat_template
    reader = open_gguf(path)
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))  # an empty cache: converted here
    _same_tokenizer(load_gguf_tokenizer(path, reader), ref)  # first load: converted by transformers
    assert list((tmp_path / "tokenizers").iterdir())  # and stored
    _same_tokenizer(load_gguf_tokenizer(path, reader), ref)  # second: from the jaxspec cache
    _same_tokenizer(smollm2.tokenizer, ref)  # the suite's (from the kept cache, when warm)
    _same_tokenizer(tokenizer_from_metadata(reader), ref)  # the torch-free path
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    assert im_end in smollm2.eos_token_ids and ref.eos_token_id in smollm2.eos_token_ids


def greedy(m, ids: list[int], max_new: int) -> list[int]:
    """Plain greedy decoding, one token per forward, prompt included (a test oracle, not the
    engine: a single compiled shape)."""
    assert len(ids) + max_new <= SMOLLM2_CAPACITY
    cache = m.init_cache(1, SMOLLM2_CAPACITY)
    one = jnp.ones((1,), jnp.int32)
    for token in ids[:-1]:
        _, cache = _forward(m.params, jnp.asarray([[token]], jnp.int32), cache, m.cfg)
        cache = cache.commit(one)
    out, token = [], ids[-1]
    for _ in range(max_new):
        logits, cache = _forward(m.params, jnp.asarray([[token]], jnp.int32), cache, m.cfg)
        cache = cache.commit(one)
        token = int(jnp.argmax(logits[0, -1]))
        out.append(token)
        if token in m.eos_token_ids:
            break
    return out


GREEDY_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


@pytest.fixture(scope="session")
def hf_greedy(smollm2, smollm2_hf):
    """transformers `generate(do_sample=False, max_new_tokens=64)`, memoised per prompt."""
    memo = {}

    def run(question: str) -> tuple[list[int], list[int]]:
        if question not in memo:
            ids = chat_ids(smollm2.tokenizer, question)
            with torch.no_grad(), quiet():
                out = smollm2_hf.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=64,
                    pad_token_id=smollm2.tokenizer.pad_token_id,
                )
            memo[question] = ids, out[0, len(ids) :].tolist()
        return memo[question]

    return run


# The token-by-token oracle (the model without the engine) on one prompt: every prompt's 64
# tokens against transformers are the engine test's below, and the model's full and incremental
# logits are test_smollm2_logits_match_transformers'.
@pytest.mark.parametrize("question", GREEDY_PROMPTS[:1])
def test_smollm2_greedy_matches_transformers_generate(smollm2, hf_greedy, question):
    ids, ref = hf_greedy(question)
    ours = greedy(smollm2, ids, 64)
    print(repr(smollm2.tokenizer.decode(ours)))
    assert ours == ref


def test_smollm2_engine_greedy_matches_transformers_generate(smollm2, hf_greedy):
    """The library's own jitted loop (plain decoding), same prompts, same references."""
    from jaxspec.engine.runner import Engine

    refs = [hf_greedy(q) for q in GREEDY_PROMPTS]
    results = Engine(smollm2).generate([ids for ids, _ in refs], max_new_tokens=64)
    for (_, ref), result in zip(refs, results):
        assert result.token_ids == ref


def test_parity_check_catches_rope_scaling_and_qk_layout_mistakes(tiny_llama_dir):
    """The tolerance above is tight enough to see the mistakes a loader can make."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from jaxspec.loading.gguf_file import permute_qk

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    m = load_model(tiny_llama_dir, layout="unrolled")  # this test edits the weights
    tokens = np.random.default_rng(3).integers(0, m.cfg.vocab_size, (1, 40))
    ref = hf_logits(hf, tokens)
    assert rel_err(full_logits(m, tokens), ref) < TOL

    no_scaling = dataclasses.replace(m, cfg=dataclasses.replace(m.cfg, rope_scaling=None))
    assert rel_err(full_logits(no_scaling, tokens), ref) > 100 * TOL

    layers = tuple(
        lp | {"wq": jnp.asarray(permute_qk(np.asarray(lp["wq"]), m.cfg.num_heads))}
        for lp in m.params["layers"]
    )
    interleaved = dataclasses.replace(m, params=m.params | {"layers": layers})
    assert rel_err(full_logits(interleaved, tokens), ref) > 100 * TOL
