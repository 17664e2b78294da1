"""Structured output (jaxspec.constrain): the device tables agree with outlines-core's own
automaton, completed outputs validate against their schema, unsupported keywords get a one-line
error, and speculative acceptance under the mask has the exact law of plain constrained sampling
(a control at the same settings passes; two broken variants fail: the drafter's reported q not
masked, and the verify positions masked with the state before the drafted prefix)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import schemas
from distribution import FAIL_P, PASS_P, chi_square_pvalue
from hypothesis import given, settings
from hypothesis import strategies as st
from outlines_core import Index, Vocabulary

from jaxspec.constrain import Constraint, compile_tables, constraint_regex, draft, mask
from jaxspec.constrain import loop as grammar_loop
from jaxspec.decode.acceptance import accept_row, accept_tree_row

# A character vocabulary plus a few multi-character tokens, id 0 = EOS.
CHARS = [chr(c) for c in range(32, 127)]
MULTI = ['{"', '":', '", "', '"}', "true", "false", "12", "name", "age", ', "', "null"]
TOKENS = {i + 1: s.encode() for i, s in enumerate(CHARS + MULTI)}
VOCAB = len(TOKENS) + 3  # the model's vocabulary is larger than the tokenizer's: ids never allowed
EOS = 0

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
     "maxItems": 3}}, "required": ["ok"]},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "[a-c]{2,4}"}]},
]


def _walk_tokens(tables, rng, max_steps=3000):
    """A random walk under the mask (uniform over allowed tokens, EOS taken when allowed)."""
    nxt = np.asarray(tables.next)
    state, out = int(tables.initial), []
    for _ in range(max_steps):
        ok = np.flatnonzero(nxt[state] >= 0)
        if EOS in ok:
            return out, True
        tok = int(rng.choice(ok))
        out.append(tok)
        state = int(nxt[state, tok])
    return out, False


@pytest.mark.parametrize("regex", ['(ab|c)+d?', r'\{"name": "[a-z]{1,5}"\}', "(true|false|null|12)"])
def test_tables_match_outlines_index_walk(regex):
    tables = compile_tables(regex, TOKENS, EOS, VOCAB)
    by_bytes = {}
    for tid, b in TOKENS.items():
        by_bytes.setdefault(b, []).append(tid)
    index = Index(regex, Vocabulary(EOS, by_bytes))
    nxt = np.asarray(tables.next)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ours, theirs = int(tables.initial), index.get_initial_state()
        for _ in range(30):
            want = sorted(index.get_allowed_tokens(theirs))
            got = sorted(np.flatnonzero(nxt[ours] >= 0).tolist())
            assert got == want
            assert bool(tables.accepting[ours]) == index.is_final_state(theirs)
            tok = int(rng.choice(want))
            if tok == EOS:
                break
            ours, theirs = int(nxt[ours, tok]), index.get_next_state(theirs, tok)
            assert (mask.advance(tables, jnp.int32(ours), jnp.int32(EOS)) >= 0) == bool(tables.accepting[ours])


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_completed_outputs_validate(schema):
    tables = compile_tables(constraint_regex(Constraint(json_schema=schema)), TOKENS, EOS, VOCAB)
    rng = np.random.default_rng(1)
    done = 0
    for _ in range(25):
        toks, complete = _walk_tokens(tables, rng)
        if complete:
            done += 1
            jsonschema.validate(json.loads(b"".join(TOKENS[t] for t in toks)), schema)
    assert done >= 20


def test_eos_only_in_accepting_states():
    tables = compile_tables(constraint_regex(Constraint(json_schema=SCHEMAS[0])), TOKENS, EOS, VOCAB)
    nxt = np.asarray(tables.next)
    np.testing.assert_array_equal(nxt[:, EOS] >= 0, np.asarray(tables.accepting))
    assert not bool(tables.accepting[int(tables.initial)])


def test_choice_and_json_object():
    tables = compile_tables(constraint_regex(Constraint(choice=("yes", "no"))), TOKENS, EOS, VOCAB)
    rng = np.random.default_rng(2)
    seen = {b"".join(TOKENS[t] for t in _walk_tokens(tables, rng)[0]) for _ in range(30)}
    assert seen == {b"yes", b"no"}
    tables = compile_tables(constraint_regex(Constraint(json_object=True)), TOKENS, EOS, VOCAB)
    toks, complete = _walk_tokens(tables, np.random.default_rng(3))
    assert complete and isinstance(json.loads(b"".join(TOKENS[t] for t in toks)), dict)


def test_unsupported_keyword_is_one_line_naming_it():
    with pytest.raises(ValueError) as e:
        constraint_regex(Constraint(json_schema={"type": "object", "properties": {"x": {"type": "string",
                                                                                        "contentEncoding": "base64"}}}))
    assert "'contentEncoding'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="exactly one"):
        Constraint(regex="a", choice=("a",))


def test_tree_states_follow_parents():
    tables = compile_tables("(ab|c)+", TOKENS, EOS, VOCAB)
    a, b, c = (CHARS.index(x) + 1 for x in "abc")
    tokens = jnp.array([a, c, b, c], jnp.int32)  # node 0: a; node 1: c (root sibling); node 2: b under a
    parents = jnp.array([-1, -1, 0, 2], jnp.int32)
    states = mask.tree_states(tables, tables.initial, tokens, parents)
    chain = mask.chain_states(tables, tables.initial, jnp.array([a, b, c], jnp.int32))
    assert int(states[0]) == int(chain[0]) and int(states[1]) == int(chain[1])
    assert int(states[3]) == int(chain[2]) and int(states[4]) == int(chain[3])
    assert int(states[2]) == int(mask.advance(tables, tables.initial, jnp.int32(c)))


# --- the exact law of speculative acceptance under the mask ---------------------------------
LAW_TOKENS = {1: b"a", 2: b"b", 3: b"ab", 4: b"c", 5: b"ba"}
LAW_V = 6
LAW_REGEX = "(ab|c)+b?"
ROWS = 20000
G = 2


def _bigrams(seed):
    logits = jax.random.normal(jax.random.key(seed), (LAW_V, LAW_V)) * 1.5
    return jax.nn.softmax(logits, -1)


def _grammar(tables):
    """The loop's Grammar (token classes) of these dense tables, one row."""
    t = (np.asarray(tables.next), np.asarray(tables.accepting), int(tables.initial))
    return grammar_loop.Grammar(*(jnp.asarray(x) for x in grammar_loop.batch_grammar([t], 1, (EOS,))))


