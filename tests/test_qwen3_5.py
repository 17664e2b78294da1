"""Qwen3.5 (hybrid: Gated DeltaNet linear layers and gated full attention) against transformers,
and speculation that rolls the linear layers' recurrent state back exactly.

A tiny random `Qwen3_5ForCausalLM` (three linear layers, one full) is written with
`save_pretrained` inside the test, float32: logits of a prefill and of a token-by-token decode
equal transformers' within 2e-4, and 24 greedy tokens equal transformers' own `generate`. The
published multimodal layout (`text_config`, `model.language_model.`, vision tower and `mtp.*`
beside it) loads the same text model.

Speculation (models/hybrid_cache.py: a ring of states per linear layer, indexed by length): greedy
speculative == greedy plain for an n-gram chain, a draft model that is a perturbed copy of the
target (chain, dynamic tree and adaptive speculation, batch 4 with rows accepting different
lengths) and layer skip (the target's own first layers, its own state ring); a broken commit
that keeps the state of the last drafted position whatever was accepted fails the exact sampled
law that the real commit passes (a perturbed-copy draft model, about half its drafts accepted).
A Qwen3.5 checkpoint served by the scheduler (the paged cache: the rings in the rows' slots
beside the pages, tests/test_hybrid_serving.py) gives the engine's greedy tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import import_torch
from jaxspec.errors import JaxspecError
from jaxspec.loading import load_model
from jaxspec.models import base, hybrid_cache, qwen3_5

VOCAB = 96
PROMPT = 20
NEW = 24
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def hf_model(seed: int = 0, vocab: int = VOCAB):
    """A tiny random transformers Qwen3.5 with its norms drawn around their neutral values."""
    torch = import_torch()
    import transformers as tr

    torch.manual_seed(seed)
    cfg = tr.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, layer_types=LAYER_TYPES, pad_token_id=0, bos_token_id=2,
        eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})
    model = tr.Qwen3_5ForCausalLM(cfg)
    randomize(model, 0.3)
    model.set_attn_implementation("eager")
    return model.eval()


def randomize(module, scale: float) -> None:
    """Weights of a tiny transformers Qwen3.5-family module (every test checkpoint's builder):
    (1 + w) norms around 0, the gated norm's w around 1, dt_bias ~ N(0, 1), A_log as built,
    the embedding at 0.3 and the rest at `scale`."""
    torch = import_torch()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                continue
            if "norm" in name:
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.3 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            else:  # weaker than the embedding: greedy output repeats at times
                p.normal_(0.0, 0.3 if "embed" in name else scale)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = hf_model()
    path = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint[1], layout="auto")


@pytest.fixture(scope="module")
def model(loaded):
    """The loaded target with EOS off (transformers' generate below runs without one)."""
    return base.Model(target=loaded.target, params=loaded.params, eos_token_ids=(-1,))


@pytest.fixture(scope="module")
def prompt_ids():
    return np.random.default_rng(0).integers(3, VOCAB, size=(2, PROMPT)).astype(np.int32)


def hf_logits(model, ids) -> np.ndarray:
    torch = import_torch()
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def our_logits(target, params, ids, *, incremental: bool) -> np.ndarray:
    """One prefill over all of `ids`, or 3 tokens then one token per call."""
    b, t = ids.shape
    cache = target.init_cache(params, b, 32)
    step = jax.jit(lambda p, x, c: target.forward(p, x, c))
    sizes = (3, *([1] * (t - 3))) if incremental else (t,)
    outs, pos = [], 0
    for size in sizes:
        out = step(params, jnp.asarray(ids[:, pos : pos + size]), cache)
        cache = out.cache.with_lengths(cache.lengths + size)
        outs.append(np.asarray(target.logits(params, out.hidden)))
        pos += size
    return np.concatenate(outs, axis=1)


def test_logits_match_transformers(checkpoint, loaded, prompt_ids):
    model, _ = checkpoint
    assert loaded.target.name == "qwen3_5" and loaded.layout == "unrolled"
    ref = hf_logits(model, prompt_ids)
    for incremental in (False, True):
        ours = our_logits(loaded.target, loaded.params, prompt_ids, incremental=incremental)
        np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)


def test_the_multimodal_layout_loads_its_text_model(checkpoint, loaded, prompt_ids, tmp_path):
    """The published layout: model_type qwen3_5 with a `text_config`, the text model under
    `model.language_model.`, a vision tower and the native MTP head (`mtp.*`) beside it: the
    text model loads (the others skipped) and computes what the plain checkpoint does."""
    import json

    from safetensors.numpy import load_file, save_file

    _, path = checkpoint
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(path / "model.safetensors").items()}
    tensors |= {"mtp.fc.weight": np.zeros((64, 128), np.float32),
                "model.visual.patch_embed.proj.weight": np.zeros((8, 3), np.float32)}
    save_file(tensors, tmp_path / "model.safetensors")
    text = json.loads((path / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    multimodal = load_model(tmp_path)
    ids = jnp.asarray(prompt_ids)
    run = lambda m: m.target.logits(  # noqa: E731
        m.params, m.target.forward(m.params, ids, m.init_cache(2, 32)).hidden)
    np.testing.assert_array_equal(np.asarray(run(multimodal)), np.asarray(run(loaded)))


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    torch = import_torch()
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=steps, min_length=0, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=gen)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def prompts():
    """Mixed lengths, each with a repeated motif (prompt lookup finds matches)."""
    rng = np.random.default_rng(1)
    out = []
    for n in (9, 14, 4, 11):
        motif = [int(t) for t in rng.integers(3, VOCAB, size=3)]
        out.append(([int(t) for t in rng.integers(3, VOCAB, size=n // 2)] + motif * 4)[:n])
    return out


@pytest.fixture(scope="module")
def plain(model, prompts):
    from jaxspec.engine.runner import Engine

    out = Engine(model).generate(prompts, max_new_tokens=NEW, batch_size=4)
    tokens = [r.token_ids for r in out]
    assert all(len(set(t)) > 6 for t in tokens)  # varied output: drafts can be rejected
    return tokens


def test_greedy_24_tokens_equal_transformers(checkpoint, prompts, plain):
    """The engine's plain greedy rows (batch 4, right-padded prompts of 4..14 tokens: the padded
    prefill keeps each row's state at its own length) equal transformers' generate per row."""
    model, _ = checkpoint
    for prompt, ours in zip(prompts, plain):
        assert ours == hf_greedy(model, prompt, NEW)


# ---------------------------------------------------------------- speculation: exact rollback


@dataclasses.dataclass(frozen=True)
class LastDraftStateKept(qwen3_5.Qwen35Target):
    """Broken: the commit writes the state after the last drafted entry at every accepted
    length, so a rejected draft's update stays in the recurrent state."""

    def commit_window(self, cache, window_kv, path, positions):
        k, v, ssm, conv = window_kv
        last = lambda w: jnp.broadcast_to(w[:, -1:], w.shape)  # noqa: E731
        return super().commit_window(
            cache, (k, v, tuple(map(last, ssm)), tuple(map(last, conv))), path, positions)


def _perturbed(params, scale: float = 0.003):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    return jax.tree.unflatten(treedef, [w + scale * jax.random.normal(k, w.shape, w.dtype)
                                        for w, k in zip(leaves, keys)])


def _drafter(name: str, model):
    from jaxspec.drafters.draft_model import ModelDrafter, layer_skip_drafter
    from jaxspec.drafters.prompt_lookup import NgramDrafter

    if name == "ngram":
        return NgramDrafter(VOCAB, 1, 3), None, 4
    if name == "layer_skip":  # the target's first 3 layers (linear, linear, full)
        return layer_skip_drafter(model.target, 3), None, 3
    draft = ModelDrafter(model=model.target, target_vocab=VOCAB)
    if name == "draft_model_tree":
        draft = dataclasses.replace(draft, tree_top_k=3, tree_levels=3, tree_budget=8)
        return draft, _perturbed(model.params), 1
    return draft, _perturbed(model.params), 3


@pytest.mark.parametrize("name", ["ngram", "draft_model", "draft_model_tree", "layer_skip",
                                  "adaptive"])
def test_greedy_speculation_is_token_identical(model, prompts, plain, name):
    """`adaptive`: the draft model under adaptive speculation, whose one-token steps write the
    state ring inside the forward and whose drafted steps commit 1..3 nodes."""
    from jaxspec.config import AdaptiveConfig
    from jaxspec.engine.runner import Engine

    drafter, dparams, gamma = _drafter("draft_model" if name == "adaptive" else name, model)
    adaptive = None
    if name == "adaptive":
        adaptive = AdaptiveConfig(enabled=True, step_costs=[1.0, 1.2, 1.4, 1.6], draft_cost=0.0,
                                  probe_every=4, decay=0.5)
    engine = Engine(model, drafter, dparams, num_speculative_tokens=gamma, adaptive=adaptive)
    out = engine.generate(prompts, max_new_tokens=NEW, batch_size=4)
    assert [r.token_ids for r in out] == plain
    if name == "adaptive":  # plain and drafted steps both taken
        hist = np.sum([r.metrics["adaptive_gamma_hist"] for r in out], axis=0)
        assert hist[0] > 0 and hist[1:].sum() > 0
    accepted = [r.metrics["num_accepted_tokens"] for r in out]
    drafted = sum(r.metrics["num_draft_tokens"] for r in out)
    if name == "draft_model":  # drafts both accepted and rejected, rows at different lengths
        assert 0 < sum(accepted) < 0.9 * drafted and len(set(accepted)) > 1
    elif name in ("draft_model_tree", "layer_skip"):
        assert sum(accepted) > 0


# ------------------------------------------------------------------ the exact sampled law

LAW_V = 8
LAW_PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 6, 1, 7, 0]


@pytest.fixture(scope="module")
def law_model():
    """A 2-layer Qwen3.5 (linear, full) of vocabulary 8; its perturbed copy drafts (about half
    of the drafts accepted at temperature 0.6)."""
    cfg = qwen3_5.Qwen35Config(
        vocab_size=LAW_V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=16, layer_types=("linear_attention", "full_attention"),
        linear_key_heads=1, linear_value_heads=2, linear_key_dim=8, linear_value_dim=8,
        rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=64)
    params = qwen3_5.init_params(cfg, jax.random.key(5), scale=0.3)
    return cfg, params


@pytest.mark.parametrize("broken_commit", [False, True])
def test_sampled_speculation_has_the_target_law(law_model, broken_commit):
    from distribution import FAIL_P, PASS_P, pvalue

    from jaxspec.decode.sampling import SamplingParams
    from jaxspec.drafters.draft_model import ModelDrafter

    cfg, params = law_model
    target = LastDraftStateKept(cfg) if broken_commit else qwen3_5.Qwen35Target(cfg)
    model = base.Model(target=target, params=params, eos_token_ids=(-1,))
    sp = SamplingParams.make(temperature=0.6)
    drafter = ModelDrafter(model=qwen3_5.Qwen35Target(cfg), target_vocab=LAW_V)
    p, results = pvalue(model, drafter, _perturbed(params, 0.02), sp, LAW_PROMPT, rows=3000,
                        gamma=3)
    if broken_commit:
        assert p < FAIL_P
        return
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    assert 0.2 * drafted < accepted < 0.8 * drafted
    assert p > PASS_P


def test_served_greedy_equals_the_engine(model, prompts, plain):
    """The scheduler (2 slots for 4 requests: slots reused) streams the engine's greedy rows."""
    from jaxspec.engine.runner import Engine
    from jaxspec.serving import Sampling
    from jaxspec.serving.scheduler import Scheduler
    from test_serving import run

    engine = Engine(model, max_context=64)
    sched = Scheduler(engine, slots=2, max_context=64, steps_per_call=4)
    done = run(sched, [(i, p, Sampling(max_tokens=NEW)) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in done] == plain


# ------------------------------------------------------------------------------- bad input


def test_native_mtp_head_without_its_tensors_refused(tmp_path, checkpoint, loaded):
    """method 'mtp' on a Qwen3.5 directory that declares an MTP layer but holds no `mtp.*`
    tensors: refused in one line naming them (tests/test_qwen3_5_mtp.py: the head itself)."""
    import json
    import shutil

    from jaxspec.formats import load_drafter_checkpoint

    _, path = checkpoint
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((path / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(JaxspecError, match=r"\(mtp\.\*\): missing tensors") as err:
        load_drafter_checkpoint("mtp", tmp_path, loaded)
    assert "\n" not in str(err.value)


def _config(tmp_path, **changes):
    import json

    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, layer_types=LAYER_TYPES).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg | changes))
    return tmp_path


@pytest.mark.parametrize("changes,words", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention",
                      "linear_attention"]}, "implements linear_attention, full_attention"),
    ({"num_experts": 8, "moe_intermediate_size": 32}, "says model_type qwen3_5_moe_text"),
])
def test_unsupported_variants_refused_before_loading(tmp_path, changes, words):
    with pytest.raises(JaxspecError, match=words) as err:  # no tensors written: none are read
        load_model(_config(tmp_path, **changes))
    assert "\n" not in str(err.value)


