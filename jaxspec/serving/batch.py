"""The widths a serving device call is compiled for: the live rows are compacted into the
narrowest row width that holds them and get a page table as wide as the longest row needs, so a
step's cost follows the load with a bounded number of programs."""

from __future__ import annotations

import jax.numpy as jnp

MIN_TABLE_PAGES = 4  # the narrowest page table a device call gets (fewer programs)


def program_widths(most: int, least: int = 1) -> tuple[int, ...]:
    """The sizes compiled for: powers of two from `least` below `most`, then `most`."""
    out, w = [], max(1, least)
    while w < most:
        out.append(w)
        w *= 2
    return (*out, most)


def table_widths(per_row: int, tables: str = "octaves") -> tuple[int, ...]:
    """The page-table widths decode calls are compiled for: "octaves" (powers of two from
    MIN_TABLE_PAGES up to `per_row`) or "one" (`per_row` alone). One table costs a short row
    nothing measurable on CPU (the attention reads the whole table's pages: SmolLM2, 4 rows
    at 1/16 of the table, within the noise of the octaves) and is what TPU/GPU paged kernels
    bound by each row's length anyway; it divides the decode programs by the octaves' count."""
    if tables not in ("octaves", "one"):
        raise ValueError(f"tables={tables!r}: use 'octaves' or 'one'")
    return program_widths(per_row, MIN_TABLE_PAGES) if tables == "octaves" else (per_row,)


def call_width(widths: tuple[int, ...], live: int) -> int:
    """The narrowest compiled width holding `live` rows."""
    return next(w for w in widths if w >= live)


def hole(pool) -> tuple:
    """Zero-size placeholders for a page pool's arrays: the batch state holds these while the
    pool itself is passed (donated) on its own, so it is never copied."""
    return tuple(jnp.zeros((0,), x.dtype) for x in pool)


def split_widths(widths: tuple[int, ...], n: int) -> list[int]:
    """`n` rows as a sum of compiled widths, widest first, none padded (widths hold 1):
    batched admission's prefill calls (7 over (1, 2, 4, 8) -> [4, 2, 1])."""
    out = []
    while n:
        out.append(max(w for w in widths if w <= n))
        n -= out[-1]
    return out
