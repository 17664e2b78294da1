"""Batched admission (`serving.batch_prefill`, jaxspec/serving/admission.py): the requests
admitted in one round are prefilled several rows a call, and chunked prompts' chunks likewise.

Greedy outputs equal one-at-a-time admission's and solo Engine runs token for token (n-gram and
EAGLE with requests of mixed prompt lengths arriving together and into a running batch; the
contiguous cache; chunked prefill of three long prompts beside a running row; tails over
shared prefix pages),
with fewer prefill calls than admissions (so the batched path did run). A splice that put the
rows into the wrong slots, or gave every row of a call the longest prompt's length, fails them
(seen).

Under a token budget (`serving.max_batched_tokens`) no round prefills more than the budget
(long prompts go in chunks across rounds) and outputs still equal one-at-a-time admission; the
control without a budget exceeds it, and a budget check turned off fails (seen). The warm-up
(`compile_prefills`) covers every program batched admission calls with the prefix cache on
(tails of every bucket, chunk writes): the run lowers none, counted (`tests/compiles.py`); a
warm-up without the tails lowers 3 (seen).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_serving import CONTEXT, Sink, engine_for, run

from jaxspec.engine.prepare import prompt_bucket
from jaxspec.serving import Sampling
from jaxspec.serving.scheduler import Scheduler


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(1, 64, size=n)] for n in (6, 21, 11, 34, 9)]


NEW = (12, 7, 15, 9, 11)


def arrivals(prompts, rounds=(0, 0, 0, 2, 2)):
    return [(r, p, Sampling(max_tokens=n)) for r, p, n in zip(rounds, prompts, NEW)]


@pytest.mark.parametrize("name,paged", [("ngram", True), ("eagle", True), ("ngram", False)])
def test_batched_admission_equals_one_at_a_time(tiny_target, prompts, name, paged):
    engine = engine_for(tiny_target, name)
    solo = [engine.generate([p], max_new_tokens=n)[0].token_ids for p, n in zip(prompts, NEW)]
    outs, stats = {}, {}
    for batched in (False, True):
        sched = Scheduler(engine, slots=4, max_context=CONTEXT, steps_per_call=3, paged=paged,
                          batch_prefill=batched)
        outs[batched] = [c.token_ids for c in run(sched, arrivals(prompts))]
        stats[batched] = sched.stats
        assert sched.pool.free_pages == sched.pool.num_pages
    assert outs[True] == outs[False] == solo
    assert stats[False].prefill_calls == stats[False].admitted == len(prompts)
    # 3 together (6 and 11 tokens share the 16-token bucket: one call; 21 another), then 2 of
    # other buckets (34, 9): a call each
    assert stats[True].admitted == len(prompts) and stats[True].prefill_calls == 4


def test_batched_chunks_and_prefix_sharing_keep_outputs(tiny_target, prompts):
    engine = engine_for(tiny_target, "plain")
    system = [int(t) % 61 + 2 for t in range(40)]  # 40 tokens: 2 full pages of 16 shared
    longs = [system + p for p in prompts[1:4]]  # 61, 51, 74 tokens: chunks of 16
    shared = [system + prompts[0], system + prompts[4][:5]]  # 46, 45 tokens
    solo = [engine.generate([p], max_new_tokens=n)[0].token_ids
            for p, n in zip([prompts[0], *longs, *shared], (*NEW[:4], 8, 8))]
    outs = {}
    for batched in (False, True):
        sched = Scheduler(engine, slots=4, max_context=CONTEXT, steps_per_call=2,
                          prefill_chunk=16, batch_prefill=batched)
        sinks = [Sink() for _ in range(4)]
        sched.enqueue(sched.new_request(prompts[0], Sampling(max_tokens=NEW[0]), sinks[0]))
        sched.run_once()  # a running row; then the long prompts arrive together
        for p, n, sink in zip(longs, NEW[1:], sinks[1:]):
            sched.enqueue(sched.new_request(p, Sampling(max_tokens=n), sink))
        while sched.busy:
            sched.run_once()
        # two prompts over the system prompt's cached pages arrive together: their tails
        # (after the 2 shared pages) are prefilled in one call
        later = [Sink(), Sink()]
        for p, sink in zip(shared, later):
            sched.enqueue(sched.new_request(p, Sampling(max_tokens=8), sink))
        while sched.busy:
            sched.run_once()
        assert [s.done.metrics["prefix_cached_tokens"] for s in later] == [32, 32]
        outs[batched] = [s.done.token_ids for s in sinks + later]
        assert sched.pool.free_pages == sched.pool.num_pages
        if batched:
            assert sched.stats.prefill_calls < sched.stats.admitted + sum(
                (len(p) - 1) // 16 for p in longs)  # fewer than one call per chunk and row
    assert outs[True] == outs[False] == solo


def budget_arrivals(prompts):
    """Eight prompts: the five short ones, then three long ones over a shared 40-token head
    (61, 51, 74 tokens), arriving over the first rounds."""
    system = [int(t) % 61 + 2 for t in range(40)]
    longs = [system + p for p in prompts[1:4]]
    every = [*prompts, *longs]
    new = (*NEW, 6, 10, 8)
    return [(r, p, Sampling(max_tokens=n))
            for r, p, n in zip((0, 0, 0, 0, 1, 1, 1, 3), every, new)]


def test_token_budget_equals_one_at_a_time_and_holds_each_round(tiny_target, prompts):
    """serving.max_batched_tokens=32: no round prefills more than 32 prompt tokens (prompts
    over 32 go in chunks of 32 across rounds; the first round's run whole, no row waiting),
    and the outputs equal one-at-a-time admission and solo runs token for token. The control
    without a budget prefills more than 32 in a round (so the bound can fail)."""
    engine = engine_for(tiny_target, "ngram")
    arrive = budget_arrivals(prompts)
    solo = [engine.generate([p], max_new_tokens=s.max_tokens)[0].token_ids for _, p, s in arrive]
    outs, stats = {}, {}
    for mode, kw in {"one": {}, "batched": {"batch_prefill": True},
                     "budget": {"max_batched_tokens": 32}}.items():
        sched = Scheduler(engine, slots=4, max_context=CONTEXT, steps_per_call=2, **kw)
        outs[mode] = [c.token_ids for c in run(sched, arrive)]
        stats[mode] = sched.stats
        assert sched.pool.free_pages == sched.pool.num_pages and not sched.prefilling
    assert outs["budget"] == outs["one"] == outs["batched"] == solo
    assert stats["batched"].max_round_prefill_tokens > 32  # the control: unbounded
    assert 0 < stats["budget"].max_round_prefill_tokens <= 32
    # the 74-token prompt alone needs three pieces: more prefill calls than admissions
    assert stats["budget"].prefill_calls > stats["budget"].admitted == len(arrive)


def test_budget_refuses_a_chunk_over_it(tiny_target):
    from jaxspec.errors import JaxspecError

    engine = engine_for(tiny_target, "plain")
    with pytest.raises(JaxspecError, match="prefill_chunk=64 exceeds serving.max_batched"):
        Scheduler(engine, max_context=CONTEXT, prefill_chunk=64, max_batched_tokens=32)


PROGRAMS = ("prefill", "prefill_into_cache", "_write_prompt", "decode")  # the model's programs


@pytest.mark.parametrize("warm", [True, False])
def test_warm_up_covers_every_prefill_batched_admission_calls(tiny_target, prompts, warm):
    """compile_programs + compile_prefills (the bench's and a server's warm-up) compile every
    program batched admission under a budget calls with the prefix cache on (whole prompts,
    tails over shared pages and over earlier chunks, chunk writes, at every row width): the
    run lowers none of the model's programs. The control (page_size 8: programs no earlier
    test compiled, no warm-up) lowers some, so the count sees them."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from compiles import counting_lowerings

    engine = engine_for(tiny_target, "ngram")
    arrive = budget_arrivals(prompts)
    sched = Scheduler(engine, slots=4, max_context=CONTEXT, steps_per_call=2,
                      page_size=16 if warm else 8, max_batched_tokens=32)
    if warm:
        sched.compile_programs()
        sched.compile_prefills([len(p) for _, p, _ in arrive])
    with counting_lowerings() as lowered:
        done = run(sched, arrive)
    assert sum(c.metrics["prefix_cached_tokens"] for c in done) > 0  # tails ran
    assert (lowered(*PROGRAMS) == 0) == warm, lowered(*PROGRAMS)


