"""Prompt lookup first, a drafter elsewhere (`speculative.lookup`).

Per row and step: where the last n committed tokens (lookup.min_ngram <= n <= lookup.max_ngram) occur
earlier in the context, propose what followed them (as the ngram drafter does); elsewhere
propose the inner drafter's draft. Summaries, retrieval answers and translations copy names and
phrases from the prompt, which a small trained drafter rarely predicts and lookup gets for free.

Lossless: which source a row uses depends on the committed tokens only, never on a draw, and each
proposal carries the distribution it was drawn from (one-hot for lookup), so the acceptance rule
sees a valid (token, q) pair either way. When every active row has a lookup continuation, an
inner drafter with `advance` (EAGLE) only updates its state (its cache entry for the last token)
instead of drafting; otherwise it drafts for all rows and each row takes its own source.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.drafters.base import CommitContext, DraftContext, Proposal, traits
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.errors import JaxspecError


@dataclasses.dataclass(frozen=True)
class LookupFirst:
    inner: Any  # a Drafter
    lookup: NgramDrafter
    name: str = "lookup"
    variable_length: bool = True  # a lookup continuation may be shorter than γ

    def __post_init__(self):
        if traits(self.inner).tree_nodes or self.lookup.branches:
            raise JaxspecError(
                "prompt lookup first works with chain drafters only: use a chain "
                "(speculative.tree.kind=chain) or set speculative.lookup.min_ngram=0"
            )

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.inner.hidden_layers

    def target_needs(self, dparams) -> tuple[str, ...]:
        needs = traits(self.inner).target_needs
        return () if needs is None else needs(dparams)

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        return self.inner.init(dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity)

    def propose(self, dparams, tparams, state, ctx: DraftContext, num_tokens, sampling, keys):
        found, _ = self.lookup.propose((), tparams, (), ctx, num_tokens, sampling, keys)

        def both(state):
            own, state = self.inner.propose(dparams, tparams, state, ctx, num_tokens, sampling, keys)
            return self._merge(found, own), state

        advance = traits(self.inner).advance  # state update without drafting
        if advance is None:
            return both(state)
        every_row_found = jnp.all((found.num_proposed > 0) | ~ctx.active)
        return jax.lax.cond(
            every_row_found, lambda st: (found, advance(dparams, tparams, st, ctx)), both, state
        )

    @staticmethod
    def _merge(found: Proposal, own: Proposal) -> Proposal:
        use = found.num_proposed > 0  # bool[B]: a match with committed text after it
        return Proposal(
            jnp.where(use[:, None], found.tokens, own.tokens),  # [B, G]
            jnp.where(use[:, None, None], found.probs, own.probs),  # [B, G, V]
            jnp.where(use, found.num_proposed, own.num_proposed),  # [B]
        )

    def commit(self, dparams, tparams, state, ctx: CommitContext):
        return self.inner.commit(dparams, tparams, state, ctx)
