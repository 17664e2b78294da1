"""DFlash (method `dflash`): parity of the draft network with the reference package (`dflash`
0.1.0 on PyPI, torch), the authors' layout read and written, lossless sampling in the loop.

Error measure: max |ours - theirs| / max |theirs| over the compared draft logits.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import import_torch
from jaxspec.drafters.base import DraftContext
from jaxspec.errors import JaxspecError
from jaxspec.formats import dflash as fmt
from jaxspec.loading import load_model
from jaxspec.models import base
from speculators_ref import Lazy

torch = import_torch()
dflash_ref = Lazy(lambda: pytest.importorskip("dflash.model"))

TOL = 1e-4
BLOCK = 5
MASK = 95


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def draft_config(num_target_layers, version=1, **overrides):
    from transformers import Qwen3Config

    dc = {"target_layer_ids": [0, num_target_layers - 1], "block_size": BLOCK,
          "mask_token_id": MASK, "input_embedding_scale": 1.5, "output_multiplier": 0.8}
    arch = "DFlashDraftModel"
    if version == 2:
        arch = "DFlash2DraftModel"
        dc |= {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8,
               "selector_top_k": 6}
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-6,
              max_position_embeddings=128, architectures=[arch])
    kw |= overrides
    cfg = Qwen3Config(**kw)
    cfg.num_target_layers = num_target_layers
    cfg.dflash_config = dc
    return cfg


def make_draft(path, num_target_layers, version=1, seed=0, **overrides):
    """A random-weight reference draft (noisy weights, norms near 1) saved at `path`."""
    cls = dflash_ref.DFlash2DraftModel if version == 2 else dflash_ref.DFlashDraftModel
    torch.manual_seed(seed)
    model = cls(draft_config(num_target_layers, version, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def targets(tiny_qwen3_dir, tiny_llama_dir, tmp_path_factory):
    """name -> (transformers model, jaxspec's load of it): Qwen3 and Llama (vocab 256), and a
    Gemma 3 with sliding layers, tied scaled embeddings and soft norms (vocab 96)."""
    from test_families import hf_model
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in (("qwen3", tiny_qwen3_dir), ("llama", tiny_llama_dir)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (hf, load_model(path, layout="unrolled"))
    gemma = hf_model("gemma3", seed=4)
    path = tmp_path_factory.mktemp("gemma3")
    gemma.save_pretrained(path)
    out["gemma3"] = (gemma, load_model(path, layout="unrolled"))
    return out


PROMPTS = [[5, 17, 90, 3, 42, 7, 60, 31, 8], [11, 85, 64, 2, 19]]  # ids below every vocabulary
NEXT = [77, 12]  # the last committed token of each row (sampled, not yet run by the target)


def raw_input_embeddings(hf, ids, scale):
    """The block's noise embedding as the reference forms it: the target's embedding table read
    by id (not the embedding module's forward, which some families scale), times `scale`."""
    return torch.nn.functional.embedding(ids, hf.get_input_embeddings().weight) * scale


def reference_logits(model, hf, prompt, nxt):
    """The reference's draft logits for the block after `prompt` + [nxt]: [BLOCK - 1, V]."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        ctx = dflash_ref.extract_context_feature(out.hidden_states, model.target_layer_ids)
        blk = torch.tensor([[nxt] + [MASK] * (BLOCK - 1)])
        scale = float(model.config.dflash_config.get("input_embedding_scale", 1.0))
        noise = raw_input_embeddings(hf, blk, scale)
        pos = torch.arange(len(prompt) + BLOCK)[None]
        h = model(target_hidden=ctx, noise_embedding=noise, position_ids=pos)
        return model.compute_logits(h[:, 1:], hf.lm_head)[0].numpy()


def jaxspec_logits(drafter, dparams, m, capacity=32):
    """jaxspec's draft logits for the same blocks, the rows batched with mixed lengths."""
    padded, plens, tokens = batch_inputs()
    return _draft_logits(drafter, dparams, m.target, m.params, padded, plens, tokens, capacity)


@functools.partial(jax.jit, static_argnums=(0, 2, 7))
def _draft_logits(drafter, dparams, target, params, padded, plens, tokens, capacity):
    tparams = base.bind(target, params)
    cache = target.init_cache(params, padded.shape[0], capacity)
    out = target.forward(params, padded, cache, taps=drafter.hidden_layers)
    state = drafter.init(dparams, tparams, padded, plens, out.taps, capacity)
    ctx = DraftContext(tokens, plens + 1, jnp.ones(plens.shape, bool))
    return drafter.draft_logits(dparams, tparams, state, ctx, BLOCK - 1)


CASES = {  # name: (target, version, draft config overrides)
    "qwen3": ("qwen3", 1, {}),
    "llama": ("llama", 1, {}),
    "gemma3": ("gemma3", 1, {"vocab_size": 96}),
    # layer 0 slides (window 3) and so is causal; layer 1 is bidirectional
    "qwen3-sliding": ("qwen3", 1, {"layer_types": ["sliding_attention", "full_attention"],
                                   "sliding_window": 3, "use_sliding_window": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draft_logits_match_reference(case, targets, tmp_path):
    """jaxspec reads the authors' layout and drafts the reference's logits (within 1e-4) for
    each row of a mixed-length batch; the same head with its block attention made causal does
    not (so the test sees the bidirectional block)."""
    tname, version, overrides = CASES[case]
    hf, m = targets[tname]
    model = make_draft(tmp_path, m.target.num_layers, version, **overrides)
    drafter, dparams = fmt.read(tmp_path, m.target)
    ours = np.asarray(jaxspec_logits(drafter, dparams, m))
    causal = np.asarray(jaxspec_logits(
        dataclasses.replace(drafter, causal_override=True), dparams, m))
    unwindowed = None
    if any(drafter.spec.windows):  # and with the sliding window ignored, it does not either
        spec = dataclasses.replace(drafter.spec, windows=(None,) * drafter.spec.num_layers)
        unwindowed = np.asarray(jaxspec_logits(dataclasses.replace(drafter, spec=spec), dparams, m))
    for row, (prompt, nxt) in enumerate(zip(PROMPTS, NEXT)):
        ref = reference_logits(model, hf, prompt, nxt)
        err = rel_err(ours[row], ref)
        print(f"{case} row {row}: rel err {err:.2e}, causal variant {rel_err(causal[row], ref):.2e}")
        assert err < TOL
        assert rel_err(causal[row], ref) > 100 * TOL
        if unwindowed is not None:
            assert rel_err(unwindowed[row], ref) > 100 * TOL


@functools.partial(jax.jit, static_argnums=(0, 2, 7))
def _propose(drafter, dparams, target, params, padded, plens, tokens, capacity, sp, keys):
    tparams = base.bind(target, params)
    cache = target.init_cache(params, padded.shape[0], capacity)
    out = target.forward(params, padded, cache, taps=drafter.hidden_layers)
    state = drafter.init(dparams, tparams, padded, plens, out.taps, capacity)
    ctx = DraftContext(tokens, plens + 1, jnp.ones(plens.shape, bool))
    proposal, _ = drafter.propose(dparams, tparams, state, ctx, BLOCK - 1, sp, keys)
    return proposal


def batch_inputs(prompts=PROMPTS, nexts=NEXT):
    b, p = len(prompts), max(map(len, prompts))
    padded = np.zeros((b, p), np.int32)
    tokens = np.zeros((b, p + 1), np.int32)
    for i, (row, nxt) in enumerate(zip(prompts, nexts)):
        padded[i, : len(row)] = row
        tokens[i, : len(row) + 1] = [*row, nxt]
    plens = jnp.asarray([len(r) for r in prompts], jnp.int32)
    return jnp.asarray(padded), plens, jnp.asarray(tokens)


def reference_select(model, hf, prompt, nxt, temperature, path=None):
    """The reference selector's (tokens, q over the vocabulary) for the block after prompt +
    [nxt]; `path`: the tokens its sampler is made to pick (so its q rows follow our path)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        ctx = dflash_ref.extract_context_feature(out.hidden_states, model.target_layer_ids)
        blk = torch.tensor([[nxt] + [MASK] * (BLOCK - 1)])
        noise = raw_input_embeddings(hf, blk, 1.5)
        h = model(target_hidden=ctx, noise_embedding=noise,
                  position_ids=torch.arange(len(prompt) + BLOCK)[None])[:, 1:]
        logits = model.compute_logits(h, hf.lm_head)
        unary, cands = torch.topk(logits, model.candidate_selector.top_k, dim=-1, sorted=False)
        picks = iter([] if path is None else path)

        def pick(q, num_samples, *args, **kwargs):  # torch.multinomial's place: the
            pos = len(q_seen)  # candidate index of our token at this position, [rows, 1]
            q_seen.append(q)
            want = next(picks)
            return (cands[:, pos] == want).int().argmax(-1)[:, None]

        q_seen: list = []
        draw = torch.multinomial  # the reference's sampler draws through it (public torch API)
        torch.multinomial = pick
        try:
            toks, cands2, q = model.propose(h, torch.tensor([nxt]), hf.lm_head, temperature)
        finally:
            torch.multinomial = draw
        assert torch.equal(cands, cands2)
        full = None
        if q is not None:
            full = torch.zeros(q.shape[:-1] + (logits.shape[-1],)).scatter(-1, cands, q)[0]
            full = full.numpy()
        return toks[0].numpy(), full


def test_dflash2_matches_reference(targets, tmp_path):
    """DFlash 2 (grouped dynamic causal convolutions, candidate selector): the draft logits, the
    greedy selector path, and the sampled selector's q rows along our own sampled path equal the
    reference's."""
    from jaxspec.decode.sampling import SamplingParams

    hf, m = targets["qwen3"]
    model = make_draft(tmp_path, m.target.num_layers, version=2)
    drafter, dparams = fmt.read(tmp_path, m.target)
    assert drafter.spec.version == 2
    ours = np.asarray(jaxspec_logits(drafter, dparams, m))
    padded, plens, tokens = batch_inputs()
    keys = jax.random.split(jax.random.key(3), len(PROMPTS))
    greedy = _propose(drafter, dparams, m.target, m.params, padded, plens, tokens, 32,
                      SamplingParams.make(0.0), keys)
    sampled = _propose(drafter, dparams, m.target, m.params, padded, plens, tokens, 32,
                       SamplingParams.make(1.0), keys)
    for row, (prompt, nxt) in enumerate(zip(PROMPTS, NEXT)):
        assert rel_err(ours[row], reference_logits(model, hf, prompt, nxt)) < TOL
        ref_tokens, _ = reference_select(model, hf, prompt, nxt, 0.0)
        np.testing.assert_array_equal(np.asarray(greedy.tokens[row]), ref_tokens)
        path = np.asarray(sampled.tokens[row])
        ref_path, ref_q = reference_select(model, hf, prompt, nxt, 1.0, path=list(path))
        np.testing.assert_array_equal(ref_path, path)
        err = np.abs(np.asarray(sampled.probs[row]) - ref_q).max()
        print(f"row {row}: greedy {ref_tokens}, sampled {path}, q max abs err {err:.1e}")
        assert err < TOL


# ---- jaxspec heads in the loop: exported, read by the reference ------------------------------


def two_token_target(hf_dir, out_dir):
    """The tiny Qwen3 with its final norm cut to one dimension: every greedy token is the max or
    the min of lm_head[:, 0], so a random DFlash head reading the same LM head through the same
    one-dimensional norm agrees with it often (acceptance lengths vary)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.model.norm.weight.zero_()
        hf.model.norm.weight[0] = 1.0
    hf.save_pretrained(out_dir, safe_serialization=True)
    return hf


def jaxspec_head(target, version=1, seed=0, **kw):
    from jaxspec.drafters import dflash_forward as net
    from jaxspec.drafters.dflash import DFlashDrafter

    two = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)
    spec = net.make_spec(target.layer_config, target.num_layers, num_layers=2, block_size=BLOCK,
                         mask_token_id=MASK, target_layer_ids=(0, target.num_layers - 1),
                         intermediate_size=96, **(two if version == 2 else {}), **kw)
    dparams = net.init_params(spec, jax.random.key(seed))
    norm = jnp.zeros_like(dparams["norm"]).at[0].set(1.0)
    return DFlashDrafter(spec, target.vocab_size), dparams | {"norm": norm}


@pytest.mark.parametrize("version", [1, 2])
def test_exported_head_matches_reference_generate(version, tiny_qwen3_dir, tmp_path, monkeypatch):
    """A jaxspec head, written in the authors' layout, loads with DFlashDraftModel
    .from_pretrained; the reference's dflash_generate and jaxspec's loop then emit the same
    greedy tokens in the same number of steps with the same acceptance lengths."""

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # its stats time CUDA
    hf = two_token_target(tiny_qwen3_dir, tmp_path / "target")
    m = load_model(tmp_path / "target", layout="unrolled")
    m = dataclasses.replace(m, eos_token_ids=(-1,)) if dataclasses.is_dataclass(m) else m
    drafter, dparams = jaxspec_head(m.target, version)
    fmt.write(tmp_path / "head", drafter, dparams, m.target.num_layers)
    cls = dflash_ref.DFlash2DraftModel if version == 2 else dflash_ref.DFlashDraftModel
    ref_model = cls.from_pretrained(tmp_path / "head", dtype=torch.float32).eval()
    reread, _ = fmt.read(tmp_path / "head", m.target)
    assert reread == drafter
    assert_reference_generation(ref_model, hf, m, drafter, dparams)


def assert_reference_generation(ref_model, hf, m, drafter, dparams, prompts=PROMPTS):
    """dflash_generate (greedy) and jaxspec's loop: the same tokens, steps, acceptance lengths."""
    from jaxspec.engine.runner import Engine

    engine = Engine(m, drafter, dparams, num_speculative_tokens=BLOCK - 1)
    accepted = 0
    for prompt in prompts:
        ref = dflash_ref.dflash_generate(ref_model, hf, torch.tensor([prompt]), 40, None,
                                         return_stats=True)
        lengths = ref.acceptance_lengths[:-1]  # full blocks only (the last one may be cut)
        n_new = 1 + sum(lengths)
        out = engine.generate([prompt], max_new_tokens=n_new)[0]
        assert out.token_ids == ref.output_ids[0, len(prompt) : len(prompt) + n_new].tolist()
        steps = out.metrics["num_steps"]
        per_pos = [round(c * steps) for c in out.metrics["accepted_per_position"]]
        want = [sum(a - 1 >= i + 1 for a in lengths) for i in range(BLOCK - 1)]
        print(f"{drafter.spec.version} prompt {len(prompt)}: reference lengths {lengths}, ours "
              f"per position {per_pos} in {steps} steps")
        assert steps == len(lengths)
        assert per_pos == want
        accepted += sum(lengths) - len(lengths)
    assert accepted > 0  # drafts were accepted


def test_trained_head_exports_and_runs_in_the_reference(tiny_qwen3_dir, tmp_path, monkeypatch):
    """DFlash's recipe in jaxspec.train lowers the loss; `python -m jaxspec.export --format
    dflash` writes the head in the authors' layout; DFlashDraftModel.from_pretrained loads it and
    the reference's dflash_generate runs step for step as jaxspec's loop."""
    from jaxspec.export import main
    from jaxspec.formats import load_drafter_checkpoint
    from jaxspec.train.data import DataConfig, generate_records
    from jaxspec.train.train import TrainConfig, train

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # its stats time CUDA
    hf = two_token_target(tiny_qwen3_dir, tmp_path / "target")
    m = load_model(tmp_path / "target", layout="unrolled")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 250, size=int(n)))) for n in rng.integers(4, 10, 12)]
    records = generate_records(m, prompts, DataConfig(layers=(1, 2), top_k=4, gen_steps=16),
                               np.asarray([-1]))
    args = {"hidden_layers": (1, 2), "block_size": BLOCK, "num_layers": 1,
            "intermediate_size": 64, "anchors": 6}
    tc = TrainConfig(method="dflash", ckpt_dir=str(tmp_path / "ckpt"),
                     export_dir=str(tmp_path / "trained"), steps=30, batch_size=4, seq_len=24,
                     lr=1e-2, warmup=2, save_every=0, draft_vocab=256, method_args=args)
    out = train(tc, target=m, data=records, eval_prompts=[], log=lambda *a: None, progress=False)
    losses = [h["loss"] for h in out.history]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    drafter, dparams = load_drafter_checkpoint("dflash", tmp_path / "trained", m)
    assert drafter == out.drafter
    assert main(["--checkpoint", str(tmp_path / "trained"), "--format", "dflash", "--out",
                 str(tmp_path / "head"), "--model", str(tmp_path / "target")]) == 0
    ref_model = dflash_ref.DFlashDraftModel.from_pretrained(tmp_path / "head",
                                                            dtype=torch.float32).eval()
    assert_reference_generation(ref_model, hf, m, drafter, dparams)


# ---- the loop: greedy identity, the exact sampled law ---------------------------------------

NEW = 24
TREE = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0))  # per-position ranks, depth 4


