"""Suffix decoding's store of earlier requests: a fixed-size token buffer, kept on the host between
engine calls and passed to the jitted loop as the drafter's params (same shape every call: no
recompiles).

Layout (int32[S]): whole documents (a finished request's prompt followed by its output), oldest
first, each followed by one SEPARATOR; unused slots hold SEPARATOR too. SEPARATOR is never a token
id, so a match never crosses a document boundary and a continuation stops at its document's end.
The position order is also the recency order, which the drafter reads (later = more recent) and
LRU eviction maintains.

Updating (`add_documents`, host side, after a batch has finished; never inside the loop):
  1. LRU only: stored documents the new ones repeat (a shared span of LRU_SPAN tokens: what the
     drafter would have matched) move to the recent end, in their order.
  2. A stored document that a new one starts with (an agent's next call repeats the whole
     conversation so far) or equals is dropped: the new one supersedes it.
  3. The new documents are appended; one longer than the store keeps its last S - 1 tokens.
  4. The oldest documents are evicted until the store fits: S slots, one separator each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

import numpy as np

SEPARATOR = -1
LRU_SPAN = 8  # tokens a new document must share with a stored one for it to count as used
Eviction = Literal["lru", "fifo"]


class SuffixStore(NamedTuple):
    tokens: object  # int32[S] documents, each followed by SEPARATOR, oldest first; then SEPARATOR


def empty_store(size: int) -> SuffixStore:
    return SuffixStore(np.full((size,), SEPARATOR, np.int32))


def documents(store: SuffixStore) -> list[list[int]]:
    """The stored documents, oldest first."""
    flat = np.asarray(store.tokens).tolist()
    docs, current = [], []
    for t in flat:
        if t == SEPARATOR:
            if current:
                docs.append(current)
            current = []
        else:
            current.append(t)
    if current:
        docs.append(current)
    return docs


def pack(docs: Sequence[Sequence[int]], size: int) -> SuffixStore:
    """Documents (oldest first; they must fit: sum(len + 1) <= size) -> the buffer."""
    out = np.full((size,), SEPARATOR, np.int32)
    at = 0
    for doc in docs:
        out[at : at + len(doc)] = doc
        at += len(doc) + 1
    if at > size:
        raise ValueError(f"{at} slots of documents do not fit a store of {size}")
    return SuffixStore(out)


def _spans(doc: Sequence[int]) -> set[tuple[int, ...]]:
    return {tuple(doc[i : i + LRU_SPAN]) for i in range(len(doc) - LRU_SPAN + 1)}


def add_documents(
    store: SuffixStore, new: Iterable[Sequence[int]], eviction: Eviction = "lru"
) -> SuffixStore:
    """The store after adding `new` documents (token lists), by the rules in the module doc."""
    size = int(np.asarray(store.tokens).shape[0])
    new = [list(map(int, d)) for d in new if len(d)]
    docs = documents(store)
    if eviction == "lru" and new and docs:
        seen = set().union(*(_spans(d) for d in new))
        used = [bool(_spans(d) & seen) for d in docs]
        docs = [d for d, u in zip(docs, used) if not u] + [d for d, u in zip(docs, used) if u]
    for doc in new:
        docs = [d for d in docs if not (len(d) <= len(doc) and doc[: len(d)] == d)]
        docs.append(doc[-(size - 1) :])
    total = sum(len(d) + 1 for d in docs)
    while total > size:  # evict the oldest
        total -= len(docs.pop(0)) + 1
    return pack(docs, size)


def used_tokens(store: SuffixStore) -> int:
    """Token slots holding documents (separators excluded)."""
    return int(np.sum(np.asarray(store.tokens) != SEPARATOR))
