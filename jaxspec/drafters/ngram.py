"""Prompt lookup (n-gram) drafting, on device inside the jitted loop.

Match the last n committed tokens (n from max_ngram down to min_ngram) against everything
committed before them (prompt and generated text); propose what followed the most recent match.
Deterministic, so its draft distribution is one-hot; rows without a match propose nothing and the
loop then verifies a shorter window (see LoopSpec.verify_windows).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafters.base import CommitContext, DraftContext, Proposal
from jaxspec.errors import JaxspecError

MAX_NGRAM = 16


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    vocab_size: int
    min_ngram: int = 1
    max_ngram: int = 3
    name: str = "ngram"
    hidden_layers: tuple[int, ...] = ()
    variable_length: bool = True

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM:
            raise JaxspecError(
                f"ngram sizes min_ngram={self.min_ngram}, max_ngram={self.max_ngram} are out of "
                f"range: need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}"
            )

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        return ()

    def propose(self, dparams, tparams, state, ctx: DraftContext, num_tokens, sampling, keys):
        starts, found_len = jax.vmap(self._match_row)(ctx.tokens, ctx.lengths)  # [B], [B]
        g = num_tokens
        pos = starts[:, None] + jnp.arange(g)[None]  # [B, G]
        drafts = jnp.take_along_axis(ctx.tokens, jnp.minimum(pos, ctx.tokens.shape[1] - 1), axis=1)
        available = jnp.clip(ctx.lengths - starts, 0, g)  # continuation must be committed text
        num_proposed = jnp.where(found_len > 0, available, 0).astype(jnp.int32)
        drafts = jnp.where(jnp.arange(g)[None] < num_proposed[:, None], drafts, 0)
        probs = jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32)  # [B, G, V]
        return Proposal(drafts, probs, num_proposed), state

    def _match_row(self, tokens, length):
        """tokens int32[W], length int32[] -> (start of the continuation, matched n; 0 = none)."""
        w = tokens.shape[0]
        j = jnp.arange(w)  # candidate match start
        best_start = jnp.zeros((), jnp.int32)
        best_n = jnp.zeros((), jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer matches override shorter
            pattern_start = length - n
            ok = (j + n <= length - 1) & (pattern_start >= 0)  # continuation exists, not itself
            for i in range(n):
                tok_j = jnp.take(tokens, jnp.minimum(j + i, w - 1))
                tok_p = jnp.take(tokens, jnp.maximum(pattern_start + i, 0))
                ok = ok & (tok_j == tok_p)
            latest = jnp.max(jnp.where(ok, j, -1))
            found = latest >= 0
            best_start = jnp.where(found, latest + n, best_start)
            best_n = jnp.where(found, n, best_n)
        return best_start.astype(jnp.int32), best_n

    def commit(self, dparams, tparams, state, ctx: CommitContext):
        return state
