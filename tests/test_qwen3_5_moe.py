"""Qwen3.5-MoE (hybrid linear attention, routed experts with a gated shared expert, native MTP)
against transformers' `Qwen3_5MoeForCausalLM`.

A tiny random checkpoint (three Gated DeltaNet layers and one gated full-attention layer, every
MLP 8 experts top-2 plus the shared expert) is written with `save_pretrained` (one tensor per
expert, as published), with an MTP head built from transformers' own `Qwen3_5MoeDecoderLayer`
saved beside it in the published `mtp.*` names. Logits of a prefill and of a token-by-token
decode equal transformers' within 2e-4; 24 greedy tokens at batch 4 (mixed prompt lengths)
equal transformers' `generate`; greedy speculative == greedy plain for an n-gram chain and for
the native MTP head chained at γ 3 (drafts accepted and rejected); the head's forward equals the
torch computation of the published definition, and written back in the published names it
reads back equal. Routings and layer types jaxspec does not implement are refused in one line
before any tensor is read.

Qwen3-Next (its fused projections split on load) equals transformers; its MTP head, stored as
published (`mtp.*`, no `mtp_num_hidden_layers` in config.json), is read by `method: mtp` with no
checkpoint, equals the published definition and drafts losslessly.

GGUF, both Qwen3.5 families and Qwen3-Next: tests/data/gguf/ holds tiny checkpoints converted by
llama.cpp's own convert_hf_to_gguf.py (scripts/qwen3_5_gguf_fixtures.py regenerates them) with
transformers' logits and greedy tokens; loaded, they match, and a reader that leaves one of the
converter's changes in place (value heads tiled, A for A_log) or undoes one it did not make
(Qwen3-Next's value heads untiled) fails.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_torch
from test_qwen3_5 import randomize

from jaxspec.errors import JaxspecError
from jaxspec.loading import load_model
from jaxspec.models import base

VOCAB = 96
NEW = 24
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def hf_config(**changes):
    import transformers as tr

    return tr.Qwen3_5MoeTextConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4, "layer_types": LAYER_TYPES, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "pad_token_id": 0, "bos_token_id": 2,
        "eos_token_id": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5}} | changes)


def _per_expert(prefix: str, state: dict) -> dict:
    """transformers' fused expert tensors -> the published one-tensor-per-expert names."""
    out = {}
    for k, v in state.items():
        v = v.numpy()
        if k.endswith("mlp.experts.gate_up_proj"):
            f = v.shape[1] // 2
            stem = k[: -len("gate_up_proj")]
            for j in range(v.shape[0]):
                out[f"{prefix}{stem}{j}.gate_proj.weight"] = v[j, :f]
                out[f"{prefix}{stem}{j}.up_proj.weight"] = v[j, f:]
        elif k.endswith("mlp.experts.down_proj"):
            stem = k[: -len("down_proj")]
            out |= {f"{prefix}{stem}{j}.down_proj.weight": v[j] for j in range(v.shape[0])}
        else:
            out[prefix + k] = v
    return out


