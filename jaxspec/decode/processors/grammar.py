"""Structured output's grammar as a processor (carry: `constrain.loop.Grammar` in
`DecodeState.grammar`): the drafts put under the constraint (`propose`, constrain/draft.py),
each window entry masked with the state along its own path, the state advanced along the
accepted path (constrain/loop.py)."""

from __future__ import annotations

from jaxspec.constrain import draft as grammar_draft, loop as grammar_loop
from jaxspec.decode.processors.base import Processor


class GrammarProcessor(Processor):
    field = "grammar"

    def propose(self, carry, proposal, keys, active):
        return grammar_draft.mask_proposal(carry, proposal, keys, active)

    def prepare(self, carry, tokens, parents):
        states = grammar_loop.window_states(carry, tokens, parents)  # [B, 1+N]
        return states, grammar_loop.allowed_mask(carry, states)  # bool[B, 1+N, V]

    def adjust(self, carry, aux, logits, tokens, mask):
        return grammar_loop.mask_logits(logits, aux[1][:, :logits.shape[1]])

    def commit(self, spec, sp, carry, aux, read, step):
        return grammar_loop.after_step(carry, aux[0], step.path, step.num_accepted,
                                       step.next_token, step.count)


GRAMMAR = GrammarProcessor()
