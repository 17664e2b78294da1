"""Prefix sharing in serving (jaxspec/serving/prefix.py, pages.py, the scheduler's admission).

Requests that start with the same system prompt share its full KV pages and prefill only the
rest, and greedy output still equals a solo Engine run (plain, n-gram, chunked prefill after the
shared prefix; staggered arrivals, mixed lengths, a request arriving after the first finished and
reusing its cached pages). A page two rows hold outlives the one that ends first; after many
requests no page leaks (cached pages no row holds count as free); `prefix_cached_tokens` counts
the shared prefix; a prompt that differs inside its first page, or one shifted by a page (the
keys are chained), shares nothing; a small pool evicts cached pages and outputs stay identical.
The pool's own bookkeeping (reference counts, the last prompt token's page never shared, LRU
eviction) is checked host side first, and a prompt's tail over shared pages on device: it writes
nothing below the row's length.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.serving import Sampling
from jaxspec.serving.paged_cache import PagedTarget, TailTarget
from jaxspec.serving.pages import PagePool
from jaxspec.serving.scheduler import Scheduler
from test_serving import Sink, run
from tiny import eagle_like, tiny_model

CONTEXT, PAGE = 128, 8
RNG = np.random.default_rng(3)
SYSTEM = [int(t) for t in RNG.integers(1, 64, size=29)]  # 3 full pages of 8, then 5 tokens
USERS = [[int(t) for t in RNG.integers(1, 64, size=n)] for n in (3, 11, 20, 6, 9)]
SHARED = 3 * PAGE


@pytest.fixture(scope="module")
def target():
    return tiny_model(packed=True)


@pytest.fixture(scope="module")
def engines(target):
    return {
        "plain": Engine(target, None, None, num_speculative_tokens=0, max_context=CONTEXT),
        "ngram": Engine(target, NgramDrafter(64, 1, 3), None, num_speculative_tokens=3,
                        max_context=CONTEXT),
    }


def solo(engine, prompts, news):
    return [engine.generate([p], max_new_tokens=n)[0].token_ids for p, n in zip(prompts, news)]


def scheduler(engine, **kw):
    return Scheduler(engine, **({"slots": 3, "max_context": CONTEXT, "steps_per_call": 3,
                                 "page_size": PAGE} | kw))


def test_the_pool_counts_holders_caches_unheld_pages_and_evicts_them():
    pool = PagePool(8, 4)
    prompt = list(range(1, 14))  # 3 full pages of 4, then one token
    assert pool.admit(0, prompt, 14) == 0  # nothing cached yet: 4 fresh pages
    assert pool.register(0, prompt) == 3
    assert pool.admit(1, prompt + [40, 41, 42], 16) == 12
    shared = pool.tables[0][:3]
    assert pool.tables[1][:3] == shared and pool.tables[1][3] != pool.tables[0][3]
    assert [pool.holders(p) for p in shared] == [2, 2, 2] and pool.used_pages == 5
    assert pool.frozen(1) == 12  # a prefill of row 1 starts past its shared pages
    pool.release(0)  # the shared pages stay with row 1; row 0's own last page is free
    assert [pool.holders(p) for p in shared] == [1, 1, 1] and pool.tables[1][:3] == shared
    assert pool.free_pages == 4 and pool.cached_pages == 0
    pool.release(1)
    assert pool.cached_pages == 3 and pool.free_pages == 8 and pool.used_pages == 0
    # the prompt's own 12 tokens: the last one's page is never shared (its logits are needed)
    assert pool.admit(2, prompt[:12], 12) == 8
    pool.release(2)
    assert pool.evictions == 0
    assert pool.admit(3, [50] * 32, 32) == 0  # 8 fresh pages: the 3 cached ones evicted
    assert pool.evictions == 3 and pool.cached_pages == 0
    pool.release(3)
    assert pool.admit(4, prompt, 14) == 0 and pool.free_pages == 4


def test_a_prompt_tail_writes_nothing_below_the_rows_length(target):
    paged = PagedTarget(target.target, PAGE, num_pages=6)
    cache = paged.init_cache(target.params, 1, 6 * PAGE)
    marked = tuple(jnp.full_like(x, 7.0) for x in cache.k)  # every slot marked
    table = jnp.asarray([[4, 1, 3, 0, 6, 6]], jnp.int32)  # pages 4, 1: the shared head
    cache = dataclasses.replace(cache, k=marked, v=marked).with_table(table)
    prompt = np.zeros((1, 32), np.int32)
    prompt[0, :25] = (SYSTEM + USERS[0])[:25]
    out = TailTarget(paged, 16).forward(target.params, jnp.asarray(prompt),
                                        cache.with_lengths(jnp.asarray([2 * PAGE])))
    for pool in (*out.cache.k, *out.cache.v):  # [K, NP, P, H]
        pool = np.asarray(pool)
        assert np.all(pool[:, [4, 1, 2, 5]] == 7.0)  # the head's pages and unheld ones: untouched
        assert not np.any(pool[:, [3, 0]] == 7.0)  # the tail's (and its padding's) own pages
    hidden = np.asarray(out.hidden)  # [1, 32, D]: the tail's positions only
    assert not np.any(hidden[0, :16]) and np.all(np.any(hidden[0, 16:], axis=-1))


@pytest.mark.parametrize("name,chunk", [("plain", None), ("ngram", None), ("ngram", 8)])
def test_greedy_outputs_with_a_shared_system_prompt_equal_solo_runs(engines, name, chunk):
    engine = engines[name]
    prompts = [SYSTEM + u for u in USERS]
    news = (12, 5, 9, 7, 10)
    want = solo(engine, prompts, news)
    sched = scheduler(engine, prefill_chunk=chunk)
    rounds = (0, 1, 1, 4, 60)  # the last arrives after every other request finished
    chunking, shared = [], {}  # chunk > 0: the rest of a shared prompt goes in chunk by chunk
    run_once = sched.run_once

    def watched():
        chunking.append(bool(sched.prefilling))
        out = run_once()
        first = [r for r in sched.active.values() if r.prompt_ids == prompts[0]]
        if first and not shared:  # the first request is in: its system prompt's pages as written
            pages = sched.pool.tables[first[0].slot][:3]
            shared.update(pages=pages, k=np.asarray(sched.state.cache.k[-1][:, pages]))
        return out

    sched.run_once = watched
    done = run(sched, [(r, p, Sampling(max_tokens=n)) for r, p, n in zip(rounds, prompts, news)])
    assert any(chunking) == bool(chunk)
    # no row wrote into the pages it shared (none evicted: the pool never ran short)
    assert sched.pool.evictions == 0
    np.testing.assert_array_equal(np.asarray(sched.state.cache.k[-1][:, shared["pages"]]),
                                  shared["k"])
    assert done[-1].queue_s >= 0 and sched.stats.finished == len(prompts)
    assert [c.token_ids for c in done] == want
    cached = [c.metrics["prefix_cached_tokens"] for c in done]
    # the first computes the system prompt, the rest share it; chunked, the first request goes
    # in chunks too, so the two arriving at round 1 find only its first chunk's page written
    early = PAGE if chunk else SHARED
    assert cached == [0, early, early, SHARED, SHARED]
    assert [c.usage()["prompt_tokens_details"]["cached_tokens"] for c in done] == cached
    assert {c.metrics["prefix_cache"] for c in done} == {"on"}
    assert sched.stats.prefix_cached_tokens == sum(cached)
    assert sched.pool.free_pages == sched.pool.num_pages and not sched.pool.tables
    assert sched.pool.cached_pages >= 3  # the system prompt's pages stay cached


def test_pages_two_rows_hold_outlive_the_row_that_ends_first(engines):
    engine = engines["plain"]
    prompts = [SYSTEM + USERS[0], SYSTEM + USERS[1], USERS[2] + USERS[3] + USERS[4]]
    news = (30, 8, 12)
    want = solo(engine, prompts, news)
    sched = scheduler(engine, slots=2)
    sinks = [Sink() for _ in prompts]
    reqs = [sched.new_request(p, Sampling(max_tokens=n), s)
            for p, n, s in zip(prompts, news, sinks)]
    sched.enqueue(reqs[0])
    sched.run_once()
    sched.enqueue(reqs[1])
    sched.run_once()
    long_pages = sched.pool.tables[reqs[0].slot][:3]
    assert sched.pool.tables[reqs[1].slot][:3] == long_pages
    assert [sched.pool.holders(p) for p in long_pages] == [2, 2, 2]
    while sinks[1].done is None:
        sched.run_once()
    assert sinks[0].done is None  # the long row runs on over the pages the short one shared
    assert sched.pool.tables[reqs[0].slot][:3] == long_pages
    assert [sched.pool.holders(p) for p in long_pages] == [1, 1, 1]
    sched.enqueue(reqs[2])  # fresh pages for an unrelated prompt: never the long row's
    while sched.busy:
        sched.run_once()
    assert [s.done.token_ids for s in sinks] == want


def test_no_page_leaks_after_many_requests_with_shared_prefixes(engines):
    sched = scheduler(engines["plain"], slots=3, kv_pages=40)
    rng = np.random.default_rng(4)
    systems = [SYSTEM, SYSTEM[::-1], SYSTEM[5:] + SYSTEM[:5]]
    arrivals = [(i // 3, systems[i % 3][: int(rng.integers(9, 29))]
                 + [int(t) for t in rng.integers(1, 64, size=int(rng.integers(1, 10)))],
                 Sampling(max_tokens=int(rng.integers(1, 6)))) for i in range(60)]
    done = run(sched, arrivals)
    assert all(1 <= len(c.token_ids) <= a[2].max_tokens for c, a in zip(done, arrivals))
    assert sched.stats.finished == 60 and sched.stats.prefix_cached_tokens > 0
    pool = sched.pool
    assert not pool.tables and pool.used_pages == 0
    assert pool.free_pages == pool.num_pages and 0 < pool.cached_pages < pool.num_pages


def test_a_prompt_that_differs_in_its_first_page_or_is_shifted_shares_nothing(engines):
    engine = engines["plain"]
    first = SYSTEM + USERS[0]
    other_first_page = first.copy()
    other_first_page[2] = other_first_page[2] % 63 + 1
    other_third_page = first.copy()
    other_third_page[20] = other_third_page[20] % 63 + 1
    shifted = SYSTEM[PAGE:] + USERS[1]  # its pages are `first`'s 2nd and 3rd, at other positions
    assert len(first) == 4 * PAGE  # the same prompt again: its last page is computed, not shared
    prompts = [first, other_first_page, other_third_page, shifted, first]
    news = (6, 6, 6, 6, 6)
    want = solo(engine, prompts, news)
    done = run(scheduler(engine), [(i, p, Sampling(max_tokens=n))
                                   for i, (p, n) in enumerate(zip(prompts, news))])
    assert [c.metrics["prefix_cached_tokens"] for c in done] == [0, 0, 2 * PAGE, 0, 3 * PAGE]
    assert [c.token_ids for c in done] == want


def test_eviction_under_a_small_pool_never_crashes_and_keeps_outputs(engines):
    engine = engines["ngram"]
    rng = np.random.default_rng(5)
    systems = [[int(t) for t in rng.integers(1, 64, size=33)] for _ in range(4)]  # 4 pages each
    order = [0, 1, 0, 2, 0, 3, 0, 1, 2, 3]  # system 0 stays warm, the others go cold
    prompts = [systems[s] + USERS[i % 5][:4] for i, s in enumerate(order)]
    news = [6 + i % 4 for i in range(len(order))]
    want = solo(engine, prompts, news)
    # 2 rows over 16 pages: the running rows take most of it, so cached pages are evicted (the
    # least recently used first, a prefix's last pages before its first)
    sched = scheduler(engine, slots=2, kv_pages=16)
    done = run(sched, [(2 * i, p, Sampling(max_tokens=n))
                       for i, (p, n) in enumerate(zip(prompts, news))])
    assert [c.token_ids for c in done] == want
    cached = [c.metrics["prefix_cached_tokens"] for c in done]
    assert sched.pool.evictions > 0
    assert cached[2] == cached[4] == cached[6] == 4 * PAGE  # the warm system prompt survived
    assert sched.pool.free_pages == sched.pool.num_pages and not sched.pool.tables


def test_prefix_sharing_is_on_for_tap_drafters_and_off_by_setting(target, engines):
    """A drafter reading target features shares prefixes too (its features are paged:
    tests/test_hybrid_serving.py checks hits against misses)."""
    eagle = Engine(target, *eagle_like(target), num_speculative_tokens=3, max_context=CONTEXT)
    assert scheduler(eagle).prefix_cache == "on"
    sched = scheduler(engines["plain"], prefix_cache=False)
    assert sched.prefix_cache.startswith("off")
    prompts = [SYSTEM + USERS[0], SYSTEM + USERS[1]]
    done = run(sched, [(0, prompts[0], Sampling(max_tokens=4)),
                       (2, prompts[1], Sampling(max_tokens=4))])
    assert [c.metrics["prefix_cached_tokens"] for c in done] == [0, 0]
    assert sched.pool.cached_pages == 0
    assert [c.token_ids for c in done] == solo(engines["plain"], prompts, (4, 4))
