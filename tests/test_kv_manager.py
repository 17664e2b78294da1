"""The serving KV manager as a unit, no model: slots a row's next call may touch, pages for an
admitted prompt (shared prefix pages only once written), and reservation that preempts the
policy's victims until the running rows fit."""

from jaxspec.serving import policy
from jaxspec.serving.kv_manager import KVManager
from jaxspec.serving.pages import PagePool
from jaxspec.serving.requests import Request, Sampling

PAGE = 4


def request(prompt, max_tokens=8, admitted=0.0, slot=-1):
    req = Request("r", list(prompt), Sampling(max_tokens=max_tokens), 0, None, 0.0)
    req.admitted, req.slot = admitted, slot
    return req


def manager(pages, sharing=False, capacity=64, steps=2, depth=2, nodes=3):
    return KVManager(PagePool(pages, PAGE), capacity, steps, depth, nodes,
                     "on" if sharing else "off (asked)")


def test_slots_needed_is_growth_plus_one_verify_window_capped_by_max_tokens_and_context():
    kv = manager(16)
    req = request(range(10), max_tokens=100)
    # 10 committed + 1 + 2 steps * (γ + 1 = 3) = 17, plus 3 drafted nodes + 1
    assert kv.slots_needed(req, 10) == 21
    assert kv.slots_needed(req, 10, steps=1) == 18
    short = request(range(10), max_tokens=2)  # growth stops at prompt + max_tokens = 12
    assert kv.slots_needed(short, 10) == 16
    assert manager(16, capacity=20).slots_needed(req, 10) == 20


def test_take_returns_none_and_holds_nothing_when_the_pool_is_short():
    kv = manager(3)
    assert kv.take(request(range(10)), 0) is None  # 10 + 1 + 3 + 3 + 1 = 18 slots: 5 pages
    assert kv.pool.free_pages == 3 and not kv.pool.tables
    assert kv.take(request(range(4)), 1) == 0  # 4 + 1 + 3 + 3 + 1 = 12 slots: 3 pages
    assert kv.pool.held(1) == 3


def test_a_prompt_shares_the_written_pages_of_an_earlier_one_only_where_sharing_is_on():
    prompt = list(range(100, 112))  # three full pages
    for sharing, expect in ((True, 12), (False, 0)):  # the three full pages before its last token
        kv = manager(32, sharing=sharing)
        assert kv.take(request(prompt), 0, written=False) == 0
        kv.written(0, prompt)
        assert kv.take(request(prompt + [7]), 1) == expect
        assert kv.pool.tables[1][:2] == (kv.pool.tables[0][:2] if sharing else
                                         kv.pool.tables[1][:2])
        assert (kv.pool.tables[1][0] == kv.pool.tables[0][0]) is sharing
    kv = manager(32, sharing=True)
    kv.take(request(prompt), 0)
    assert kv.take(request(prompt), 1) == 0  # not written yet: nothing to share


def test_reserve_preempts_the_newest_rows_until_the_older_ones_fit():
    kv = manager(8)
    old, new = request(range(4), 50, admitted=1.0, slot=0), request(range(4), 50, 2.0, slot=1)
    active = {0: old, 1: new}
    for req in active.values():
        assert kv.take(req, req.slot) == 0  # 12 slots: 3 pages each
    preempted = []

    def preempt(req):
        kv.pool.release(req.slot)
        del active[req.slot]
        preempted.append(req)
        req.slot = -1

    fcfs = policy.named("fcfs", kv.pool)
    lengths = {0: 16, 1: 4}  # the old row needs 16 + 1 + 6 + 4 = 27 slots: 7 pages
    kv.reserve(active, lengths, fcfs.victim, preempt)
    assert preempted == [new] and list(active) == [0]
    assert kv.pool.held(0) == 7 and old.peak_pages == 7
    lengths = {0: 40}  # 40 + 1 + 6 + 4 = 51 slots: 13 pages, more than the pool
    kv.reserve(active, lengths, fcfs.victim, preempt)
    assert preempted == [new, old] and not active and kv.pool.free_pages == 8
