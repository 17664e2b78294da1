"""Draft trees: the verify window, the tree acceptance rule (exact law, and a broken variant that
fails), static (Medusa, n-gram) and dynamic (EAGLE-2) trees token-identical to plain greedy,
no recompilation (a one-branch tree equal to the chain, compaction: tests/test_tree_chain.py)."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiles import counting_lowerings
from distribution import FAIL_P, PASS_P, pvalue
from tiny import motif_prompts, tiny_model

from jaxspec.decode import acceptance, tree
from jaxspec.drafters.base import Proposal
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, llama
from jaxspec.decode.sampling import SamplingParams, logits_to_probs
from jaxspec.train import methods

PROMPT_LENGTHS = (5, 17, 9, 30)

# ---- the window ------------------------------------------------------------------------------


def test_chain_window_is_the_causal_window():
    b, n = 2, 4
    w = tree.build_window(
        jnp.asarray([7, 8]), jnp.asarray([10, 3]), jnp.ones((b, n), jnp.int32),
        tree.chain_parents(b, n), jnp.asarray([4, 4]),
    )
    np.testing.assert_array_equal(w.mask, np.broadcast_to(np.tril(np.ones((5, 5), bool)), (2, 5, 5)))
    np.testing.assert_array_equal(w.positions, [[10, 11, 12, 13, 14], [3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(w.tokens[:, 0], [7, 8])


def test_tree_window_mask_depth_and_padding():
    parents = jnp.asarray([[-1, -1, 0, 0, 1, 2, 3]])  # node 6 is padding (num_nodes = 6)
    w = tree.build_window(jnp.asarray([5]), jnp.asarray([20]), jnp.arange(7)[None] + 1, parents,
                          jnp.asarray([6]))
    np.testing.assert_array_equal(w.depth[0], [0, 1, 1, 2, 2, 2, 3, 1])
    np.testing.assert_array_equal(w.positions[0], 20 + np.array([0, 1, 1, 2, 2, 2, 3, 1]))
    anc = {t: set(np.nonzero(np.asarray(w.mask[0, t]))[0]) for t in range(8)}
    assert anc[6] == {0, 1, 3, 6}  # node 5 -> node 2 -> node 0 -> root
    assert anc[5] == {0, 2, 5} and anc[2] == {0, 2} and anc[7] == {0, 7}


def test_bad_tree_choices_are_clear_errors():
    for bad, word in [([], "empty"), ([[0, 1]], "no parent"), ([[0], [0]], "repeat"),
                      ([[-1]], "ranks"), ("x", "invalid")]:
        with pytest.raises(JaxspecError, match=word):
            tree.check_choices(bad)
    assert tree.check_choices([[1], [0, 0], [0]]) == ((0,), (1,), (0, 0))


@pytest.mark.parametrize(
    "overrides,word",
    [
        (["speculative.tree.kind=dynamic"], "kind=dynamic is supported by method"),
        (["speculative.method=eagle", "speculative.tree.kind=dynamic", "speculative.tree.children=gumbel"],
         "one of top_k, sampled, without_replacement"),
        (["speculative.method=eagle", "speculative.tree.kind=static"], "medusa or ngram"),
        (["speculative.method=medusa", "speculative.tree.kind=static"], "needs speculative.tree.choices"),
        (["speculative.tree.budget=0"], "speculative.tree.budget=0 is invalid"),
        (["speculative.tree.choices=[[0, 1]]"], "no parent"),
        (["speculative.tree.kind=bogus"], "one of chain, static, dynamic"),
        (["speculative.method=eagle", "speculative.tree.kind=dynamic", "speculative.tree.budget=60"],
         "use 1..52"),
        (["speculative.method=ngram", "speculative.tree.kind=static", "speculative.tree.branches=20"],
         "<= 63"),
        (["speculative.method=eagle", "speculative.tree.kind=dynamic", "speculative.lookup.min_ngram=2"],
         "does not combine"),
        (["speculative.method=eagle", "speculative.tree.kind=dynamic",
          "speculative.eagle.draft_confidence=0.3"],
         "does not combine"),
    ],
)
def test_bad_tree_config_is_a_one_line_error(overrides, word):
    from jaxspec.config import load_config

    with pytest.raises(JaxspecError, match=word) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_tree_config_builds_the_tree_drafter():
    from jaxspec.build import build_drafter
    from jaxspec.config import load_config

    cfg = load_config(None, ["speculative.method=ngram", "speculative.tree.kind=static",
                             "speculative.tree.branches=2", "speculative.tree.depth=3"])
    d, _ = build_drafter(cfg.speculative, SimpleNamespace(target=SimpleNamespace(vocab_size=64)))
    assert isinstance(d, NgramDrafter) and (d.tree_nodes, d.tree_depth) == (6, 3)
    cfg = load_config(None, ["speculative.method=medusa", "speculative.tree.kind=static",
                             "speculative.tree.choices=[[1], [0], [0, 0]]"])
    assert cfg.speculative.tree.choices == [[0], [1], [0, 0]]


# ---- the acceptance rule ---------------------------------------------------------------------


def test_chain_through_the_tree_rule_equals_the_chain_rule():
    rng = np.random.default_rng(0)
    g, v, rows = 4, 7, 400
    sp = SamplingParams.make(temperature=0.9, top_k=5)
    p = np.asarray(logits_to_probs(jnp.asarray(rng.normal(size=(rows, g + 1, v)) * 2), sp))
    q = np.array(logits_to_probs(jnp.asarray(rng.normal(size=(rows, g, v)) * 2), sp))
    q[: rows // 2] = p[: rows // 2, :g]  # half the rows draft from the target: long accepts
    tokens = np.stack([[rng.choice(v, p=qi) for qi in qr] for qr in q]).astype(np.int32)
    num = rng.integers(0, g + 1, rows).astype(np.int32)
    keys = jax.random.split(jax.random.key(3), rows)
    n, nxt = jax.jit(acceptance.accept)(tokens, q, p, num, keys)
    path, n_t, nxt_t = jax.jit(acceptance.accept_tree, static_argnums=6)(
        tokens, tree.chain_parents(rows, g), q, p, num, keys, g + 1
    )
    np.testing.assert_array_equal(n_t, n)
    np.testing.assert_array_equal(nxt_t, nxt)
    for r in range(rows):
        np.testing.assert_array_equal(path[r, : n[r] + 1], np.arange(n[r] + 1))
    assert 0 < np.mean(np.asarray(n) == num) < 1


def test_greedy_tree_rule_takes_the_deepest_argmax_path():
    v = 10
    # root children: 3, 4 (argmax 4); under 4: 5, 6 (argmax 6); under 6: 1 (argmax 2)
    tokens = jnp.asarray([3, 4, 5, 6, 1, 4])
    parents = jnp.asarray([-1, -1, 1, 1, 3, 0])
    argmax = jnp.asarray([4, 0, 6, 0, 2, 0, 0])  # per window entry (root, nodes 0..5)
    p = jax.nn.one_hot(argmax, v)
    q = jax.nn.one_hot(tokens, v)
    path, n, nxt = acceptance.accept_tree_row(tokens, parents, q, p, 6, jax.random.key(0), 4)
    assert (int(n), int(nxt)) == (2, 2)
    np.testing.assert_array_equal(path[:3], [0, 2, 4])
    _, n, nxt = acceptance.accept_tree_row(tokens, parents, q, p, 1, jax.random.key(0), 4)
    assert (int(n), int(nxt)) == (0, 4)  # node 1 is padding: the root's argmax


# ---- the exact law of a whole tree loop on a tiny target -------------------------------------

V = 6
NUM_ROWS = 12000
BROKEN_ROWS = 6000  # p = 6e-89 (residual not updated) and 0.0 (siblings' q) at this size


@dataclasses.dataclass(frozen=True)
class MixedTreeDrafter:
    """Context-free test drafter mixing every kind of sibling the rule must handle:
    node 0 deterministic (q one-hot), nodes 1, 2 i.i.d. from Q1 (SpecInfer), node 3 deterministic
    under node 0, node 4 from Q2 under node 0, node 5 from Q2 under node 1, node 6 deterministic
    under node 4. dparams: {"q1": [V], "q2": [V], "det": int32[3]}."""

    vocab: int
    name: str = "mixed_tree"
    hidden_layers: tuple[int, ...] = ()
    variable_length: bool = False
    tree_nodes: int = 7
    tree_depth: int = 3

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        return ()

    def propose(self, dparams, tparams, state, ctx, num_tokens, sp, keys):
        b = keys.shape[0]
        draw = lambda k, q, n: jax.random.categorical(k, jnp.log(q), shape=(n,))
        k1, k2 = jax.vmap(lambda k: jax.random.split(k), out_axes=1)(keys)
        s1 = jax.vmap(lambda k: draw(k, dparams["q1"], 2))(k1)  # [B, 2]
        s2 = jax.vmap(lambda k: draw(k, dparams["q2"], 2))(k2)
        det = jnp.broadcast_to(dparams["det"], (b, 3))
        tokens = jnp.stack([det[:, 0], s1[:, 0], s1[:, 1], det[:, 1], s2[:, 0], s2[:, 1], det[:, 2]], 1)
        one = lambda t: jax.nn.one_hot(t, self.vocab)
        qs = [one(det[:, 0]), *[jnp.broadcast_to(dparams["q1"], (b, self.vocab))] * 2,
              one(det[:, 1]), *[jnp.broadcast_to(dparams["q2"], (b, self.vocab))] * 2, one(det[:, 2])]
        parents = jnp.broadcast_to(jnp.asarray([-1, -1, -1, 0, 0, 1, 4], jnp.int32), (b, 7))
        return Proposal(tokens.astype(jnp.int32), jnp.stack(qs, 1), jnp.full((b,), 7, jnp.int32),
                        parents), state

    def commit(self, dparams, tparams, state, ctx):
        return state


@pytest.fixture(scope="module")
def small_vocab():
    target = tiny_model(seed=5, scale=0.6, vocab=V, layers=2, hidden=32, eos=(-1,))
    q = logits_to_probs(2.0 * jax.random.normal(jax.random.key(4), (2, V)),
                        SamplingParams.make(temperature=1.0))
    dparams = {"q1": q[0], "q2": q[1], "det": jnp.asarray([2, 1, 3], jnp.int32)}
    return target, dparams


TREE_SP = dict(temperature=0.7, top_k=4, top_p=0.9)
PROMPT = [1, 2, 3, 4, 5]


def tree_pvalue(target, dparams, rows=NUM_ROWS):
    sp = SamplingParams.make(**TREE_SP)
    return pvalue(target, MixedTreeDrafter(V), dparams, sp, PROMPT, rows=rows, num_tokens=3,
                  gamma=1, seed=11)


def test_tree_sampling_has_the_target_distribution(small_vocab):
    target, dparams = small_vocab
    p, results = tree_pvalue(target, dparams)
    per_depth = np.mean([r.metrics["accepted_per_position"] for r in results], axis=0)
    assert 0.05 < per_depth[0] < 0.95 and per_depth[1] > 0.01  # rejections and depth-2 accepts
    assert p > PASS_P


@pytest.mark.patches_traced_code
def test_distribution_test_catches_a_residual_not_updated_between_siblings(small_vocab, monkeypatch):
    target, dparams = small_vocab
    broken = functools.partial(acceptance.accept_tree, update_residual=False)
    monkeypatch.setattr(acceptance, "accept_tree", broken)  # speculate reads it
    p, _ = tree_pvalue(target, dparams, rows=BROKEN_ROWS)
    assert p < FAIL_P


# ---- sampled children of a dynamic tree (draft_model): exact law, and a broken variant ------


def sampled_tree_pvalue(target, children, seed=11, rows=NUM_ROWS):
    """A draft_model tree (its own tiny network, unlike the target) with sampled children:
    k 3 children per node, 2 levels, 6 of 12 candidates kept; top_k 4 sampling leaves some
    nodes fewer than 3 tokens to draw, so deterministic siblings past q's support occur too."""
    from jaxspec.drafters.draft_model import ModelDrafter

    draft = tiny_model(seed=9, scale=0.6, vocab=V, layers=1, hidden=32, eos=(-1,))
    drafter = ModelDrafter(model=llama.LlamaTarget(draft.cfg), target_vocab=V, tree_top_k=3, tree_levels=2,
                           tree_budget=6, tree_children=children)
    sp = SamplingParams.make(**TREE_SP)
    return pvalue(target, drafter, draft.params, sp, PROMPT, rows=rows, num_tokens=4,
                  gamma=1, seed=seed)


