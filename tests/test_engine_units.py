"""The engine's units, each alone (jaxspec/engine/prepare.py, programs.py, results.py, adaptive_host.py)
and the loop's adaptive interface (adaptive.Controller.plan / observe): what each promises,
through public names only."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import motif_prompts, sequence_logits, tiny_model

from jaxspec.decode import adaptive, calibration, speculate
from jaxspec.engine.adaptive_host import REPROBE_BATCHES, AdaptiveHost
from jaxspec.config import AdaptiveConfig
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.engine.prepare import Requests, bucket, prompt_bucket
from jaxspec.engine.programs import Programs
from jaxspec.engine.results import Report, fetch
from jaxspec.decode.sampling import SamplingParams


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, layers=2)


# ---- request preparation ----------------------------------------------------------------------
def test_requests_pack_bucket_and_check(target):
    prep = Requests(target, depth=3, num_nodes=3)
    assert [bucket(n) for n in (1, 16, 17, 40)] == [16, 16, 32, 64]
    batch = prep.pack([[5, 6, 7], list(range(1, 21))], 8, row_ids=[4, 9], batch_size=3)
    assert batch.prompt.shape == (3, 32)  # 3 rows (one padding), prompts to bucket(20)
    np.testing.assert_array_equal(batch.prompt[0, :4], [5, 6, 7, 0])
    np.testing.assert_array_equal(batch.lengths, [3, 20, 1])
    np.testing.assert_array_equal(batch.max_new, [8, 8, 1])  # the padding row ends at once
    np.testing.assert_array_equal(batch.row_ids, [4, 9, 0])
    assert batch.capacity >= 32 + bucket(8) + 3 + 1
    assert prep.encode((1, 2, np.int32(3))) == [1, 2, 3]
    for bad, word in (([], "empty prompt"), ([64], "out of range"), ([1] * 500, "context of 512")):
        with pytest.raises(JaxspecError, match=word) as e:
            prep.check_fits(bad, 16)
        assert "\n" not in str(e.value)
    prep.check_fits([1] * 490, 16)  # 490 + 16 + depth 3 fits in 512
    with pytest.raises(JaxspecError, match="no tokenizer"):
        prep.encode("text")
    small = Requests(target, depth=3, max_context=40)
    with pytest.raises(JaxspecError, match="generation.max_context=40"):
        small.check_fits([1] * 30, 8)
    assert small.capacity(16, 8) >= 40


def test_prompt_buckets_pad_little_and_keep_greedy_output(target):
    """Prompts pad to `prompt_bucket` (at most 1.25x past 64 tokens, a few programs per octave),
    the cache to the power-of-two `bucket`; greedy output over such a width (70 tokens -> 80,
    cache sized from 128) is the reference forward's argmax chain, speculative or plain."""
    assert [prompt_bucket(n) for n in (1, 16, 17, 65, 660, 769, 1025)] == [16, 16, 32, 80, 768,
                                                                           896, 1280]
    assert max(prompt_bucket(n) / n for n in range(65, 9000)) <= 1.25
    assert len({prompt_bucket(n) for n in range(1, 8193)}) <= 4 * len({bucket(n) for n in
                                                                       range(1, 8193)})
    batch = Requests(target).pack([[3] * 70], 8, row_ids=[0], batch_size=1)
    assert batch.prompt.shape == (1, 80) and batch.capacity >= 128 + bucket(8)
    prompt = motif_prompts([70], seed=3)[0]
    plain = Engine(target).generate([prompt], max_new_tokens=12)[0].token_ids
    logits = sequence_logits(target.target, target.params, prompt + plain)
    reference = [int(i) for i in logits[len(prompt) - 1 : -1].argmax(-1)]
    assert plain == reference[: len(plain)] and plain
    spec = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3)
    assert spec.generate([prompt], max_new_tokens=12)[0].token_ids == plain


# ---- the one sampling type --------------------------------------------------------------------
def test_engine_takes_the_one_sampling_type(target):
    """`jaxspec.Sampling` (the server's type too) drives an engine call: its values, max_tokens,
    seed and penalties give the very tokens the same settings give as explicit arguments (the
    device params and penalties tuple), the call's own arguments win, and what only a server
    honours is refused in one line before anything compiles."""
    import jaxspec
    from jaxspec.serving import Sampling as ServingSampling

    assert jaxspec.Sampling is ServingSampling
    engine = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3)
    prompt = motif_prompts([20], seed=5)[0]
    settings = jaxspec.Sampling(temperature=0.9, top_k=20, max_tokens=10, seed=7,
                                repetition_penalty=1.3)
    [via_type] = engine.generate([prompt], sampling=settings)
    [explicit] = engine.generate([prompt], max_new_tokens=10, seed=7,
                                 sampling=SamplingParams.make(0.9, 20, 1.0, 0.0),
                                 penalties=(0.0, 0.0, 1.3, {}))
    assert via_type.token_ids == explicit.token_ids and via_type.num_generated_tokens == 10
    [other_seed] = engine.generate([prompt], sampling=settings, seed=8)  # the argument wins
    [shorter] = engine.generate([prompt], sampling=settings, max_new_tokens=4)
    assert shorter.num_generated_tokens == 4 and other_seed.token_ids != via_type.token_ids
    for bad, words in ((jaxspec.Sampling(stop=("x",)), "server"),
                       (jaxspec.Sampling(logprobs=2), "Engine(..., logprobs=k)")):
        with pytest.raises(JaxspecError, match=words.replace("(", r"\(").replace(")", r"\)")):
            engine.generate([prompt], sampling=bad)