def mtp_head(m, family: str, cfg):
    """The published MTP head's modules from transformers' `m` (classes `<family>RMSNorm` and
    `<family>DecoderLayer`), before randomizing: norms, fc over [embedding; hidden], one full-
    attention layer, the final norm."""
    torch = import_torch()
    d, norm = cfg.hidden_size, getattr(m, family + "RMSNorm")
    layer = getattr(m, family + "DecoderLayer")
    return torch.nn.ModuleDict({
        "pre_fc_norm_embedding": norm(d, eps=cfg.rms_norm_eps),
        "pre_fc_norm_hidden": norm(d, eps=cfg.rms_norm_eps),
        "fc": torch.nn.Linear(2 * d, d, bias=False),
        "layers": torch.nn.ModuleList([layer(cfg, LAYER_TYPES.index("full_attention"))]),
        "norm": norm(d, eps=cfg.rms_norm_eps),
    })


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(model, mtp head, path): the target and, in the same directory, its MTP head."""
    torch = import_torch()
    import transformers as tr
    from safetensors.numpy import load_file, save_file
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    torch.manual_seed(0)
    cfg = hf_config()
    model = tr.Qwen3_5MoeForCausalLM(cfg)
    randomize(model, 0.1)
    with torch.no_grad():  # a pull towards repeating the last token: the echoing MTP head
        model.lm_head.weight.add_(0.15 * model.model.embed_tokens.weight)  # drafts get accepted
    model.set_attn_implementation("eager")
    head = mtp_head(m, "Qwen3_5Moe", cfg)
    randomize(head, 0.3)
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    model.eval().save_pretrained(path)
    tensors = load_file(path / "model.safetensors") | _per_expert("mtp.", head.state_dict())
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    return model, head.eval(), path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint[2], layout="auto")


@pytest.fixture(scope="module")
def model(loaded):
    return base.Model(target=loaded.target, params=loaded.params, eos_token_ids=(-1,))


def test_logits_match_transformers(checkpoint, loaded):
    from test_qwen3_5 import hf_logits, our_logits

    assert loaded.target.name == "qwen3_5_moe" and loaded.layout == "unrolled"
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(2, 20)).astype(np.int32)
    ref = hf_logits(checkpoint[0], ids)
    for incremental in (False, True):
        ours = our_logits(loaded.target, loaded.params, ids, incremental=incremental)
        np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)


@pytest.fixture(scope="module")
def prompts():
    from test_qwen3_5 import prompts as mixed

    return mixed.__wrapped__()


@pytest.fixture(scope="module")
def plain(model, prompts):
    from jaxspec.engine.runner import Engine

    out = Engine(model).generate(prompts, max_new_tokens=NEW, batch_size=4)
    tokens = [r.token_ids for r in out]
    assert all(len(set(t)) > 3 for t in tokens)  # varied output: drafts can be rejected
    return tokens


def test_greedy_24_tokens_equal_transformers(checkpoint, prompts, plain):
    from test_qwen3_5 import hf_greedy

    for prompt, ours in zip(prompts, plain):
        assert ours == hf_greedy(checkpoint[0], prompt, NEW)


@pytest.fixture(scope="module")
def head(loaded):
    from test_qwen3_5_mtp import spec

    from jaxspec.build import build_drafter

    return build_drafter(spec(), loaded)  # no checkpoint: the target's own mtp.* tensors


def test_mtp_head_forward_equals_the_published_definition(checkpoint, loaded, head):
    from test_qwen3_5_mtp import assert_head_matches_transformers

    model, thead, _ = checkpoint
    assert_head_matches_transformers(*head, loaded, model, thead, VOCAB)


def echoing(dparams, scale: float = 0.2):
    """The head leaning on the target's hidden state it reads (tests/test_qwen3_5_mtp.py's
    `echoing`, with the routed and shared experts' outputs scaled)."""
    d = dparams["fc"].shape[0]
    layer = dparams["layer"]
    layer = layer | {k: scale * layer[k] for k in ("wo", "we_down", "ws_down")}
    neutral = jnp.zeros(d)
    return dparams | {"fc": dparams["fc"].at[:, d:].add(20.0 * jnp.eye(d)), "layer": layer,
                      "pre_fc_norm_hidden": neutral, "norm": neutral}


@pytest.mark.parametrize("name", ["ngram", "mtp"])
def test_greedy_speculation_is_token_identical(model, prompts, plain, head, name):
    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.engine.runner import Engine

    if name == "ngram":
        drafter, dparams, gamma = NgramDrafter(VOCAB, 1, 3), None, 4
    else:  # the native head, leaning on the target's hidden state: accepted and rejected
        drafter, dparams, gamma = head[0], echoing(head[1]), 3
    out = Engine(model, drafter, dparams, num_speculative_tokens=gamma).generate(
        prompts, max_new_tokens=NEW, batch_size=4)
    assert [r.token_ids for r in out] == plain
    accepted = sum(r.metrics["num_accepted_tokens"] for r in out)
    drafted = sum(r.metrics["num_draft_tokens"] for r in out)
    assert accepted < drafted  # rejected drafts rolled back (n-gram: its prompt motifs)
    if name == "mtp":
        assert accepted > 0


