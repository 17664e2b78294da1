"""P-EAGLE (method `peagle`): parity of every draft's logits, from one parallel pass, with the
reference package's own forward (`speculators` 0.9.0, torch) for tiny Qwen3 and Llama targets;
the speculators layout read and written; bad checkpoints refused in one line; the loop: greedy
identical to plain at batch 8, the sampled law exact (a broken q seen failing).

Error measure: speculators_ref.rel_err.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import import_torch
from jaxspec.drafters.base import DraftContext
from jaxspec.drafters.peagle import PEagleDrafter
from jaxspec.errors import JaxspecError
from jaxspec.formats import peagle as fmt
from jaxspec.loading import load_model
from jaxspec.models import base
from speculators_ref import (Lazy, assert_same_tensors, edited, import_reference, load_targets,
                             rel_err, same_params, training_inputs)

torch = import_torch()
ref = Lazy(lambda: import_reference("peagle"))
ref_core = Lazy(lambda: (ref._get(), sys.modules["speculators.models.peagle.core"])[1])

TOL = 1e-4
GAMMA = 4
MASK = 95
LAYERS = [0, 1, 1]




@pytest.fixture(scope="module")
def targets(tiny_qwen3_dir, tiny_llama_dir):
    return load_targets(torch, {"qwen3": tiny_qwen3_dir, "llama": tiny_llama_dir})


def make_reference(hf, seed=0, layers=LAYERS, **overrides):
    """A random-weight PEagleDraftModel for the target hf: one Llama draft layer of the target's
    dims (the target's own rope for a Llama target), its own embedding and LM head."""
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    c = hf.config
    if c.model_type == "llama":
        layer = copy.deepcopy(c)
        layer.num_hidden_layers = 1
    else:
        layer = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                            num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                            vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
                            max_position_embeddings=c.max_position_embeddings)
    layer._attn_implementation = "eager"
    kw = dict(transformer_layer_config=layer, draft_vocab_size=layer.vocab_size,
              eagle_aux_hidden_state_layer_ids=list(layers), mask_token_id=MASK,
              norm_before_residual=True,
              speculators_config=SpeculatorsConfig(
                  algorithm="peagle", default_proposal_method="greedy",
                  proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=GAMMA)],
                  verifier=VerifierConfig(name_or_path=None, architectures=[])))
    torch.manual_seed(seed)
    model = ref.PEagleDraftModel(ref.PEagleSpeculatorConfig(**(kw | overrides))).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model


PROMPTS = [[5, 17, 90, 3, 42, 7, 60, 31, 8], [11, 85, 64, 2, 19]]
NEXT = [77, 12]  # the last committed token of each row


def reference_logits(model, hf, prompt, nxt):
    """The reference training forward with its COD sample fixed to what decoding runs: every
    context position at depth 0 and one rollout of depths 1..γ-1 at the last one -> the γ drafts'
    logits [γ, V]. Its sequence starts at x_1 (jaxspec's slot 0, x_0, has no feature)."""
    n = len(prompt)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in LAYERS], dim=-1)  # f_0 .. f_{n-1}
        pad = GAMMA  # the reference gathers every sampled position's token and feature
        feats = torch.nn.functional.pad(feats, (0, 0, 0, pad))
        ids = torch.tensor([prompt[1:] + [nxt] + [0] * pad])
        anchor = torch.cat([torch.arange(n), torch.full((GAMMA - 1,), n - 1)])
        depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, GAMMA)])
        seen = {}

        def capture(logits, *args, **kwargs):
            seen["logits"] = logits
            return torch.zeros(()), {}

        saved = ref_core.generate_cod_sample_indices, ref_core.compute_metrics
        ref_core.generate_cod_sample_indices = lambda *a, **k: (anchor, depth)
        ref_core.compute_metrics = capture
        try:
            model(feats, ids, torch.zeros(1, n + pad, dtype=torch.long),
                  verifier_last_hidden_states=torch.zeros(1, n + pad, hf.config.hidden_size),
                  num_depths=GAMMA)
        finally:
            ref_core.generate_cod_sample_indices, ref_core.compute_metrics = saved
    return seen["logits"][0, n - 1:].numpy()


