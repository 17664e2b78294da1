"""The non-Llama families and sliding-window attention against transformers.

Per family (Gemma 2, Gemma 3, Phi-3, and Mistral / Qwen2 for the Llama family's window) a tiny
random checkpoint is built with transformers inside the test, float32, with a sliding window
(6 tokens) far shorter than the prompts (20): logits of a prefill and of a token-by-token decode
equal transformers' within 1e-4 in every layout, and 32 greedy tokens equal transformers' own
`generate`. Two broken variants must fail the same comparison: Gemma without its sliding-window
mask, and Gemma's RMS norm scaling by w instead of (1 + w). The real Gemma 3 270M GGUF runs end to
end against transformers' own load of the same file, recorded (scripts/gemma3_270m_reference.py).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import import_torch
from jaxspec.errors import JaxspecError
from jaxspec.loading import load_model
from jaxspec.loading.registry import find_packaged_file, short_names
from jaxspec.models import blocks, gemma

WINDOW = 6
PROMPT = 20
VOCAB = 96
FAMILIES = ("gemma3", "gemma2", "phi3", "mistral", "qwen2")


def hf_model(kind: str, seed: int = 0):
    """A tiny random transformers model of `kind` with a sliding window of WINDOW tokens, its
    norm weights drawn around their neutral value (so (1 + w) versus w shows)."""
    torch = import_torch()
    import transformers as tr

    torch.manual_seed(seed)
    dims = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                pad_token_id=0, bos_token_id=2, eos_token_id=1)
    if kind == "gemma3":
        cfg = tr.Gemma3TextConfig(
            **dims, head_dim=16, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 100000.0}})
        model = tr.Gemma3ForCausalLM(cfg)
    elif kind == "gemma2":
        cfg = tr.Gemma2Config(**dims, head_dim=16, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        model = tr.Gemma2ForCausalLM(cfg)
    elif kind == "phi3":
        model = tr.Phi3ForCausalLM(tr.Phi3Config(**dims))
    elif kind == "mistral":
        model = tr.MistralForCausalLM(tr.MistralConfig(**dims))
    else:  # Qwen2: layers from max_window_layers on slide
        model = tr.Qwen2ForCausalLM(tr.Qwen2Config(**dims, use_sliding_window=True,
                                                   max_window_layers=1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if kind.startswith("gemma") else 1.0) + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    model.set_attn_implementation("eager")  # the reference computes attention plainly
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (transformers model, its save_pretrained directory)."""
    out = {}
    for kind in FAMILIES:
        model = hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = (model, path)
    return out


@pytest.fixture(scope="module")
def prompt_ids():
    return np.random.default_rng(0).integers(3, VOCAB, size=(2, PROMPT)).astype(np.int32)


def hf_logits(model, ids) -> np.ndarray:
    torch = import_torch()
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def our_logits(target, params, ids, *, incremental: bool) -> np.ndarray:
    """One prefill over all of `ids`, or 3 tokens then one token per call (decode past the window)."""
    b, t = ids.shape
    cache = target.init_cache(params, b, 32)
    step = jax.jit(lambda p, x, c: target.forward(p, x, c))
    if not incremental:
        return np.asarray(target.logits(params, step(params, jnp.asarray(ids), cache).hidden))
    outs, pos = [], 0
    for size in (3, *([1] * (t - 3))):
        out = step(params, jnp.asarray(ids[:, pos : pos + size]), cache)
        cache = out.cache.with_lengths(cache.lengths + size)
        outs.append(np.asarray(target.logits(params, out.hidden)))
        pos += size
    return np.concatenate(outs, axis=1)


LAYOUTS = [(k, layout) for k in FAMILIES for layout in ("unrolled", "stacked", "packed")
           if k in ("gemma3", "mistral") or layout == "unrolled"]


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_logits_match_transformers_past_the_window(checkpoints, prompt_ids, kind, layout):
    if layout == "packed":
        from jaxspec import kernels

        if not kernels.available():
            pytest.skip("the packed layout needs the CPU kernels")
    model, path = checkpoints[kind]
    loaded = load_model(path, layout=layout)
    assert loaded.target.name == kind and loaded.layout == layout
    ref = hf_logits(model, prompt_ids)
    for incremental in (False, True):
        ours = our_logits(loaded.target, loaded.params, prompt_ids, incremental=incremental)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def greedy(target, params, prompt: list[int], steps: int) -> list[int]:
    cache = target.init_cache(params, 1, len(prompt) + steps + 1)
    step = jax.jit(lambda p, x, c: target.forward(p, x, c))
    out = step(params, jnp.asarray([prompt]), cache)
    cache = out.cache.with_lengths(cache.lengths + len(prompt))
    tokens = [int(jnp.argmax(target.logits(params, out.hidden[:, -1])))]
    while len(tokens) < steps:
        out = step(params, jnp.asarray([[tokens[-1]]]), cache)
        cache = out.cache.with_lengths(cache.lengths + 1)
        tokens.append(int(jnp.argmax(target.logits(params, out.hidden[:, -1]))))
    return tokens


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' own generate (its sliding-window cache), EOS disabled."""
    torch = import_torch()
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=steps, min_length=0, do_sample=False, pad_token_id=0)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # an unset field would fall back to it
    gen.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=gen)
    model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_32_tokens_equal_transformers(checkpoints, prompt_ids, kind):
    model, path = checkpoints[kind]
    loaded = load_model(path)
    prompt = prompt_ids[0, :10].tolist()
    assert greedy(loaded.target, loaded.params, prompt, 32) == hf_greedy(model, prompt, 32)


