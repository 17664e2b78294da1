"""The KV page pool: fixed-size pages of cache slots, a page table per row, pages taken as a
row grows (its drafted window included) and given back when it ends. A row's footprint is its
length rounded up to a page, not the context limit; when the pool cannot cover the next device
call the scheduler preempts (recompute) rather than fail. Rejected draft slots are never
counted: a row holds pages for its committed length plus the next call's growth only.

Prefix sharing (`serving.prefix`): a page may be held by several rows (a reference count per
page). A row's full prompt pages are named by their content once written (`register`); a later
row whose prompt begins with the same pages starts its table with them (`admit`) and prefills
only the rest. A page goes back to the free list only when no row holds it; a named page no row
holds stays cached (reusable by the next prompt that starts the same) until a fresh page is
needed and none is free, then the least recently used one is evicted. Cached pages count as
free (`free_pages`): they never stop a row from growing. Rows write only at positions >= their
length, and a shared page lies wholly below it, so no row writes into a page it shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.serving import prefix


def pages_for(slots: int, page_size: int) -> int:
    return -(-slots // page_size)


@dataclasses.dataclass
class PagePool:
    num_pages: int
    page_size: int
    tables: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # row slot -> pages
    _free: list[int] = dataclasses.field(default_factory=list)  # unheld, unnamed
    _refs: dict[int, int] = dataclasses.field(default_factory=dict)  # held page -> rows holding it
    evictions: int = 0  # cached pages taken back for fresh content, over the pool's life
    _index: prefix.PrefixIndex = dataclasses.field(default_factory=prefix.PrefixIndex)

    def __post_init__(self):
        if self.num_pages < 1 or self.page_size < 1:
            raise JaxspecError(
                f"serving.kv_pages={self.num_pages} / page_size={self.page_size}: both must be >= 1"
            )
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first

    @property
    def free_pages(self) -> int:
        """Pages a row can take now: free ones plus cached ones no row holds (evictable)."""
        return len(self._free) + len(self._index.idle)

    @property
    def cached_pages(self) -> int:
        """Named pages no row holds: reusable by a matching prompt until evicted."""
        return len(self._index.idle)

    @property
    def used_pages(self) -> int:
        """Distinct pages held by at least one row (a shared page counts once)."""
        return len(self._refs)

    def holders(self, page: int) -> int:
        """How many rows hold `page` now."""
        return self._refs.get(page, 0)

    def frozen(self, row: int) -> int:
        """Slots of `row` it must never write: those up to the end of its last named page
        (named content is read, or may be read, by other rows)."""
        named = [i for i, p in enumerate(self.tables.get(row, ())) if p in self._index.key_of]
        return (named[-1] + 1) * self.page_size if named else 0

    def held(self, row: int) -> int:
        return len(self.tables.get(row, ()))

    def needed(self, row: int, slots: int) -> int:
        """Pages `row` must still take to hold `slots` cache slots."""
        return max(0, pages_for(slots, self.page_size) - self.held(row))

    def grow(self, row: int, slots: int) -> bool:
        """Take pages so `row` holds `slots` slots; False (nothing taken) if the pool is short."""
        need = self.needed(row, slots)
        if need > self.free_pages:
            return False
        table = self.tables.setdefault(row, [])
        for _ in range(need):
            page = self._take()
            self._refs[page] = 1
            table.append(page)
        return True

    def cached_prefix(self, tokens: Sequence[int], salt: bytes = b"") -> list[int]:
        """The cached pages a prompt of `tokens` may start with (never its last token's), among
        those named under `salt`."""
        keys = prefix.page_keys(tokens, self.page_size,
                                prefix.shareable_pages(len(tokens), self.page_size), salt)
        return self._index.lookup(keys)

    def admit(self, row: int, tokens: Sequence[int], slots: int,
              salt: bytes = b"") -> int | None:
        """A new row (no pages yet) for a prompt of `tokens`, holding `slots` slots: its table
        starts with the prompt's cached pages (shared), the rest fresh. Returns the prompt
        tokens whose k/v the shared pages hold; None (nothing taken) if the pool is short."""
        if self.tables.get(row):
            raise ValueError(f"row {row} already holds pages")
        shared = self.cached_prefix(tokens, salt)
        idle = sum(p in self._index.idle for p in shared)  # counted free now, not once taken
        if pages_for(slots, self.page_size) - len(shared) > self.free_pages - idle:
            return None
        for page in shared:
            self._index.revive(page)
            self._refs[page] = self._refs.get(page, 0) + 1
        self.tables[row] = list(shared)
        self.grow(row, slots)
        return len(shared) * self.page_size

    def register(self, row: int, tokens: Sequence[int], salt: bytes = b"") -> int:
        """Name the full pages of `row`'s table that hold `tokens` (its prompt's first tokens,
        their k/v written), so later prompts starting the same share them. Returns how many
        pages are named after it (a page whose content is already named elsewhere stays the
        row's own)."""
        table = self.tables.get(row, [])
        keys = prefix.page_keys(tokens, self.page_size, len(table), salt)
        for key, page in zip(keys, table):
            self._index.name(key, page)
        return sum(page in self._index.key_of for page in table[: len(keys)])

    def release(self, row: int) -> int:
        """Give back every page of `row`; returns how many. A page still held by another row
        stays; a named one goes to the cache (its last pages first in eviction order), the
        rest to the free list."""
        table = self.tables.pop(row, [])
        for page in reversed(table):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if not self._index.park(page):
                self._free.append(page)
        return len(table)

    def _take(self) -> int:
        """A page for fresh content: a free one, else the least recently used cached one."""
        if self._free:
            return self._free.pop()
        page = self._index.evict()
        if page is None:
            raise RuntimeError("the page pool is empty (callers check free_pages first)")
        self.evictions += 1
        return page

    def table(self, rows: int, max_pages: int, only=None) -> np.ndarray:
        """The device page table int32[rows, max_pages]: each row's pages in order (of the rows
        in `only` where given), the rest `num_pages` (no page: writes there are dropped, see
        models/paged_attention.py)."""
        out = np.full((rows, max_pages), self.num_pages, np.int32)
        for row, pages in self.tables.items():
            if only is None or row in only:
                out[row, : len(pages)] = pages
        return out