@functools.partial(jax.jit, static_argnums=(0, 2, 7))
def _pass_logits(drafter, dparams, target, params, padded, plens, tokens, gamma):
    tparams = base.bind(target, params)
    cache = target.init_cache(params, padded.shape[0], 64)
    out = target.forward(params, padded, cache, taps=drafter.hidden_layers)
    state = drafter.init(dparams, tparams, padded, plens, out.taps, 64)
    ctx = DraftContext(tokens, plens + 1, jnp.ones(plens.shape, bool))
    return drafter.parallel_logits(dparams, tparams, state, ctx, gamma)


def jaxspec_logits(drafter, dparams, m):
    b, p = len(PROMPTS), max(map(len, PROMPTS))
    padded = np.zeros((b, p), np.int32)
    tokens = np.zeros((b, p + 1), np.int32)
    for i, (row, nxt) in enumerate(zip(PROMPTS, NEXT)):
        padded[i, : len(row)] = row
        tokens[i, : len(row) + 1] = [*row, nxt]
    plens = jnp.asarray([len(r) for r in PROMPTS], jnp.int32)
    return np.asarray(_pass_logits(drafter, dparams, m.target, m.params, jnp.asarray(padded),
                                   plens, jnp.asarray(tokens), GAMMA))


@pytest.mark.parametrize("tname", ["qwen3", "llama"])
def test_draft_logits_match_reference(tname, targets, tmp_path):
    """jaxspec reads the speculators layout and, from one pass, gives all γ drafts' logits within
    1e-4 of the reference's forward for each row of a mixed-length batch; with mask_hidden
    zeroed the depth > 0 drafts do not match (the test sees the mask feature)."""
    hf, m = targets[tname]
    model = make_reference(hf)
    model.save_pretrained(tmp_path)
    drafter, dparams = fmt.read(tmp_path, m.cfg)
    assert isinstance(drafter, PEagleDrafter) and drafter.mask_token == MASK
    z = jaxspec_logits(drafter, dparams, m)
    z0 = jaxspec_logits(drafter, {**dparams, "mask_hidden": 0 * dparams["mask_hidden"]}, m)
    for row, (prompt, nxt) in enumerate(zip(PROMPTS, NEXT)):
        theirs = reference_logits(model, hf, prompt, nxt)
        err, err0 = rel_err(z[row], theirs), rel_err(z0[row, 1:], theirs[1:])
        print(f"{tname} row {row}: logits rel err {err:.1e}, without mask_hidden {err0:.1e}")
        assert err < TOL and err0 > 100 * TOL


def test_written_head_loads_in_the_reference_and_reads_back(tmp_path):
    """fmt.write's directory (naming its verifier, which the reference's loader reads and whose
    taps it wants distinct: a 3-layer target here) loads with PEagleDraftModel.from_pretrained
    (config validated by speculators, every weight equal) and reads back to the same drafter
    and params."""
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_checkpoint

    verifier = make_tiny_checkpoint(tmp_path / "target", "llama", seed=6, num_hidden_layers=3)
    hf = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    m = load_model(verifier, layout="unrolled")
    model = make_reference(hf, layers=(0, 1, 2))
    model.save_pretrained(tmp_path / "a")
    drafter, dparams = fmt.read(tmp_path / "a", m.cfg)
    fmt.write(tmp_path / "b", drafter, dparams, m.cfg, verifier=str(verifier))
    loaded = ref.PEagleDraftModel.from_pretrained(tmp_path / "b")
    assert loaded.config.mask_token_id == MASK
    theirs = {k: v for k, v in model.state_dict().items() if "verifier" not in k}
    assert_same_tensors(loaded, theirs)
    again, params2 = fmt.read(tmp_path / "b", m.cfg)
    assert again == drafter
    assert same_params(dparams, params2)




