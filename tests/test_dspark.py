"""DSpark (method `dspark`): parity of the draft logits and confidences with the reference package
(`speculators` 0.9.0 on PyPI, torch) for every sequential-head variant and both slot conventions,
the speculators layout read and written, bad checkpoints refused in one line, and the loop:
greedy identical to plain at batch 8, the sampled law exact (a broken q seen failing).

Error measure: speculators_ref.rel_err.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import import_torch
from jaxspec.drafters.base import DraftContext
from jaxspec.errors import JaxspecError
from jaxspec.formats import dspark as fmt
from jaxspec.models import base
from speculators_ref import (Lazy, assert_same_tensors, edited, import_reference, load_targets,
                             rel_err, same_params, training_inputs)

torch = import_torch()




ref = Lazy(lambda: import_reference("dspark"))
ref_core = Lazy(lambda: (ref._get(), sys.modules["speculators.models.dspark.core"])[1])

TOL = 1e-4
BLOCK = 4
MASK = 95
RANK = 8




@pytest.fixture(scope="module")
def targets(tiny_qwen3_dir, tiny_llama_dir):
    return load_targets(torch, {"qwen3": tiny_qwen3_dir, "llama": tiny_llama_dir})


def make_reference(hf, kind, anchor, *, layers=(0, 1), seed=0, **overrides):
    """A random-weight DSparkDraftModel over the target hf (its layer config, 2 draft layers),
    with the target's embedding and LM head, as from_training_args builds one."""
    import copy

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = copy.deepcopy(hf.config)
    layer.num_hidden_layers = 2
    layer._attn_implementation = "eager"
    if getattr(layer, "layer_types", None):
        layer.layer_types = ["full_attention"] * 2
    kw = dict(transformer_layer_config=layer, draft_vocab_size=layer.vocab_size,
              block_size=BLOCK, aux_hidden_state_layer_ids=list(layers), mask_token_id=MASK,
              sample_from_anchor=anchor, markov_rank=RANK, markov_head_type=kind,
              speculators_config=SpeculatorsConfig(
                  algorithm="dspark", default_proposal_method="greedy",
                  proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
                  verifier=VerifierConfig(name_or_path=None, architectures=[])))
    kw |= overrides
    torch.manual_seed(seed)
    model = ref.DSparkDraftModel(ref.DSparkSpeculatorConfig(**kw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            scale = 1.0 if "markov_w1" in name else 0.15
            p.copy_(1.0 + 0.2 * noise if "norm" in name else scale * noise)
        model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
        model.lm_head.weight.copy_(hf.lm_head.weight)
    return model


PROMPTS = [[5, 17, 90, 3, 42, 7, 60, 31, 8], [11, 85, 64, 2, 19]]
NEXT = [77, 12]  # the last committed token of each row (the anchor)
CONT = [[33, 9, 50, 21, 4], [70, 6, 88, 13, 40]]  # the block's true continuation


def reference_outputs(model, hf, prompt, nxt, cont):
    """The reference training forward's block at the anchor (one anchor, its true block):
    (logits [BLOCK, V] with the Markov bias, confidence logits [BLOCK] or None)."""
    ids = torch.tensor([prompt + [nxt] + cont[:BLOCK]])
    t, p = ids.shape[1], len(prompt)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in model.target_layer_ids], dim=-1)
        loss_mask = torch.zeros(1, t, dtype=torch.long)
        loss_mask[0, p] = 1  # the only anchor select_anchors can pick
        seen = {}

        def capture(logits, targets, confidence_logits, *args, **kwargs):
            seen["logits"], seen["conf"] = logits, confidence_logits
            return torch.zeros(()), {}

        orig, ref_core.compute_metrics = ref_core.compute_metrics, capture
        try:
            model(feats, ids, loss_mask, torch.zeros(1, t, hf.config.hidden_size),
                  torch.zeros(1, t, dtype=torch.long), max_anchors=1)
        finally:
            ref_core.compute_metrics = orig
    conf = seen["conf"]
    return seen["logits"][0].numpy(), None if conf is None else conf[0].numpy()