def tiny_head(target, version=1, *, block=BLOCK, mask=None, seed=0, layers=(0, 1), top_k=4,
              **kw):
    """A random DFlash head for a tiny jaxspec target (models.base.Target)."""
    from jaxspec.drafters import dflash_forward as net
    from jaxspec.drafters.dflash import DFlashDrafter

    two = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=top_k)
    mask = target.vocab_size - 1 if mask is None else mask
    spec = net.make_spec(target.layer_config, target.num_layers, num_layers=2, block_size=block,
                         mask_token_id=mask, target_layer_ids=layers,
                         **(two if version == 2 else {}))
    drafter = DFlashDrafter(spec, target.vocab_size, **kw)
    return drafter, net.init_params(spec, jax.random.key(seed))


@pytest.fixture(scope="module")
def greedy_target():
    from jaxspec import kernels
    from tiny import tiny_model

    return tiny_model(seed=2, scale=0.3, eos=(-1,), packed=kernels.available())


@pytest.fixture(scope="module")
def mixed_prompts():
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(1, 63, size=n)] for n in (5, 17, 9, 30, 12, 3, 25, 8)]


@pytest.fixture(scope="module")
def plain(greedy_target, mixed_prompts):
    from jaxspec.engine.runner import Engine

    return Engine(greedy_target).generate(mixed_prompts, max_new_tokens=NEW, batch_size=8)