@pytest.mark.parametrize("children", ["without_replacement"])  # i.i.d.: the mixed tree test
def test_sampled_tree_children_have_the_target_distribution(small_vocab, children):
    target, _ = small_vocab
    p, results = sampled_tree_pvalue(target, children)
    per_depth = np.mean([r.metrics["accepted_per_position"] for r in results], axis=0)
    assert 0.05 < per_depth[0] < 0.95 and per_depth[1] > 0.01  # rejections and depth-2 accepts
    assert p > PASS_P


@pytest.mark.patches_traced_code
def test_distribution_test_catches_without_replacement_siblings_reporting_q(small_vocab, monkeypatch):
    """Broken: later without-replacement siblings report the un-renormalised q."""
    target, _ = small_vocab
    monkeypatch.setattr(tree, "grow", functools.partial(tree.grow, reported_q="shared"))
    p, _ = sampled_tree_pvalue(target, "without_replacement", rows=BROKEN_ROWS)
    assert p < FAIL_P


def test_without_replacement_children_are_distinct_and_follow_the_support():
    logp = jnp.log(jnp.asarray([[[0.5, 0.3, 0.15, 0.05]]]))
    q = jnp.asarray([[[0.6, 0.0, 0.4, 0.0]]])  # two tokens to draw, then the rest by logp
    keys = jax.random.split(jax.random.key(0), 1)
    inc, ids = tree.draw_children(logp, q, 3, "without_replacement", keys)
    np.testing.assert_allclose(inc[0, 0], np.log([0.5, 0.3, 0.15]), rtol=1e-6)
    assert sorted(np.asarray(ids[0, 0, :2]).tolist()) == [0, 2] and int(ids[0, 0, 2]) == 1
    earlier = jnp.asarray([[[4, 4], [int(ids[0, 0, 0]), 4], [0, 2]]])  # 4 = absent
    qs = tree.without_earlier(jnp.broadcast_to(q[0], (1, 3, 4)), ids[0], earlier)
    np.testing.assert_allclose(qs[0, 0], q[0, 0])
    np.testing.assert_allclose(qs[0, 1], jax.nn.one_hot(ids[0, 0, 1], 4))  # the other one, surely
    np.testing.assert_allclose(qs[0, 2], jax.nn.one_hot(1, 4))  # past the support: deterministic