def test_mtp_head_writes_back_in_the_published_names(checkpoint, loaded, head, tmp_path):
    import jax
    from safetensors.numpy import load_file, save_file

    from jaxspec.formats import load_drafter_checkpoint, qwen3_5_mtp

    _, dparams = head
    tensors = qwen3_5_mtp.to_tensors(loaded.target.cfg, dparams)
    stored = {k: v for k, v in load_file(checkpoint[2] / "model.safetensors").items()
              if k.startswith("mtp.")}
    assert sorted(tensors) == sorted(stored)
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in tensors
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint[2] / "config.json").read_text())
    _, again = load_drafter_checkpoint("mtp", tmp_path, loaded)
    jax.tree.map(np.testing.assert_array_equal, again, dparams)


@pytest.mark.parametrize("changes,words", [
    ({"n_group": 4, "topk_group": 2}, "n_group=4 is a routing jaxspec does not implement"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
    ({"mlp_only_layers": [1]}, "Qwen3.5-MoE supports softmax top-k routing"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention",
                      "linear_attention"]}, "implements linear_attention, full_attention"),
])
def test_unsupported_variants_refused_before_loading(tmp_path, changes, words):
    (tmp_path / "config.json").write_text(json.dumps(hf_config().to_dict() | changes))
    with pytest.raises(JaxspecError, match=words) as err:  # no tensors written: none are read
        load_model(tmp_path)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------- Qwen3-Next


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """A tiny random `Qwen3NextForCausalLM` (its fused in_proj_qkvz / in_proj_ba) with an MTP head
    (transformers' own Qwen3-Next decoder layer) saved beside it in the `mtp.*` names, and, as
    in the published Qwen3-Next checkpoints, no `mtp_num_hidden_layers` in config.json:
    (model, head, load)."""
    torch = import_torch()
    import transformers as tr
    from safetensors.numpy import load_file, save_file
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    torch.manual_seed(3)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "pad_token_id", "bos_token_id", "eos_token_id",
            "rope_parameters")
    base_cfg = hf_config().to_dict()
    cfg = tr.Qwen3NextConfig(**{k: base_cfg[k] for k in keys}, intermediate_size=64)
    model = tr.Qwen3NextForCausalLM(cfg)
    randomize(model, 0.3)
    with torch.no_grad():  # a pull towards repeating the last token: the echoing MTP head
        model.lm_head.weight.add_(0.15 * model.model.embed_tokens.weight)  # drafts get accepted
    model.set_attn_implementation("eager")
    head = mtp_head(m, "Qwen3Next", cfg)
    randomize(head, 0.3)
    path = tmp_path_factory.mktemp("qwen3_next")
    model.eval().save_pretrained(path)
    tensors = load_file(path / "model.safetensors") | _per_expert("mtp.", head.state_dict())
    save_file(tensors, path / "model.safetensors")
    assert "mtp_num_hidden_layers" not in json.loads((path / "config.json").read_text())
    return model, head.eval(), load_model(path, layout="auto")


def test_qwen3_next_matches_transformers_and_speculates_exactly(qwen3_next, prompts):
    """Logits (prefill, token by token) equal transformers'; 24 greedy tokens equal its
    `generate`; greedy n-gram speculation equals greedy plain."""
    from test_qwen3_5 import hf_greedy, hf_logits, our_logits

    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.engine.runner import Engine

    hf, _, loaded = qwen3_next
    assert loaded.target.name == "qwen3_next"
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(2, 20)).astype(np.int32)
    ref = hf_logits(hf, ids)
    for incremental in (False, True):
        ours = our_logits(loaded.target, loaded.params, ids, incremental=incremental)
        np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)
    model = base.Model(target=loaded.target, params=loaded.params, eos_token_ids=(-1,))
    plain = [r.token_ids for r in Engine(model).generate(prompts[:2], max_new_tokens=NEW,
                                                          batch_size=2)]
    assert plain[0] == hf_greedy(hf, prompts[0], NEW)
    out = Engine(model, NgramDrafter(VOCAB, 1, 3), None, num_speculative_tokens=4).generate(
        prompts[:2], max_new_tokens=NEW, batch_size=2)
    assert [r.token_ids for r in out] == plain