@pytest.mark.parametrize("name,one_width", [("ngram", True), ("eagle", False)])
def test_tail_programs_grow_with_the_tail_buckets_not_times_the_prompt_buckets(
        tiny_target, name, one_width):
    """A drafter whose prompt setup runs no model (n-gram) takes every tail's prefill at one
    prompt width: one tail program per tail bucket, so the list grows with the sum of the
    bucket counts. EAGLE (its head runs over the prompt array) keeps a tail program per
    (prompt bucket, tail bucket): the control, the product. Listing only: nothing compiles."""
    engine = engine_for(tiny_target, name)
    sched = Scheduler(engine, slots=2, max_context=CONTEXT, steps_per_call=2)
    rows = sched.prefill_programs(range(1, 100))
    tails = [(r["prompt_bucket"], r["tokens"]) for r in rows if r["name"] == "prefill_tail"]
    tail_buckets = [16, 32, 64, 128]  # bucket(1..99)
    wholes = [r["prompt_bucket"] for r in rows if r["name"] == "prefill"]
    if one_width:  # and whole prompts run as tails from 0: no program per prompt bucket
        assert tails == [(CONTEXT, t) for t in tail_buckets]
        assert wholes == []
    else:
        assert tails == [(p, t) for p in tail_buckets for t in tail_buckets if t <= p]
        assert wholes == sorted({prompt_bucket(n) for n in range(1, 100)})


def test_a_whole_prompt_past_128_tokens_runs_as_a_tail_of_three_quarters_its_octave(tiny_target):
    """With the prefix cache on, a whole prompt runs as a tail from 0 (`whole_as_tail`): past
    128 tokens its tail bucket has a step at 3/4 of each octave (`tail_bucket`: 140 -> 192, not
    256), listed for the warm-up, and the greedy output still equals a solo run."""
    from jaxspec.serving.admission import tail_bucket

    assert [tail_bucket(n) for n in (100, 129, 192, 193, 264, 400, 700)] == [
        128, 192, 192, 256, 384, 512, 768]
    engine = engine_for(tiny_target, "plain", context=256)
    sched = Scheduler(engine, slots=1, max_context=256, steps_per_call=4)
    tails = [r["tokens"] for r in sched.prefill_programs(range(1, 200))
             if r["name"] == "prefill_tail"]
    assert tails == [16, 32, 64, 128, 192, 256]
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 64, size=140)]
    solo = engine.generate([prompt], max_new_tokens=6)[0].token_ids
    assert [c.token_ids for c in run(sched, [(0, prompt, Sampling(max_tokens=6))])] == [solo]
    assert sched.stats.prefill_calls == 1