def with_tree(drafter, kind, children="top_k"):
    """The head as the tree `kind` names: a static tree of ranks (TREE) or a dynamic one (the
    drafter's path probabilities pick 5 of up to 2 + 2*4 candidates over 3 block positions)."""
    if "dynamic" in kind:
        return dataclasses.replace(drafter, tree_top_k=2, tree_levels=3, tree_budget=5,
                                   tree_children=children)
    if "tree" in kind:
        return dataclasses.replace(drafter, tree_choices=TREE, tree_children=children)
    return drafter


@pytest.mark.parametrize("kind", ["chain", "dflash2", "tree", "dflash2-tree", "dynamic",
                                  "dflash2-dynamic"])
def test_greedy_dflash_is_token_identical_at_batch_8(greedy_target, mixed_prompts, plain, kind):
    """Chains, static trees and dynamic trees of DFlash 1 and 2 heads emit plain's tokens."""
    from jaxspec.engine.runner import Engine

    version = 2 if kind.startswith("dflash2") else 1
    drafter, dparams = tiny_head(greedy_target.target, version, block=5, layers=(0, 2))
    drafter = with_tree(drafter, kind)
    engine = Engine(greedy_target, drafter, dparams, num_speculative_tokens=4)
    out = engine.generate(mixed_prompts, max_new_tokens=NEW, batch_size=8)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert sum(r.metrics["num_accepted_tokens"] for r in out) > 0  # drafts were kept


