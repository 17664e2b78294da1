"""Sampled speculative output has the target's exact law, for every drafter, under temperature
with top-k, top-p and min-p all on -- and each drafter has a broken variant that this same test
rejects (seen failing, p < FAIL_P). Engine-level: longer outputs with EOS, the bonus position,
mixed prompt lengths and several batch sizes, with a broken bonus rule that must fail.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import cases
import pytest

from distribution import FAIL_P, PASS_P, chi_square_pvalue, counts_of, exact_law, pvalue, sample_rows
from jaxspec.decode import acceptance, sampling
from jaxspec.decode.acceptance import accept_tree
from jaxspec.drafters import eagle_head as eagle_lib
from jaxspec.drafters.draft_model import layer_skip_drafter
from jaxspec.drafters.prompt_lookup_first import LookupFirst
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.models import llama
from jaxspec.decode.sampling import SamplingParams
from jaxspec.train import methods
from tiny import tiny_model

V = 8
DRAFT_IDS = np.array([0, 1, 2, 3, 5, 6], np.int32)  # trained drafters: 6 of the 8 target tokens
ROWS = 12000  # a correct rule must pass at this size
BROKEN_ROWS = 6000  # every broken variant fails far below FAIL_P at this size
PROMPT = [1, 2, 3, 4, 5]
REPEATING = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 6, 1, 7, 0]  # prompt lookup matches on most steps
# Every transform on at once: a q that skips any one of them has the wrong law.
FILTERED = dict(temperature=0.6, top_k=6, top_p=0.95, min_p=0.05)


@pytest.fixture(scope="module")
def target():
    """Flat enough at T = 0.6 that every drafter gets 5-50% of its drafts accepted. Two layers of
    width 32: the law tests run 6000-24000-row batches, whose cost grows with the model."""
    return tiny_model(seed=5, scale=0.3, vocab=V, layers=2, hidden=32, eos=(-1,))


def trained(target, method, noise=0.3):
    """A trained-drafter architecture with random weights near its init (accepts sometimes)."""
    params, frozen = method.init(target, DRAFT_IDS, jax.random.key(7))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(8), len(leaves))
    params = jax.tree.unflatten(
        treedef, [w + noise * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
    )
    return method.drafter(target.cfg), method.runtime(params, frozen)


def eagle(target):
    return trained(target, methods.Eagle(hidden_layers=(0, 1, 1), input_scale=1.0))


def build(target, name):
    """(drafter, dparams, prompt, γ) for every drafting method."""
    if name == "ngram":
        return NgramDrafter(V, 1, 2), None, REPEATING, 3
    if name == "layer_skip":
        return layer_skip_drafter(target.target, 1), None, PROMPT, 2
    if name == "draft_model":
        return (*trained(target, methods.Draft(layers_from=(0, 1)), noise=0.15), PROMPT, 2)
    if name == "medusa":
        return (*trained(target, methods.Medusa(num_heads=2)), PROMPT, 2)
    drafter, dparams = eagle(target)
    if name == "eagle":
        return drafter, dparams, PROMPT, 2
    if name == "eagle_gated":
        gated = dataclasses.replace(drafter, min_confidence=0.5, variable_length=True)
        return gated, dparams, PROMPT, 3
    if name == "eagle_lookup":
        return LookupFirst(drafter, NgramDrafter(V, 1, 2)), dparams, REPEATING, 3
    raise ValueError(name)


DRAFTERS = cases.names("law")  # tests/cases.py: every registered drafter's law cases


@dataclasses.dataclass(frozen=True)
class MisreportedQ:
    """Broken: proposes the inner drafter's tokens but reports q mixed with the uniform law, so
    the acceptance rule divides by the wrong probability (one-hot drafters included)."""

    inner: Any
    mix: float = 0.5

    def __getattr__(self, name):  # name, hidden_layers, variable_length, init, commit, advance
        if name == "inner":  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, dparams, tparams, state, ctx, num_tokens, sp, keys):
        proposal, state = self.inner.propose(dparams, tparams, state, ctx, num_tokens, sp, keys)
        probs = (1 - self.mix) * proposal.probs + self.mix / proposal.probs.shape[-1]
        return proposal._replace(probs=probs), state


@pytest.mark.parametrize("name", DRAFTERS)
def test_sampled_output_has_the_target_law(target, name):
    drafter, dparams, prompt, gamma = build(target, name)
    sp = SamplingParams.make(**FILTERED)
    p, results = pvalue(target, drafter, dparams, sp, prompt, rows=ROWS, gamma=gamma)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    assert 0.03 * drafted < accepted < 0.95 * drafted  # acceptance and rejection both happen
    assert p > PASS_P


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_drafter_with_a_wrong_q_fails(target, name):
    drafter, dparams, prompt, gamma = build(target, name)
    sp = SamplingParams.make(**FILTERED)
    p, _ = pvalue(target, MisreportedQ(drafter), dparams, sp, prompt, rows=BROKEN_ROWS, gamma=gamma)
    assert p < FAIL_P


@jax.tree_util.register_static
class UntemperedDrawEagle(eagle_lib.EagleDrafter):
    """Broken: reports q after the sampling transform but draws from softmax(logits). At
    temperature 1 with no filter the two agree (such a bug passes a T = 1 test); here they don't."""

    def _sample(self, dparams, logits, sp, keys):
        _, probs = super()._sample(dparams, logits, sp, keys)
        idx = sampling.sample_rows(keys, jax.nn.softmax(logits, axis=-1))
        return idx, probs


