"""Qwen3-MoE (routed experts, `models/moe.py`, `models/qwen3_moe.py`) against transformers.

Two tiny random checkpoints written by transformers' `save_pretrained` inside the test: "mixed"
(3 layers: experts, a dense MLP via `mlp_only_layers`, experts; 8 experts, top 2, renormed) and
"sparse" (2 layers, all experts, top 3 of 6, not renormed). Logits of a prefill and of a
token-by-token decode equal transformers' within 1e-4 in every layout; 24 greedy tokens equal
transformers' `generate`; greedy speculation (n-gram chain and tree, a draft model that is a
perturbed copy of the target, batch of 4 prompts of mixed lengths) is token-identical to greedy
plain; the three expert paths (gather, grouped, dense) equal an independent reference; broken
variants (the top-k weights not renormed, one routing shared by a whole window) fail parity; bad
checkpoints are refused in one line before any tensor is placed; on (1, 2) and (2, 4) CPU meshes
(a subprocess, `tests/moe_mesh_check.py`) the experts split over `model` and the output equals
one device.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import import_torch
from jaxspec.errors import JaxspecError
from jaxspec.loading import load_model
from jaxspec.models import moe

VOCAB = 96
PROMPT = 20
NEW = 24
CONFIGS = {
    "mixed": dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                  norm_topk_prob=True),
    "sparse": dict(num_hidden_layers=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False),
}


def hf_model(kind: str, seed: int = 0):
    torch = import_torch()
    import transformers as tr

    torch.manual_seed(seed)
    cfg = tr.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, decoder_sparse_step=1, pad_token_id=0, bos_token_id=2,
                            eos_token_id=1, **CONFIGS[kind])
    model = tr.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name  # weights wide enough that greedy output does not repeat
            p.copy_((1.0 if norm else 0.0) + (0.3 if norm else 0.5) * torch.randn_like(p))
    model.set_attn_implementation("eager")
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for kind in CONFIGS:
        model = hf_model(kind)
        path = tmp_path_factory.mktemp(f"qwen3_moe_{kind}")
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
    """One prefill, or 3 tokens then one per call (the decode path: few (token, expert) pairs)."""
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


@pytest.mark.parametrize("kind,layout", [("mixed", "unrolled"), ("mixed", "packed"),
                                         ("sparse", "stacked")])
def test_logits_match_transformers(checkpoints, prompt_ids, kind, layout):
    if layout == "packed":
        from jaxspec import kernels

        if not kernels.available():
            pytest.skip("the packed layout needs the CPU kernels")
    model, path = checkpoints[kind]
    loaded = load_model(path, layout=layout)
    assert loaded.target.name == "qwen3_moe" and loaded.layout == layout
    ref = hf_logits(model, prompt_ids)
    for incremental in (False, True):
        ours = our_logits(loaded.target, loaded.params, prompt_ids, incremental=incremental)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_greedy_24_tokens_equal_transformers(checkpoints, prompt_ids):
    from test_families import greedy, hf_greedy

    model, path = checkpoints["mixed"]
    loaded = load_model(path)
    prompt = prompt_ids[0, :10].tolist()
    ours = greedy(loaded.target, loaded.params, prompt, NEW)
    assert ours == hf_greedy(model, prompt, NEW)
    assert len(set(ours)) > 4  # not one repeated token


# --------------------------------------------------------------------- broken variants must fail


def _window_routed(route):
    """Broken: every token of a block routed by the block's mean hidden state."""
    def one_routing(router, x, top_k, norm_topk):
        w, e = route(router, jnp.broadcast_to(x.mean(0, keepdims=True), x.shape), top_k, norm_topk)
        return w, e
    return one_routing


@pytest.mark.patches_traced_code
@pytest.mark.parametrize("variant", ["correct", "not_renormed", "one_routing_per_window"])
def test_broken_routing_fails(checkpoints, prompt_ids, monkeypatch, variant):
    model, path = checkpoints["mixed"]
    loaded = load_model(path)
    target = loaded.target
    if variant == "not_renormed":
        target = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg,
                                                                     norm_topk_prob=False))
    elif variant == "one_routing_per_window":
        monkeypatch.setattr(moe, "route", _window_routed(moe.route))
    error = np.abs(our_logits(target, loaded.params, prompt_ids, incremental=False)
                   - hf_logits(model, prompt_ids)).max()
    if variant == "correct":
        assert error < 1e-4
    else:
        assert error > 1e-2, f"{variant} should not match transformers (max error {error})"