def test_qwen3_next_mtp_head_read_from_the_checkpoint(qwen3_next, prompts):
    """Qwen3-Next's published checkpoints carry the same `mtp.*` head as Qwen3.5 (without
    `mtp_num_hidden_layers`): `speculative.method: mtp` with no checkpoint reads it; its forward
    equals the published definition on transformers' own layer, and greedy speculation with it
    equals greedy plain (drafts accepted and rejected)."""
    from test_qwen3_5_mtp import assert_head_matches_transformers, spec

    from jaxspec.build import build_drafter
    from jaxspec.engine.runner import Engine

    hf, thead, loaded = qwen3_next
    drafter, dparams = build_drafter(spec(), loaded)
    assert_head_matches_transformers(drafter, dparams, loaded, hf, thead, VOCAB)
    model = base.Model(target=loaded.target, params=loaded.params, eos_token_ids=(-1,))
    plain = [r.token_ids for r in Engine(model).generate(prompts, max_new_tokens=NEW,
                                                          batch_size=4)]
    res = Engine(model, drafter, echoing(dparams), num_speculative_tokens=3).generate(
        prompts, max_new_tokens=NEW, batch_size=4)
    assert [r.token_ids for r in res] == plain
    accepted = sum(r.metrics["num_accepted_tokens"] for r in res)
    assert 0 < accepted < sum(r.metrics["num_draft_tokens"] for r in res)


# ------------------------------------- GGUF: both Qwen3.5 families, llama.cpp's own converter

GGUF_DIR = __import__("pathlib").Path(__file__).parent / "data" / "gguf"


@pytest.fixture(scope="module")
def gguf_reference():
    """transformers' prompt logits and 24 greedy tokens for the checkpoints the fixtures were
    converted from (scripts/qwen3_5_gguf_fixtures.py)."""
    return dict(np.load(GGUF_DIR / "qwen3_5_reference.npz"))


def gguf_logits(loaded, prompt) -> np.ndarray:  # [T, V]
    cache = loaded.target.init_cache(loaded.params, 1, 64)
    out = loaded.target.forward(loaded.params, jnp.asarray(prompt)[None], cache)
    return np.asarray(loaded.target.logits(loaded.params, out.hidden))[0]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_gguf_from_llama_cpps_converter_matches_transformers(name, gguf_reference):
    """A tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next converted by llama.cpp's convert_hf_to_gguf.py
    (value heads regrouped (not for Qwen3-Next), A stored as -exp(A_log), norms as w + 1,
    experts stacked, Qwen3-Next's qkvz split and ba kept fused) loads to transformers' logits,
    and the engine's greedy tokens equal transformers' generate."""
    from jaxspec.engine.runner import Engine

    loaded = load_model(GGUF_DIR / f"{name}.gguf")
    assert loaded.target.name == name and loaded.target.cfg.linear_value_heads == 4
    prompt = [int(t) for t in gguf_reference["prompt"]]
    ref = gguf_reference[f"{name}/logits"]
    assert np.abs(gguf_logits(loaded, prompt) - ref).max() < 2e-4 * np.abs(ref).max()
    model = base.Model(target=loaded.target, params=loaded.params, eos_token_ids=(-1,))
    (out,) = Engine(model).generate([prompt], max_new_tokens=NEW)
    assert out.token_ids == [int(t) for t in gguf_reference[f"{name}/greedy"]]


@pytest.mark.parametrize("broken", ["value heads left tiled", "A read as A_log",
                                    "qwen3next untiled as qwen35"])
def test_gguf_read_without_undoing_a_converter_change_fails(monkeypatch, gguf_reference, broken):
    from jaxspec.models import qwen3_5_gguf

    name = "qwen3_next" if broken.startswith("qwen3next") else "qwen3_5"
    if broken == "value heads left tiled":
        monkeypatch.setattr(qwen3_5_gguf, "untile", lambda x, axis, *dims: x)
    elif name == "qwen3_next":  # its value heads were never tiled: undoing a tiling breaks it
        convert = qwen3_5_gguf.convert
        monkeypatch.setattr(qwen3_5_gguf, "convert",
                            lambda flat, cfg, source, tiled=True: convert(flat, cfg, source))
    else:
        undo = qwen3_5_gguf.undo
        monkeypatch.setattr(qwen3_5_gguf, "undo", lambda leaf, w, cfg, tiled=True: (
            w if leaf == "A_log" else undo(leaf, w, cfg, tiled)))
    loaded = load_model(GGUF_DIR / f"{name}.gguf")
    ref = gguf_reference[f"{name}/logits"]
    assert np.abs(gguf_logits(loaded, [int(t) for t in gguf_reference["prompt"]]) - ref).max() > 1e-2
