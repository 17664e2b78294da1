"""Prefill: the prompt through the target, the first token sampled (under the rows' penalties and
constraint), the drafter set up -> the `DecodeState` the decode loop (speculate.py) starts from.

A long prompt (padded wider than PROMPT_CHUNK) runs as a `lax.scan` over fixed-width chunks
(`forward_prompt`): each chunk attends the cache the chunks before it wrote plus itself, so the
program holds one chunk's layers whatever the prompt's length (an 8k prompt traced 16 straight-line
query chunks through every layer and compiled for 13 min) and one chunk's activations.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.constrain import loop as grammar_loop
from jaxspec.decode import logprob_record, processors, sampling
from jaxspec.decode.processors import score_logits  # noqa: F401 (its old home)
from jaxspec.decode.sampling import SamplingParams
from jaxspec.decode.state import DecodeState, LoopSpec, place
from jaxspec.models import base
from jaxspec.models.cache import KVCache

PROMPT_CHUNK = 1024  # prompt positions per chunk of a long prefill (`prompt_chunk`)
MIN_PROMPT_CHUNK = 128  # narrower chunks cost more than the one pass they replace


def prompt_chunk(width: int, chunk: int = PROMPT_CHUNK) -> int | None:
    """The chunk width a prompt padded to `width` runs in: the largest divisor of `width` that is
    a power of two no wider than `chunk` (prompt buckets are multiples of a power of two, so
    8192 -> 1024, 1280 -> 256), None (one pass) when `width` <= `chunk` or no such divisor of at
    least MIN_PROMPT_CHUNK exists."""
    if chunk <= 0 or width <= chunk:
        return None
    size = math.gcd(width, 1 << (chunk.bit_length() - 1))
    return size if size >= min(MIN_PROMPT_CHUNK, chunk) else None


def forward_prompt(target, params, tokens: jax.Array, cache: Any, prompt_lengths: jax.Array,
                   taps: tuple[int, ...], chunk: int | None) -> base.TargetOutput:
    """The right-padded prompts `tokens` int32[B, P] through the target into `cache`: one pass
    (chunk None, a target with its own padded-prompt forward, or a cache that is not a plain
    KVCache, e.g. the server's pages), else a lax.scan over P / chunk chunks, chunk i written at
    slots [i * chunk, (i + 1) * chunk) of every row (a shorter row's padding past its length is
    garbage the caller masks by its lengths, as in the one pass). Returns hidden [B, P, D], taps
    [len(taps), B, P, D] and the cache as `base.forward_prompt` does (lengths: the caller sets)."""
    if (chunk is None or base.target_traits(target).forward_prompt is not None
            or type(cache) is not KVCache):
        return base.forward_prompt(target, params, tokens, cache, prompt_lengths, taps)
    b, p = tokens.shape
    n = p // chunk
    pieces = tokens.reshape(b, n, chunk).transpose(1, 0, 2)  # [n, B, C]
    starts = jnp.arange(n, dtype=jnp.int32) * chunk

    def one_chunk(cache, piece):
        ids, start = piece
        out = target.forward(params, ids, cache.with_lengths(jnp.full((b,), start)), taps=taps)
        return out.cache, (out.hidden, out.taps)

    cache, (hidden, tapped) = jax.lax.scan(one_chunk, cache, (pieces, starts))
    hidden = hidden.transpose(1, 0, 2, 3).reshape(b, p, -1)  # [n, B, C, D] -> [B, P, D]
    if tapped is not None:  # [n, taps, B, C, D] -> [taps, B, P, D]
        tapped = tapped.transpose(1, 2, 0, 3, 4).reshape(tapped.shape[1], b, p, -1)
    return base.TargetOutput(hidden, tapped, None, cache)


def prefill(
    spec: LoopSpec,
    tparams,
    dparams,
    prompt_tokens: jax.Array,  # int32[B, P] right-padded
    prompt_lengths: jax.Array,  # int32[B]
    max_new_tokens: jax.Array,  # int32[B]
    sp: SamplingParams,
    key: jax.Array,
    row_ids: jax.Array,  # int32[B]
    capacity: int,
    cache: Any = None,
    penalties: Any = None,
    grammar: grammar_loop.Grammar | None = None,
    chunk: int | None = -1,
) -> DecodeState:
    """Run the prompt through the target, sample the first token, set up the drafter.
    cache: the target cache to prefill into (None: a fresh `target.init_cache`); the serving
    scheduler passes its shared page pool with the row's page table. penalties: the rows'
    `penalties.Penalties` (None: off), their counts started here from the prompt. grammar: the
    rows' constraints (constrain/loop.py; None: every row free), the first token sampled under it.
    chunk: prompt positions per prefill chunk (-1: `prompt_chunk` of the padded width; None: one
    pass; see `forward_prompt`)."""
    target = spec.target
    b, p = prompt_tokens.shape
    g = max(spec.depth, 1)
    hidden_layers = spec.drafter.hidden_layers if spec.drafter is not None else ()
    if cache is None:
        cache = target.init_cache(tparams, b, capacity)
    if spec.mesh is not None:  # allocated sharded, not allocated whole and then split
        cache = spec.mesh.constrain(cache, b)
    if chunk == -1:
        chunk = prompt_chunk(p)
    out = forward_prompt(target, kernels.for_prompts(tparams), prompt_tokens, cache,
                         prompt_lengths, hidden_layers, chunk)
    last = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = target.logits(tparams, last)  # [B, V]
    extras = _extras(spec, b, capacity, penalties, grammar)
    extras = processors.start(extras, prompt_tokens, prompt_lengths)
    none = jnp.zeros((b, 0), jnp.int32)
    aux = processors.prepare(extras, none, none)  # one entry: the last prompt position
    adjusted = processors.adjust(extras, aux, logits[:, None], jnp.zeros((b, 1), jnp.int32),
                                 jnp.ones((b, 1, 1), bool))  # [B, 1, V]
    row_steps = jnp.zeros((b,), jnp.int32)
    first = sampling.choose_rows(sampling.row_keys(key, row_ids, row_steps), adjusted[:, 0], sp)
    # a served tail's prompt array may be wider than the row's slots (its power-of-two bucket
    # against max_context): the positions past `capacity` hold padding only (check_fits)
    tokens = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompt_tokens[:, :capacity])
    tokens = tokens.at[jnp.arange(b), prompt_lengths].set(first)
    reads = processors.read(spec, sp, extras, logits[:, None], adjusted)
    extras = processors.commit(spec, sp, extras, aux, reads,
                               processors.first_token_step(tokens, prompt_lengths, first))
    done = jnp.isin(first, jnp.asarray(spec.eos_ids, jnp.int32)) | (max_new_tokens <= 1)
    dstate = None
    if spec.drafter is not None:
        dstate = spec.drafter.init(
            dparams, base.bind(target, tparams), prompt_tokens, prompt_lengths, out.taps, capacity
        )
    zeros = jnp.zeros((b,), jnp.int32)
    state = DecodeState(
        tokens=tokens,
        lengths=prompt_lengths + 1,
        max_lengths=prompt_lengths + max_new_tokens,
        done=done,
        cache=out.cache.with_lengths(prompt_lengths),
        drafter_state=dstate,
        key=key,
        row_ids=row_ids,
        row_steps=row_steps + 1,
        num_draft=zeros,
        num_accepted=zeros,
        accepted_per_position=jnp.zeros((b, g), jnp.int32),
        **extras,
    )
    return place(spec, state)


def _extras(spec: LoopSpec, batch: int, capacity: int, penalties, grammar) -> processors.Carries:
    """The processors' first carries: the rows' penalties and grammar as given (None: off),
    an empty logprob record when the spec records logprobs."""
    extras = {"penalties": penalties, "grammar": grammar, "logprobs": None}
    if spec.logprobs is not None:
        extras["logprobs"] = logprob_record.empty(batch, capacity, spec.logprobs)
    return {p.field: extras[p.field] for p in processors.LOOP if extras[p.field] is not None}