# ---- the compiled-program cache ---------------------------------------------------------------
def test_programs_compile_once_per_key_and_read_the_attention(target):
    spec = speculate.LoopSpec(target=target.target, drafter=None, num_speculative_tokens=0,
                              eos_ids=(0,))
    batch = Requests(target).pack([[1, 2, 3]], 4, row_ids=[0], batch_size=1)
    sp = SamplingParams.make()
    args = (spec, target.params, None, jnp.asarray(batch.prompt), jnp.asarray(batch.lengths),
            jnp.asarray(batch.max_new), sp, jax.random.key(0), jnp.asarray(batch.row_ids))
    decode_args = lambda state: (spec, target.params, None, state, sp, jnp.int32(1))
    programs = Programs()
    assert not programs.warm("k")
    first = programs.compile("k", args, batch.capacity, decode_args, sharded=False)
    assert first > 0 and set(programs.attention) == {"prefill", "decode"}
    assert programs.attention["decode"]  # read from the compiled program's text
    programs.attention = {}
    assert programs.compile("k", args, batch.capacity, decode_args, sharded=False) == 0.0
    assert set(programs.attention) == {"prefill", "decode"}  # the warm shape's, again


# ---- results and metrics ----------------------------------------------------------------------
def test_report_rows_and_metrics(target):
    spec = speculate.LoopSpec(target=target.target, drafter=None, num_speculative_tokens=0,
                              eos_ids=(0,))
    report = Report(target, spec, "plain")
    state = types.SimpleNamespace(
        tokens=np.asarray([[7, 8, 9, 10, 11, 0], [7, 3, 4, 0, 0, 0]]),
        lengths=np.asarray([5, 4]), row_steps=np.asarray([3, 3]), num_draft=np.asarray([0, 0]),
        num_accepted=np.asarray([0, 0]), accepted_per_position=np.zeros((2, 1), int), adaptive=None,
    )
    out = report.results(["a", [7]], [[7, 8], [7]], state, 0.5, 2.0, {"decode": "xla"})
    assert [r.token_ids for r in out] == [[9, 10, 11], [3, 4, 0]]
    assert out[0].prompt == "a" and out[1].prompt == ""  # token-id prompts have no text
    assert out[0].decode_tokens_per_s == pytest.approx(1.0)  # 2 decode tokens in 2 s
    m = out[1].metrics
    assert m["num_steps"] == 2 and m["mean_accepted_length"] == 1.0 and m["attention"] == "xla"
    assert report.decode_text([1, 2]) == ""  # no tokenizer
    fetched = fetch(types.SimpleNamespace(
        tokens=jnp.ones((1, 2)), lengths=jnp.ones(1), row_steps=jnp.ones(1),
        num_draft=jnp.ones(1), num_accepted=jnp.ones(1), accepted_per_position=jnp.ones((1, 1)),
    ))
    assert fetched.adaptive is None and isinstance(fetched.tokens, np.ndarray)


# ---- the host side of adaptive policy ---------------------------------------------------------
def host(target, **settings) -> AdaptiveHost:
    engine = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3,
                    adaptive=AdaptiveConfig(enabled=True, **settings))
    return engine.policy


def test_adaptive_host_learns_across_batches(target):
    h = host(target, step_costs=[1.0, 1.3, 1.6, 1.9], draft_cost=0.0)
    assert h.runs_adaptive(4)  # the prior (0.6) pays on this curve: 1.6 tokens for 1.3
    st = types.SimpleNamespace(  # what a losing batch of 2 real rows (of 4) leaves
        reached=np.asarray([[10, 5, 0], [10, 5, 0], [9, 9, 9], [9, 9, 9]]),
        hits=np.asarray([[1, 0, 0], [1, 0, 0], [9, 9, 9], [9, 9, 9]]),
        window_hist=np.asarray([0, 10, 0, 0]), spent=13.0,
    )
    h.record(st, rows=2, batch=4, tokens=[11, 12])
    assert h.observed_acceptance == pytest.approx([0.45, 0.4, 0.8])  # padding rows ignored
    assert h.last_runs[4] == ([0, 10, 0, 0], [11, 12], 13.0) and h.last_runs["any"] == h.last_runs[4]
    assert h.realized_gain(4) == pytest.approx(12 / 13) and not h.runs_adaptive(4)
    for _ in range(REPROBE_BATCHES - 1):  # plain batches count up to a re-probe
        assert not h.runs_adaptive(4)
        h.record(None, rows=2, batch=4, tokens=[])
    assert h.off_batches == REPROBE_BATCHES - 1 and h.runs_adaptive(4)
    h.record(st, rows=2, batch=4, tokens=[11, 12])
    assert h.off_batches == 0


