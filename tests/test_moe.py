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
(a subprocess, `tests/moe_mesh_check.py`) Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE split experts and
linear-attention heads over `model`, gather no weight, and equal one device.
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
from jaxspec.models import moe, moe_shards

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


_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def write_gguf(model, path, *, stack: bool = True):
    """The checkpoint in llama.cpp's `qwen3moe` names and metadata (float32): the experts of a
    layer stacked into `ffn_{gate,up,down}_exps` [E, ...]. stack=False: broken, expert 0 only
    (every expert of the layer the same)."""
    import re

    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    sd = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"],
           "output_norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    experts = {}
    for k, v in sd.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", k)
        if m and m.group(2) in _GGUF_NAMES:
            out[f"blk.{m.group(1)}.{_GGUF_NAMES[m.group(2)]}.weight"] = v
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight", k)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj", k)
        if m:  # the fused layout transformers may keep
            parts = np.split(v, 2, axis=1) if m.group(2) == "gate_up" else [v]
            for kind, part in zip(m.group(2).split("_"), parts):
                experts[(m.group(1), kind)] = dict(enumerate(part))
    for (layer, kind), per in experts.items():
        stacked = np.stack([per[j if stack else 0] for j in range(len(per))])
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = stacked
    for name, x in out.items():
        w.add_tensor(name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("broken", [False, True])
def test_gguf_in_llama_cpp_names_matches_transformers(checkpoints, prompt_ids, tmp_path, broken):
    """A `qwen3moe` GGUF (llama.cpp's names: ffn_gate_inp, ffn_*_exps stacked; a dense layer's
    ffn_gate/up/down) loads through the family registry and its logits equal transformers';
    every expert written as expert 0 (broken) does not."""
    model, _ = checkpoints["mixed"]
    loaded = load_model(write_gguf(model, tmp_path / "m.gguf", stack=not broken))
    assert loaded.target.name == "qwen3_moe" and loaded.cfg.moe_layers == (True, False, True)
    ours = our_logits(loaded.target, loaded.params, prompt_ids, incremental=False)
    close = np.allclose(ours, hf_logits(model, prompt_ids), atol=1e-4, rtol=0)
    assert close != broken


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
    """gather, grouped and looped equal every expert run on every token, weighted by a one-hot
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
        for path in ("gather", "grouped", "dense", "looped"):
            got = moe.moe_block(p, x, top_k=k, norm_topk=True, path=path)
            np.testing.assert_allclose(got, dense, atol=1e-5, err_msg=f"{path}, {n} tokens")
        assert moe.path_for(n, k, e) == ("gather" if n * k < e else "dense")  # on CPU
    # the TPU prompt path: the Pallas grouped matmul (run interpreted here) on each half of the
    # experts, as two devices would, sums to the reference
    w, picked = moe.route(p["router"], x, k, True)
    halves = [{name: p[name][first:first + e // 2] for name in moe_shards.EXPERT_LEAVES}
              for first in (0, e // 2)]
    kernel = sum(moe_shards.experts_local(h, x, w, picked, first, platform="interpret")
                 for h, first in zip(halves, (0, e // 2)))
    np.testing.assert_allclose(kernel, dense, atol=1e-5)
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
    """Qwen3-MoE, Qwen3.5 (hybrid) and Qwen3.5-MoE on (1, 2) and (2, 4) meshes equal one device
    (prompt logits; greedy tokens plain and with n-gram drafts; Qwen3-MoE's (2, 4) with the
    rules table's experts over "data", placed and combined there), with experts (run per device),
    linear-attention value heads and q/k/v channels split by the rules table, no weight
    all-gathered in a compiled step or window, and on (1, 2) no activation moved between
    devices but the all-reduces (tests/moe_mesh_check.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, "tests/moe_mesh_check.py"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == {f"{m}/{d}" for m in ("qwen3_moe", "qwen3_5", "qwen3_5_moe")
                        for d in ("1x2", "2x4e" if m == "qwen3_moe" else "2x4")}
    for name, result in out.items():
        assert all(v for k, v in result.items() if k.startswith("equal/")), name
        assert result["logits_max_diff"] < 2e-4, name
        assert result["weight_gathers"] == [], name  # weights stay on their devices
    for fam in ("qwen3_5", "qwen3_5_moe"):  # model=2 splits the 2 key heads whole
        assert out[f"{fam}/1x2"]["regathers"] == [], fam  # q/k/v channels stay with their heads
    assert out["qwen3_5/1x2"]["equal/plain"] and out["qwen3_5_moe/2x4"]["equal/ngram"]
    for fam in ("qwen3_moe", "qwen3_5_moe"):  # 16 experts, 8 / 4 per device
        assert out[f"{fam}/1x2"]["shards"]["we_gate"] == [8, 16, 64]
        assert out[f"{fam}/1x2"]["expert_collectives"] == ["all-reduce:model"], fam
    assert out["qwen3_5_moe/2x4"]["shards"]["we_gate"] == [4, 16, 64]
    assert out["qwen3_5_moe/2x4"]["expert_collectives"] == ["all-reduce:model"]
    # the rules table puts Qwen3-MoE's experts over "data" on (2, 4): 8 a device, combined over
    # "data" (the batch's axis too: a reduce-scatter back to the rows' devices where 4 rows
    # split), never over "model" (the table ignored: experts split and combined over "model")
    moe_data = out["qwen3_moe/2x4e"]
    assert moe_data["shards"]["we_gate"] == [8, 16, 64], moe_data
    assert moe_data["expert_collectives"] == ["reduce-scatter:data"], moe_data
    assert not [r for r in moe_data["regathers"] if "collective-permute" in r], moe_data
    for fam in ("qwen3_5", "qwen3_5_moe"):  # 4 value heads of 8 (in_z 32 rows), 64 channels
        assert out[f"{fam}/1x2"]["shards"]["in_z"] == [16, 64]
        assert out[f"{fam}/2x4"]["shards"]["in_z"] == [8, 64]
        assert out[f"{fam}/2x4"]["shards"]["in_qkv"] == [16, 64]


def test_a_loop_states_its_expected_trips_to_the_byte_count():
    """A data-dependent loop in `hlo.expected_trips_scope(2.5)` (the woken-experts loop's) is
    counted 2.5 times by `hlo.device_bytes`, whatever its unknown_trip; the same loop unnamed
    is counted at unknown_trip."""
    from jaxspec import hlo

    scope = hlo.expected_trips_scope(2.5)

    def summed(w, n):  # w [8, 256], n: a traced trip count
        body = lambda i, acc: 1.5 * acc + jax.lax.dynamic_index_in_dim(w, i, keepdims=False)  # noqa: E731
        with jax.named_scope(scope):
            return jax.lax.fori_loop(0, n, body, jnp.zeros(w.shape[1:], w.dtype))

    named = jax.jit(summed).lower(jnp.ones((8, 256)), jnp.int32(3)).compile().as_text()
    assert scope in named
    plain = named.replace(scope, "plain")  # the same program, its loop unnamed
    assert hlo.device_bytes(named, unknown_trip=7) == hlo.device_bytes(plain, unknown_trip=2.5)
    assert hlo.device_bytes(named, unknown_trip=7) < hlo.device_bytes(plain, unknown_trip=7)


def test_active_weight_bytes_at_real_shapes_match_the_published_counts():
    """Qwen3-30B-A3B is published as 30.5B parameters, 3.3B activated per token: the roofline's
    shape (abstract, no weights) holds 30.5B and a one-token step reads 3.3B (x 2 bytes); a
    verify window of 5 wakes more experts (`moe.window_cost_ratio` agrees with the bytes)."""
    from jaxspec.tools import moe_shapes

    target = moe_shapes.qwen3_30b_a3b("bfloat16")
    total, experts, layers = moe_shapes.weight_bytes(target)
    assert layers == 48 and abs(total / 2 - 30.5e9) < 0.05e9
    one = moe_shapes.active_weight_bytes(target, 1)
    assert abs(one / 2 - 3.3e9) < 0.1e9
    five = moe_shapes.active_weight_bytes(target, 5)
    share = experts * 8 / 128 / one  # the routed experts' share of a one-token step
    assert five / one == pytest.approx(moe.window_cost_ratio(5, 1, 8, 128, share), rel=1e-9)
    assert 2.5 < five / one < 3.2
    fields = moe_shapes.active_fields(target, 8, 5)
    assert fields["experts_woken"] == pytest.approx(moe.experts_woken(40, 8, 128), abs=0.01)


def test_experts_per_shard_read_a_chips_share_on_a_v5e_mesh():
    """Qwen3-30B-A3B's MoE block compiled for a v5e 1x4 (experts 32 a chip): on the per-shard
    path (models/moe_shards.py) each chip moves <= 1.1x its share of the active weights (the
    router + its share of the experts the tokens wake) for a 5-token window, with one collective (the output's psum) and no expert-sized all-gather. GSPMD's gather path
    on the same mesh (the broken variant) moves many times its share."""
    from jaxspec.tools import accel_roofline, moe_shapes

    target = moe_shapes.qwen3_30b_a3b("bfloat16")
    place = accel_roofline.placement("v5e", (1, 4), target)
    row = moe_shapes.block_row(place, target, 1, 5)  # 35 of 128 experts woken
    assert row["ratio"] <= 1.1 and row["collectives"] == 1, row
    assert row["weight_gathers"] == [] and row["data_dependent_loops"] == 1, row
    assert moe_shapes.block_row(place, target, 1, 5, path="gather")["ratio"] > 5