@pytest.mark.parametrize("change, target, message", [
    ({"speculators_model_type": "peagle2"}, None, "type 'peagle2' is not supported"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}, None, "tapped target layer 9"),
    ({"mask_token_id": 999}, None, "mask_token_id=999 must be a token id"),
    ({"fc_norm": True}, None, "fc_norm"),
    ({}, dict(vocab=128, hidden=64), "is for a vocabulary of 256 tokens"),
    ({}, dict(vocab=256, hidden=32), "reads target features of size 64"),
])
def test_bad_checkpoints_are_refused_in_one_line(change, target, message, targets, tmp_path):
    from jaxspec.formats import detect_format, load_drafter_checkpoint
    from tiny import tiny_model

    hf, m = targets["qwen3"]
    make_reference(hf).save_pretrained(tmp_path / "a")
    assert detect_format(tmp_path / "a") == "peagle"
    bad = edited(tmp_path / "a", tmp_path / "b", **change)
    with pytest.raises(JaxspecError) as err:
        load_drafter_checkpoint("peagle", bad, m if target is None else tiny_model(**target))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_config_builds_the_head(targets, tmp_path):
    from jaxspec.build import build_drafter
    from jaxspec.config import load_config

    hf, m = targets["qwen3"]
    make_reference(hf).save_pretrained(tmp_path)
    spec = load_config(None, ["speculative.method=peagle", "speculative.num_speculative_tokens=3",
                              f"speculative.peagle.checkpoint={tmp_path}"]).speculative
    drafter, _ = build_drafter(spec, m)
    assert drafter.name == "peagle" and drafter.hidden_layers == tuple(LAYERS)
    static = load_config(None, ["speculative.method=peagle",
                                f"speculative.peagle.checkpoint={tmp_path}",
                                "speculative.tree.kind=static",
                                "speculative.tree.choices=[[0],[1],[0,0]]"]).speculative
    drafter, _ = build_drafter(static, m)
    assert drafter.tree_nodes == 3 and drafter.tree_depth == 2
    with pytest.raises(JaxspecError, match="invalid for a static P-EAGLE tree") as err:
        dataclasses.replace(drafter, tree_children="without_replacement")
    assert "\n" not in str(err.value)


# ---- the loop: greedy identity, the exact sampled law ---------------------------------------

NEW = 20


def tiny_head(target_model, *, layers=(0, 2, 3), seed=0, scale=0.3, **kw):
    """A random P-EAGLE head (one Llama layer of the target's dims) for a tiny jaxspec target."""
    cfg = dataclasses.replace(target_model.cfg, num_layers=1)
    h, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"fc": (h, 3 * h), "norm": (h,), "lm_head": (v, h), "embed": (v, h),
              "mask_hidden": (3 * h,)}
    lshapes = {"input_norm": (h,), "hidden_norm": (h,), "wq": (q, 2 * h), "wk": (kv, 2 * h),
               "wv": (kv, 2 * h), "wo": (h, q), "mlp_norm": (h,), "w_gate": (f, h),
               "w_up": (f, h), "w_down": (h, f)}
    keys = iter(jax.random.split(jax.random.key(seed), 32))

    def draw(name, shape):
        noise = jax.random.normal(next(keys), shape)
        return 1.0 + 0.2 * noise if "norm" in name else scale * noise

    dparams = {k: draw(k, s) for k, s in shapes.items()}
    dparams["layer"] = {k: draw(k, s) for k, s in lshapes.items()}
    dparams["d2t"] = jnp.arange(v, dtype=jnp.int32)
    drafter = PEagleDrafter(cfg=cfg, target_vocab=v, hidden_layers=tuple(layers),
                            norm_before_residual=True, mask_token=v - 1, **kw)
    return drafter, dparams


@pytest.fixture(scope="module")
def greedy_target():
    from tiny import tiny_model

    return tiny_model(seed=2, scale=0.3, eos=(-1,))