# ---- tree drafters on a tiny target: greedy identity, chain equivalence, compaction ----------


@pytest.fixture(scope="module")
def prompts():
    return motif_prompts(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def plain_greedy(target, prompts):
    return [r.token_ids for r in Engine(target).generate(prompts, max_new_tokens=40, batch_size=4)]


DRAFT_IDS = np.arange(0, 64, 2, dtype=np.int32)  # a reduced draft vocabulary: 32 of 64 tokens


def trained_like(target, name, **tree_kw):
    """A random Medusa / EAGLE drafter on the tiny target (as the training code builds it)."""
    m = {"eagle": methods.Eagle(hidden_layers=(1, 2, 2), input_scale=1.0),
         "medusa": methods.Medusa(num_heads=3), "draft_model": methods.Draft()}[name]
    params, frozen = m.init(target, DRAFT_IDS, jax.random.key(7))  # packed: traits unpack
    return dataclasses.replace(m.drafter(target.target), **tree_kw), m.runtime(params, frozen)


TREE_DRAFTERS = {
    "ngram": lambda t: (NgramDrafter(vocab_size=64, min_ngram=1, max_ngram=3, branches=3, depth=3), None),
    "medusa": lambda t: trained_like(
        t, "medusa", tree_choices=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1))
    ),
    "eagle": lambda t: trained_like(t, "eagle", tree_top_k=3, tree_levels=3, tree_budget=8),
    "draft_model": lambda t: trained_like(
        t, "draft_model", tree_top_k=3, tree_levels=3, tree_budget=8
    ),
}