V = 8
PROMPT = [1, 2, 3, 4, 5]
FILTERED = dict(temperature=0.6, top_k=6, top_p=0.95, min_p=0.05)  # every transform on
LAW_ROWS = 6000


@pytest.fixture(scope="module")
def law_target():
    from tiny import tiny_model

    return tiny_model(seed=5, scale=0.3, vocab=V, layers=2, hidden=32, eos=(-1,))


@dataclasses.dataclass(frozen=True)
class NextPositionsQ:
    """Broken: proposes the DFlash draws but reports for each one the q of the next block
    position (the last reports the first's)."""

    inner: object

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, dparams, tparams, state, ctx, num_tokens, sp, keys):
        proposal, state = self.inner.propose(dparams, tparams, state, ctx, num_tokens, sp, keys)
        return proposal._replace(probs=jnp.roll(proposal.probs, -1, axis=1)), state


LAW_TREE = ((0,), (1,), (0, 0), (1, 0))


def law_head(target, kind):
    version = 2 if "dflash2" in kind else 1
    drafter, dparams = tiny_head(target.target, version, block=4, mask=0, seed=4, top_k=V)
    if "dynamic" in kind:
        drafter = dataclasses.replace(drafter, tree_top_k=2, tree_levels=2, tree_budget=4,
                                      tree_children="sampled")
    elif "tree" in kind:
        drafter = dataclasses.replace(drafter, tree_choices=LAW_TREE, tree_children="sampled")
    if kind.startswith("broken"):
        drafter = NextPositionsQ(drafter)
    return drafter, dparams