def test_a_drafter_drawing_before_the_transform_fails(target):
    good, dparams = eagle(target)
    broken = UntemperedDrawEagle(**{f.name: getattr(good, f.name) for f in dataclasses.fields(good)})
    sp = SamplingParams.make(**FILTERED)
    p, _ = pvalue(target, broken, dparams, sp, PROMPT, rows=ROWS)
    assert p < FAIL_P


# ---- engine level: EOS, the bonus position, mixed prompt lengths and batch sizes -------------

EOS_V = 6
LONG_TOKENS = 4  # γ = 2: token 1 from prefill, tokens 2..4 from one step (2 drafts + bonus)
MIXED = ([1, 2, 3, 4, 5], [3, 1, 4, 1, 5, 2, 2, 4, 3])
SETTINGS = {
    "temperature": dict(temperature=0.9),
    "top_k": dict(temperature=1.2, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=0.8, min_p=0.2),
    "filtered": FILTERED,
}


@pytest.fixture(scope="module")
def eos_target():
    """Token 5 ends a row, so some rows stop inside the window."""
    target = tiny_model(seed=5, scale=0.6, vocab=EOS_V, layers=2, hidden=32, eos=(5,))
    leaves, treedef = jax.tree.flatten(target.params)
    keys = jax.random.split(jax.random.key(6), len(leaves))
    draft = jax.tree.unflatten(
        treedef, [w + 0.3 * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
    )
    from jaxspec.drafters.draft_model import ModelDrafter

    return target, ModelDrafter(model=llama.LlamaTarget(target.cfg), target_vocab=EOS_V), draft


def mixed_pvalues(eos_target, sp, batch_size, rows=24000):
    """Rows alternate two prompts of different lengths, `batch_size` rows per jitted batch."""
    target, drafter, dparams = eos_target
    results = sample_rows(target, drafter, dparams, sp, MIXED, rows=rows, num_tokens=LONG_TOKENS,
                          gamma=2, seed=11, batch_size=batch_size)
    out = []
    for i, prompt in enumerate(MIXED):
        ids = [r.token_ids for r in results[i :: len(MIXED)]]
        counts = counts_of(ids, EOS_V, LONG_TOKENS)
        out.append(chi_square_pvalue(counts, exact_law(target, prompt, sp, LONG_TOKENS, (5,))))
    return out, results


# (setting, rows, rows per batch): the plain temperature law at the most rows; each filter at
# 12000 rows; every setting over several batches, of two sizes (the settings are arrays of one
# sampled program: a size's programs serve all its settings; five sizes traced five program pairs
# for the same property).
@pytest.mark.parametrize("setting,rows,batch_size", [("temperature", 24000, 6000),
                                                     ("top_k", 12000, 4000),
                                                     ("top_p", 12000, 6000),
                                                     ("min_p", 12000, 4000),
                                                     ("filtered", 12000, 6000)])
def test_longer_outputs_with_eos_have_the_target_law(eos_target, setting, rows, batch_size):
    sp = SamplingParams.make(**SETTINGS[setting])
    pvalues, results = mixed_pvalues(eos_target, sp, batch_size, rows)
    lengths = [len(r.token_ids) for r in results]
    assert min(lengths) < LONG_TOKENS == max(lengths)  # some rows stopped at EOS, some ran on
    full_steps = sum(r.metrics["num_accepted_tokens"] == 2 for r in results)
    assert full_steps > 100  # the bonus position (all drafts accepted) is in the window
    assert min(pvalues) > PASS_P, pvalues


def bonus_from_q(tokens, parents, q, p, num_nodes, keys, path_len, update_residual=True):
    """A classic bug: when every draft of the chain passes, the bonus token is drawn from the
    draft's last distribution q[N-1] instead of the target's p[N]. Everything else is the real
    rule (acceptance.accept_tree)."""
    path, n, nxt = accept_tree(tokens, parents, q, p, num_nodes, keys, path_len, update_residual)
    last_q = jnp.take_along_axis(q, jnp.maximum(num_nodes - 1, 0)[:, None, None], axis=1)[:, 0]
    from_q = jax.vmap(lambda k, w: jax.random.categorical(jax.random.fold_in(k, 7), jnp.log(w)))(
        keys, last_q)
    all_in = (n == num_nodes) & (num_nodes > 0)
    return path, n, jnp.where(all_in, from_q, nxt).astype(jnp.int32)


BONUS_ROWS = 6000  # the wrong bonus gives p = 0.0 (underflow) for both prompts at 8000 rows


@pytest.mark.patches_traced_code
def test_longer_outputs_catch_a_wrong_bonus(eos_target, monkeypatch):
    sp = SamplingParams.make(**SETTINGS["temperature"])
    monkeypatch.setattr(acceptance, "accept_tree", bonus_from_q)  # speculate reads it
    pvalues, _ = mixed_pvalues(eos_target, sp, BONUS_ROWS, rows=BONUS_ROWS)  # one batch
    assert max(pvalues) < FAIL_P, pvalues