def batch_inputs():
    b, p = len(PROMPTS), max(map(len, PROMPTS))
    padded = np.zeros((b, p), np.int32)
    tokens = np.zeros((b, p + 1), np.int32)
    for i, (row, nxt) in enumerate(zip(PROMPTS, NEXT)):
        padded[i, : len(row)] = row
        tokens[i, : len(row) + 1] = [*row, nxt]
    plens = jnp.asarray([len(r) for r in PROMPTS], jnp.int32)
    return jnp.asarray(padded), plens, jnp.asarray(tokens)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _teacher_forced(drafter, dparams, target, params, padded, plens, tokens, drafts):
    tparams = base.bind(target, params)
    cache = target.init_cache(params, padded.shape[0], 32)
    out = target.forward(params, padded, cache, taps=drafter.hidden_layers)
    state = drafter.init(dparams, tparams, padded, plens, out.taps, 32)
    ctx = DraftContext(tokens, plens + 1, jnp.ones(plens.shape, bool))
    return drafter.teacher_forced(dparams, tparams, state, ctx, drafts)


def jaxspec_outputs(drafter, dparams, m):
    padded, plens, tokens = batch_inputs()
    drafts = jnp.asarray([c[: drafter.max_drafts] for c in CONT], jnp.int32)
    z, conf = _teacher_forced(drafter, dparams, m.target, m.params, padded, plens, tokens, drafts)
    return np.asarray(z), None if conf is None else np.asarray(conf)