def _spec_step(tables, P, Q, last, state, key, variant):
    """One chain step of G drafts for one row -> (emitted tokens int32[G+1], count, last, state).
    Variants "handoff*": the drafter drafts unmasked from Q (autoregressive: each q depends on
    the previous draft) and the loop's hand-off (constrain/draft.py) puts the chain under the
    mask, redrawing or dropping disallowed drafts; "handoff_q_not_masked" reports Q unmasked."""
    kd, ka = jax.random.split(key)
    dkeys = jax.random.split(kd, G + 1)
    toks, qs, s, prev = [], [], state, last
    handoff = variant.startswith("handoff")
    for i in range(G):
        ok = mask.allowed(tables, s)
        q_masked = Q[prev] if handoff else mask.mask_probs(Q[prev], ok)
        x = jax.random.categorical(dkeys[i], jnp.log(q_masked))
        toks.append(x)
        qs.append(Q[prev] if variant in ("q_not_masked", "handoff") else q_masked)
        s = mask.advance(tables, s, x)
        prev = x
    tokens = jnp.stack(toks).astype(jnp.int32)
    num = jnp.int32(G)
    if handoff:
        g = _grammar(tables)._replace(state=state[None])
        d = draft.mask_drafts(g, tokens[None], jnp.stack(qs)[None], None, num[None], dkeys[G][None],
                              report_masked=variant == "handoff")
        tokens, qs, num = d.tokens[0], list(d.probs[0]), d.num_nodes[0]
    chain = mask.chain_states(tables, state, tokens)  # the same states, from the tables alone
    if variant == "state_before_prefix":
        chain = jnp.full_like(chain, state)
    ctx = jnp.concatenate([last[None], tokens])  # the token each window position conditions on
    p = mask.mask_probs(P[ctx], mask.allowed(tables, chain))
    n, nxt = accept_row(tokens, jnp.stack(qs), p, num, ka)
    emitted = jnp.where(jnp.arange(G + 1) < n, jnp.concatenate([tokens, tokens[-1:]]), nxt)
    new_state = mask.advance(tables, chain[n], nxt)
    return emitted, n + 1, nxt, new_state


