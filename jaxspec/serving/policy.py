"""Scheduling policies: which queued request the scheduler admits next and which running one it
preempts when the page pool runs short. The scheduler's loop (`serving.scheduler`) asks; a
policy only chooses, so every policy keeps the loop's guarantees (greedy output equals a solo
run, a preempted request restarts from its prompt with the same seed).

A policy is an object with three methods:

    order(queue)           the queued requests, the one to admit first first
    admit(request, pool)   whether `request` may take pages from `pool` (a `pages.PagePool`)
                           now; False skips it this round, the ones after it are still tried
    victim(running)        the running request to preempt when a row cannot grow

and a name in `POLICIES`; `serving.policy` (and `Scheduler(policy=...)`) selects it by that name.
A policy is built with the scheduler's page pool (`policy(pool)`), so one that ranks by the
pool's contents reads it. A new policy is a class in a module of its own that calls
`register_policy` (imported before the scheduler is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from jaxspec.errors import JaxspecError


class Policy(Protocol):
    def order(self, queue: Sequence) -> list: ...

    def admit(self, request, pool) -> bool: ...

    def victim(self, running: Sequence): ...


@dataclasses.dataclass(frozen=True)
class FirstComeFirstServed:
    """Admission in arrival order (a preempted request goes back to the front); the most recently
    admitted request is preempted first (vLLM's recompute preemption)."""

    pool: Any = dataclasses.field(default=None, repr=False, compare=False)  # pages.PagePool

    def order(self, queue: Sequence) -> list:
        return list(queue)

    def admit(self, request, pool) -> bool:
        return True

    def victim(self, running: Sequence):
        return max(running, key=lambda r: r.admitted)


@dataclasses.dataclass(frozen=True)
class Priority(FirstComeFirstServed):
    """Higher `Request.priority` first, arrival order among equals; the lowest priority (then the
    most recently admitted) is preempted first."""

    def order(self, queue: Sequence) -> list:
        return sorted(queue, key=lambda r: -r.priority)  # stable: arrival order among equals

    def victim(self, running: Sequence):
        return min(running, key=lambda r: (r.priority, -r.admitted))


@dataclasses.dataclass(frozen=True)
class PrefixAware(FirstComeFirstServed):
    """The queued requests whose prompts start with the most pages already in the pool first
    (their prefill is shortest and their pages shared: SGLang's longest-prefix-match), arrival
    order among equals; preemption as first come, first served."""

    def order(self, queue: Sequence) -> list:
        return sorted(queue, key=lambda r: -len(self.pool.cached_prefix(r.prompt_ids,
                                                                         r.cache_salt)))


POLICIES: dict[str, type] = {}


def register_policy(name: str, cls: type) -> None:
    """Make `serving.policy: name` select `cls` (built as `cls(pool)`)."""
    if POLICIES.get(name, cls) is not cls:
        raise ValueError(f"scheduling policy '{name}' is already registered")
    POLICIES[name] = cls


register_policy("fcfs", FirstComeFirstServed)
register_policy("priority", Priority)
register_policy("prefix", PrefixAware)


def named(name: str, pool) -> Policy:
    """The registered policy `name` over `pool`, or a one-line error naming the choices."""
    if name not in POLICIES:
        raise JaxspecError(f"serving.policy={name!r}: use one of {', '.join(POLICIES)}")
    return POLICIES[name](pool)
