"""Scheduling policies (jaxspec/serving/policy.py) on the real scheduler with the tiny model: the
order each shipped policy admits in and the row it preempts, each next to what first come, first
served does with the same arrivals (so a policy that fell back to FCFS fails), and outputs that
stay equal to solo runs whatever the order."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.serving import Sampling
from jaxspec.serving.scheduler import Scheduler
from tiny import tiny_model

CONTEXT = 64


class Sink:
    """Records the order requests finish in."""

    def __init__(self, name, finished):
        self.name, self.finished, self.done = name, finished, None

    def push(self, piece):
        pass

    def finish(self, completion, error=None):
        assert error is None
        self.done = completion
        self.finished.append(self.name)


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model(packed=True), None, None, num_speculative_tokens=0,
                  max_context=CONTEXT)


def prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(1, 64, size=n)]


BLOCKER = ("blocker", list(range(1, 7)), 50, 9)  # holds one of two slots while the rest pass


def serve(sched, rounds):
    """rounds: {round: [(name, prompt, max_tokens, priority)]} -> (finish order, completions)."""
    finished, sinks, rnd = [], {}, 0
    while rnd <= max(rounds) or sched.busy:
        for name, ids, new, priority in rounds.get(rnd, ()):
            sinks[name] = Sink(name, finished)
            sched.enqueue(sched.new_request(ids, Sampling(max_tokens=new), sinks[name],
                                            priority=priority))
        sched.run_once()
        rnd += 1
    return [n for n in finished if n != "blocker"], {n: s.done for n, s in sinks.items()}


def one_at_a_time(engine, policy, **kw):
    """Two slots, one held by BLOCKER (admitted in round 0): the others pass through the
    other slot one at a time, so they finish in the order they were admitted."""
    return Scheduler(engine, slots=2, max_context=CONTEXT, policy=policy, **kw)


def test_fcfs_admits_in_arrival_order(engine):
    arrivals = {0: [BLOCKER],
                1: [("a", prompt(1, 6), 3, 0), ("b", prompt(2, 6), 3, 9),
                    ("c", prompt(3, 6), 3, 0)]}
    order, _ = serve(one_at_a_time(engine, "fcfs"), arrivals)
    assert order == ["a", "b", "c"]


def test_priority_admits_higher_priority_first(engine):
    arrivals = {0: [BLOCKER],
                1: [("a", prompt(1, 6), 3, 0), ("b", prompt(2, 6), 3, 0),
                    ("c", prompt(3, 6), 3, 5)]}
    order, done = serve(one_at_a_time(engine, "priority"), arrivals)
    assert order == ["c", "a", "b"]
    solo = {n: engine.generate([p], max_new_tokens=k)[0].token_ids
            for n, p, k, _ in arrivals[0] + arrivals[1]}
    assert {n: c.token_ids for n, c in done.items()} == solo


@pytest.mark.parametrize("policy, preempted", [("fcfs", "high"), ("priority", "low")])
def test_victim_is_the_policys_choice(engine, policy, preempted):
    # two growing rows over 8 pages of 8 slots: one must give way; FCFS preempts the newest
    # (the high-priority one), priority the lowest priority (the older one)
    sched = Scheduler(engine, slots=2, max_context=CONTEXT, steps_per_call=4, kv_pages=8,
                      page_size=8, policy=policy)
    _, done = serve(sched, {0: [("low", prompt(6, 10), 40, 0)],
                            1: [("high", prompt(5, 10), 40, 1)]})
    assert {n: c.preemptions > 0 for n, c in done.items()} == {
        "low": preempted == "low", "high": preempted == "high"}


@pytest.mark.parametrize("policy, first", [("fcfs", "other"), ("prefix", "shares")])
def test_prefix_policy_admits_the_longest_cached_prefix_first(engine, policy, first):
    seen = prompt(6, 40)  # its first 32 tokens (4 pages of 8) stay cached after it ends
    order, _ = serve(one_at_a_time(engine, policy, page_size=8),
                     {0: [BLOCKER], 1: [("seen", seen, 2, 0)],
                      3: [("other", prompt(7, 20), 2, 0), ("shares", seen[:36], 2, 0)]})
    assert order == ["seen", first, ({"other", "shares"} - {first}).pop()]


def test_unknown_policy_is_one_line_naming_the_choices(engine):
    with pytest.raises(JaxspecError, match=r"serving.policy='lifo': use one of fcfs, priority"):
        Scheduler(engine, slots=2, max_context=CONTEXT, policy="lifo")