def test_layouts_other_than_unrolled_refused(checkpoint):
    with pytest.raises(JaxspecError, match="use layout 'unrolled' or 'auto'"):
        load_model(checkpoint[1], layout="stacked")


def test_ring_rollback_reads_the_state_at_the_length():
    """The ring slot of length l is l mod R: a commit of P < R entries never touches the slot
    of the length before it."""
    ring = jnp.zeros((1, 4, 2))
    ring = hybrid_cache.write_states(ring, jnp.ones((1, 3, 2)) * jnp.arange(1, 4)[None, :, None],
                                     jnp.asarray([[5, 6, 7]]))
    read = [float(hybrid_cache.read_state(ring, jnp.asarray([n]))[0, 0]) for n in (4, 5, 7)]
    assert read == [0, 1, 3]


# ------------------------------------------- jaxspec.train's recipes on the hybrid target

TRAIN_ARGS = {  # taps 1, 2, 3: the outputs of layers 0 and 1 (linear) and 2 (full attention)
    "eagle3": {"hidden_layers": (1, 2, 3), "ttt_steps": 2},
    "dflash": {"hidden_layers": (1, 2, 3), "block_size": 4, "num_layers": 1,
               "intermediate_size": 64, "anchors": 6},
}


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_trained_head_on_the_hybrid_target_is_lossless(tmp_path, model, prompts, plain, method):
    """EAGLE-3 and DFlash trained by `jaxspec.train` on the transformers-written Qwen3.5 (its own
    greedy continuations of these prompts and others, features tapped after linear and attention
    layers alike): the loss falls, and the trained head drafts for the target (some drafts
    accepted) with greedy output equal to plain."""
    from jaxspec.engine.runner import Engine
    from jaxspec.train.data import DataConfig, generate_records
    from jaxspec.train.train import TrainConfig, train

    rng = np.random.default_rng(3)
    train_prompts = list(prompts) * 2 + [list(map(int, rng.integers(3, VOCAB, size=int(n))))
                                         for n in rng.integers(4, 10, 8)]
    records = generate_records(model, train_prompts,
                               DataConfig(layers=(1, 2, 3), top_k=4, gen_steps=16), np.asarray([-1]))
    tc = TrainConfig(method=method, ckpt_dir=str(tmp_path / "ckpt"), steps=30, batch_size=4,
                     seq_len=24, lr=1e-2, warmup=2, save_every=0, draft_vocab=VOCAB,
                     method_args=TRAIN_ARGS[method])
    out = train(tc, target=model, data=records, eval_prompts=[], log=lambda *a: None,
                progress=False)
    losses = [h["loss"] for h in out.history]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    dparams = out.method.runtime(out.params, out.frozen)
    engine = Engine(model, out.drafter, dparams, num_speculative_tokens=3)
    res = engine.generate(prompts, max_new_tokens=NEW, batch_size=4)
    assert [r.token_ids for r in res] == plain
    assert sum(r.metrics["num_accepted_tokens"] for r in res) > 0  # the head's drafts were used
