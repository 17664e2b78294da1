"""A sampled row's tokens are its own at every batch width: a top-p row served beside greedy rows
that arrive and leave (the scheduler's programs of widths 1 to 3) draws the very tokens it draws
alone, for every drafter.

The one property of the serving scheduler that depends on the last bit of each width's program:
under the fast code generation (LLVM level 0, tests/conftest.py) XLA:CPU compiled the vmapped
top-p filter differently per width and the row's tokens moved, so this module runs with XLA's
defaults, as users compile (tests/suite_plan.py PRODUCTION_CODEGEN). Everything else about the
scheduler compares jaxspec with itself and is tests/test_serving.py's, under the fast one.
"""

from __future__ import annotations

import pytest

from jaxspec.serving import Sampling
from jaxspec.serving.scheduler import Scheduler
from test_serving import CONTEXT, DRAFTERS, engine_for, run, serving_prompts
from tiny import tiny_model

SAMPLED = Sampling(temperature=0.9, top_p=0.9, top_k=20, max_tokens=12, seed=5)


@pytest.fixture(scope="module")
def target():
    return tiny_model(packed=True)  # test_serving.py's target


@pytest.fixture(scope="module")
def prompts():
    return serving_prompts()


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_a_sampled_top_p_row_draws_the_same_tokens_at_every_batch_width(target, prompts, name):
    """The sampled row starts alone (width 1), two short greedy rows join it one call after the
    other (widths 2 and 3) and leave before it ends. Short greedy prompts of one bucket: the
    programs this compiles under production code generation are the widths', not prompt
    buckets' (the greedy rows' own outputs at every width and bucket are test_serving.py's)."""
    engine = engine_for(target, name)
    mates = [p[:8] for p in (prompts[0], prompts[2])]
    arrivals = [(0, prompts[1], SAMPLED), (1, mates[0], Sampling(max_tokens=5)),
                (2, mates[1], Sampling(max_tokens=4))]
    batched = Scheduler(engine, slots=3, max_context=CONTEXT, steps_per_call=3)
    done = run(batched, arrivals)
    alone = Scheduler(engine, slots=3, max_context=CONTEXT, steps_per_call=3)
    solo = run(alone, [(0, prompts[1], SAMPLED)])[0]
    assert done[0].token_ids == solo.token_ids
    # the row lived through programs of every width, alone in the width-1 program
    assert {rows for rows, _ in batched.stats.calls_by_shape} == {1, 2, 3}
    assert {rows for rows, _ in alone.stats.calls_by_shape} == {1}
    assert len(set(solo.token_ids)) > 1  # a draw, not one token repeated
