"""Run by tests/test_serving_mesh.py in a subprocess with 8 simulated CPU devices (the flag must
be set before jax starts): the serving scheduler on a (2, 4) mesh with its page pool sharded over
kv heads, against one-device runs; the pool's shardings after serving; pool-sized copies in
the optimised HLO of every decode program the scheduler compiles. Prints one JSON object.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/serving_mesh_check.py [view] [replicated]

The controls (n-gram only, run after the real thing in the same process, each undone after):
`replicated`, a pool kept whole on every device (the sharding rules
for the pool replaced by a replicated one): the shard checks must show it; `view`, the paged
forward reading gathered contiguous views of the rows' pages (`PagedTarget(read="view")`): the
copy count must show it.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import mesh_check
from jaxspec import hlo, sharding
from jaxspec.drafters import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.serving import Sampling, paged_cache
from jaxspec.serving.scheduler import Scheduler

CONTEXT = 200  # 25 pages of 8 a row: the XLA loop reads blocks of 5 pages, a row's view is 25
PAGE = 8
SLOTS = 4
NEW = (9, 14, 5, 12, 7, 10)
METHODS = {"plain": (None, 0), "ngram": (NgramDrafter(mesh_check.V, 1, 3), 3)}


class Sink:
    def __init__(self):
        self.done = None

    def push(self, piece):
        pass

    def finish(self, completion, error=None):
        assert error is None, error
        self.done = completion


def serve(sched, prompts):
    """Requests arriving one a round, so later ones join a running batch -> token ids."""
    sinks, pending, rnd = [], list(zip(prompts, NEW)), 0
    while pending or sched.busy:
        if pending:
            prompt, n = pending.pop(0)
            sinks.append(Sink())
            sched.enqueue(sched.new_request(prompt, Sampling(max_tokens=n), sinks[-1]))
        sched.run_once()
        rnd += 1
        assert rnd < 500, "the scheduler did not finish"
    return [s.done.token_ids for s in sinks]


def pool_copies(sched, which: str = "all") -> dict:
    """Copies, zero-fills and gathers as large as one device's pool shard, or (whole-row tables)
    as its rows' contiguous view of their pages (what a gather of the pages builds), in each decode
    program's optimised HLO (the codegen the one-device HLO checks read:
    tests/mesh_check.ACCEL_LIKE)."""
    cfg = sched.engine.model.cfg
    mesh = sched.spec.mesh.mesh.shape
    kv = cfg.num_kv_heads // mesh["model"]
    shard = (kv, sched.pool.num_pages, PAGE, cfg.head_dim)
    out = {}
    for row in sched.decode_programs():
        if which == "whole" and row["table_pages"] != sched.max_pages:
            continue
        fn, args, kwargs = row["program"]
        text = fn.lower(*args, **kwargs).compile(compiler_options=mesh_check.ACCEL_LIKE).as_text()
        rows = row["rows"] // mesh["data"] if row["rows"] % mesh["data"] == 0 else row["rows"]
        found = [*hlo.cache_traffic(text, shard).copies, *hlo.cache_traffic(text, shard).zero_fills]
        if row["table_pages"] == sched.max_pages:  # a whole row's view (200 slots): nothing else
            # has that many (the XLA loop's blocks hold 40); narrower views are the size of
            # score buffers
            view = (rows, kv, row["table_pages"] * PAGE, cfg.head_dim)
            found += hlo.cache_traffic(text, view).copies
        out[f"{row['rows']}x{row['table_pages']}"] = found[:3] + (
            [f"... {len(found)} in all"] if len(found) > 3 else [])
    return out


def control(name: str):
    """Apply a control (module docstring) -> a function that undoes it."""
    if name == "view":
        module = sys.modules["jaxspec.serving.scheduler"].paged_cache
        real = module.PagedTarget
        module.PagedTarget = functools.partial(paged_cache.PagedTarget, read="view")
    else:  # "replicated": every device holds the whole pool
        module, real = sharding, sharding.paged_cache_shardings

        def replicate(cache, mesh, rules=sharding.ShardingRules()):
            out = real(cache, mesh, rules)
            rep = lambda s: NamedSharding(mesh, P()) if len(s.spec) == 4 else s  # noqa: E731
            return type(out)(k=jax.tree.map(rep, out.k), v=jax.tree.map(rep, out.v),
                             page_table=out.page_table, lengths=out.lengths)

        module.paged_cache_shardings = replicate
    attr = "PagedTarget" if name == "view" else "paged_cache_shardings"

    def undo():
        setattr(module, attr, real)
        jax.clear_caches()

    jax.clear_caches()  # no program traced before the control serves it
    return undo


def run(target, prompts, plan, name, with_solo=True, copies_of=None) -> dict:
    drafter, gamma = METHODS[name]
    args = (target, drafter, () if drafter else None)
    eng = Engine(*args, num_speculative_tokens=gamma, max_context=CONTEXT, mesh=plan)
    sched = Scheduler(eng, slots=SLOTS, max_context=CONTEXT, steps_per_call=3, page_size=PAGE)
    got = serve(sched, prompts)
    pool = sched.state.cache.k[0]
    out = {"kv_layout": sched.kv_layout, "pool_spec": str(tuple(pool.sharding.spec)),
           "pool_shard": list(pool.addressable_shards[0].data.shape),
           "copies": pool_copies(sched, copies_of) if copies_of else None}
    if with_solo:  # one device, the prompts in one batch (a greedy row's tokens are its own
        # whatever shares its batch: test_speculative, test_serving), each cut to its request's
        # length: one program pair, not one per prompt bucket and length bucket
        one = Engine(*args, num_speculative_tokens=gamma, max_context=CONTEXT)
        rows = one.generate(prompts, max_new_tokens=max(NEW), batch_size=len(prompts))
        want = [r.token_ids[:n] for r, n in zip(rows, NEW)]
        out["same"] = got == want
    return out


def main(controls: list[str]) -> dict:
    """plain and n-gram serving, then each control in turn (n-gram, at the same settings, one
    request: what a control must show is the pool's sharding and the copies in the programs
    decode_programs lists, not outputs; the view control's copies read in the whole-row
    programs, where its gathered view is)."""
    target = mesh_check.model()
    prompts = [p for p in mesh_check.PROMPTS[: len(NEW)]]
    plan = sharding.MeshPlan(sharding.make_mesh(2, 4))
    out = {name: run(target, prompts, plan, name, copies_of="all" if name == "ngram" else None)
           for name in METHODS}
    for name in controls:
        undo = control(name)
        try:
            out[f"control_{name}"] = run(target, prompts[:1], plan, "ngram", with_solo=False,
                                         copies_of="whole" if name == "view" else None)
        finally:
            undo()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