def test_calibration_is_an_explicit_step(target, monkeypatch):
    """Measured curves come from `Engine.calibrate` (announced by calibration's progress line),
    never from choosing a program: spec_for before calibrate is a one-line error."""
    measured = []
    monkeypatch.setattr(calibration, "loop_drifted", lambda *a: False)
    monkeypatch.setattr(calibration, "loop_costs", lambda m, s, p, b, recalibrate: measured.append(b)
                        or {128: [1.0, 1.2, 1.3, 1.4]})
    engine = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3,
                    adaptive=AdaptiveConfig(enabled=True))
    with pytest.raises(JaxspecError, match=r"call Engine.calibrate\(2\) first") as e:
        engine.spec_for(2)
    assert "\n" not in str(e.value) and measured == []
    assert engine.calibrate(2) == {128: [1.0, 1.2, 1.3, 1.4]} and measured == [2]
    assert engine.spec_for(2) is engine.spec and measured == [2]  # read, not measured again
    off = Engine(target, NgramDrafter(64), None, num_speculative_tokens=3,
                 adaptive=AdaptiveConfig(enabled=False))
    assert off.policy is None and off.spec.adaptive is None and off.calibrate(2) is None


# ---- the loop's adaptive interface ------------------------------------------------------------
def test_one_settings_object_and_the_jit_key():
    """The config section is the settings: the controller keeps it whole; only the fields the
    loop reads (adaptive.LOOP_SETTINGS) make two controllers different programs."""
    a = adaptive.Controller(3, AdaptiveConfig(decay=0.5, switch_off_acceptance=0.7))
    b = adaptive.Controller(3, AdaptiveConfig(decay=0.5, switch_off_acceptance=0.9))
    c = adaptive.Controller(3, AdaptiveConfig(decay=0.6))
    assert a == b and hash(a) == hash(b) and a != c
    assert a != adaptive.Controller(3, a.settings, fixed=1)
    with pytest.raises(JaxspecError, match="speculative.adaptive.step_costs"):
        AdaptiveConfig(step_costs="fast")


def test_plan_then_observe():
    """plan: the lengths `choose` gives, the hand-off once due (then no node); a fixed plan
    gives k nodes wherever a row can use them. observe: `update`, and a handed-off step priced
    at one plain step with the step it began at."""
    ctl = adaptive.Controller(2, AdaptiveConfig(handoff_after=3, probe_every=0, explore=0.0))
    st = ctl.init(2, [1.05, 1.9, 2.9])  # no window pays
    active, room, ctx = jnp.ones((2,), bool), jnp.full((2,), 20), jnp.full((2,), 40)
    early = ctl.plan(st, jnp.full((2,), 2), active, room, ctx, may_hand_off=True)
    np.testing.assert_array_equal(early.lengths, [0, 0])
    assert not bool(early.hand_off) and not bool(early.drafts())
    due = ctl.plan(st, jnp.full((2,), 3), active, room, ctx, may_hand_off=True)
    assert bool(due.hand_off)
    assert not bool(ctl.plan(st, jnp.full((2,), 3), active, room, ctx).hand_off)  # batch 1
    fixed = adaptive.Controller(2, ctl.settings, fixed=2)
    near_end = jnp.asarray([20, 2])
    np.testing.assert_array_equal(fixed.plan(st, jnp.full((2,), 9), active, near_end, ctx).lengths,
                                  [2, 1])
    zeros = jnp.zeros((2,), jnp.int32)
    outcome = adaptive.Outcome(zeros, zeros, active, ctx, jnp.asarray(7))
    after = ctl.observe(st, due, outcome)
    assert float(after.spent) == 1.0 and int(after.handoff_at) == 7
    np.testing.assert_array_equal(after.length_hist[:, 0], [1, 1])
    drafted = adaptive.Plan(jnp.asarray([2, 2]), jnp.zeros((), bool))
    two = adaptive.Outcome(jnp.asarray([2, 2]), jnp.asarray([1, 2]), active, ctx, jnp.asarray(7))
    after = ctl.observe(st, drafted, two)
    assert float(after.spent) == pytest.approx(2.9) and int(after.handoff_at) == -1
    np.testing.assert_array_equal(after.hits, [[1, 0], [1, 1]])