CASES = {  # name: (target, head type, sample_from_anchor, config overrides)
    "qwen3-vanilla": ("qwen3", "vanilla", True, {}),
    "qwen3-gated": ("qwen3", "gated", True, {}),
    "qwen3-rnn": ("qwen3", "rnn", True, {}),
    "llama-vanilla": ("llama", "vanilla", True, {}),
    "llama-rnn-not-anchor": ("llama", "rnn", False, {}),
    "qwen3-gated-not-anchor-plain-confidence": ("qwen3", "gated", False,
                                                {"confidence_head_with_markov": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draft_logits_and_confidence_match_reference(case, targets, tmp_path):
    """jaxspec reads the speculators layout and, on the true block (the reference's training
    view), gives every slot's biased logits and confidence logit within 1e-4 for each row of a
    mixed-length batch; with the sequential head's output weights zeroed it does not (the test
    sees the bias)."""
    tname, kind, anchor, overrides = CASES[case]
    hf, m = targets[tname]
    model = make_reference(hf, kind, anchor, **overrides)
    model.save_pretrained(tmp_path)
    drafter, dparams = fmt.read(tmp_path, m.target)
    assert drafter.heads.markov_type == kind and drafter.heads.sample_from_anchor == anchor
    z, conf = jaxspec_outputs(drafter, dparams, m)
    unbiased = {**dparams, "markov": {**dparams["markov"],
                                      "w2": jnp.zeros_like(dparams["markov"]["w2"])}}
    z0, _ = jaxspec_outputs(drafter, unbiased, m)
    for row, (prompt, nxt, cont) in enumerate(zip(PROMPTS, NEXT, CONT)):
        ref_z, ref_conf = reference_outputs(model, hf, prompt, nxt, cont)
        first = 0 if anchor else 1  # slot 0 predicts nothing without sample_from_anchor
        err = rel_err(z[row, first:], ref_z[first:])
        cerr = rel_err(conf[row, first:], ref_conf[first:])
        print(f"{case} row {row}: logits rel err {err:.1e}, confidence {cerr:.1e}, "
              f"unbiased {rel_err(z0[row, first:], ref_z[first:]):.1e}")
        assert err < TOL and cerr < TOL
        assert rel_err(z0[row, first:], ref_z[first:]) > 100 * TOL


def test_written_head_loads_in_the_reference_and_reads_back(targets, tmp_path):
    """fmt.write's directory loads with DSparkDraftModel.from_pretrained (its config validated by
    speculators) and reads back to the same drafter and params."""
    hf, m = targets["qwen3"]
    model = make_reference(hf, "rnn", True)
    model.save_pretrained(tmp_path / "a")
    drafter, dparams = fmt.read(tmp_path / "a", m.target)
    fmt.write(tmp_path / "b", drafter, dparams)
    loaded = ref.DSparkDraftModel.from_pretrained(tmp_path / "b")
    assert loaded.config.markov_head_type == "rnn" and loaded.config.markov_rank == RANK
    theirs = {k: v for k, v in model.state_dict().items() if k in loaded.state_dict()
              and "embed" not in k and "lm_head" not in k and "verifier" not in k}
    assert_same_tensors(loaded, theirs)
    again, params2 = fmt.read(tmp_path / "b", m.target)
    assert again == drafter
    assert same_params(dparams, params2)




@pytest.mark.parametrize("change, message", [
    ({"speculators_model_type": "peagle2"}, "type 'peagle2' is not supported"),
    ({"markov_head_type": "lstm"}, "markov_head_type='lstm' is unknown"),
    ({"aux_hidden_state_layer_ids": [0, 9]}, "aux_hidden_state_layer_ids [0, 9] must be"),
    ({"block_size": 1, "sample_from_anchor": False}, "block_size 1 drafts nothing"),
])
def test_bad_checkpoints_are_refused_in_one_line(change, message, targets, tmp_path):
    from jaxspec.formats import detect_format, load_drafter_checkpoint

    hf, m = targets["qwen3"]
    make_reference(hf, "vanilla", True).save_pretrained(tmp_path / "a")
    assert detect_format(tmp_path / "a") == "dspark"
    bad = edited(tmp_path / "a", tmp_path / "b", **change)
    with pytest.raises(JaxspecError) as err:
        load_drafter_checkpoint("dspark", bad, m)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_block_size_over_the_head_is_refused(targets, tmp_path):
    hf, m = targets["qwen3"]
    make_reference(hf, "vanilla", False).save_pretrained(tmp_path)
    drafter, dparams = fmt.read(tmp_path, m.target)
    from jaxspec.engine.runner import Engine

    with pytest.raises(JaxspecError, match="num_speculative_tokens=4 exceeds"):
        Engine(m, drafter, dparams, num_speculative_tokens=BLOCK).generate(
            [[1, 2]], max_new_tokens=2)


# ---- the loop: greedy identity, the exact sampled law ---------------------------------------

NEW = 20


def tiny_head(target, kind="vanilla", *, anchor=True, block=BLOCK, seed=0, layers=(0, 1),
              scale=0.5, **kw):
    """A random DSpark head for a tiny jaxspec target (models.base.Target)."""
    from jaxspec.drafters import dflash_forward as net
    from jaxspec.drafters import dspark_heads as hd
    from jaxspec.drafters.dspark import DSparkDrafter

    spec = net.make_spec(target.layer_config, target.num_layers, num_layers=2, block_size=block,
                         mask_token_id=target.vocab_size - 1, target_layer_ids=layers)
    heads = hd.HeadSpec(markov_rank=4, markov_type=kind, sample_from_anchor=anchor)
    k1, k2 = jax.random.split(jax.random.key(seed))
    dparams = net.init_params(spec, k1) | hd.init_params(
        heads, k2, target.hidden_size, target.vocab_size, scale)
    return DSparkDrafter(spec, target.vocab_size, heads=heads, **kw), dparams


@pytest.fixture(scope="module")
def greedy_target():
    from tiny import tiny_model

    return tiny_model(seed=2, scale=0.3, eos=(-1,))


@pytest.fixture(scope="module")
def mixed_prompts():
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(1, 63, size=n)] for n in (5, 17, 9, 30, 12, 3, 25, 8)]


TREE = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
DYNAMIC = dict(tree_top_k=2, tree_levels=3, tree_budget=5)


@pytest.fixture(scope="module")
def plain(greedy_target, mixed_prompts):
    from jaxspec.engine.runner import Engine

    return Engine(greedy_target).generate(mixed_prompts, max_new_tokens=NEW, batch_size=8)


@pytest.mark.parametrize("kind, anchor, cost, shape", [
    ("vanilla", True, 0.0, {}), ("rnn", False, 0.0, {}), ("gated", True, 0.3, {}),
    ("vanilla", False, 0.0, {"tree_choices": TREE}), ("gated", True, 0.0, DYNAMIC)])
def test_greedy_dspark_is_token_identical_at_batch_8(greedy_target, mixed_prompts, plain, kind,
                                                     anchor, cost, shape):
    """Greedy chains of every head type and slot convention emit plain's tokens, and so do
    confidence-scheduled verification (cost > 0, whose per-row lengths then vary), a static
    tree and a dynamic tree (the bias along each path)."""
    from jaxspec.engine.runner import Engine

    drafter, dparams = tiny_head(greedy_target.target, kind, anchor=anchor, layers=(0, 2),
                                 cost_per_draft=cost, variable_length=cost > 0,
                                 online_calibration=2.0 if cost > 0 else 0.0, **shape)
    engine = Engine(greedy_target, drafter, dparams, num_speculative_tokens=3)
    out = engine.generate(mixed_prompts, max_new_tokens=NEW, batch_size=8)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    drafted = sum(r.metrics["num_draft_tokens"] for r in out)
    steps = sum(r.metrics["num_steps"] for r in out)
    print(f"{kind} cost {cost}: {drafted / steps:.2f} drafts verified per step")
    if cost > 0:
        assert 0 < drafted < 3 * steps
    if shape:  # trees keep no record: chains only
        return
    for r in out:  # the lengths chosen, and acceptance per position, as the loop counted them
        m = r.metrics
        hist = m["verify_length_hist"]
        assert sum(hist) == m["num_steps"]
        assert sum(k * c for k, c in enumerate(hist)) == m["num_draft_tokens"]
        per_pos = np.asarray(m["accepted_per_position"]) * m["num_steps"]  # [γ] counts
        seen = [o * n if n else 0.0 for o, n in zip(m["confidence_observed_per_position"],
                                                    m["confidence_steps_per_position"])]
        np.testing.assert_allclose(seen[: len(per_pos)], per_pos, atol=0.01)  # 4 decimals
        assert all(p is None or 0 <= p <= 1 for p in m["confidence_predicted_per_position"])


def test_scheduled_length_maximises_tokens_per_cost():
    """Sure drafts are all verified, hopeless ones none; in between the length follows the
    cost: E(k) = 1 + sum of survivals, k = argmax E(k) / (1 + c k)."""
    from jaxspec.drafters import dspark_heads as hd

    logit = lambda p: float(np.log(p / (1 - p)))  # noqa: E731
    conf = jnp.asarray([[logit(0.999)] * 4, [logit(0.01)] * 4, [logit(0.9), logit(0.5),
                                                                logit(0.2), logit(0.2)]])
    np.testing.assert_array_equal(hd.scheduled_length(conf, 0.2), [4, 0, 2])
    # row 3 at cost 0.05: survivals .9, .45, .09, .018 -> E/cost 1.81, 2.14, 2.12, 2.05
    assert int(hd.scheduled_length(conf, 0.05)[2]) == 2
    assert int(hd.scheduled_length(conf, 0.0)[2]) == 4  # free drafts: verify all
    # a calibrated curve instead of the line: flat up to 3 drafts, then steep
    np.testing.assert_array_equal(hd.scheduled_length(conf, [1.0, 1.0, 1.0, 1.0, 9.0]),
                                  [3, 3, 3])
    # one length for the batch (its window is shared): argmax of the active rows' summed E(k)
    # over the cost; rows 0 + 2 at c 0.2: 2, 3.25, 3.82, 4.02, 4.14 -> 4 (row 2 alone: 2);
    # rows 1 + 2: 2, 2.43, 2.40, ... -> 1; an inactive row verifies nothing
    shared = lambda act: hd.scheduled_length(conf, 0.2, jnp.asarray(act), shared=True)  # noqa: E731
    np.testing.assert_array_equal(shared([True, False, True]), [4, 0, 4])
    np.testing.assert_array_equal(shared([False, True, True]), [0, 1, 1])
    # curves measured at batch 1 and 8: batch 4 prices between them, batch 16 as 8
    by_batch = ((8, (1.0, 2.0, 3.0)), (1, (1.0, 1.2, 1.4)))
    np.testing.assert_allclose(hd.curve_at(by_batch, 4), (1.0, 1.2 + 0.8 * 3 / 7,
                                                          1.4 + 1.6 * 3 / 7))
    assert hd.curve_at(by_batch, 16) == (1.0, 2.0, 3.0) and hd.curve_at(by_batch, 1)[1] == 1.2
    # online correction: no evidence leaves the head's survival; a batch that accepted half of
    # what it predicted at position 0 and a third at position 1 scales them (prior 2 each
    # side: (5 + 2) / (12 + 2), (2 + 2) / (10 + 2)); kept in [0, 1] and non-increasing
    c = hd.init_calibration(2, 3)
    s = jnp.asarray([[0.9, 0.6, 0.3], [0.8, 0.8, 0.1]])
    np.testing.assert_allclose(hd.corrected_survival(c, s, 2.0), [[0.9, 0.6, 0.3],
                                                                   [0.8, 0.8, 0.1]])
    c = c._replace(predicted=jnp.asarray([[6.0, 5.0, 0.0], [6.0, 5.0, 0.0]]),
                   observed=jnp.asarray([[3.0, 1.0, 0.0], [2.0, 1.0, 0.0]]))
    np.testing.assert_allclose(hd.corrected_survival(c, s, 2.0), [
        [0.45, 0.2, 0.2], [0.4, 0.8 / 3, 0.1]], rtol=1e-5)
    # an overconfident head's correction shortens the schedule (row 2 above: 2 -> 0 at c 0.2)
    few = hd.corrected_survival(c._replace(predicted=jnp.full((2, 4), 9.0),
                                           observed=jnp.full((2, 4), 1.0)),
                                hd.survival(conf), 2.0)
    assert int(hd.scheduled_length(conf, 0.2, s=few)[2]) < 2
    drafter, _ = tiny_head_spec_only()
    with pytest.raises(JaxspecError, match="lacks: set it to 0"):
        dataclasses.replace(drafter, cost_per_draft=0.3)


def tiny_head_spec_only():
    """A DSpark drafter without a confidence head (no params needed)."""
    from jaxspec.drafters import dflash_forward as net
    from jaxspec.drafters import dspark_heads as hd
    from jaxspec.drafters.dspark import DSparkDrafter
    from tiny import tiny_model

    t = tiny_model(seed=2, vocab=16, layers=2, hidden=32).target
    spec = net.make_spec(t.layer_config, t.num_layers, num_layers=1, block_size=BLOCK,
                         mask_token_id=0, target_layer_ids=(0,))
    heads = hd.HeadSpec(markov_rank=4, confidence=False)
    return DSparkDrafter(spec, t.vocab_size, heads=heads), None


V = 8
PROMPT = [1, 2, 3, 4, 5]
FILTERED = dict(temperature=0.6, top_k=6, top_p=0.95, min_p=0.05)
LAW_ROWS = 3000


@pytest.fixture(scope="module")
def law_target():
    from tiny import tiny_model

    return tiny_model(seed=5, scale=0.3, vocab=V, layers=2, hidden=32, eos=(-1,))


@pytest.mark.parametrize("kind", ["gated-scheduled", "gated-tree", "broken-gated"])
def test_sampled_dspark_has_the_target_law(law_target, kind):
    """Sampled output has the target's exact law: each draft is drawn from its Markov-biased
    law given the draft before it, and that law is reported (here with confidence-scheduled
    per-row lengths); the broken variant that reports
    the backbone's law without the bias fails at the same settings and sample size."""
    from distribution import FAIL_P, PASS_P, pvalue
    from jaxspec.decode.sampling import SamplingParams

    broken = kind.startswith("broken")
    scheduled = kind.endswith("-scheduled")  # per-row lengths from the confidence head
    head_type = kind.removeprefix("broken-").split("-")[0]
    drafter, dparams = tiny_head(law_target.target, head_type, block=3, seed=4, scale=3.0,
                                 report_unbiased_q=broken, cost_per_draft=0.3 * scheduled,
                                 variable_length=scheduled, share_length=False)
    if kind.endswith("-tree"):  # sampled children: each node a draw from its biased law
        drafter = dataclasses.replace(drafter, tree_choices=((0,), (1,), (0, 0), (1, 0)),
                                      tree_children="sampled")
    sp = SamplingParams.make(**FILTERED)
    p, results = pvalue(law_target, drafter, dparams, sp, PROMPT, rows=LAW_ROWS, gamma=2)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    print(f"{kind}: p {p:.2e}, acceptance {accepted / drafted:.2f}")
    assert 0.02 * drafted < accepted < 0.95 * drafted
    assert (p < FAIL_P) if broken else (p > PASS_P)


def spec_of(*overrides):
    from jaxspec.config import load_config

    base_ = ["speculative.method=dspark", "speculative.num_speculative_tokens=3"]
    return load_config(None, [*base_, *overrides]).speculative


def test_config_builds_the_head_with_its_schedule_and_trees(targets, tmp_path):
    """speculative.method=dspark reads the speculators layout through the config; the scheduler
    and trees are set from it; a scheduler without a confidence head, an RNN head as a tree and a
    tree depth past the block are refused in one line."""
    from jaxspec.build import build_drafter

    hf, m = targets["qwen3"]
    make_reference(hf, "gated", True).save_pretrained(tmp_path / "gated")
    make_reference(hf, "rnn", True, enable_confidence_head=False,
                   confidence_head_with_markov=False).save_pretrained(tmp_path / "rnn")
    head = f"speculative.dspark.checkpoint={tmp_path / 'gated'}"
    drafter, _ = build_drafter(spec_of(head, "speculative.dspark.cost_per_draft=0.2"), m)
    assert drafter.name == "dspark" and drafter.cost_per_draft == 0.2 and drafter.variable_length
    curves = "speculative.dspark.step_costs={1: [1, 1.1, 1.2, 1.3, 1.4], 8: [1, 1.5, 2, 2.5, 3]}"
    drafter, _ = build_drafter(spec_of(head, curves), m)
    assert drafter.costs_at(8) == (1.0, 1.5, 2.0, 2.5, 3.0) and drafter.scheduled
    tree = ["speculative.tree.kind=static", "speculative.tree.choices=[[0],[1],[0,0]]"]
    assert build_drafter(spec_of(head, *tree), m)[0].tree_nodes == 3
    dynamic = ["speculative.tree.kind=dynamic", "speculative.tree.top_k=2",
               "speculative.tree.budget=5"]
    rnn = f"speculative.dspark.checkpoint={tmp_path / 'rnn'}"
    for overrides, message in (
            ((rnn, "speculative.dspark.cost_per_draft=0.2"), "which this DSpark head lacks"),
            ((head, "speculative.dspark.step_costs={1: [1, 1.1], 8: [1, 2, 3, 4]}"),
             "holds 2 costs"),
            ((rnn, *tree), "RNN DSpark head drafts chains only"),
            ((head, *dynamic, "speculative.tree.depth=5"), "drafts at most 4 positions")):
        with pytest.raises(JaxspecError, match=message) as err:
            build_drafter(spec_of(*overrides), m)
        assert "\n" not in str(err.value)


# ---- the training recipe (jaxspec.train.dspark) ----------------------------------------------


@pytest.fixture(scope="module")
def trained_dspark(greedy_target, tmp_path_factory):
    """A DSpark head trained a few steps on the tiny target's own generations, exported."""
    from jaxspec.train.data import DataConfig, generate_records
    from jaxspec.train.train import TrainConfig, train

    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 63, size=int(n)))) for n in rng.integers(4, 10, 12)]
    records = generate_records(greedy_target, prompts,
                               DataConfig(layers=(1, 2), top_k=4, gen_steps=16), np.asarray([-1]))
    out_dir = tmp_path_factory.mktemp("dspark") / "trained"
    args = {"hidden_layers": (1, 2), "block_size": 4, "num_layers": 1, "intermediate_size": 64,
            "anchors": 6, "markov_rank": 8, "markov_type": "gated", "own_drafts": 0.5}
    tc = TrainConfig(method="dspark", ckpt_dir=str(out_dir.parent / "ckpt"),
                     export_dir=str(out_dir), steps=24, batch_size=4, seq_len=24, lr=1e-2,
                     warmup=2, save_every=0, draft_vocab=greedy_target.cfg.vocab_size,
                     method_args=args)
    result = train(tc, target=greedy_target, data=records, eval_prompts=[],
                   log=lambda *a: None, progress=False)
    return result, records, out_dir


