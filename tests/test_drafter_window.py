"""Drafter sliding windows (`speculative.{eagle3,dflash}.sliding_window`): the published EAGLE-3
head (drafters/feature_chain.py) and DFlash (drafters/dflash_net.py) read only the last `window`
positions of the context. The chain's mask against a mask built here in numpy; the window reaches
the drafts (a window shorter than the prompt changes them, one as long as it does not); greedy
speculative output with a window is plain greedy output; the option is validated and refused by a
head without a window.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import dflash_like, motif_prompts, tiny_model

from jaxspec.decode import speculate
from jaxspec.decode.drafter import DraftContext
from jaxspec.decode.sampling import SamplingParams
from jaxspec.drafters import eagle3, feature_chain, trained
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.models import base

PROMPT = 24  # tokens: longer than WINDOW
WINDOW = 4
NEW = 12


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=2, scale=0.3, eos=(-1,))


def eagle3_like(target):
    from jaxspec.train import methods  # training code: only the tests that need it import it

    m = methods.Eagle3(hidden_layers=(1, 2, 3))
    params, frozen = m.init(target, np.arange(0, 64, 2, dtype=np.int32), jax.random.key(7))
    return m.drafter(target.target), m.runtime(params, frozen)


HEADS = {"eagle3": eagle3_like, "dflash": dflash_like}


def test_chain_window_masks_keys_older_than_the_window(target):
    """cached_block with a window equals the same layer under a mask built here: slot s is read
    by the query at position p when 1 <= s <= p and p - s < window."""
    drafter, dparams = eagle3_like(target)
    cfg, lp = drafter.cfg, dparams["layer"]
    b, t, s = 2, 3, 16
    keys = jax.random.split(jax.random.key(0), 4)
    attn_in = jax.random.normal(keys[0], (b, t, lp["wq"].shape[1]))
    residual = jax.random.normal(keys[1], (b, t, cfg.hidden_size))
    shape = (b, cfg.num_kv_heads, s, cfg.head_dim)
    k_cache, v_cache = (jax.random.normal(k, shape) for k in keys[2:])
    positions = jnp.asarray([[6, 7, 8], [10, 11, 12]], jnp.int32)
    got, _, _ = feature_chain.cached_block(cfg, lp, attn_in, residual, k_cache, v_cache, positions,
                                           WINDOW)
    q, k, v = feature_chain.qkv(cfg, lp, attn_in, positions)
    from jaxspec.models import decoder

    kc, vc = decoder.write_kv(k_cache, k, positions), decoder.write_kv(v_cache, v, positions)
    p, slot = np.asarray(positions)[..., None], np.arange(s)[None, None]
    mask = jnp.asarray((slot >= 1) & (slot <= p) & (p - slot < WINDOW))
    x = residual + feature_chain.linear(feature_chain.attend(q, kc, vc, mask), lp["wo"])
    np.testing.assert_allclose(got, feature_chain.mlp(cfg, lp, x), rtol=1e-5, atol=1e-5)
    full, _, _ = feature_chain.cached_block(cfg, lp, attn_in, residual, k_cache, v_cache, positions)
    assert not np.allclose(got, full, atol=1e-3)  # the window is not the whole context


def first_drafts(target, drafter, dparams, prompts, gamma=3):
    """int32[B, γ] the drafter's first greedy proposal after the prompts (prefilled by the loop)."""
    spec = speculate.LoopSpec(target=target.target, drafter=drafter,
                              num_speculative_tokens=gamma, eos_ids=())
    b, p = len(prompts), max(map(len, prompts))
    tokens = jnp.asarray([row + [0] * (p - len(row)) for row in prompts], jnp.int32)
    lengths = jnp.asarray([len(row) for row in prompts], jnp.int32)
    cap, sp = p + 32, SamplingParams.make()
    state = speculate.prefill_jit(spec, target.params, dparams, tokens, lengths,
                                  jnp.full((b,), 16, jnp.int32), sp, jax.random.key(0),
                                  jnp.arange(b, dtype=jnp.int32), capacity=cap)
    ctx = DraftContext(state.tokens, state.lengths, jnp.ones((b,), bool))
    keys = jax.random.split(jax.random.key(1), b)
    bound = base.bind(target.target, target.params)
    proposal, _ = drafter.propose(dparams, bound, state.drafter_state, ctx, gamma, sp, keys)
    return np.asarray(proposal.tokens)


@pytest.mark.parametrize("head", list(HEADS))
def test_the_window_reaches_the_drafts_and_greedy_stays_plain(target, head):
    drafter, dparams = HEADS[head](target)
    prompts = motif_prompts((PROMPT, PROMPT - 5))
    whole = first_drafts(target, drafter, dparams, prompts)
    narrow = drafter.with_sliding_window(WINDOW)
    assert (first_drafts(target, narrow, dparams, prompts) != whole).any()
    wide = drafter.with_sliding_window(PROMPT + 40)  # covers every key: the same drafts
    np.testing.assert_array_equal(first_drafts(target, wide, dparams, prompts), whole)
    plain = Engine(target).generate(prompts, max_new_tokens=NEW)
    got = Engine(target, narrow, dparams, num_speculative_tokens=3).generate(
        prompts, max_new_tokens=NEW)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]


def test_the_option_is_validated_and_refused_where_a_head_has_no_window():
    with pytest.raises(JaxspecError, match="sliding_window"):
        eagle3.Eagle3Options(checkpoint="x", sliding_window=0)
    opts = eagle3.Eagle3Options(checkpoint="ckpt", sliding_window=8)
    windowless = types.SimpleNamespace(name="medusa")
    ctx = types.SimpleNamespace(target=None, load_checkpoint=lambda *a: (windowless, {}))
    with pytest.raises(JaxspecError, match="speculative.eagle3.sliding_window: the medusa head"):
        trained.load("eagle3", opts, ctx)
    head = types.SimpleNamespace(name="eagle3", with_sliding_window=lambda w: ("windowed", w))
    ctx.load_checkpoint = lambda *a: (head, {})
    assert trained.load("eagle3", opts, ctx) == (("windowed", 8), {})