DYNAMIC = dict(tree_top_k=2, tree_levels=3, tree_budget=5)


STATIC = dict(tree_choices=((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))


@pytest.mark.parametrize("gamma, tree", [(1, None), (4, None), (3, "dynamic"), (3, "static")])
def test_greedy_peagle_is_token_identical_at_batch_8(greedy_target, gamma, tree):
    """Chains, dynamic trees (one pass gives every depth's law) and static trees of ranks emit
    plain's tokens."""
    from jaxspec.engine.runner import Engine

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, 63, size=n)] for n in (5, 17, 9, 30, 12, 3, 25, 8)]
    plain = Engine(greedy_target).generate(prompts, max_new_tokens=NEW, batch_size=8)
    drafter, dparams = tiny_head(greedy_target, **{"dynamic": DYNAMIC, "static": STATIC}.get(
        tree, {}))
    out = Engine(greedy_target, drafter, dparams, num_speculative_tokens=gamma).generate(
        prompts, max_new_tokens=NEW, batch_size=8)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    steps = sum(r.metrics["num_steps"] for r in out)
    assert steps > 0


V = 8
PROMPT = [1, 2, 3, 4, 5]
FILTERED = dict(temperature=0.6, top_k=6, top_p=0.95, min_p=0.05)
LAW_ROWS = 3000


@pytest.mark.parametrize("kind", ["chain", "broken", "dynamic", "static-top_k", "static-sampled"])
def test_sampled_peagle_has_the_target_law(kind):
    """Sampled output has the target's exact law: each draft is an independent draw from its
    entry's law, which is reported (chains, dynamic trees with sampled children, static trees of
    ranks (one-hot q) or of draws); the broken variant reporting entry 0's law for every draft
    fails at the same settings and sample size."""
    from distribution import FAIL_P, PASS_P, pvalue
    from jaxspec.decode.sampling import SamplingParams
    from tiny import tiny_model

    broken = kind == "broken"
    trees = {"dynamic": dict(tree_top_k=2, tree_levels=2, tree_budget=4,
                             tree_children="sampled")}
    for children in ("top_k", "sampled"):
        trees[f"static-{children}"] = dict(tree_choices=((0,), (1,), (0, 0)),
                                           tree_children=children)
    target = tiny_model(seed=5, scale=0.3, vocab=V, layers=2, hidden=32, eos=(-1,))
    drafter, dparams = tiny_head(target, layers=(0, 1, 1), seed=4, scale=1.5,
                                 report_q_of_first=broken, **trees.get(kind, {}))
    sp = SamplingParams.make(**FILTERED)
    p, results = pvalue(target, drafter, dparams, sp, PROMPT, rows=LAW_ROWS, gamma=2)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    print(f"{kind}: p {p:.2e}, acceptance {accepted / drafted:.2f}")
    assert 0.01 * drafted < accepted < 0.95 * drafted
    assert (p < FAIL_P) if broken else (p > PASS_P)


def test_a_qwen3_draft_layer_is_refused_in_one_line(targets, tmp_path):
    """A draft layer with q/k norms (a Qwen3 transformer_layer_config) is not read as if it had
    none: one line naming the tensors."""
    from jaxspec.formats import load_drafter_checkpoint

    hf, m = targets["qwen3"]
    layer = copy.deepcopy(hf.config)
    layer.num_hidden_layers = 1
    layer.layer_types = ["full_attention"]
    layer._attn_implementation = "eager"
    make_reference(hf, transformer_layer_config=layer).save_pretrained(tmp_path)
    with pytest.raises(JaxspecError) as err:
        load_drafter_checkpoint("peagle", tmp_path, m)
    print(err.value)
    assert "q_norm" in str(err.value) and "\n" not in str(err.value)


# ---- the training recipe (jaxspec.train.peagle) ----------------------------------------------

TRAIN_LAYERS = (0, 2, 3)
DEPTHS = 4