# --------------------------------------------------------------------- broken variants must fail


def broken(variant: str, monkeypatch, loaded):
    """(target, params) with one Gemma ingredient removed."""
    import dataclasses

    target = loaded.target
    if variant == "no_sliding_mask":  # every layer global
        cfg = dataclasses.replace(target.cfg, sliding_layers=(False,) * target.cfg.num_layers)
        target = dataclasses.replace(target, cfg=cfg)
    elif variant == "norm_w_not_1_plus_w":
        rms = blocks.rms_norm
        monkeypatch.setattr(blocks, "rms_norm", lambda x, w, eps, offset=0.0: rms(x, w, eps))
    return target, loaded.params


@pytest.mark.patches_traced_code
@pytest.mark.parametrize("variant", ["correct", "no_sliding_mask", "norm_w_not_1_plus_w"])
def test_broken_gemma_variants_fail(checkpoints, prompt_ids, monkeypatch, variant):
    model, path = checkpoints["gemma3"]
    target, params = broken(variant, monkeypatch, load_model(path))
    error = np.abs(our_logits(target, params, prompt_ids, incremental=False)
                   - hf_logits(model, prompt_ids)).max()
    if variant == "correct":
        assert error < 1e-4
    else:
        assert error > 1e-2, f"{variant} should not match transformers (max error {error})"


def test_sliding_window_boundary():
    """q - window < k <= q: the query and the window - 1 keys before it (HF's convention)."""
    vis = blocks.sliding_window_visible(jnp.array([10]), jnp.arange(12), 4)[0]
    assert np.flatnonzero(np.asarray(vis)).tolist() == [7, 8, 9, 10]


# ---------------------------------------------------------------------------------- loading


def _gguf_bytes(arch: str) -> bytes:
    """A GGUF header: general.architecture, then a vocabulary array cut off mid-way (parsing it
    would fail as an unreadable file, not as the architecture)."""
    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    kv = s("general.architecture") + struct.pack("<I", 8) + s(arch)
    kv += s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 10**6) + s("a")
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv


def test_unsupported_gguf_refused_before_its_vocabulary(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf_bytes("falcon"))
    with pytest.raises(JaxspecError, match=r"architecture 'falcon' is not supported.*gemma3") as e:
        load_model(path)
    assert "\n" not in str(e.value)


def test_unsupported_model_type_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "falcon"}')
    with pytest.raises(JaxspecError, match=r"model_type 'falcon' is not supported.*gemma2"):
        load_model(tmp_path)


# ------------------------------------------------------------------------- Gemma 3 270M (real)

GEMMA = short_names()["gemma3-270m"]


@pytest.fixture(scope="module")
def gemma3_270m():
    if find_packaged_file(GEMMA) is None:
        pytest.skip(f"Gemma 3 270M is not installed: {GEMMA.install_hint}")
    start = time.perf_counter()
    loaded = load_model("gemma3-270m", layout="auto")
    return loaded, time.perf_counter() - start


def test_gemma3_270m_config(gemma3_270m):
    loaded, _ = gemma3_270m
    cfg = loaded.cfg
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("gemma3", 18, 640, 262144)
    assert cfg.sliding_window == 512 and sum(cfg.sliding_layers) == 15
    assert [i for i, s in enumerate(cfg.sliding_layers) if not s] == [5, 11, 17]
    assert loaded.eos_token_ids[0] == 1


GEMMA_REFERENCE = Path(__file__).parent / "data" / "reference" / "gemma3_270m_greedy.json"