def _tree_step(tables, P, Q, last, state, key, variant):
    """One tree step for one row -> (emitted int32[3], count, last, state). The tree: node 0 a
    deterministic one-hot draft ('c': dropped where disallowed, the nodes after it renumbered),
    node 1 ~ Q[last], nodes 2 and 3 i.i.d. children of node 1; drafted unmasked, put under the
    mask by the loop's hand-off. "tree_q_not_masked" reports the drafter's own q."""
    kd, ka = jax.random.split(key)
    k = jax.random.split(kd, 4)
    x1 = jax.random.categorical(k[0], jnp.log(Q[last]))
    x2, x3 = (jax.random.categorical(k[i], jnp.log(Q[x1])) for i in (1, 2))
    tokens = jnp.stack([jnp.int32(4), x1, x2, x3]).astype(jnp.int32)
    q = jnp.stack([jax.nn.one_hot(4, LAW_V), Q[last], Q[x1], Q[x1]])
    g = _grammar(tables)._replace(state=state[None])
    d = draft.mask_drafts(g, tokens[None], q[None], jnp.array([[-1, -1, 1, 1]], jnp.int32),
                          jnp.array([4]), k[3][None], report_masked=variant == "tree")
    tokens, q, parents, num = d.tokens[0], d.probs[0], d.parents[0], d.num_nodes[0]
    states = mask.tree_states(tables, state, tokens, parents)
    window = jnp.concatenate([last[None], tokens])
    p = mask.mask_probs(P[window], mask.allowed(tables, states))
    path, n, nxt = accept_tree_row(tokens, parents, q, p, num, ka, 3)
    emitted = jnp.where(jnp.arange(3) < n, window[path[jnp.minimum(jnp.arange(3) + 1, 2)]], nxt)
    return emitted, n + 1, nxt, mask.advance(tables, states[path[n]], nxt)


def _law_index():
    """outlines-core's own automaton of LAW_REGEX: the reference the law reads its allowed
    tokens from, apart from constrain/ (its tables, mask and advance are what is tested). Not
    the regex language itself: outlines-core 0.2.14 disallows some tokens the language allows
    ("a" after "ab", though "abab" matches): test_outlines_core_allows_every_prefix_token."""
    by_bytes = {}
    for tid, b in LAW_TOKENS.items():
        by_bytes.setdefault(b, []).append(tid)
    return Index(LAW_REGEX, Vocabulary(EOS, by_bytes))


def _allowed_after(index, tokens) -> np.ndarray:
    """bool[LAW_V]: the tokens outlines-core's automaton allows after these token ids."""
    state = index.get_initial_state()
    for t in tokens:
        state = index.get_next_state(state, t)
    ok = np.zeros(LAW_V, bool)
    ok[sorted(index.get_allowed_tokens(state))] = True
    return ok


def _masked(p: np.ndarray, ok: np.ndarray) -> np.ndarray:
    w = np.where(ok, p, 0.0)
    return w / w.sum()


def _first_two(variant, rows):
    tables = compile_tables(LAW_REGEX, LAW_TOKENS, EOS, LAW_V)
    P, Q = _bigrams(0), _bigrams(1)
    step = _tree_step if variant.startswith("tree") else _spec_step

    @jax.jit
    @jax.vmap
    def run(key):
        k1, k2 = jax.random.split(key)
        e1, c1, last, s = step(tables, P, Q, jnp.int32(4), tables.initial, k1, variant)
        e2, _, _, _ = step(tables, P, Q, last, s, k2, variant)
        return jnp.where(c1 >= 2, e1[1], e2[0]), e1[0]

    second, first = run(jax.random.split(jax.random.key(7), rows))
    counts = np.zeros((LAW_V, LAW_V))
    np.add.at(counts, (np.asarray(first), np.asarray(second)), 1)
    # the exact law of plain constrained sampling, p'(t1 | c) p'(t2 | t1), computed apart from
    # constrain/: numpy over outlines-core's own automaton (_law_index)
    index, pn = _law_index(), np.asarray(P, np.float64)
    law = np.zeros((LAW_V, LAW_V))
    p1 = _masked(pn[4], _allowed_after(index, []))
    for t1 in range(1, LAW_V):
        if p1[t1] > 0:
            law[t1] = p1[t1] * _masked(pn[t1], _allowed_after(index, [t1]))
    return chi_square_pvalue(counts, law)


@pytest.mark.xfail(strict=True, reason="outlines-core 0.2.14's Index disallows 'a' after 'ab' "
                   "under (ab|c)+b? (a prefix of 'abab'): the constrained law leaves out valid text")
