"""TTFT of a prefix-cache hit against a miss, paired in one run (BENCHMARKS.md, issues 56/61):
the tiny Qwen3.5 (hybrid) target of tests/test_qwen3_5.py, plain and under a random DFlash head
(a drafter reading target features: paged since issue 61), one slot, page 16. Each pair: a
fresh 480-token head + 16-token tail (a miss), then the same head with another tail (a hit:
480 tokens from the cache, the linear state from the page snapshot, the drafter's features from
the feature pool). Programs compiled ahead; one warm pair first.

    PYTHONPATH=$PWD:$PWD/tests python scripts/bench_prefix_hit.py
"""
import sys
import tempfile

import numpy as np

sys.path.insert(0, "tests")
from test_qwen3_5 import hf_model
from tiny import dflash_like
from jaxspec.loading import load_model
from jaxspec.engine.runner import Engine
from jaxspec.serving import Sampling
from jaxspec.serving.scheduler import Scheduler
from test_serving import run
d = tempfile.mkdtemp(); hf_model(vocab=256).save_pretrained(d)
model = load_model(d, layout="auto")
rng = np.random.default_rng(0)
head = [int(t) for t in rng.integers(3, 256, size=480)]
for name, drafter in [("plain", (None, None)), ("dflash", dflash_like(model))]:
    eng = Engine(model, *drafter, num_speculative_tokens=3 if drafter[0] else 0, max_context=640)
    sched = Scheduler(eng, slots=1, max_context=640, steps_per_call=4, page_size=16)
    sched.compile_prefills([496]); sched.compile_programs()
    reqs, r = [], 0
    for i in range(4):  # (miss, hit) pairs: a fresh head each pair
        h = [int(t) for t in rng.integers(3, 256, size=480)]
        for j in range(2):
            reqs.append((r, h + [int(t) for t in rng.integers(3, 256, size=16)], Sampling(max_tokens=4))); r += 40
    run(sched, [(0, head + [5] * 16, Sampling(max_tokens=4)), (40, head + [6] * 16, Sampling(max_tokens=4))])
    done = run(sched, reqs)
    miss = [c.time_to_first_token_s for c in done[0::2]]
    hit = [c.time_to_first_token_s for c in done[1::2]]
    print(name, "cached", [c.metrics["prefix_cached_tokens"] for c in done],
          "TTFT miss median %.3f s hit median %.3f s ratio %.2fx" % (np.median(miss), np.median(hit), np.median(miss) / np.median(hit)))