@pytest.mark.parametrize("method", list(TREE_DRAFTERS))
@pytest.mark.parametrize("batch_size", [1, 4])
def test_tree_greedy_is_token_identical(target, prompts, plain_greedy, method, batch_size):
    drafter, dparams = TREE_DRAFTERS[method](target)
    engine = Engine(target, drafter, dparams, num_speculative_tokens=1)
    results = engine.generate(prompts, max_new_tokens=40, batch_size=batch_size)
    assert [r.token_ids for r in results] == plain_greedy
    assert all(r.metrics["tree_nodes"] == drafter.tree_nodes for r in results)
    if method == "ngram":  # the motif prompts: branches get accepted
        assert sum(r.metrics["num_accepted_tokens"] for r in results) > 0


@pytest.mark.parametrize("layout", ["unrolled", "stacked"])
def test_tree_on_the_xla_attention_path(prompts, layout):
    """Without the CPU kernels the ancestor mask goes through XLA's attention (both layouts)."""
    model = tiny_model(seed=0, layers=2)
    if layout == "stacked":
        model = dataclasses.replace(model, params=decoder.stack_layers(model.params))
    plain = [r.token_ids for r in Engine(model).generate(prompts, max_new_tokens=30, batch_size=4)]
    engine = Engine(model, NgramDrafter(64, branches=3, depth=3), num_speculative_tokens=1)
    results = engine.generate(prompts, max_new_tokens=30, batch_size=4)
    assert [r.token_ids for r in results] == plain
    assert sum(r.metrics["num_accepted_tokens"] for r in results) > 0