@pytest.fixture(scope="module")
def trained_peagle(greedy_target, tmp_path_factory):
    """A P-EAGLE head trained a few steps on the tiny target's own generations, exported."""
    from jaxspec.train.data import DataConfig, generate_records
    from jaxspec.train.train import TrainConfig, train

    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 63, size=int(n)))) for n in rng.integers(4, 10, 12)]
    records = generate_records(greedy_target, prompts,
                               DataConfig(layers=TRAIN_LAYERS, top_k=4, gen_steps=16),
                               np.asarray([-1]))
    out_dir = tmp_path_factory.mktemp("peagle") / "trained"
    args = {"hidden_layers": TRAIN_LAYERS, "num_depths": DEPTHS, "mask_token_id": 5}
    tc = TrainConfig(method="peagle", ckpt_dir=str(out_dir.parent / "ckpt"),
                     export_dir=str(out_dir), steps=24, batch_size=4, seq_len=24, lr=1e-2,
                     warmup=2, save_every=0, draft_vocab=greedy_target.cfg.vocab_size,
                     method_args=args)
    result = train(tc, target=greedy_target, data=records, eval_prompts=[],
                   log=lambda *a: None, progress=False)
    return result, records, out_dir


def test_training_pass_is_the_drafting_pass(greedy_target, trained_peagle):
    """The recipe's loss falls, and what it trains is what drafting runs: at every training
    anchor a, depth d's logits (COD-sampled, nested across depths) equal draft d+1 of the
    exported drafter's one pass at committed length a + 1; the same pass one position later
    (a shifted anchor) differs."""
    from jaxspec.formats import load_drafter_checkpoint

    result, records, out_dir = trained_peagle
    losses = [h["loss"] for h in result.history]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    drafter, dparams = load_drafter_checkpoint("peagle", out_dir, greedy_target)
    assert isinstance(drafter, PEagleDrafter) and drafter.mask_token == 5
    m, t = result.method, greedy_target.target
    tok, batch, frozen = training_inputs(greedy_target, records, drafter)
    depths = m.depth_logits(dparams, frozen, batch, t)
    assert len(depths) == DEPTHS
    order = np.asarray(m.anchor_order(tok))
    checked = 0
    for i, a in enumerate(order[: len(depths[-1][1])][:4]):
        if a + DEPTHS > tok.shape[1] - 1:
            continue
        run = lambda at: np.asarray(_pass_logits(  # noqa: E731
            drafter, dparams, t, greedy_target.params, tok[:, :at], jnp.asarray([at], jnp.int32),
            tok[:, : at + 1], DEPTHS))[0]
        z, shifted = run(int(a)), run(int(a) + 1)
        ours = [np.asarray(depths[0][0][0, a])] + [np.asarray(x[0][0, i]) for x in depths[1:]]
        for d in range(DEPTHS):
            np.testing.assert_allclose(z[d], ours[d], rtol=2e-4, atol=2e-4, err_msg=f"a {a} d {d}")
        assert np.abs(shifted[1] - ours[1]).max() > 1e-2
        checked += 1
    assert checked >= 2


def test_trained_head_exports_in_the_speculators_layout(greedy_target, trained_peagle, tmp_path):
    """`python -m jaxspec.export --format peagle` writes the trained head in the speculators
    layout; read back, it is the same drafter with the same params."""
    from jaxspec.export import export
    from jaxspec.formats import detect_format, load_drafter_checkpoint

    _, _, out_dir = trained_peagle
    export(out_dir, "peagle", tmp_path / "head", target=greedy_target)
    assert detect_format(tmp_path / "head") == "peagle"
    mine, ours = load_drafter_checkpoint("peagle", out_dir, greedy_target)
    theirs, back = load_drafter_checkpoint("peagle", tmp_path / "head", greedy_target)
    assert theirs == mine
    assert set(ours) == set(back)
    for key in ours:
        for x, y in zip(jax.tree.leaves(ours[key]), jax.tree.leaves(back[key])):
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                       rtol=1e-6, err_msg=key)