def test_outlines_core_allows_every_prefix_token():
    """A token is allowed where the text so far plus its bytes still begins a string of the
    language (checked with Python's re over every string up to 8 letters). Strict xfail: it
    turns into a failure the day outlines-core allows them, so this note goes."""
    import itertools
    import re

    words = ("".join(w) for n in range(9) for w in itertools.product("abc", repeat=n))
    prefixes = {w[:i] for w in words if re.fullmatch(LAW_REGEX, w) for i in range(len(w) + 1)}
    index = _law_index()
    for text_ids in ([], [1], [3], [4], [3, 4]):
        text = "".join(LAW_TOKENS[t].decode() for t in text_ids)
        want = {t for t, b in LAW_TOKENS.items() if text + b.decode() in prefixes}
        want |= {EOS} if re.fullmatch(LAW_REGEX, text) else set()
        got = set(np.flatnonzero(_allowed_after(index, text_ids)).tolist())
        assert got == want, (text, sorted(got), sorted(want))


@pytest.mark.parametrize("variant", ["correct", "handoff", "tree"])
def test_speculative_under_the_mask_has_the_constrained_law(variant):
    """"handoff", "tree": the loop's own hand-off (constrain/draft.py) puts an unmasked
    drafter's chain or tree under the mask."""
    assert _first_two(variant, ROWS) > PASS_P


@pytest.mark.parametrize("variant", ["q_not_masked", "state_before_prefix", "handoff_q_not_masked",
                                     "tree_q_not_masked"])
def test_broken_variants_fail_the_law(variant):
    assert _first_two(variant, ROWS) < FAIL_P


@settings(max_examples=60, deadline=None, derandomize=True)
@given(schema=schemas.schemas(), seed=st.integers(0, 2**16))
def test_every_accepted_keyword_is_enforced(schema, seed):
    """Schemas drawn from every accepted keyword (tests/schemas.py): each completed walk under the
    mask validates with jsonschema (formats parsed by the standard library)."""
    tables = compile_tables(constraint_regex(Constraint(json_schema=schema)), TOKENS, EOS, VOCAB)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        toks, complete = _walk_tokens(tables, rng)
        assert complete
        schemas.validate(json.loads(b"".join(TOKENS[t] for t in toks)), schema)


@pytest.mark.parametrize("schema,keyword", schemas.REFUSED, ids=[k for _, k in schemas.REFUSED])
def test_every_other_keyword_is_refused_by_name(schema, keyword):
    with pytest.raises(ValueError) as e:
        constraint_regex(Constraint(json_schema=schema))
    assert f"'{keyword}'" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_bounds_outlines_core_drops_are_enforced():
    """The reported case: {"type": "integer", "minimum": 1, "maximum": 5} once let 1000 through."""
    schema = {"type": "object", "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["limit"]}
    tables = compile_tables(constraint_regex(Constraint(json_schema=schema)), TOKENS, EOS, VOCAB)
    seen = set()
    for seed in range(40):
        toks, complete = _walk_tokens(tables, np.random.default_rng(seed))
        assert complete
        seen.add(json.loads(b"".join(TOKENS[t] for t in toks))["limit"])
    assert seen == {1, 2, 3, 4, 5}
    from outlines_core.json_schema import build_regex_from_schema  # control: outlines-core alone

    bare = compile_tables(build_regex_from_schema(json.dumps(schema)), TOKENS, EOS, VOCAB)
    state = int(bare.initial)
    for ch in b'{"limit":1000}':
        state = int(np.asarray(bare.next)[state, CHARS.index(chr(ch)) + 1])
        assert state >= 0
    assert bool(bare.accepting[state])


def test_deterministic_drafts_are_cut_at_the_first_disallowed_token():
    tables = compile_tables("(ab|c)+", TOKENS, EOS, VOCAB)
    a, b, c = (CHARS.index(x) + 1 for x in "abc")
    cut = jax.jit(mask.valid_prefix)
    assert int(cut(tables, tables.initial, jnp.array([a, b, c, c], jnp.int32), jnp.int32(4))) == 4
    assert int(cut(tables, tables.initial, jnp.array([a, b, b, c], jnp.int32), jnp.int32(4))) == 2
    assert int(cut(tables, tables.initial, jnp.array([b, c, c, c], jnp.int32), jnp.int32(4))) == 0
    assert int(cut(tables, tables.initial, jnp.array([c, c, c, c], jnp.int32), jnp.int32(3))) == 3
