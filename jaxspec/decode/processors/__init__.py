"""The step's extras as logits processors (interface: processors/base.py), applied by the loop
at one place each: one file per processor, each a pure function of its own carry in
`DecodeState`. A new processor is one file and one entry of `LOOP`.

`LOOP` is the order hooks run in: penalties adjust the logits before the grammar masks them;
commits run penalties, the logprob record, then the grammar. Only processors whose carry is in
the state run (`carries`): with none on, the step is exactly the one without extras.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxspec.decode.processors.base import Committed, Processor  # noqa: F401
from jaxspec.decode.processors.grammar import GRAMMAR
from jaxspec.decode.processors.logprobs import LOGPROBS, score_logits  # noqa: F401
from jaxspec.decode.processors.penalties import PENALTIES

LOOP: tuple[Processor, ...] = (PENALTIES, LOGPROBS, GRAMMAR)

Carries = dict  # {processor field: its carry}, in LOOP order, the processors that are on


def carries(state) -> Carries:
    """The processors on in `state` (a DecodeState) -> their carries."""
    out = {}
    for p in LOOP:
        carry = getattr(state, p.field)
        if carry is not None:
            out[p.field] = carry
    return out


def _on(c: Carries):
    return [p for p in LOOP if p.field in c]


def start(c: Carries, prompt, lengths) -> Carries:
    return {p.field: p.start(c[p.field], prompt, lengths) for p in _on(c)}


def propose(c: Carries, proposal, keys, active) -> tuple[Any, Carries]:
    """The proposal after every processor's `propose` hook (the grammar's masking)."""
    c = dict(c)
    for p in _on(c):
        proposal, c[p.field] = p.propose(c[p.field], proposal, keys, active)
    return proposal, c


def prepare(c: Carries, tokens, parents) -> dict:
    return {p.field: p.prepare(c[p.field], tokens, parents) for p in _on(c)}


def adjust(c: Carries, aux: dict, logits, tokens, mask):
    """logits f32[B, T, V] of window entries (tokens int32[B, T], mask bool[B, T, T])."""
    for p in _on(c):
        logits = p.adjust(c[p.field], aux[p.field], logits, tokens, mask)
    return logits


def read(spec, sp, c: Carries, logits, adjusted) -> dict:
    out = {}
    for p in _on(c):
        got = p.read(spec, sp, c[p.field], logits, adjusted)
        if got is not None:
            out[p.field] = got
    return out


def commit(spec, sp, c: Carries, aux: dict, reads: dict, step: Committed) -> Carries:
    return {p.field: p.commit(spec, sp, c[p.field], aux[p.field], reads.get(p.field), step)
            for p in _on(c)}


def first_token_step(tokens, prompt_lengths, first) -> Committed:
    """Prefill's commit of the first sampled token (int32[B]) as a one-entry path."""
    b = first.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)
    path = jnp.zeros((b, 1), jnp.int32)
    return Committed(tokens, prompt_lengths, prompt_lengths + 1, zeros + 1, path,
                     first[:, None], zeros, first)