def test_training_walk_is_the_runtime_walk(greedy_target, trained_dspark):
    """The recipe's loss falls, and what it trains is what drafting runs: for each training
    anchor a, the biased logits and confidences of block entries 1..G-1 (the sequential head fed
    the true previous tokens) equal the exported drafter's teacher-forced walk at committed
    length a + 1 over the same drafts (a shifted previous token or slot would differ). With the
    training-time test on every block (own_drafts 1), entry i reads the walk's own greedy draft
    i - 1: equal to the runtime walk over those drafts."""
    from jaxspec.formats import load_drafter_checkpoint

    result, records, out_dir = trained_dspark
    losses = [h["loss"] for h in result.history]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    drafter, dparams = load_drafter_checkpoint("dspark", out_dir, greedy_target)
    assert drafter.heads.markov_type == "gated" and drafter.max_drafts == 3
    m, t = result.method, greedy_target.target
    tok, batch, frozen = training_inputs(greedy_target, records, drafter)
    blocks = m.block_forward(dparams, frozen, batch, t)
    z_train, conf_train = dataclasses.replace(m, own_drafts=0.0).sequential(dparams, blocks)
    z_own, conf_own = dataclasses.replace(m, own_drafts=1.0).sequential(dparams, blocks,
                                                                        frozen["d2t"])
    g = m.block_size
    checked = 0
    for j, a in enumerate(np.asarray(m.anchor_positions(tok))):
        if a + g > tok.shape[1]:
            continue
        padded, plens = tok[:, :a], jnp.asarray([a], jnp.int32)
        drafts = tok[:, a + 1: a + g]
        own = jnp.argmax(z_own[:, j], -1).astype(jnp.int32)  # [1, G-1] its greedy drafts
        for given, z_ref, conf_ref in ((drafts, z_train, conf_train), (own, z_own, conf_own)):
            z, conf = _teacher_forced(drafter, dparams, t, greedy_target.params, padded, plens,
                                      tok[:, : a + 1], given)
            np.testing.assert_allclose(np.asarray(z[0, 1:]), np.asarray(z_ref[0, j]),
                                       rtol=2e-4, atol=2e-4)
            np.testing.assert_allclose(np.asarray(conf[0, 1:]), np.asarray(conf_ref[0, j]),
                                       rtol=2e-4, atol=2e-4)
        checked += int(jnp.any(own[0, :-1] != drafts[0, :-1]))
    assert checked, "no anchor where the own drafts differ from the true tokens"


