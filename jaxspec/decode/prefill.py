"""Prefill: the prompt through the target, the first token sampled (under the rows' penalties and
constraint), the drafter set up -> the `DecodeState` the decode loop (speculate.py) starts from."""

from __future__ import annotations

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
) -> DecodeState:
    """Run the prompt through the target, sample the first token, set up the drafter.
    cache: the target cache to prefill into (None: a fresh `target.init_cache`); the serving
    scheduler passes its shared page pool with the row's page table. penalties: the rows'
    `penalties.Penalties` (None: off), their counts started here from the prompt. grammar: the
    rows' constraints (constrain/loop.py; None: every row free), the first token sampled under it."""
    target = spec.target
    b, p = prompt_tokens.shape
    g = max(spec.depth, 1)
    hidden_layers = spec.drafter.hidden_layers if spec.drafter is not None else ()
    if cache is None:
        cache = target.init_cache(tparams, b, capacity)
    if spec.mesh is not None:  # allocated sharded, not allocated whole and then split
        cache = spec.mesh.constrain(cache, b)
    out = base.forward_prompt(target, kernels.for_prompts(tparams), prompt_tokens, cache,
                              prompt_lengths, hidden_layers)
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
    tokens = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompt_tokens)
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

