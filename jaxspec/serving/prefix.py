"""Prefix sharing: full KV pages of prompt tokens, named by content, shared between rows.

A page whose every slot holds a prompt token is named by a chained key: the hash of (the
previous page's key, this page's token ids). Equal keys mean the same tokens at the same
positions from the start of the prompt, so the same k/v (a causal model's k/v at a position
depend only on the tokens up to it): a request whose prompt begins with those pages takes them
instead of recomputing them. Only full pages are named (a partly filled page is still being
written by its row), and a prompt never shares the page holding its last token (that token's
logits give the request's first token, so it is always computed).

`PrefixIndex` is the host-side name table: key -> page for the pages holding named content,
and, among those, the ones no row holds, least recently used first: they stay reusable until
the pool needs them (evicted oldest first). The pool's reference counts live in
`serving.pages.PagePool`, which owns the pages.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

ROOT = b""  # the key before a prompt's first page


def page_keys(tokens: Sequence[int], page_size: int, pages: int | None = None,
              salt: bytes = b"") -> list[bytes]:
    """The chained keys of the first `pages` full pages of `tokens` (None: every full page).
    `salt` (a tenant's `cache_salt`) starts the chain: pages named under one salt are never
    found under another, so no tenant learns what another's prompts hold."""
    full = len(tokens) // page_size
    pages = full if pages is None else min(pages, full)
    ids = np.asarray(tokens[: pages * page_size], np.int64).reshape(pages, page_size)
    keys = []
    key = ROOT if not salt else hashlib.blake2b(b"salt\0" + salt, digest_size=16).digest()
    for row in ids:
        key = hashlib.blake2b(key + row.tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


def shareable_pages(prompt_length: int, page_size: int) -> int:
    """Pages of a prompt that may come from the cache: the full pages before the one holding
    its last token (whose logits give the first token: always computed)."""
    return max(0, prompt_length - 1) // page_size


@dataclasses.dataclass
class PrefixIndex:
    by_key: dict[bytes, int] = dataclasses.field(default_factory=dict)  # key -> page
    key_of: dict[int, bytes] = dataclasses.field(default_factory=dict)  # page -> key
    idle: collections.OrderedDict = dataclasses.field(  # named pages no row holds, LRU first
        default_factory=collections.OrderedDict)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `keys` from the first that are all named."""
        pages = []
        for key in keys:
            page = self.by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def name(self, key: bytes, page: int) -> bool:
        """Name `page` (held by a row, its content written) by `key`; False where the key
        already names another page or the page is named (the first one stays)."""
        if key in self.by_key or page in self.key_of:
            return False
        self.by_key[key], self.key_of[page] = page, key
        return True

    def park(self, page: int) -> bool:
        """`page` is held by no row any more: kept as the most recently used idle page if it
        is named (True), else False (the caller frees it)."""
        if page not in self.key_of:
            return False
        self.idle[page] = None
        return True

    def revive(self, page: int) -> None:
        """A row takes a named page: it is no longer idle (never evicted while held)."""
        self.idle.pop(page, None)

    def evict(self) -> int | None:
        """The least recently used idle page, its name dropped; None when none is idle."""
        if not self.idle:
            return None
        page, _ = self.idle.popitem(last=False)
        del self.by_key[self.key_of.pop(page)]
        return page


def mode(enabled: bool, paged: bool, taps: bool) -> str:
    """Whether a scheduler shares prompt prefixes, and if not why (a Completion metric):
    "on", or "off: <reason>"."""
    if not enabled:
        return "off: serving.prefix_cache is false"
    if not paged:
        return "off: the contiguous KV cache has no pages to share"
    if taps:
        return "off: the drafter reads the target's hidden states at every prompt position"
    return "on"
