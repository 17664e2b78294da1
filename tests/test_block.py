"""The parallel block drafter (drafters/parallel_block.py, method `block`): greedy output identical to plain
decoding (chain and tree, batch 1 and 8, mixed prompt lengths); sampled output with the target's
exact law (chain and sampled tree) and a broken variant -- each draft reported with the q of
another block position -- that the same test rejects; training, export and load round trip."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distribution import FAIL_P, PASS_P, pvalue
from jaxspec import kernels
from jaxspec.engine.runner import Engine
from jaxspec.formats import load_drafter_checkpoint
from jaxspec.decode.sampling import SamplingParams
from jaxspec.train import block as block_train
from jaxspec.train.data import DataConfig, generate_records
from jaxspec.train.train import TrainConfig, train
from tiny import tiny_model

NEW = 24
VOCAB = 64
TREE = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0))  # per-position ranks, depth 4


def block_drafter(target, draft_ids, *, noise=0.0, layers=(1, 1, 2), seed=3, **kw):
    """An untrained block drafter (EAGLE-style initialisation, optionally perturbed)."""
    m = block_train.Block(hidden_layers=layers, input_scale=1.0, block_size=4, extra_mlp=16, **kw)
    p, frozen = m.init(target, np.asarray(draft_ids, np.int32), jax.random.key(seed))
    if noise:
        leaves, treedef = jax.tree.flatten(p)
        keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
        p = jax.tree.unflatten(
            treedef, [w + noise * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
        )
    return m.drafter(target.target), m.runtime(p, frozen)


# ---- greedy identity ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_target():
    """A random target in the layout configs load on a CPU (the near-tie model of
    test_greedy_identity.py needs XLA's production codegen; this module compiles fast)."""
    return tiny_model(seed=2, scale=0.3, eos=(-1,), packed=kernels.available())


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(1, VOCAB, size=n)] for n in (5, 17, 9, 30, 12, 3, 25, 8)]


@pytest.fixture(scope="module")
def plain(greedy_target, prompts):
    engine = Engine(greedy_target)
    return [engine.generate([p], max_new_tokens=NEW)[0].token_ids for p in prompts]


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_block_drafting_is_token_identical(greedy_target, prompts, plain, kind, batch):
    drafter, dparams = block_drafter(greedy_target, np.arange(VOCAB), layers=(1, 2, 3))
    if kind == "tree":
        drafter = dataclasses.replace(drafter, tree_choices=TREE)
    engine = Engine(greedy_target, drafter, dparams, num_speculative_tokens=4)
    out = engine.generate(prompts, max_new_tokens=NEW, batch_size=batch)
    assert [r.token_ids for r in out] == plain
    assert sum(r.metrics["num_accepted_tokens"] for r in out) > 0  # drafts were kept


# ---- the exact law --------------------------------------------------------------------------

V = 8
DRAFT_IDS = np.array([0, 1, 2, 3, 5, 6], np.int32)  # 6 of the 8 target tokens
PROMPT = [1, 2, 3, 4, 5]
FILTERED = dict(temperature=0.6, top_k=6, top_p=0.95, min_p=0.05)  # every transform on


@pytest.fixture(scope="module")
def law_target():
    return tiny_model(seed=5, scale=0.3, vocab=V, layers=2, hidden=32, eos=(-1,))


@dataclasses.dataclass(frozen=True)
class OtherPositionsQ:
    """Broken: proposes the block drafter's draws but reports for each one the q of the next
    block position (the last reports the first's), as a drafter that mixed up its slots would."""

    inner: Any

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, dparams, tparams, state, ctx, num_tokens, sp, keys):
        proposal, state = self.inner.propose(dparams, tparams, state, ctx, num_tokens, sp, keys)
        return proposal._replace(probs=jnp.roll(proposal.probs, -1, axis=1)), state


def law_drafter(target, kind):
    drafter, dparams = block_drafter(target, DRAFT_IDS, noise=0.3, layers=(0, 1, 1))
    if kind == "tree":
        drafter = dataclasses.replace(
            drafter, tree_choices=((0,), (1,), (0, 0), (1, 0)), tree_children="sampled"
        )
    return drafter, dparams


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampled_block_drafting_has_the_target_law(law_target, kind):
    drafter, dparams = law_drafter(law_target, kind)
    sp = SamplingParams.make(**FILTERED)
    p, results = pvalue(law_target, drafter, dparams, sp, PROMPT, rows=12000, gamma=2)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    assert 0.03 * drafted < accepted < 0.95 * drafted  # acceptance and rejection both happen
    assert p > PASS_P


def test_block_drafter_reporting_another_positions_q_fails(law_target):
    drafter, dparams = law_drafter(law_target, "chain")
    sp = SamplingParams.make(**FILTERED)
    p, _ = pvalue(law_target, OtherPositionsQ(drafter), dparams, sp, PROMPT, rows=6000, gamma=2)
    assert p < FAIL_P


# ---- training, export, load -----------------------------------------------------------------


@pytest.fixture(scope="module")
def train_target():
    return tiny_model(seed=1, scale=0.5, eos=(-1,))


@pytest.fixture(scope="module")
def records(train_target):
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 64, size=int(n)))) for n in rng.integers(4, 12, 16)]
    return generate_records(train_target, prompts, DataConfig(layers=(1, 2, 3), top_k=4, gen_steps=20),
                            np.asarray([-1]))


def test_block_head_trains_exports_and_loads(tmp_path, train_target, records):
    args = {"hidden_layers": (1, 2, 3), "input_scale": 1.0, "block_size": 3, "extra_mlp": 32,
            "anchors": 8}
    tc = TrainConfig(method="block", ckpt_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "out"),
                     steps=20, batch_size=4, seq_len=32, lr=3e-3, warmup=2, save_every=0,
                     draft_vocab=48, method_args=args)
    out = train(tc, target=train_target, data=records, eval_prompts=[], log=lambda *a: None,
                progress=False)
    losses = [h["loss"] for h in out.history]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    drafter, dparams = load_drafter_checkpoint("block", tmp_path / "out", train_target)
    assert drafter == out.drafter
    trained = out.method.runtime(out.params, out.frozen)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(trained), jax.tree.leaves(dparams)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    prompt = records["tokens"][0, :6].tolist()
    plain = Engine(train_target).generate([prompt], max_new_tokens=16)[0]
    spec = Engine(train_target, drafter, dparams, num_speculative_tokens=3).generate(
        [prompt], max_new_tokens=16)[0]
    assert spec.token_ids == plain.token_ids