@pytest.mark.parametrize("kind", ["chain", "dflash2", "tree", "dflash2-tree", "dflash2-dynamic",
                                  "broken", "broken-dflash2-dynamic"])
def test_sampled_dflash_has_the_target_law(law_target, kind):
    """Sampled output (temperature, top-k, top-p, min-p on both sides) has the target's exact
    law for the chain, DFlash 2's selector, sampled static trees (DFlash 1 and 2) and a sampled
    dynamic DFlash 2 tree; the broken variants that report another node's q (the chain's and
    the dynamic tree's) fail at the same settings and sample size."""
    from distribution import FAIL_P, PASS_P, pvalue
    from jaxspec.decode.sampling import SamplingParams

    drafter, dparams = law_head(law_target, kind)
    sp = SamplingParams.make(**FILTERED)
    p, results = pvalue(law_target, drafter, dparams, sp, PROMPT, rows=LAW_ROWS, gamma=2)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    print(f"{kind}: p {p:.2e}, acceptance {accepted / drafted:.2f}")
    # acceptance and rejection both happen (a tree's drafted count is its nodes, most of them
    # off the accepted path: these random DFlash 2 heads keep 1-3 % of them)
    assert 0.005 * drafted < accepted < 0.95 * drafted
    assert (p < FAIL_P) if kind.startswith("broken") else (p > PASS_P)