def test_expert_paths_equal_a_dense_reference():
    """gather and grouped equal every expert run on every token, weighted by a one-hot
    combine matrix (an independent reference), for token counts on both sides of N*k = E."""
    e, f, d, k = 8, 16, 32, 3
    keys = jax.random.split(jax.random.key(0), 5)
    p = {"router": jax.random.normal(keys[0], (e, d)),
         "we_gate": 0.3 * jax.random.normal(keys[1], (e, f, d)),
         "we_up": 0.3 * jax.random.normal(keys[2], (e, f, d)),
         "we_down": 0.3 * jax.random.normal(keys[3], (e, d, f))}
    for n in (1, 2, 5, 16):
        x = jax.random.normal(jax.random.fold_in(keys[4], n), (n, d))
        logits = x @ p["router"].T
        probs = jax.nn.softmax(logits, -1)
        top = jnp.sort(probs, -1)[:, -k][:, None]
        combine = jnp.where(probs >= top, probs, 0.0)
        combine = combine / combine.sum(-1, keepdims=True)  # [N, E]
        every = jnp.einsum("efd,nd->nef", p["we_gate"], x)
        h = jax.nn.silu(every) * jnp.einsum("efd,nd->nef", p["we_up"], x)
        dense = jnp.einsum("ne,nef,edf->nd", combine, h, p["we_down"])
        for path in ("gather", "grouped", "dense"):
            got = moe.moe_block(p, x, top_k=k, norm_topk=True, path=path)
            np.testing.assert_allclose(got, dense, atol=1e-5, err_msg=f"{path}, {n} tokens")
        assert moe.path_for(n, k, e) == ("gather" if n * k < e else "dense")  # on CPU
    assert moe.experts_woken(1, k, e) == pytest.approx(k)
    assert k < moe.experts_woken(5, k, e) < e


# ------------------------------------------------------------------ speculation == plain greedy


@pytest.fixture(scope="module")
def engine_model(checkpoints):
    return load_model(checkpoints["mixed"][1], layout="auto")


@pytest.fixture(scope="module")
def engine_prompts():
    rng = np.random.default_rng(1)
    out = []
    for n in (9, 14, 4, 11):  # mixed lengths, a repeated motif (prompt lookup finds matches)
        motif = [int(t) for t in rng.integers(3, VOCAB, size=3)]
        out.append(([int(t) for t in rng.integers(3, VOCAB, size=n // 2)] + motif * 4)[:n])
    return out


@pytest.fixture(scope="module")
def plain(engine_model, engine_prompts):
    from jaxspec.engine.runner import Engine

    engine = Engine(engine_model)
    return [engine.generate([p], max_new_tokens=NEW)[0].token_ids for p in engine_prompts]


def _drafter(name: str, model):
    from jaxspec.drafters.draft_model import ModelDrafter
    from jaxspec.drafters.prompt_lookup import NgramDrafter

    if name == "ngram":
        return NgramDrafter(VOCAB, 1, 3), None, 4
    if name == "ngram_tree":
        return NgramDrafter(vocab_size=VOCAB, min_ngram=1, max_ngram=3, branches=3, depth=3), None, 1
    # a perturbed copy of the target (its own unpacked params): drafts accepted and rejected
    fresh = load_model(model.source_path)
    noise = lambda i, w: w + 0.15 * jax.random.normal(jax.random.key(i), w.shape, w.dtype)  # noqa: E731
    leaves, treedef = jax.tree.flatten(fresh.params)
    dparams = jax.tree.unflatten(treedef, [noise(i, w) for i, w in enumerate(leaves)])
    return ModelDrafter(model=fresh.target, target_vocab=VOCAB), dparams, 3


@pytest.mark.parametrize("name", ["ngram", "ngram_tree", "draft_model"])
def test_greedy_speculation_is_token_identical(engine_model, engine_prompts, plain, name):
    from jaxspec.engine.runner import Engine

    drafter, dparams, gamma = _drafter(name, engine_model)
    engine = Engine(engine_model, drafter, dparams, num_speculative_tokens=gamma)
    out = engine.generate(engine_prompts, max_new_tokens=NEW, batch_size=2)
    assert [r.token_ids for r in out] == plain
    drafted = sum(r.metrics["num_draft_tokens"] for r in out)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in out)
    assert accepted > 0
    if name == "draft_model":
        assert accepted < drafted  # some drafts rejected too


# ------------------------------------------------------------------------------- bad input


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | changes))
    return dst


@pytest.mark.parametrize("changes,expect", [
    ({"shared_expert_intermediate_size": 64}, "routing jaxspec does not implement"),
    ({"n_group": 4, "topk_group": 2}, "routing jaxspec does not implement"),
    ({"scoring_func": "sigmoid"}, "softmax top-k routing"),
    ({"model_type": "qwen2_moe"}, "qwen3_moe"),
])
def test_unsupported_routing_refused_in_one_line(checkpoints, tmp_path, changes, expect):
    path = _edit_config(checkpoints["mixed"][1], tmp_path / "ckpt", **changes)
    with pytest.raises(JaxspecError) as err:
        load_model(path)
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_missing_expert_and_mixed_stack_refused(checkpoints, tmp_path):
    path = _edit_config(checkpoints["mixed"][1], tmp_path / "more", num_experts=9)
    with pytest.raises(JaxspecError, match="experts"):
        load_model(path)
    with pytest.raises(JaxspecError, match="layout 'unrolled'"):
        load_model(checkpoints["mixed"][1], layout="stacked")


# ------------------------------------------------------------- meshes (1, 2), (2, 4) = one device


def test_experts_sharded_on_meshes_equal_one_device():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, "tests/moe_mesh_check.py"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == {"ngram/1x2", "ngram/2x4"}
    for name, result in out.items():
        assert result["equal"], name
        assert result["weight_gathers"] == 0, name  # experts stay on their devices
    assert out["ngram/1x2"]["experts_shard"] == [8, 16, 64]  # 16 experts, 8 per device
    assert out["ngram/2x4"]["experts_shard"] == [4, 16, 64]