def test_trained_head_exports_in_the_speculators_layout(greedy_target, trained_dspark, tmp_path):
    """`python -m jaxspec.export --format dspark` writes the trained head in the speculators
    layout; read back, it is the same drafter with the same params."""
    from jaxspec.export import export
    from jaxspec.formats import load_drafter_checkpoint

    _, _, out_dir = trained_dspark
    export(out_dir, "dspark", tmp_path / "head", target=greedy_target)
    mine, ours = load_drafter_checkpoint("dspark", out_dir, greedy_target)
    theirs, back = load_drafter_checkpoint("dspark", tmp_path / "head", greedy_target)
    assert theirs.heads == mine.heads and theirs.spec.target_layer_ids == mine.spec.target_layer_ids
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(back)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=1e-6)


def test_bench_pools_the_calibration_by_verified_steps():
    """The benchmark's calibration report weights each row by the steps that verified each
    position (a row that verified position 2 once must not count as much as one that did 9
    times); rows without a record give no report."""
    from jaxspec.bench.rows import calibration

    a = {"confidence_predicted_per_position": [0.5, 0.2], "confidence_observed_per_position":
         [1.0, 0.0], "confidence_steps_per_position": [1, 1], "verify_length_hist": [0, 0, 1]}
    b = {"confidence_predicted_per_position": [0.3, None], "confidence_observed_per_position":
         [0.0, None], "confidence_steps_per_position": [9, 0], "verify_length_hist": [0, 9, 0]}
    out = calibration([a, b, {"num_steps": 3}])
    assert out["confidence_predicted_per_position"] == [0.32, 0.2]
    assert out["confidence_observed_per_position"] == [0.1, 0.0]
    assert out["confidence_steps_per_position"] == [10, 1]
    assert out["verify_length_hist"] == [0, 9, 1]
    assert calibration([{"num_steps": 3}]) == {}


