"""Prompt lookup (n-gram) drafting, on device inside the jitted loop.

Match the last n committed tokens (n from max_ngram down to min_ngram) against everything
committed before them (prompt and generated text); propose what followed the most recent match.
Deterministic, so its draft distribution is one-hot; rows without a match propose nothing and the
loop then verifies a shorter window (see LoopSpec.verify_windows).

Tree (`branches` > 0): the `branches` most recent matches of the longest matching n whose
continuations start with distinct tokens each give a branch of `depth` nodes under the root
(a static tree of that shape; nodes past the committed text or beyond the matches found are
padding, parent -2).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.drafters.base import CommitContext, DraftContext, Proposal
from jaxspec.drafters.registry import BuildContext, DrafterOptions, register_drafter
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
    drafts_from_tokens: bool = True  # the match reads committed tokens only
    branches: int = 0  # > 0: a tree of this many distinct continuations, `depth` nodes each
    depth: int = 0

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM:
            raise JaxspecError(
                f"ngram sizes min_ngram={self.min_ngram}, max_ngram={self.max_ngram} are out of "
                f"range: need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}"
            )
        if self.branches and self.depth < 1:
            raise JaxspecError(f"ngram tree depth={self.depth} is invalid: use an integer >= 1")

    @property
    def tree_nodes(self) -> int | None:
        return self.branches * self.depth if self.branches else None

    @property
    def tree_depth(self) -> int | None:
        return self.depth if self.branches else None

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        return ()

    def propose(self, dparams, tparams, state, ctx: DraftContext, num_tokens, sampling, keys):
        if self.branches:
            return self._propose_tree(ctx), state
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

    def _propose_tree(self, ctx: DraftContext) -> Proposal:
        """K branches of D nodes, laid out level by level (depth 1 of every branch, then depth
        2, ...): parents before children, the root's children in recency order, and a cut to
        depth c (adaptive speculation) keeps a prefix of c * K nodes."""
        k, d = self.branches, self.depth
        starts, count = jax.vmap(self._match_starts)(ctx.tokens, ctx.lengths)  # [B, K], [B]
        pos = starts[:, None, :] + jnp.arange(d)[None, :, None]  # [B, D, K]
        valid = (jnp.arange(k)[None, None, :] < count[:, None, None]) & (
            pos < ctx.lengths[:, None, None]
        )  # a branch continues only through committed text
        w = ctx.tokens.shape[1]
        tokens = jnp.take_along_axis(
            ctx.tokens, jnp.minimum(pos, w - 1).reshape(-1, d * k), axis=1
        ).reshape(-1, d, k)
        tokens = jnp.where(valid, tokens, 0).reshape(-1, d * k)  # level-major: [d1b0, d1b1, ...]
        node = jnp.arange(d * k, dtype=jnp.int32).reshape(d, k)
        parents = jnp.where(jnp.arange(d)[:, None] == 0, -1, node - k)  # [D, K] one level up
        parents = jnp.where(valid, parents[None], -2).reshape(-1, d * k)  # -2: padding
        last_valid = jnp.max(jnp.where(valid.reshape(-1, d * k), node.reshape(-1) + 1, 0), axis=1)
        probs = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        return Proposal(tokens, probs, last_valid.astype(jnp.int32), parents.astype(jnp.int32))

    def _match_starts(self, tokens, length):
        """tokens int32[W], length int32[] -> (starts int32[K]: continuation starts of the K most
        recent matches of the longest matching suffix whose next tokens differ; count int32[])."""
        w = tokens.shape[0]
        j = jnp.arange(w)
        best_ok = jnp.zeros((w,), bool)
        best_n = jnp.zeros((), jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer matches override shorter
            pattern_start = length - n
            ok = (j + n <= length - 1) & (pattern_start >= 0)
            for i in range(n):
                tok_j = jnp.take(tokens, jnp.minimum(j + i, w - 1))
                tok_p = jnp.take(tokens, jnp.maximum(pattern_start + i, 0))
                ok = ok & (tok_j == tok_p)
            found = jnp.any(ok)
            best_ok = jnp.where(found, ok, best_ok)
            best_n = jnp.where(found, n, best_n)
        first = jnp.take(tokens, jnp.minimum(j + best_n, w - 1))  # each match's next token
        latest = jnp.full((self.vocab_size,), -1, jnp.int32).at[first].max(
            jnp.where(best_ok, j, -1).astype(jnp.int32)
        )
        distinct = best_ok & (latest[first] == j)  # the most recent match per next token
        top, _ = jax.lax.top_k(jnp.where(distinct, j, -1), self.branches)
        count = jnp.sum(top >= 0, dtype=jnp.int32)
        return (jnp.maximum(top, 0) + best_n).astype(jnp.int32), count

    def commit(self, dparams, tparams, state, ctx: CommitContext):
        return state

    def commit_plain(self, dparams, tparams, state, ctx: CommitContext):
        """Adaptive plain steps: nothing to keep (the match reads the committed tokens)."""
        return state


# ---- method "ngram" ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramOptions(DrafterOptions):
    """speculative.ngram; a static tree (speculative.tree.kind=static) uses tree.branches x depth."""

    SECTION: ClassVar[str] = "speculative.ngram"
    min_ngram: int = 1  # shortest suffix to look up
    max_ngram: int = 3  # longest suffix to look up

    def _validate(self):
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM:
            raise JaxspecError(
                f"{self.SECTION}.min_ngram={self.min_ngram}, {self.SECTION}.max_ngram="
                f"{self.max_ngram} are invalid: need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}"
            )

    def check(self, spec):
        if spec.lookup.min_ngram:
            raise JaxspecError(
                "speculative.lookup adds prompt lookup to a drafter; method 'ngram' is prompt "
                "lookup already: set speculative.lookup.min_ngram=0 (tune speculative.ngram instead)"
            )


def build(options: NgramOptions, ctx: BuildContext) -> tuple[NgramDrafter, tuple]:
    tree = ctx.spec.tree
    static = tree.kind == "static"
    drafter = NgramDrafter(
        vocab_size=ctx.target.target.vocab_size,
        min_ngram=options.min_ngram,
        max_ngram=options.max_ngram,
        branches=tree.branches if static else 0,
        depth=tree.depth if static else 0,
    )
    return drafter, ()


register_drafter("ngram", build, options=NgramOptions, tree_kinds=("static",), summary=(
    "prompt lookup on device: copy what followed the latest match of the last tokens"))
