"""jaxspec.bench.paired: the per-round figures (step cost, speedup, medians, token checks, tree
ratios) on synthetic rows, and bad input as one line with exit 2. The timed run itself is the
benchmark (docs/usage.md); it is not repeated here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxspec.bench import paired


def rows_for(method, rnd, step_s, steps, accepted_per_step, tokens=(1, 2, 3), prompts=2):
    """One round of one method: `prompts` prompts of `steps` steps each, every step taking
    step_s seconds and emitting accepted_per_step tokens."""
    out = []
    for i in range(prompts):
        emitted = steps * accepted_per_step
        out.append({"round": rnd, "method": method, "prompt": i, "num_steps": steps,
                    "num_generated_tokens": emitted + 1, "decode_s": steps * step_s,
                    "tokens": list(tokens) + [i]})
    return out


def test_step_cost_and_speedup_per_round_against_plain_of_that_round():
    rows = []
    # round 0: a quiet machine (plain 10 ms a step); round 1: twice as slow for everyone
    for rnd, scale in ((0, 1.0), (1, 2.0)):
        rows += rows_for("plain", rnd, 0.010 * scale, 60, 1)
        rows += rows_for("eagle", rnd, 0.013 * scale, 36, 5 / 3)  # 1.3 plain steps, MAL 1.67
    s = paired.summarise_tree(rows, ["plain", "eagle"])
    assert s["plain"]["step_cost"] == pytest.approx(1.0)
    assert s["plain"]["speedup"] == pytest.approx(1.0)
    assert s["eagle"]["step_cost"] == pytest.approx(1.3)
    assert s["eagle"]["mean_accepted_length"] == pytest.approx(5 / 3)
    assert s["eagle"]["speedup"] == pytest.approx((5 / 3) / 1.3)  # = MAL / step cost
    assert s["eagle"]["speedup_min"] == pytest.approx(s["eagle"]["speedup_max"])
    assert s["eagle"]["tokens_equal_plain"]
    # tok/s is a median of absolute figures (machine-dependent); the ratios are not
    assert s["plain"]["decode_tokens_per_s"] == pytest.approx(75.0)


def test_median_over_rounds_ignores_one_disturbed_round():
    rows = []
    for rnd, eagle_step in ((0, 0.013), (1, 0.013), (2, 0.030)):  # round 2: eagle disturbed
        rows += rows_for("plain", rnd, 0.010, 60, 1)
        rows += rows_for("eagle", rnd, eagle_step, 36, 5 / 3)
    s = paired.summarise_tree(rows, ["plain", "eagle"])
    assert s["eagle"]["step_cost"] == pytest.approx(1.3)
    assert s["eagle"]["speedup_min"] == pytest.approx((5 / 3) / 3.0)


def test_by_prompt_median_ignores_one_stalled_call():
    rows = []
    for rnd in (0, 1):
        rows += rows_for("plain", rnd, 0.010, 60, 1, prompts=3)
        rows += rows_for("eagle", rnd, 0.013, 36, 5 / 3, prompts=3)
    rows[3]["decode_s"] *= 100  # round 0, eagle, prompt 0: the machine stalled the call
    s = paired.summarise_tree(rows, ["plain", "eagle"])
    assert s["eagle"]["step_cost_by_prompt"] == pytest.approx(1.3)
    assert s["eagle"]["speedup_by_prompt"] == pytest.approx((5 / 3) / 1.3)
    assert s["eagle"]["rounds"][0]["step_cost"] > 30  # the round's sum carries the stall


def test_tokens_differing_from_plain_are_reported():
    rows = rows_for("plain", 0, 0.01, 10, 1) + rows_for("ngram", 0, 0.01, 8, 1.25, tokens=(1, 9))
    s = paired.summarise_tree(rows, ["plain", "ngram"])
    assert not s["ngram"]["tokens_equal_plain"]
    assert s["plain"]["tokens_equal_plain"]


def test_two_trees_compared_round_by_round():
    a_rows, b_rows = [], []
    for rnd, scale in ((0, 1.0), (1, 1.5)):  # the machine drifts; both trees see it in turns
        a_rows += rows_for("plain", rnd, 0.010 * scale, 60, 1)
        a_rows += rows_for("eagle", rnd, 0.013 * scale, 36, 5 / 3)
        b_scale = 1.2 * scale  # b's turns ran on a busier machine: plain slower too
        b_rows += rows_for("plain", rnd, 0.010 * b_scale, 60, 1)
        b_rows += rows_for("eagle", rnd, 0.020 * b_scale, 36, 5 / 3)  # b: a slower EAGLE step
    methods = ["plain", "eagle"]
    a, b = paired.summarise_tree(a_rows, methods), paired.summarise_tree(b_rows, methods)
    c = paired.compare_trees(a, b, a_rows, b_rows)
    assert c["plain"]["step_cost_b_over_a"] == pytest.approx(1.0)
    assert c["plain"]["tokens_per_s_b_over_a"] == pytest.approx(1 / 1.2)
    # the step cost is against each tree's own plain: the busier turns cancel out
    assert c["eagle"]["step_cost_b_over_a"] == pytest.approx(2.0 / 1.3)
    assert c["eagle"]["speedup_b_over_a"] == pytest.approx(1.3 / 2.0)
    assert c["eagle"]["tokens_per_s_b_over_a"] == pytest.approx(1.3 / (2.0 * 1.2))
    assert c["eagle"]["step_cost_by_prompt_b_over_a"] == pytest.approx(2.0 / 1.3)
    assert c["eagle"]["tokens_equal"]
    b_rows[-1]["tokens"] = [7]
    assert not paired.compare_trees(a, b, a_rows, b_rows)["eagle"]["tokens_equal"]


def test_prompts_one_per_category_first():
    prompts = paired.pick_prompts(paired.REPO_ROOT / "data" / "spec_bench_dev.jsonl", 7)
    assert len(prompts) == 7 and len(set(prompts)) == 7
    six = paired.pick_prompts(paired.REPO_ROOT / "data" / "spec_bench_dev.jsonl", 6)
    assert prompts[:6] == six


@pytest.mark.parametrize("args, needle", [
    (["--configs", "plain", "eagel"], "--configs 'eagel'"),
    (["--rounds", "0"], "--rounds 0"),
    (["--tree", "/nonexistent/tree"], "--tree /nonexistent/tree"),
])
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    p = subprocess.run([sys.executable, "-m", "jaxspec.bench.paired", *args, "--out",
                        str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error:")
    assert needle in p.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_batch_call_is_one_row_of_throughput_and_row_steps():
    """--batch-size B: the B results of one call share its decode seconds; the row counts every
    row's tokens after its first and sums their steps (so speedup is throughput over plain's)."""
    from types import SimpleNamespace

    def result(n, steps, decode_s, toks):
        return SimpleNamespace(num_generated_tokens=n, decode_tokens_per_s=(n - 1) / decode_s,
                               metrics={"num_steps": steps}, token_ids=toks)

    row = paired.batch_figures([result(9, 4, 2.0, [1]), result(5, 3, 2.0, [2]),
                                result(1, 0, 2.0, [3])])
    assert row["decode_s"] == pytest.approx(2.0)
    assert (row["num_generated_tokens"], row["num_steps"]) == (1 + 8 + 4, 7)
    assert row["tokens"] == [[1], [2], [3]]
    assert paired.round_figures([row])["mean_accepted_length"] == pytest.approx(12 / 7)
    assert paired.batch_figures([result(5, 2, 1.0, [7])])["tokens"] == [7]  # batch 1: as before
