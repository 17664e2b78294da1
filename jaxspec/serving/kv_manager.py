"""The scheduler's KV bookkeeping in one unit (vLLM keeps its KV-cache manager apart from the
scheduler the same way): how many cache slots a row may touch in its next call, pages for an
admitted prompt (its cached prefix pages shared where prefix sharing is on), pages for every
running row's next call with the policy's victims preempted where the pool is short, and the
naming of written prompt pages for later prompts to share. Host side only: the device pool and
its tables are the scheduler's (`PagePool.table` is what it uploads)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from jaxspec.serving.pages import PagePool


@dataclasses.dataclass
class KVManager:
    pool: PagePool
    capacity: int  # serving.max_context: the most slots a row can hold
    steps: int  # decode steps per device call
    depth: int  # the speculative plan's γ: a step commits at most depth + 1 tokens
    num_nodes: int  # drafted slots one verify window writes past the committed length
    prefix_cache: str = "off"  # "on", or "off (why)": `prefix.mode`

    @property
    def sharing(self) -> bool:
        return self.prefix_cache == "on"

    def slots_needed(self, req, length: int, steps: int | None = None) -> int:
        """Cache slots a row of `length` committed tokens may touch in its next `steps` steps
        (None: a device call's): its growth (at most depth + 1 tokens a step, never past
        max_tokens) plus one verify window of drafted slots, never past max_context."""
        limit = len(req.prompt_ids) + int(req.sampling.max_tokens)
        grow = min(length + 1 + (steps or self.steps) * (self.depth + 1), limit)
        return min(grow + self.num_nodes + 1, self.capacity)

    def take(self, req, slot: int, written: bool = True) -> int | None:
        """Pages for a request's prompt and one step (as vLLM does: growth past it is reserved
        call by call), its cached prefix pages shared where sharing is on and the pool was
        written (`written`). Returns the prompt tokens those hold (0: none shared); None
        (nothing taken) when the pool is short."""
        slots = self.slots_needed(req, len(req.prompt_ids), 1)
        if not self.sharing or not written:
            return 0 if self.pool.grow(slot, slots) else None
        return self.pool.admit(slot, req.prompt_ids, slots, req.cache_salt)

    def written(self, slot: int, tokens: Sequence[int], salt: bytes = b"") -> None:
        """Row `slot`'s prompt pages holding `tokens` are written: shareable from now on (under
        `salt`, the request's cache_salt)."""
        if self.sharing:
            self.pool.register(slot, tokens, salt)

    def reserve(self, active: Mapping[int, object], lengths, victim: Callable,
                preempt: Callable) -> None:
        """Every active row (oldest admitted first) holds pages for its next call; where the
        pool is short `victim(running)` names a row and `preempt(row)` frees it (and removes it
        from `active`), until the row fits or is itself the victim. `lengths[slot]`: committed
        tokens per slot."""
        for req in sorted(active.values(), key=lambda r: r.admitted):
            if req.slot < 0:  # preempted for an older row
                continue
            need = self.slots_needed(req, int(lengths[req.slot]))
            while not self.pool.grow(req.slot, need):
                chosen = victim(list(active.values()))
                preempt(chosen)
                if chosen is req:
                    break
            if req.slot >= 0:
                req.peak_pages = max(req.peak_pages, self.pool.held(req.slot))
