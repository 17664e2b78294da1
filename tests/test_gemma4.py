"""Gemma 4 text (`models/gemma4.py`) against transformers.

One tiny random checkpoint written by transformers' `save_pretrained` inside the test, with every
Gemma 4 ingredient on: 5 layers (local, global, local, local, global; window 6, prompts 20),
global layers with their own head dim (32 vs 16) and kv heads (1 vs 2), proportional RoPE on a
quarter of the global dims, values equal to keys on global layers, the last two layers sharing
the k/v of earlier ones, per-layer input embeddings, the MoE block (4 experts, top 2) beside a
double-wide MLP on the sharing layers, final soft-cap. Logits of a prefill and of a
token-by-token decode equal transformers' within 1e-4; 24 greedy tokens equal transformers'
`generate`; broken variants (RoPE on every global dim, KV sharing dropped: a sharing layer
reading the wrong layer) fail; greedy speculation (n-gram chain and tree, a perturbed draft
model, batch of 4 prompts of mixed lengths) is token-identical to greedy plain; configurations
jaxspec does not implement are refused in one line.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from conftest import import_torch
from jaxspec.errors import JaxspecError
from jaxspec.loading import load_model

VOCAB = 96
NEW = 24
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "full_attention"]


def hf_model(seed: int = 0):
    torch = import_torch()
    import transformers as tr

    torch.manual_seed(seed)
    cfg = tr.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=6,
        layer_types=LAYER_TYPES, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=16, final_logit_softcapping=30.0,
        pad_token_id=0, bos_token_id=2, eos_token_id=1)
    model = tr.Gemma4ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = "norm" in name or "scale" in name  # multipliers drawn around one
            p.copy_((1.0 if scale else 0.0) + 0.3 * torch.randn_like(p))
        # small token embeddings: the tied head then does not just repeat the last token
        model.model.embed_tokens.weight.mul_(0.05 / 0.3)
    model.set_attn_implementation("eager")
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = hf_model()
    path = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint[1], layout="auto")


@pytest.fixture(scope="module")
def prompt_ids():
    return np.random.default_rng(0).integers(3, VOCAB, size=(2, 20)).astype(np.int32)


def test_logits_match_transformers(checkpoint, loaded, prompt_ids):
    from test_moe import hf_logits, our_logits

    assert loaded.target.name == "gemma4" and loaded.layout == "unrolled"
    assert len(loaded.init_cache(1, 8).k) == 3  # the two sharing layers hold no k/v
    ref = hf_logits(checkpoint[0], prompt_ids)
    for incremental in (False, True):
        ours = our_logits(loaded.target, loaded.params, prompt_ids, incremental=incremental)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_greedy_24_tokens_equal_transformers(checkpoint, loaded, prompt_ids):
    from test_families import greedy, hf_greedy

    prompt = prompt_ids[0, :10].tolist()
    ours = greedy(loaded.target, loaded.params, prompt, NEW)
    assert ours == hf_greedy(checkpoint[0], prompt, NEW)
    assert len(set(ours)) > 4


@pytest.mark.parametrize("variant", ["full_rope_on_global_layers", "no_kv_sharing"])
def test_broken_variants_fail(checkpoint, loaded, prompt_ids, variant):
    from test_moe import hf_logits, our_logits

    cfg = loaded.target.cfg
    if variant == "full_rope_on_global_layers":
        cfg = dataclasses.replace(cfg, rope_global_partial=1.0)
    else:  # the local sharing layer reads the first local layer's k/v, not the last one's
        assert cfg.kv_source == (0, 1, 2, 2, 1)
        cfg = dataclasses.replace(cfg, kv_source=(0, 1, 2, 0, 1))
    target = dataclasses.replace(loaded.target, cfg=cfg)
    error = np.abs(our_logits(target, loaded.params, prompt_ids, incremental=False)
                   - hf_logits(checkpoint[0], prompt_ids)).max()
    assert error > 1e-2, f"{variant} should not match transformers (max error {error})"


# ------------------------------------------------------------------ speculation == plain greedy


@pytest.fixture(scope="module")
def engine_prompts():
    rng = np.random.default_rng(1)
    out = []
    for n in (9, 14, 4, 11):
        motif = [int(t) for t in rng.integers(3, VOCAB, size=3)]
        out.append(([int(t) for t in rng.integers(3, VOCAB, size=n // 2)] + motif * 4)[:n])
    return out


@pytest.fixture(scope="module")
def plain(loaded, engine_prompts):
    from jaxspec.engine.runner import Engine

    engine = Engine(loaded)
    return [engine.generate([p], max_new_tokens=NEW)[0].token_ids for p in engine_prompts]


@pytest.mark.parametrize("name", ["ngram", "ngram_tree", "draft_model"])
def test_greedy_speculation_is_token_identical(loaded, engine_prompts, plain, name):
    from jaxspec.drafters.draft_model import ModelDrafter
    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.engine.runner import Engine

    dparams, gamma = None, 4
    if name == "ngram":
        drafter = NgramDrafter(VOCAB, 1, 3)
    elif name == "ngram_tree":
        drafter, gamma = NgramDrafter(vocab_size=VOCAB, min_ngram=1, max_ngram=3, branches=3,
                                      depth=3), 1
    else:  # a perturbed copy of the target: drafts accepted and rejected
        leaves, treedef = jax.tree.flatten(loaded.params)
        dparams = jax.tree.unflatten(treedef, [
            w + 0.1 * jax.random.normal(jax.random.key(i), w.shape, w.dtype)
            for i, w in enumerate(leaves)])
        drafter, gamma = ModelDrafter(model=loaded.target, target_vocab=VOCAB), 3
    engine = Engine(loaded, drafter, dparams, num_speculative_tokens=gamma)
    out = engine.generate(engine_prompts, max_new_tokens=NEW, batch_size=2)
    assert [r.token_ids for r in out] == plain
    accepted = sum(r.metrics["num_accepted_tokens"] for r in out)
    assert accepted > 0
    if name == "draft_model":
        assert accepted < sum(r.metrics["num_draft_tokens"] for r in out)


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("changes,expect", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_type"),
])
def test_unsupported_configs_refused_in_one_line(checkpoint, tmp_path, changes, expect):
    from test_moe import _edit_config

    path = _edit_config(checkpoint[1], tmp_path / "ckpt", **changes)
    with pytest.raises(JaxspecError) as err:
        load_model(path)
    message = str(err.value)
    assert expect in message and "Gemma 4 in jaxspec runs" in message and "\n" not in message


def test_stacked_layout_refused(checkpoint):
    with pytest.raises(JaxspecError, match="unrolled"):
        load_model(checkpoint[1], layout="stacked")
