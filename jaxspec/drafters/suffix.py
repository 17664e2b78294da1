"""Suffix decoding (`speculative.method: suffix`): model-free drafts from the row's own context and
a store of earlier requests' prompts and outputs, on device inside the jitted loop.

Per row and step: the longest suffix of the committed tokens (up to max_match tokens) that occurs
earlier in the store or the row's context is found; its occurrences (the `candidates` most recent
of them) vote on what follows. A continuation prefix's score is the share of occurrences it heads
(count(prefix) / count(match)): the product of the next-token frequencies along its path, what a
suffix tree's node counts give. A chain follows the most frequent next token at each depth; a tree
(speculative.tree.kind=dynamic) keeps the `budget` best-scoring prefixes, `depth` levels at most.
Prefixes scoring under min_token_prob are not proposed, and a row drafts at most
max_spec_factor x (its match length) tokens: a long match earns a long draft.

The store (jaxspec.drafters.suffix_store) is the drafter's params: a fixed-size token buffer the
engine passes to every call and updates between calls, after a batch has finished (`observe`),
never inside the loop. Matching is data-parallel over the buffer (shifted compares, as the n-gram
drafter), so no host round trip per step.

Lossless whatever the store holds: a proposal is a deterministic function of the committed tokens
and the store (no draw of this step), each node carries a one-hot q, and the acceptance rule then
keeps the target's law (greedy: its tokens). The store changes only how many drafts are accepted.

`then` (lookup first, like speculative.lookup): where suffix decoding has a proposal, verify it;
elsewhere a trained drafter's (`SuffixFirst`). Which source a row uses depends on the committed
tokens and the store only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp

from jaxspec.drafters import suffix_store
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal, traits
from jaxspec.drafters.prompt_lookup import MAX_NGRAM
from jaxspec.drafters.registry import BuildContext, DrafterOptions, get, register_drafter
from jaxspec.drafters.suffix_store import SEPARATOR, SuffixStore
from jaxspec.errors import JaxspecError

MAX_CANDIDATES = 128


@dataclasses.dataclass(frozen=True)
class SuffixDrafter:
    vocab_size: int
    min_match: int = 1  # shortest suffix matched
    max_match: int = MAX_NGRAM  # longest suffix matched
    candidates: int = 32  # most recent occurrences of the match that vote
    max_spec_factor: float = 1.0  # draft depth <= this x match length
    min_token_prob: float = 0.1  # a prefix heading fewer occurrences than this share is cut
    store_tokens: int = 16384  # S: the store's slots (0: the row's context only)
    eviction: Literal["lru", "fifo"] = "lru"
    budget: int = 0  # > 0: a tree of this many nodes, `depth` levels at most
    depth: int = 0
    name: str = "suffix"
    hidden_layers: tuple[int, ...] = ()
    variable_length: bool = True
    drafts_from_tokens: bool = True  # committed tokens and the store only: no state, no draw
    verify_windows: tuple[int, ...] = (3, 5, 9, 17)  # draft lengths vary with the match length

    def __post_init__(self):
        if not 1 <= self.min_match <= self.max_match <= MAX_NGRAM:
            raise JaxspecError(
                f"suffix match sizes min_match={self.min_match}, max_match={self.max_match} are "
                f"out of range: need 1 <= min_match <= max_match <= {MAX_NGRAM}"
            )
        if not 1 <= self.candidates <= MAX_CANDIDATES:
            raise JaxspecError(f"suffix candidates={self.candidates}: use 1..{MAX_CANDIDATES}")
        if self.budget and self.depth < 1:
            raise JaxspecError(f"suffix tree depth={self.depth} is invalid: use an integer >= 1")

    @property
    def tree_nodes(self) -> int | None:
        return self.budget or None

    @property
    def tree_depth(self) -> int | None:
        return self.depth if self.budget else None

    # ---- the store (host side) -----------------------------------------------------------
    def empty_store(self) -> SuffixStore | None:
        if not self.store_tokens:
            return None
        return SuffixStore(jnp.asarray(suffix_store.empty_store(self.store_tokens).tokens))

    def observe(self, dparams, sequences) -> Any:
        """The params after a finished batch: `sequences` (each a request's prompt + output
        token ids) added to the store. Host side, between engine calls."""
        if dparams is None:
            return None
        store = suffix_store.add_documents(dparams, sequences, self.eviction)
        return SuffixStore(jnp.asarray(store.tokens))

    # ---- the loop --------------------------------------------------------------------------
    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        return ()

    def propose(self, dparams, tparams, state, ctx: DraftContext, num_tokens, sampling, keys):
        store = None if dparams is None else dparams.tokens  # int32[S]
        depth = self.depth if self.budget else num_tokens
        match = jax.vmap(self._occurrences, in_axes=(None, 0, 0, None))(
            store, ctx.tokens, ctx.lengths, depth
        )
        if self.budget:
            proposal = jax.vmap(self._tree)(*match)
        else:
            proposal = jax.vmap(self._chain)(*match)
        tokens, num, parents = proposal
        num = jnp.where(ctx.active, num, 0).astype(jnp.int32)
        probs = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)  # [B, N, V]
        return Proposal(tokens, probs, num, parents if self.budget else None), state

    def _occurrences(self, store, tokens, length, depth: int):
        """One row: store int32[S] | None, tokens int32[W], length int32[] -> the continuations
        of the longest match's K most recent occurrences, cont int32[K, D] (SEPARATOR past the
        text); valid bool[K, D] (the prefix up to d exists); the depth this row may draft."""
        w, k, m_max = tokens.shape[0], self.candidates, self.max_match
        context = jnp.where(jnp.arange(w) < length, tokens, SEPARATOR)  # committed text only
        parts = [context] if store is None else [store, jnp.full((1,), SEPARATOR), context]
        text = jnp.concatenate(parts)  # [M] store first: later = more recent
        m = text.shape[0]
        padded = jnp.concatenate([jnp.full((m_max,), SEPARATOR), text])
        run = jnp.zeros((m,), jnp.int32)  # suffix tokens matched ending at each position
        alive = jnp.ones((m,), bool)
        for i in range(m_max):
            pattern = jnp.take(tokens, jnp.maximum(length - 1 - i, 0))
            alive = alive & (padded[m_max - i : m_max - i + m] == pattern) & (length - 1 - i >= 0)
            run = run + alive
        after = jnp.concatenate([text[1:], jnp.full((depth + 1,), SEPARATOR)])  # [M + D]
        has_next = after[:m] != SEPARATOR  # a continuation exists (the row's own end has none)
        run = jnp.where(has_next, run, 0)
        best = jnp.max(run)
        best = jnp.where(best >= self.min_match, best, 0)
        ends, _ = jax.lax.top_k(jnp.where((run == best) & (best > 0), jnp.arange(m), -1), k)
        found = ends >= 0  # [K] most recent first
        pos = jnp.maximum(ends, 0)[:, None] + jnp.arange(depth)[None]  # [K, D]
        cont = jnp.where(found[:, None], jnp.take(after, pos), SEPARATOR)
        valid = jnp.cumprod(cont != SEPARATOR, axis=1).astype(bool)
        limit = jnp.minimum(jnp.floor(self.max_spec_factor * best).astype(jnp.int32), depth)
        return cont, valid, limit

    def _prefix_stats(self, cont, valid):
        """same bool[K, K, D]: occurrences k and k' share the prefix through depth d; count
        int32[K, D] occurrences heading each k's prefix; score f32[K, D] their share."""
        same = jnp.cumprod(cont[:, None, :] == cont[None, :, :], axis=2).astype(bool)
        same = same & valid[:, None, :] & valid[None, :, :]
        count = jnp.sum(same, axis=1, dtype=jnp.int32)
        total = jnp.maximum(jnp.sum(valid[:, 0]), 1)
        return same, count, count / total

    def _chain(self, cont, valid, limit):
        """The most frequent next token at each depth (ties: the most recent occurrence)."""
        k, d = cont.shape
        same, count, score = self._prefix_stats(cont, valid)
        alive = valid[:, 0]
        tokens, ok = [], jnp.ones((), bool)
        num = jnp.zeros((), jnp.int32)
        for i in range(d):
            votes = jnp.where(alive & valid[:, i], count[:, i], -1)
            pick = jnp.argmax(votes)
            ok = ok & (votes[pick] > 0) & (score[pick, i] >= self.min_token_prob) & (i < limit)
            tokens.append(jnp.where(ok, cont[pick, i], 0))
            num = num + ok
            alive = alive & same[:, pick, i]
        return jnp.stack(tokens).astype(jnp.int32), num, None

    def _tree(self, cont, valid, limit):
        """The `budget` best-scoring prefixes, level by level (parents before children, siblings
        by score): a prefix heads at least as many occurrences as any extension and sits a level
        higher, so it always ranks before it and the kept set is ancestor-closed."""
        k, d = cont.shape
        n = self.budget
        same, count, score = self._prefix_stats(cont, valid)
        rep = jnp.argmax(same, axis=1)  # [K, D] the most recent occurrence sharing the prefix
        level = jnp.arange(d)[None]
        eligible = (rep == jnp.arange(k)[:, None]) & valid & (score >= self.min_token_prob)
        eligible = eligible & (level < limit)
        rank = jnp.where(eligible, count * (d + 1) + (d - level), -1)  # [K, D]
        flat_rank = rank.T.reshape(-1)  # flat index level * K + k: ties -> the most recent
        top, picked = jax.lax.top_k(flat_rank, n)
        kept = top >= 0
        lv, occ = picked // k, picked % k
        order = jnp.argsort(jnp.where(kept, lv * (k + 1) * k + (k - top // (d + 1)) * k + occ,
                                      jnp.iinfo(jnp.int32).max))  # level-major, by score
        lv, occ, kept, picked = lv[order], occ[order], kept[order], picked[order]
        tokens = jnp.where(kept, cont[occ, lv], 0)
        parent_id = (lv - 1) * k + rep[occ, jnp.maximum(lv - 1, 0)]  # the prefix one level up
        hit = (picked[None, :] == parent_id[:, None]) & kept[None, :]  # [N, N]
        parents = jnp.where(lv == 0, -1, jnp.argmax(hit, axis=1))
        parents = jnp.where(kept, parents, -2)  # -2: padding
        return tokens.astype(jnp.int32), jnp.sum(kept, dtype=jnp.int32), parents.astype(jnp.int32)

    def commit(self, dparams, tparams, state, ctx: CommitContext):
        return state

    def commit_plain(self, dparams, tparams, state, ctx: CommitContext):
        """Adaptive plain steps: nothing to keep (the match reads the committed tokens)."""
        return state


@dataclasses.dataclass(frozen=True)
class SuffixFirst:
    """Suffix decoding first, a trained chain drafter elsewhere (speculative.suffix.then).
    Params: (the inner drafter's, the store). Per row: the suffix proposal where it has one,
    else the inner draft; an inner drafter with `advance` only updates its state when every
    active row has a suffix proposal."""

    inner: Any  # a Drafter (a chain)
    suffix: SuffixDrafter
    name: str = "suffix"
    variable_length: bool = True

    def __post_init__(self):
        if traits(self.inner).tree_nodes or self.suffix.budget:
            raise JaxspecError(
                "speculative.suffix.then works with chains only: set speculative.tree.kind=chain"
            )

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.inner.hidden_layers

    @property
    def verify_windows(self) -> tuple[int, ...]:
        return self.suffix.verify_windows

    def target_needs(self, dparams) -> tuple[str, ...]:
        needs = traits(self.inner).target_needs
        return () if needs is None else needs(dparams[0])

    def observe(self, dparams, sequences):
        inner_params, store = dparams
        return inner_params, self.suffix.observe(store, sequences)

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        return self.inner.init(
            dparams[0], tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity
        )

    def propose(self, dparams, tparams, state, ctx: DraftContext, num_tokens, sampling, keys):
        inner_params, store = dparams
        found, _ = self.suffix.propose(store, tparams, (), ctx, num_tokens, sampling, keys)

        def both(state):
            own, state = self.inner.propose(
                inner_params, tparams, state, ctx, num_tokens, sampling, keys
            )
            use = found.num_proposed > 0  # bool[B]
            return Proposal(
                jnp.where(use[:, None], found.tokens, own.tokens),  # [B, G]
                jnp.where(use[:, None, None], found.probs, own.probs),  # [B, G, V]
                jnp.where(use, found.num_proposed, own.num_proposed),  # [B]
            ), state

        advance = traits(self.inner).advance
        if advance is None:
            return both(state)
        every_row_found = jnp.all((found.num_proposed > 0) | ~ctx.active)
        return jax.lax.cond(
            every_row_found, lambda st: (found, advance(inner_params, tparams, st, ctx)), both,
            state,
        )

    def commit(self, dparams, tparams, state, ctx: CommitContext):
        return self.inner.commit(dparams[0], tparams, state, ctx)


# ---- method "suffix" --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class SuffixOptions(DrafterOptions):
    """speculative.suffix; a tree (speculative.tree.kind=dynamic) keeps tree.budget nodes over
    tree.depth levels."""

    SECTION: ClassVar[str] = "speculative.suffix"
    store_tokens: int = 16384  # slots of the store of earlier requests (0: own context only)
    eviction: Literal["lru", "fifo"] = "lru"  # which stored documents go first when it is full
    min_match: int = 1  # shortest suffix matched
    max_match: int = MAX_NGRAM  # longest suffix matched
    candidates: int = 32  # most recent occurrences of the match that vote
    max_spec_factor: float = 1.0  # draft depth <= this x match length
    min_token_prob: float = 0.1  # prefixes heading a smaller share of the occurrences are cut
    then: str = "none"  # a trained method drafting where suffix decoding has nothing

    def _validate(self):
        if not 0 <= self.store_tokens <= 1 << 22:
            self._fail("store_tokens", "use 0 (no store) .. 4194304")
        if 0 < self.store_tokens < 2:
            self._fail("store_tokens", "use 0 (no store) or at least 2")
        if not 1 <= self.min_match <= MAX_NGRAM:
            self._fail("min_match", f"use 1..{MAX_NGRAM}")
        if not self.min_match <= self.max_match <= MAX_NGRAM:
            self._fail("max_match", f"use min_match ({self.min_match})..{MAX_NGRAM}")
        if not 1 <= self.candidates <= MAX_CANDIDATES:
            self._fail("candidates", f"use 1..{MAX_CANDIDATES}")
        if not self.max_spec_factor > 0:
            self._fail("max_spec_factor", "use a number > 0")
        if not 0 <= self.min_token_prob <= 1:
            self._fail("min_token_prob", "use a number in 0..1")

    def with_sections(self, sections):
        """Keep the `then` method's section (read next to this one) for the build."""
        out = dataclasses.replace(self)
        object.__setattr__(out, "then_section", sections.get(self.then))
        return out

    def check(self, spec):
        if spec.lookup.min_ngram:
            raise JaxspecError(
                "speculative.lookup adds prompt lookup to a drafter; method 'suffix' looks up "
                "already: set speculative.lookup.min_ngram=0 (tune speculative.suffix instead)"
            )
        if self.then == "none":
            return
        if self.then in ("suffix", "ngram"):
            raise JaxspecError(
                f"speculative.suffix.then={self.then!r} is invalid: name a trained method "
                "(e.g. eagle) or none"
            )
        get(self.then)  # a one-line error listing the available methods
        if spec.tree.kind != "chain":
            raise JaxspecError(
                "speculative.suffix.then works with chains only: set speculative.tree.kind=chain "
                "or speculative.suffix.then=none"
            )


def build(options: SuffixOptions, ctx: BuildContext):
    tree = ctx.spec.tree
    dynamic = tree.kind == "dynamic"
    drafter = SuffixDrafter(
        vocab_size=ctx.target.target.vocab_size,
        min_match=options.min_match,
        max_match=options.max_match,
        candidates=options.candidates,
        max_spec_factor=options.max_spec_factor,
        min_token_prob=options.min_token_prob,
        store_tokens=options.store_tokens,
        eviction=options.eviction,
        budget=tree.budget if dynamic else 0,
        depth=tree.depth if dynamic else 0,
    )
    store = drafter.empty_store()
    if options.then == "none":
        return drafter, store
    method = get(options.then)
    inner_options = getattr(options, "then_section", None)
    if inner_options is None and method.options is not None:
        inner_options = method.options()
    inner, inner_params = method.factory(inner_options, ctx)
    return SuffixFirst(inner, drafter, name=f"suffix+{inner.name}"), (inner_params, store)


register_drafter("suffix", build, options=SuffixOptions, tree_kinds=("dynamic",), summary=(
    "model-free: continuations from the row's context and a store of earlier requests' text "
    "(SuffixDecoding)"))