def test_gemma3_270m_greedy_equals_transformers(gemma3_270m):
    """jaxspec's greedy tokens at batch 3 == transformers' own load and `generate` of the same
    GGUF file, as recorded by scripts/gemma3_270m_reference.py (transformers' load of the 262k
    vocabulary took ~70 s a run; the live transformers comparisons of this family run on tiny
    checkpoints above and in test_gemma_gguf.py). The record answers for one file: its name, size
    and sha256 must be the loaded file's, and its prompt ids the tokenizer's."""
    import hashlib

    from jaxspec.engine.runner import Engine

    loaded, _ = gemma3_270m
    reference = json.loads(GEMMA_REFERENCE.read_text())
    path = Path(loaded.source_path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    identity = {"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}
    assert identity == reference["checkpoint"], "rerun scripts/gemma3_270m_reference.py"
    rows = reference["rows"]
    prompts = [loaded.tokenizer(row["prompt"])["input_ids"] for row in rows]
    assert prompts == [row["prompt_ids"] for row in rows]
    engine = Engine(dataclasses.replace(loaded, eos_token_ids=()), chat_template=False)
    ours = [r.token_ids for r in engine.generate(prompts, max_new_tokens=reference["new_tokens"],
                                                  batch_size=3)]
    assert ours == [row["greedy"] for row in rows]


# ------------------------------------------------------- speculation on Gemma 3: greedy identity

ENGINE_NEW = 32


@pytest.fixture(scope="module")
def gemma_engine_model(checkpoints):
    """The tiny Gemma 3 in the layout the CLI loads ("auto": packed CPU kernels where they build)."""
    return load_model(checkpoints["gemma3"][1], layout="auto")


@pytest.fixture(scope="module")
def engine_prompts():
    rng = np.random.default_rng(1)
    out = []
    for n in (9, 14, 4, 11):  # a repeated motif, so prompt lookup finds matches; most past WINDOW
        motif = [int(t) for t in rng.integers(3, VOCAB, size=3)]
        out.append(([int(t) for t in rng.integers(3, VOCAB, size=n // 2)] + motif * 4)[:n])
    return out


@pytest.fixture(scope="module")
def gemma_plain(gemma_engine_model, engine_prompts):
    from jaxspec.engine.runner import Engine

    engine = Engine(gemma_engine_model)
    return [engine.generate([p], max_new_tokens=ENGINE_NEW)[0].token_ids for p in engine_prompts]


def _drafter(name: str, model):
    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.train import methods

    d2t = np.arange(0, VOCAB, 2, dtype=np.int32)  # a reduced draft vocabulary
    if name == "ngram":
        return NgramDrafter(VOCAB, 1, 3), None, 4
    if name == "ngram_tree":
        return NgramDrafter(vocab_size=VOCAB, min_ngram=1, max_ngram=3, branches=3, depth=3), None, 1
    m = {"eagle3": methods.Eagle3(hidden_layers=(1, 2, 3)),
         "eagle_tree": methods.Eagle(hidden_layers=(1, 2, 3), input_scale=1.0)}[name]
    params, frozen = m.init(model, d2t, jax.random.key(7))
    drafter = m.drafter(model.target)
    if name == "eagle_tree":
        import dataclasses

        drafter = dataclasses.replace(drafter, tree_top_k=3, tree_levels=3, tree_budget=8)
        return drafter, m.runtime(params, frozen), 1
    return drafter, m.runtime(params, frozen), 4


@pytest.mark.parametrize("name", ["ngram", "eagle3", "ngram_tree", "eagle_tree"])
def test_gemma3_greedy_speculation_is_token_identical(gemma_engine_model, engine_prompts,
                                                      gemma_plain, name):
    from jaxspec.engine.runner import Engine

    drafter, dparams, gamma = _drafter(name, gemma_engine_model)
    engine = Engine(gemma_engine_model, drafter, dparams, num_speculative_tokens=gamma)
    out = engine.generate(engine_prompts, max_new_tokens=ENGINE_NEW, batch_size=2)
    assert [r.token_ids for r in out] == gemma_plain
    if name.startswith("ngram"):  # the motif prompts: drafts get accepted
        assert sum(r.metrics["num_accepted_tokens"] for r in out) > 0


@pytest.fixture(scope="module")
def gemma_varied_model():
    """A tiny Gemma 3 (local, global, local, global; window 6) whose greedy output varies: its
    embeddings small against the post-normed sublayers, so the tied head does not just repeat the
    last token (the transformers-built one above does, from its embeddings scaled by sqrt(d))."""
    from jaxspec.models import base

    cfg = gemma.GemmaConfig(
        family="gemma3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        sliding_layers=(True, False, True, False), rope_local_theta=10000.0, rope_theta=1e5,
        max_position_embeddings=128)
    params = gemma.init_params(cfg, jax.random.key(5), scale=0.1)
    params["embed"] = params["embed"] * 0.1
    return base.Model(target=gemma.GemmaTarget(cfg), params=params, eos_token_ids=(-1,))


@pytest.fixture(scope="module")
def gemma_varied_plain(gemma_varied_model, engine_prompts):
    from jaxspec.engine.runner import Engine

    engine = Engine(gemma_varied_model)
    out = [engine.generate([p], max_new_tokens=ENGINE_NEW)[0].token_ids for p in engine_prompts]
    assert all(len(set(t)) > 4 for t in out)  # not a repeated token: drafts can be rejected
    return out


def _model_drafter(name: str, model):
    """Layer skip (the target's first 3 of 4 layers) or a draft model with the target's own
    weights (its own network, params and cache); `draft_model_no_window`: that draft with every
    layer global (no sliding-window mask, the global RoPE base)."""
    from jaxspec.drafters.draft_model import ModelDrafter, layer_skip_drafter

    if name == "layer_skip":
        return layer_skip_drafter(model.target, 3), None
    draft = model.target
    if name == "draft_model_no_window":
        no_window = dataclasses.replace(draft.cfg, sliding_layers=(False,) * 4)
        draft = dataclasses.replace(draft, cfg=no_window)
    return ModelDrafter(model=draft, target_vocab=VOCAB), model.params


@pytest.mark.parametrize("name", ["layer_skip", "draft_model", "draft_model_no_window"])
def test_gemma3_layer_skip_and_draft_model(gemma_varied_model, engine_prompts, gemma_varied_plain,
                                           name):
    """Both model drafters run on a Gemma 3 target (sliding-window local layers, outputs past the
    window) token-identical to plain. A draft that is the target itself proposes the target's own
    greedy tokens, so (nearly) every draft is accepted; the same draft without its window is not:
    the draft path honours the family's local layers."""
    from jaxspec.engine.runner import Engine

    drafter, dparams = _model_drafter(name, gemma_varied_model)
    engine = Engine(gemma_varied_model, drafter, dparams, num_speculative_tokens=3)
    out = engine.generate(engine_prompts, max_new_tokens=ENGINE_NEW, batch_size=2)
    assert [r.token_ids for r in out] == gemma_varied_plain
    drafted = sum(r.metrics["num_draft_tokens"] for r in out)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in out)
    if name == "draft_model":
        assert accepted >= 0.95 * drafted > 0
    elif name == "draft_model_no_window":
        assert accepted < 0.8 * drafted
    else:
        assert drafted > 0


# ------------------------------------------------- sampled output has the exact law (Gemma 3)

LAW_V = 8
LAW_PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 6, 1, 7, 0]  # prompt lookup matches on most steps


@pytest.fixture(scope="module")
def gemma_law_model():
    """A 2-layer Gemma 3 of vocabulary 8 whose first layer slides over 3 tokens (the prompt is
    14): flat enough at temperature 0.6 that drafts are both accepted and rejected."""
    from jaxspec.models import base

    cfg = gemma.GemmaConfig(
        family="gemma3", vocab_size=LAW_V, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=3,
        sliding_layers=(True, False), rope_local_theta=10000.0, rope_theta=1e6,
        max_position_embeddings=64)
    params = gemma.init_params(cfg, jax.random.key(5), scale=0.3)
    params["embed"] = params["embed"] * 0.3  # tied head: next-token maxima ~0.25-0.45 at T = 0.6
    return base.Model(target=gemma.GemmaTarget(cfg), params=params, eos_token_ids=(-1,))


@dataclasses.dataclass(frozen=True)
class MisreportedQ:
    """Broken: the inner drafter's tokens with q mixed with the uniform law."""

    inner: object

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, dparams, tparams, state, ctx, num_tokens, sp, keys):
        proposal, state = self.inner.propose(dparams, tparams, state, ctx, num_tokens, sp, keys)
        return proposal._replace(probs=0.5 * proposal.probs + 0.5 / proposal.probs.shape[-1]), state


@pytest.mark.parametrize("broken_q", [False, True])
def test_gemma3_sampled_speculation_has_the_target_law(gemma_law_model, broken_q):
    from distribution import FAIL_P, PASS_P, pvalue

    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.decode.sampling import SamplingParams

    drafter = NgramDrafter(LAW_V, 1, 2)
    sp = SamplingParams.make(temperature=0.6, top_k=6, top_p=0.95, min_p=0.05)
    if broken_q:
        p, _ = pvalue(gemma_law_model, MisreportedQ(drafter), None, sp, LAW_PROMPT, rows=6000,
                      gamma=3)
        assert p < FAIL_P
        return
    p, results = pvalue(gemma_law_model, drafter, None, sp, LAW_PROMPT, rows=8000, gamma=3)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    assert 0.03 * drafted < accepted < 0.95 * drafted
    assert p > PASS_P


# ------------------------------------------------------------------------ mesh (1, 2) = one device


def test_qwen3_and_gemma3_on_a_1x2_mesh_equal_one_device():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    proc = subprocess.run([sys.executable, "tests/families_mesh_check.py"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == {"qwen3/plain", "gemma3/ngram"}
    for name, result in out.items():
        assert result["equal"], name
        assert result["wq_shard"] == [32, 64], name  # whole heads per device: 2 of 4 on each