# ---- the published layout from a config: detected, checked against the target ---------------


def spec_of(*overrides):
    from jaxspec.config import load_config

    base_ = ["speculative.method=dflash", "speculative.num_speculative_tokens=3"]
    return load_config(None, [*base_, *overrides]).speculative


def edited(src, dst, **changes):
    """A copy of the head at src with config.json fields changed (dflash_config.X as X__)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if k.endswith("__"):
            cfg["dflash_config"][k[:-2]] = v
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_config_reads_the_authors_layout_and_refuses_another_targets_head(tiny_qwen3_dir,
                                                                           tmp_path):
    from jaxspec.build import build_drafter

    m = load_model(tiny_qwen3_dir, layout="unrolled")
    make_draft(tmp_path / "head", m.target.num_layers)
    drafter, _ = build_drafter(spec_of(f"speculative.dflash.checkpoint={tmp_path / 'head'}"), m)
    assert drafter.name == "dflash" and drafter.spec.block_size == BLOCK
    tree = ["speculative.tree.kind=static", "speculative.tree.choices=[[0],[1],[0,0]]",
            f"speculative.dflash.checkpoint={tmp_path / 'head'}"]
    assert build_drafter(spec_of(*tree), m)[0].tree_nodes == 3
    dynamic = ["speculative.tree.kind=dynamic", "speculative.tree.top_k=2",
               "speculative.tree.budget=5", f"speculative.dflash.checkpoint={tmp_path / 'head'}"]
    built = build_drafter(spec_of(*dynamic, "speculative.tree.depth=3"), m)[0]
    assert (built.tree_nodes, built.tree_depth) == (5, 3)
    with pytest.raises(JaxspecError, match="drafts at most 4 positions"):
        build_drafter(spec_of(*dynamic, "speculative.tree.depth=5"), m)
    bad = {
        "num_target_layers": ({"num_target_layers": 5}, "target of 5 layers"),
        "hidden": ({"hidden_size": 32, "head_dim": 8}, "hidden size is 32"),
        "vocab": ({"vocab_size": 300}, "vocabulary of 300 tokens"),
        "layer ids": ({"target_layer_ids__": [0, 7]}, r"target_layer_ids \[7\]"),
        "mask": ({"mask_token_id__": 999}, "mask_token_id=999"),
    }
    for name, (changes, message) in bad.items():
        path = edited(tmp_path / "head", tmp_path / name.replace(" ", "_"), **changes)
        with pytest.raises(JaxspecError, match=message) as err:
            build_drafter(spec_of(f"speculative.dflash.checkpoint={path}"), m)
        assert "\n" not in str(err.value)


def test_adaptive_dflash_is_token_identical(greedy_target, mixed_prompts, plain):
    """Adaptive speculation: plain runs catch the head up (commit_plain) between drafted steps;
    greedy output stays plain's."""
    from jaxspec.config import AdaptiveConfig
    from jaxspec.engine.runner import Engine

    drafter, dparams = tiny_head(greedy_target.target, block=5, layers=(0, 2))
    opts = AdaptiveConfig(enabled=True, step_costs=[1.0, 1.2, 1.4, 1.6], draft_cost=0.0,
                          probe_every=4, decay=0.5)
    engine = Engine(greedy_target, drafter, dparams, num_speculative_tokens=3, adaptive=opts)
    out = engine.generate(mixed_prompts, max_new_tokens=NEW, batch_size=8)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    hist = np.sum([r.metrics["adaptive_gamma_hist"] for r in out], axis=0)
    assert hist[0] > 0 and hist[1:].sum() > 0  # plain and drafted steps


def test_top_indices_is_lax_top_k_with_ties():
    """The static top_k tree ranks block positions with k max-reductions (XLA:CPU sorted the
    whole vocabulary for lax.top_k inside the loop): same indices, ties to the lower index, and
    -inf entries not re-picked (a variant without the taken mask re-picked tied indices)."""
    from jaxspec.drafters.dflash import top_indices

    x = jnp.round(jax.random.normal(jax.random.key(3), (2, 3, 257)) * 2) / 2  # many ties
    for k in (1, 2, 4):
        np.testing.assert_array_equal(top_indices(x, k), jax.lax.top_k(x, k)[1])
    sparse = jnp.full((1, 8), -jnp.inf).at[0, 5].set(0.0)
    np.testing.assert_array_equal(top_indices(sparse, 3), [[5, 0, 1]])