def test_served_metrics_report_the_calibration(tmp_path):
    """A scheduled DSpark chain behind the server on loopback: /metrics counts, per request as
    it ends, the steps by chosen verify length (summing to the request's steps and drafts), and
    per draft position the steps that verified it, its acceptances (summing to the accepted
    tokens) and the predicted survival; two requests through one slot: each adds its own."""
    import httpx

    from loopback import NAME, byte_chat_model, listening
    from test_server_ops import scrape
    from jaxspec.engine.runner import Engine
    from jaxspec.serving import Server
    from jaxspec.serving.http import make_app

    model = byte_chat_model(tmp_path)
    drafter, dparams = tiny_head(model.target, "gated", cost_per_draft=0.1,
                                 variable_length=True, online_calibration=2.0)
    engine = Engine(model, drafter, dparams, num_speculative_tokens=3, max_context=96)
    server = Server(engine, slots=1, max_context=96, steps_per_call=4, max_queue=4,
                    model_name=NAME)
    try:
        with listening(make_app(server)) as url:
            for prompt in ([97, 98, 99, 97, 98, 99], [100, 101, 102]):
                before = scrape(url)
                body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
                usage = httpx.post(url + "/v1/completions", json=body, timeout=300).json()[
                    "usage"]["speculative"]
                after = scrape(url)

                def moved(name, **labels):
                    key = (name, tuple(sorted((labels | {"method": "dspark"}).items())))
                    return after.get(key, 0) - before.get(key, 0)

                hist = [moved("jaxspec_spec_verify_length_steps_total", length=str(k))
                        for k in range(4)]
                assert sum(hist) == usage["num_steps"] > 0
                assert sum(k * c for k, c in enumerate(hist)) == usage["num_draft_tokens"]
                steps = [moved("jaxspec_spec_confidence_steps_total", position=str(i))
                         for i in range(3)]
                assert steps == [sum(hist[i + 1:]) for i in range(3)]
                seen = [moved("jaxspec_spec_confidence_observed_total", position=str(i))
                        for i in range(3)]
                assert sum(seen) == usage["num_accepted_tokens"]
                for i in range(3):
                    predicted = moved("jaxspec_spec_confidence_predicted_total", position=str(i))
                    assert 0 <= seen[i] <= steps[i] and 0 <= predicted <= steps[i] + 1e-3
                    used = moved("jaxspec_spec_confidence_used_total", position=str(i))
                    assert 0 <= used <= steps[i] + 1e-3
    finally:
        server.close()