def test_no_recompilation_across_tree_shapes(target):
    """Tree shapes are data: rows and steps with different trees reuse one program."""
    engines = [Engine(target, *TREE_DRAFTERS[m](target), num_speculative_tokens=1)
               for m in ("eagle", "draft_model", "ngram")]
    rng = np.random.default_rng(1)
    requests = [[int(t) for t in rng.integers(1, 64, size=int(n))] for n in rng.integers(17, 30, 6)]
    for e in engines:  # warm up (40 tokens: the programs the batch-1 greedy tests compiled)
        e.generate(requests[:1], max_new_tokens=40)
    with counting_lowerings() as lowered:
        for ids in requests:
            for e in engines:
                e.generate([ids], max_new_tokens=40)
    assert lowered("decode", "prefill") == 0


# ---- the shipped tree configs on SmolLM2 ----------------------------------------------------

SMOL_PROMPTS = [
    "A baker makes 24 muffins and sells 3 boxes of 5. How many muffins are left?",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
]


@pytest.fixture(scope="module")
def smol_plain(smollm2):
    return Engine(smollm2).generate(SMOL_PROMPTS, max_new_tokens=32, batch_size=2)


@pytest.mark.parametrize("name", ["eagle-tree", "medusa-tree", "ngram-tree", "draft-tree",
                                  "dflash-tree", "dflash-dynamic"])
def test_shipped_tree_config_is_token_identical(smollm2, smol_plain, name):
    from jaxspec.build import build_engine
    from jaxspec.config import load_config

    engine = build_engine(load_config(f"configs/smollm2-135m-{name}.yaml"), target=smollm2)
    results = engine.generate(SMOL_PROMPTS, max_new_tokens=32, batch_size=2)
    assert [r.token_ids for r in results] == [r.token_ids for r in smol_plain]
    assert np.mean([r.metrics["mean_accepted_length"] for r in results]) > 1.1
    nodes = engine.spec.num_nodes  # eagle, medusa, draft: every step verifies the whole tree
    assert all(r.metrics["nodes_per_step"] == nodes or name == "ngram-tree" for r in results)
    assert all(r.metrics["nodes_per_step"] > 0 for r in results)
