"""The KV page pool: fixed-size pages of cache slots, a page table per row, pages taken as a
row grows (its drafted window included) and given back when it ends. A row's footprint is its
length rounded up to a page, not the context limit; when the pool cannot cover the next device
call the scheduler preempts (recompute) rather than fail. Rejected draft slots are never
counted: a row holds pages for its committed length plus the next call's growth only."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxspec.errors import JaxspecError


def pages_for(slots: int, page_size: int) -> int:
    return -(-slots // page_size)


@dataclasses.dataclass
class PagePool:
    num_pages: int
    page_size: int
    tables: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # row slot -> pages
    _free: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.num_pages < 1 or self.page_size < 1:
            raise JaxspecError(
                f"serving.kv_pages={self.num_pages} / page_size={self.page_size}: both must be >= 1"
            )
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def held(self, row: int) -> int:
        return len(self.tables.get(row, ()))

    def needed(self, row: int, slots: int) -> int:
        """Pages `row` must still take to hold `slots` cache slots."""
        return max(0, pages_for(slots, self.page_size) - self.held(row))

    def grow(self, row: int, slots: int) -> bool:
        """Take pages so `row` holds `slots` slots; False (nothing taken) if the pool is short."""
        need = self.needed(row, slots)
        if need > len(self._free):
            return False
        table = self.tables.setdefault(row, [])
        table.extend(self._free.pop() for _ in range(need))
        return True

    def release(self, row: int) -> int:
        """Give back every page of `row`; returns how many."""
        table = self.tables.pop(row, [])
        self._free.extend(reversed(table))
        return len(table)

    def table(self, rows: int, max_pages: int, only=None) -> np.ndarray:
        """The device page table int32[rows, max_pages]: each row's pages in order (of the rows
        in `only` where given), the rest `num_pages` (no page: writes there are dropped, see
        models/paged_attention.py)."""
        out = np.full((rows, max_pages), self.num_pages, np.int32)
        for row, pages in self.tables.items():
            if only is None or row in only:
                out[row, : len(pages)] = pages
        return out
