"""Prefill: the prompt through the target, the first token sampled (under the rows' penalties and
constraint), the drafter set up -> the `DecodeState` the decode loop (speculate.py) starts from."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.constrain import loop as grammar_loop
from jaxspec.decode import logprob_record, logprobs, penalties as penalties_lib, sampling
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
    if penalties is not None:
        penalties = penalties_lib.with_prompt(penalties, prompt_tokens, prompt_lengths)
    adjusted = penalties_lib.row_logits(penalties, logits)
    if grammar is not None:
        adjusted = grammar_loop.mask_logits(
            adjusted, grammar_loop.allowed_mask(grammar, grammar.state))
    probs = sampling.logits_to_probs(adjusted, sp)  # [B, V]
    row_steps = jnp.zeros((b,), jnp.int32)
    first = sampling.sample_rows(sampling.row_keys(key, row_ids, row_steps), probs)  # [B]
    if grammar is not None:
        grammar = grammar_loop.first_token(grammar, first)
    tokens = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompt_tokens)
    record = None
    if spec.logprobs is not None:
        scores = score_logits(spec, logits, adjusted)[:, None]  # [B, 1, V]
        scored = logprobs.scored(scores, first[:, None], spec.logprobs, sp, spec.logprobs_mode)
        record = logprob_record.write(logprob_record.empty(b, capacity, spec.logprobs),
                                      prompt_lengths, jnp.ones((b,), jnp.int32), scored)
    tokens = tokens.at[jnp.arange(b), prompt_lengths].set(first)
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
        penalties=penalties_lib.commit(penalties, tokens, prompt_lengths, prompt_lengths + 1, 1),
        logprobs=record,
        grammar=grammar,
    )
    return place(spec, state)


def score_logits(spec: LoopSpec, logits, adjusted):
    """The logits the emitted tokens' logprobs are read from: the model's own ("raw") or the
    request's penalties, logit_bias and constraint applied ("processed", which
    `logprobs.log_probs` then puts through the sampling transform)."""
    return logits if spec.logprobs_mode == "raw" else adjusted
