"""Bring your own target: a toy decoder that is not a Llama -- a Flax NNX module with learned
absolute position embeddings, LayerNorm, GELU MLPs, fused qkv and its own cache layout -- plugs
into the engine through the target protocol (jaxspec/models/base.py) with nothing in jaxspec
edited, and every drafter that needs only what it provides runs on it, greedy == plain.

The module is split to (graphdef, state) at the jit boundary: the graphdef sits in the hashable
target object (the static part of the jit key), the state is the params pytree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.drafters.draft_model import ModelDrafter, layer_skip_drafter
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.models import base, llama
from jaxspec.train import methods

V, D, HEADS, LAYERS, MAX_LEN = 64, 32, 4, 3, 256


class Block(nnx.Module):
    """Pre-LayerNorm block: fused qkv attention (no rotary: positions are learned) + GELU MLP."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.out = nnx.Linear(dim, dim, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def kv_and_q(self, x):  # x [B, T, D] -> q, k, v [B, T, N, H]
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        return split(q), split(k), split(v)

    def finish(self, x, q, k_ctx, v_ctx, mask):
        """Attention of q [B, T, N, H] over k/v [B, S', N, H] where mask [B, T, S'], then MLP."""
        b, t, n, h = q.shape
        scores = jnp.einsum("btnh,bsnh->bnts", q, k_ctx) * h**-0.5
        scores = jnp.where(mask[:, None], scores, -1e30)
        attn = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v_ctx)
        x = x + self.out(attn.reshape(b, t, n * h))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class ToyLM(nnx.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_len: int, *, rngs):
        self.tok = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(max_len, dim, rngs=rngs)  # learned absolute positions
        self.blocks = nnx.List([Block(dim, heads, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ToyCache:
    """Its own layout: per layer [B, S, N, H] (slots before heads), one length per row."""

    k: tuple  # per layer [B, S, N, H]
    v: tuple
    lengths: jax.Array  # int32[B]

    def positions(self, num_queries: int) -> jax.Array:
        return self.lengths[:, None] + jnp.arange(num_queries, dtype=jnp.int32)

    def with_lengths(self, lengths) -> ToyCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def _write(buf, new, positions):  # [B, S, N, H] <- [B, T, N, H] at positions [B, T]
    return jax.vmap(lambda c, n, p: c.at[p].set(n, mode="drop"))(buf, new, positions)


@dataclasses.dataclass(frozen=True)
class ToyTarget:
    """The target protocol over the NNX module (graphdef static, state = params)."""

    graphdef: nnx.GraphDef
    num_layers: int
    vocab_size: int = V
    hidden_size: int = D
    max_position_embeddings: int = MAX_LEN
    dtype: str = "float32"
    name: str = "toy"

    def init_cache(self, params, batch, capacity):
        shape = (batch, capacity, HEADS, D // HEADS)
        z = tuple(jnp.zeros(shape, jnp.float32) for _ in range(self.num_layers))
        return ToyCache(z, z, jnp.zeros((batch,), jnp.int32))

    def forward(self, params, tokens, cache, *, positions=None, window_mask=None,
                write_cache=True, taps=()):
        m = nnx.merge(self.graphdef, params)
        b, t = tokens.shape
        positions = cache.positions(t) if positions is None else positions
        if window_mask is None:
            window_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        s = cache.k[0].shape[1]
        prefix = jnp.arange(s)[None, None, :] < cache.lengths[:, None, None]  # [B, 1, S]
        mask = jnp.concatenate([jnp.broadcast_to(prefix, (b, t, s)), window_mask], axis=2)
        x = m.tok(tokens) + m.pos(positions)
        hidden = [x]
        ks, vs = [], []
        for blk, k_c, v_c in zip(m.blocks, cache.k, cache.v):
            q, k, v = blk.kv_and_q(x)
            x = blk.finish(x, q, jnp.concatenate([k_c, k], 1), jnp.concatenate([v_c, v], 1), mask)
            hidden.append(x)
            ks.append(_write(k_c, k, positions) if write_cache else k)
            vs.append(_write(v_c, v, positions) if write_cache else v)
        x = m.ln_f(x)
        hidden[-1] = x  # tap num_layers: the final-normed state
        tapped = jnp.stack([hidden[i] for i in taps]) if taps else None
        if write_cache:
            return base.TargetOutput(x, tapped, None, ToyCache(tuple(ks), tuple(vs), cache.lengths))
        return base.TargetOutput(x, tapped, (tuple(ks), tuple(vs)), cache)

    def logits(self, params, hidden):
        return nnx.merge(self.graphdef, params).head(hidden).astype(jnp.float32)

    def commit_window(self, cache, window_kv, path, positions):
        pick = lambda w: jnp.take_along_axis(w, path[:, :, None, None], axis=1)  # noqa: E731
        k = tuple(_write(c, pick(w), positions) for c, w in zip(cache.k, window_kv[0]))
        v = tuple(_write(c, pick(w), positions) for c, w in zip(cache.v, window_kv[1]))
        return dataclasses.replace(cache, k=k, v=v)

    # optional traits: what EAGLE-3 heads and trained heads ask for
    def embed(self, params, tokens):
        return nnx.merge(self.graphdef, params).tok(tokens)

    def embedding_table(self, params):
        return nnx.merge(self.graphdef, params).tok.embedding[...]

    def head_table(self, params):  # nnx.Linear's kernel is [in, out]: rows per token are its .T
        return nnx.merge(self.graphdef, params).head.kernel[...].T

    @property
    def layer_config(self):  # the shape an EAGLE-3 head's decoder layer takes for this target
        return llama.ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D,
                                 num_layers=1, num_heads=HEADS, num_kv_heads=HEADS,
                                 head_dim=D // HEADS, max_position_embeddings=MAX_LEN)


def toy_model(layers: int = LAYERS, seed: int = 0) -> base.Model:
    graphdef, state = nnx.split(ToyLM(V, D, HEADS, layers, MAX_LEN, rngs=nnx.Rngs(seed)))
    return base.Model(target=ToyTarget(graphdef, layers), params=state, eos_token_ids=(-1,),
                      name=f"toy-{layers}")


PROMPTS = [[3, 9, 27, 3, 9, 27, 3, 9], [5, 7, 11, 13, 5, 7, 11, 13, 5, 7, 11, 2, 4]]


@pytest.fixture(scope="module")
def toy():
    return toy_model()


@pytest.fixture(scope="module")
def plain(toy):
    return [r.token_ids for r in Engine(toy).generate(PROMPTS, max_new_tokens=16, batch_size=2)]


def test_plain_decoding_matches_one_full_forward(toy, plain):
    """The protocol's incremental decode (prefill, then one-token steps) gives the tokens a
    from-scratch forward's argmax gives at every step: one causal forward over prompt + output,
    whose argmax at each position from the prompt's last on is the next generated token."""
    t = toy.target

    @jax.jit
    def argmax_at_every_position(params, ids):  # ids [1, T] -> int32[T]
        hidden = t.forward(params, ids, t.init_cache(params, 1, ids.shape[1])).hidden
        return jnp.argmax(t.logits(params, hidden[0]), axis=-1)

    for prompt, out in zip(PROMPTS, plain):
        ids = jnp.asarray([list(prompt) + list(out)], jnp.int32)
        predicted = np.asarray(argmax_at_every_position(toy.params, ids))
        assert predicted[len(prompt) - 1 : -1].tolist() == list(out)


def _eagle3(toy):
    m = methods.Eagle3(hidden_layers=(1, 2, 3))
    params, frozen = m.init(toy, np.arange(0, V, 2, dtype=np.int32), jax.random.key(7))
    return m.drafter(toy.target), m.runtime(params, frozen)


def drafters(toy):
    draft = toy_model(layers=1, seed=1)  # a smaller toy as the draft model: a Target too
    return {
        "ngram": (NgramDrafter(vocab_size=V, min_ngram=1, max_ngram=3), None, 3),
        "draft_model": (ModelDrafter(model=draft.target, target_vocab=V), draft.params, 3),
        "eagle3": (*_eagle3(toy), 2),
    }


@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle3"])
def test_drafters_on_a_byo_target_are_greedy_identical(toy, plain, name):
    drafter, dparams, gamma = drafters(toy)[name]
    engine = Engine(toy, drafter, dparams, num_speculative_tokens=gamma)
    results = engine.generate(PROMPTS, max_new_tokens=16, batch_size=2)
    assert [r.token_ids for r in results] == plain
    assert all(r.metrics["num_draft_tokens"] > 0 for r in results)
    assert results[0].metrics["layout"] == "custom"


def test_self_draft_is_always_accepted(toy, plain):
    """The target drafting for itself through the protocol: every greedy draft is accepted."""
    engine = Engine(toy, ModelDrafter(model=toy.target, target_vocab=V), toy.params,
                    num_speculative_tokens=3)
    [r] = engine.generate(PROMPTS[:1], max_new_tokens=16)
    assert r.token_ids == plain[0]
    assert r.metrics["acceptance_rate"] == 1.0


def test_what_the_toy_lacks_is_refused_in_one_line(toy):
    with pytest.raises(JaxspecError, match="layer_skip cannot run on target 'toy'.*layer prefix"):
        layer_skip_drafter(toy.target, 1)
    drafter, dparams = _eagle3(toy)
    deep = dataclasses.replace(drafter, hidden_layers=(1, 2, 7))
    with pytest.raises(JaxspecError, match=r"reads target hidden states \[7\].*has 3 layers"):
        Engine(toy, deep, dparams, num_speculative_tokens=2)
    no_embed = base.Model(target=NoEmbed(toy.target.graphdef, LAYERS), params=toy.params)
    refusal = "'eagle3' cannot run on target 'toy'.*shared token embedding"
    with pytest.raises(JaxspecError, match=refusal):
        Engine(no_embed, drafter, dparams, num_speculative_tokens=2)


@dataclasses.dataclass(frozen=True)
class NoEmbed(ToyTarget):
    embed = None  # a target that does not share its embedding
