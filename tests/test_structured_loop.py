"""Constraints inside the decode loop (constrain/loop.py): greedy speculative == greedy plain
under the same constraint for n-gram, suffix (chain and tree) and EAGLE, at batch 1 and a mixed
batch (constrained and free rows in one program); completed outputs validate against their
schema; max_new_tokens inside an unfinished structure ends with finish_reason "length"; and a
broken variant (every verify position masked with the root's state) is caught."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
import schemas
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.constrain import Constraint
from jaxspec.constrain import loop as grammar_loop
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.drafters.suffix import SuffixDrafter
from jaxspec.decode.sampling import SamplingParams
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.drafters.draft_model import layer_skip_drafter
from tiny import dflash_like, eagle_like, tiny_model

V = 64
# id 0 = EOS (special); 1..63: the characters JSON needs (GPT-2 byte alphabet: printable ASCII)
CHARS = list('{}[]":,0123456789-.truefalsn') + list("abcdghijkmopqvwxyz") + list("ABCDEFGHIJKLMNOPQ")
CHARS = list(dict.fromkeys(CHARS))[: V - 1]


class CharTokenizer:
    """The two calls constrain.vocabulary_from_tokens makes of a tokenizer."""

    all_special_ids = [0]

    def get_vocab(self):
        return {"<eos>": 0} | {ch: i + 1 for i, ch in enumerate(CHARS)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(CHARS[i - 1] for i in ids if i > 0)


SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}, "b": {"type": "boolean"},
          "c": {"type": "string", "maxLength": 4}}, "required": ["a", "b", "c"]}
NEW = 40


@pytest.fixture(scope="module")
def target():
    return dataclasses.replace(tiny_model(seed=3, layers=2, packed=True), tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def prompts():
    return [[5, 9, 12, 5, 9, 12, 7], [3, 4, 3, 4, 3, 4, 3, 4, 20], [30, 31, 2, 30, 31, 2]]


def text(ids):
    return CharTokenizer().decode(ids)


@pytest.fixture(scope="module")
def plain(target, prompts):
    return [r.token_ids for r in Engine(target).generate(
        prompts, max_new_tokens=NEW, constraint=Constraint(json_schema=SCHEMA))]


def test_plain_constrained_outputs_validate(plain):
    for ids in plain:
        assert ids[-1] == 0, text(ids)  # completed: ended on EOS, allowed only when complete
        jsonschema.validate(json.loads(text(ids)), SCHEMA)


def test_a_free_run_differs(target, prompts, plain):  # control: the constraint changes something
    free = [r.token_ids for r in Engine(target).generate(prompts, max_new_tokens=NEW)]
    assert free != plain


def drafter(name, target, prompts, plain):
    if name == "ngram":
        return NgramDrafter(V, 1, 3), None
    if name == "eagle":
        return eagle_like(target)
    if name == "layer_skip":  # the draft-model family: an autoregressive sampled drafter
        return layer_skip_drafter(target.target, 1), None
    if name == "layer_skip_tree":  # EAGLE-2 dynamic tree over the same drafter
        return dataclasses.replace(layer_skip_drafter(target.target, 1), tree_top_k=2, tree_levels=3,
                                   tree_budget=6), None
    if name == "medusa_tree":  # parallel heads, a static tree
        import jax
        import numpy as np

        from jaxspec.train import methods

        m = methods.Medusa(num_heads=3)
        params, frozen = m.init(target, np.arange(V), jax.random.key(3))
        d = dataclasses.replace(m.drafter(target.target),
                                tree_choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
        return d, m.runtime(params, frozen)
    if name == "dflash":
        return dflash_like(target)
    tree = name == "suffix_tree"
    d = SuffixDrafter(V, store_tokens=512, budget=8 if tree else 0, depth=4 if tree else 0)
    return d, d.observe(d.empty_store(), [p + o for p, o in zip(prompts, plain)])


@pytest.mark.parametrize("name", ["ngram", "suffix", "suffix_tree", "eagle", "layer_skip",
                                  "layer_skip_tree", "medusa_tree", "dflash"])
def test_greedy_speculative_equals_greedy_plain_under_the_constraint(target, prompts, plain, name):
    d, dparams = drafter(name, target, prompts, plain)
    out = Engine(target, d, dparams, num_speculative_tokens=4).generate(
        prompts, max_new_tokens=NEW, constraint=Constraint(json_schema=SCHEMA))
    assert [r.token_ids for r in out] == plain
    if name.startswith("suffix"):  # the store holds these outputs: windows carry tokens
        assert sum(r.metrics["num_accepted_tokens"] for r in out) > 0
    for r in out:
        assert r.metrics["finish_reason"] == "stop" and r.metrics["constraint_complete"]
        assert 0.0 <= r.metrics["masked_draft_fraction"] <= 1.0
        assert r.metrics["num_draft_tokens"] <= r.metrics["num_proposed_draft_tokens"]
    if not name.startswith("suffix"):  # random drafters: the mask removes some of their drafts
        assert sum(r.metrics["num_masked_draft_tokens"] for r in out) > 0


def test_constrained_and_free_rows_share_a_batch(target, prompts, plain):
    free = Engine(target).generate(prompts, max_new_tokens=NEW)
    c = Constraint(json_schema=SCHEMA)
    d, dparams = drafter("suffix", target, prompts, plain)
    mixed = Engine(target, d, dparams, num_speculative_tokens=4).generate(
        prompts, max_new_tokens=NEW, constraint=[c, None, c], batch_size=4)
    assert [r.token_ids for r in mixed] == [plain[0], free[1].token_ids, plain[2]]
    assert "finish_reason" not in mixed[1].metrics  # a free row reports no constraint
    # the constrained rows speculated under their masks beside the free one
    assert all(mixed[i].metrics["num_accepted_tokens"] > 0 for i in (0, 2))


def test_choice_and_regex(target, prompts):
    out = Engine(target).generate(prompts, max_new_tokens=NEW,
                                  constraint=Constraint(choice=("true", "false", "null")))
    assert all(text(r.token_ids) in ("true", "false", "null") for r in out)
    out = Engine(target).generate(prompts[:1], max_new_tokens=NEW, constraint=Constraint(regex="[a-d]{3}-[0-9]+"))
    import re

    got, reason = text(out[0].token_ids), out[0].metrics["finish_reason"]
    if reason == "stop":
        assert re.fullmatch("[a-d]{3}-[0-9]+", got), got
    else:  # cut by the budget: every token spent, on a prefix of the language
        assert reason == "length" and len(out[0].token_ids) == NEW, (reason, got)
        assert re.fullmatch("[a-d]{3}-[0-9]*", got), got


ENGINE_FORMATS = ("date", "time", "uuid")  # what CHARS spells ("T", "@" and "+" are not there)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(drawn=st.lists(schemas.schemas(formats=ENGINE_FORMATS), min_size=6, max_size=6), seed=st.integers(0, 99))
def test_sampled_outputs_under_drawn_schemas_validate(target, prompts, drawn, seed):
    """Six schemas drawn from every accepted keyword (tests/schemas.py), one per row of one
    sampled batch through the Engine: every completed output validates with jsonschema."""
    rows = [prompts[i % len(prompts)] for i in range(len(drawn))]
    out = Engine(target).generate(rows, max_new_tokens=48, batch_size=len(drawn), seed=seed,
                                  sampling=SamplingParams.make(temperature=1.0),
                                  constraint=[Constraint(json_schema=s) for s in drawn])
    done = [(r, s) for r, s in zip(out, drawn) if r.metrics["finish_reason"] == "stop"]
    for r, s in done:
        assert r.token_ids[-1] == 0 and r.metrics["constraint_complete"]
        schemas.validate(json.loads(text(r.token_ids)), s)
    assert len(done) >= len(drawn) // 2, [(text(r.token_ids), s) for r, s in zip(out, drawn)]


def test_max_tokens_inside_the_structure_is_length(target, prompts):
    out = Engine(target, NgramDrafter(V, 1, 3), None, num_speculative_tokens=4).generate(
        prompts, max_new_tokens=5, constraint=Constraint(json_schema=SCHEMA))
    for r in out:
        assert len(r.token_ids) == 5
        assert r.metrics["finish_reason"] == "length" and not r.metrics["constraint_complete"]


def test_unsupported_keyword_is_one_line(target, prompts):
    from jaxspec.constrain.host import make_constraint

    with pytest.raises(JaxspecError) as e:
        make_constraint(json_schema={"type": "string", "contentEncoding": "base64"})
    assert "contentEncoding" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.patches_traced_code
def test_broken_variant_masking_every_position_with_the_root_state_is_caught(
        target, prompts, plain, monkeypatch):
    """Verify positions masked with the row's state before the drafted prefix (a wrong law):
    greedy speculation then leaves the constrained output."""
    def root_only(g, tokens, parents):
        return grammar_loop.jnp.broadcast_to(g.state[:, None], (tokens.shape[0], 1 + tokens.shape[1]))

    monkeypatch.setattr(grammar_loop, "window_states", root_only)
    d, dparams = drafter("suffix", target, prompts, plain)
    out = Engine(target, d, dparams, num_speculative_tokens=4).generate(
        prompts, max_new_tokens=NEW, constraint=Constraint(json_schema=SCHEMA))
    assert [r.token_ids for r in out] != plain


def test_token_classes_rebuild_the_dense_table():
    import numpy as np

    rng = np.random.default_rng(0)
    dense = rng.integers(-1, 5, size=(7, 12))[:, rng.integers(0, 4, size=300)].astype(np.int32)
    by_class, class_of = grammar_loop.token_classes(dense)
    assert by_class.shape[1] <= 4 and np.array_equal(by_class[:, class_of], dense)
    dense[3, 17] = 99  # one column made unique: one more class, still exact
    by_class2, class_of2 = grammar_loop.token_classes(dense)
    assert by_class2.shape[1] == by_class.shape[1] + 1 and np.array_equal(by_class2[:, class_of2], dense)


def test_cli_unsupported_keyword_exits_2_with_one_line(capsys):
    from jaxspec.generate import main

    rc = main(["--prompt", "hi", 'structured.json_schema={"type": "string", "contentEncoding": "x"}'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "contentEncoding" in err and "\n" not in err
    rc = main(["--prompt", "hi", "structured.regex=a+", "structured.json_object=true"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "only one" in err and "\n" not in err


# ---- the exact law of constrained sampling, end to end ---------------------------------------
CHOICES = ("ab", "ba", "b", "aab")  # "b" is a prefix of "ba": EOS and "a" both allowed after "b"
LAW_PROMPT = [CHARS.index(ch) + 1 for ch in "aababbaab"]  # n-gram drafts a's and b's from it
LAW_ROWS = 1200


def constrained_law(target):
    """Exact probability of each choice under the target masked to the choices (char tokens),
    computed independently of constrain/: the allowed set after a prefix read off the strings."""
    import numpy as np
    from tiny import target_logits

    tid = {ch: i + 1 for i, ch in enumerate(CHARS)}
    law = []
    for c in CHOICES:
        seq = [tid[ch] for ch in c] + [0]
        ids = np.asarray([LAW_PROMPT + seq[:-1]])
        logits = np.asarray(target_logits(target.params, ids, target=target.target))[0]
        p = 1.0
        for i, tok in enumerate(seq):
            prefix = c[:i]
            ok = {tid[x[i]] for x in CHOICES if x.startswith(prefix) and len(x) > i}
            ok |= {0} if prefix in CHOICES else set()
            row = logits[len(LAW_PROMPT) - 1 + i]
            w = np.exp(row - row.max())
            p *= w[tok] / sum(w[t] for t in ok)
        law.append(p)
    return np.asarray(law + [0.0])  # the last cell: anything else


def law_pvalue(target, d, dparams):
    import numpy as np
    from distribution import chi_square_pvalue

    from jaxspec.decode.sampling import SamplingParams

    out = Engine(target, d, dparams, num_speculative_tokens=3).generate(
        [LAW_PROMPT] * LAW_ROWS, max_new_tokens=5, batch_size=64,
        sampling=SamplingParams.make(temperature=1.0), constraint=Constraint(choice=CHOICES))
    counts = np.zeros(len(CHOICES) + 1)
    for r in out:
        t = text(r.token_ids)
        counts[CHOICES.index(t) if t in CHOICES and r.token_ids[-1] == 0 else -1] += 1
    totals = {k: sum(r.metrics.get(k, 0) for r in out) for k in (
        "num_proposed_draft_tokens", "num_masked_draft_tokens", "num_draft_tokens", "num_accepted_tokens")}
    return chi_square_pvalue(counts, constrained_law(target)), totals


def law_eagle(target):
    """EAGLE drafting every id (the default eagle_like drafts even ids only, and under CHOICES
    the one even id allowed is EOS: nothing to renormalise over, nothing to redraw)."""
    return eagle_like(target, draft_ids=np.arange(V))


@pytest.fixture(scope="module")
def law_target():
    return dataclasses.replace(tiny_model(seed=5, layers=2, scale=1.0), tokenizer=CharTokenizer())


@pytest.mark.parametrize("name", ["plain", "ngram", "eagle"])
def test_sampled_constrained_output_has_the_exact_law(law_target, name):
    from distribution import PASS_P

    d, dparams = {"plain": (None, None), "ngram": (NgramDrafter(V, 1, 3), None)}.get(name) or (
        law_eagle(law_target))
    p, n = law_pvalue(law_target, d, dparams)
    assert p > PASS_P
    if name == "eagle":  # the hand-off fired: drafts outside the choices' next letters redrawn
        # from q renormalised over the allowed ones ("a", "b" at the start), kept drafts both
        # accepted and rejected (a residual draw)
        assert n["num_masked_draft_tokens"] > 100, n
        assert 0 < n["num_accepted_tokens"] < n["num_draft_tokens"], n


@pytest.mark.patches_traced_code
def test_the_law_test_catches_nodes_masked_with_the_root_state(law_target, monkeypatch):
    from distribution import FAIL_P

    def root_only(g, tokens, parents):
        return grammar_loop.jnp.broadcast_to(g.state[:, None], (tokens.shape[0], 1 + tokens.shape[1]))

    monkeypatch.setattr(grammar_loop, "window_states", root_only)
    assert law_pvalue(law_target, NgramDrafter(V, 1, 3), None)[0] < FAIL_P


def test_adaptive_speculation_under_the_constraint_equals_plain(target, prompts, plain):
    """The adaptive loop's steps (drafted, one-token, plain runs) carry the grammar too."""
    from jaxspec.config import AdaptiveConfig

    d, dparams = drafter("suffix", target, prompts, plain)
    engine = Engine(target, d, dparams, num_speculative_tokens=4, adaptive=AdaptiveConfig(
        enabled=True, step_costs=[1.0, 1.2, 1.4, 1.6, 1.8], draft_cost=0.0, probe_every=2))
    engine.spec_for = lambda *_: engine.spec  # the adaptive program whatever the costs
    out = engine.generate(prompts, max_new_tokens=NEW, constraint=Constraint(json_schema=SCHEMA))
    assert [r.token_ids for r in out] == plain
