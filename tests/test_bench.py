"""jaxspec.bench: formula, category mapping, aggregation/plots/Ctrl-C on synthetic rows, bad input,
and one small end-to-end run of the CLI (plain + ngram, HF peers, γ and batch sweeps)."""

from __future__ import annotations

import json
import math

import pytest

from jaxspec.bench import cli, options
from jaxspec.bench import spec_bench as bench
from jaxspec.bench import formula as F
from jaxspec.bench.plots import accepted_count_distribution

CONFIGS = [
    str(options.REPO_ROOT / "configs" / n) for n in ("smollm2-135m.yaml", "smollm2-135m-ngram.yaml")
]
PROMPTS = [  # one short prompt per category: one prompt-length bucket, so one compile per engine
    ("writing", "Write one short sentence about cats."),
    ("translation", "Translate to French: good morning, my friend."),
    ("summarization", "Summarize: the cat sat on the mat all day long."),
    ("qa", "What is the capital of France?"),
    ("math_reasoning", "What is 2 + 3? Answer with the number."),
    ("rag", "Context: Paris is in France. Question: where is Paris?"),
]


def write_jsonl(path, rows=PROMPTS):
    path.write_text(
        "".join(
            json.dumps({"question_id": 2 * i + 1, "category": c, "turns": [t, "next turn"]}) + "\n"
            for i, (c, t) in enumerate(rows)
        )
    )
    return path


# ---- formula ----------------------------------------------------------------------------------
def test_expected_tokens_per_step():
    assert F.expected_tokens_per_step(0.0, 5) == 1.0
    assert F.expected_tokens_per_step(1.0, 5) == 6.0
    assert math.isclose(F.expected_tokens_per_step(0.5, 2), 1 + 0.5 + 0.25)
    assert math.isclose(F.speedup(0.5, 2, c=0.1), 1.75 / 1.2)
    assert math.isclose(F.speedup(0.5, 2, step_cost=1.4), 1.75 / 1.4)


def test_alpha_inverts_expected_length():
    for alpha in (0.0, 0.2, 0.55, 0.9):
        for g in (1, 3, 8):
            mal = F.expected_tokens_per_step(alpha, g)
            assert abs(F.alpha_from_accepted_length(mal, g) - alpha) < 1e-6
    assert F.alpha_from_accepted_length(0.5, 4) == pytest.approx(0.0)  # clipped to [1, γ+1]


def test_step_cost_fit_and_optimal_gamma():
    r0, r1 = F.fit_step_cost([1, 2, 4], [1.2, 1.4, 1.8])
    assert r0 == pytest.approx(1.0) and r1 == pytest.approx(0.2)
    assert F.fit_step_cost([], []) == (1.0, 0.0)
    assert F.fit_step_cost([4], [2.0]) == pytest.approx((1.0, 0.25))
    # the seed's point: a long draft at low α with a real step cost is slower than plain
    assert F.speedup_curve(0.2, [8], 1.0, 0.3)[0] < 1.0
    assert F.optimal_gamma(0.2, 1.0, 0.3) == 1
    assert F.optimal_gamma(0.95, 1.0, 0.02) > 5
    dist = accepted_count_distribution([0.8, 0.5, 0.2])
    assert sum(dist) == pytest.approx(1.0) and dist == pytest.approx([0.2, 0.3, 0.3, 0.2])


# ---- data -----------------------------------------------------------------------------------
def test_category_mapping_and_selection(tmp_path):
    assert bench.category_of("writing") == "mt_bench"
    assert bench.category_of("coding") == "mt_bench"
    for c in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        assert bench.category_of(c) == c
    rows = bench.read_questions(write_jsonl(tmp_path / "q.jsonl", PROMPTS + PROMPTS[:2]))
    assert rows[0]["prompt"] == PROMPTS[0][1] and rows[0]["raw_category"] == "writing"
    picked = bench.select(rows, 2)
    assert [r["category"] for r in picked] == [
        "mt_bench",
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
        "mt_bench",
        "translation",
    ]
    assert len(bench.select(rows, 1)) == 6


def test_default_data_is_shipped_in_the_repo():
    d = options.DEFAULT_DATA
    assert d == options.REPO_ROOT / "data" / "spec_bench_dev.jsonl" and d.is_file()
    assert len(bench.select(bench.read_questions(str(d)), 3)) == 18


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--config", CONFIGS[0], "--data", "nope.jsonl", "--out", "o"], "does not exist"),
        (["--config", "configs/missing.yaml", "--out", "o"], "does not exist"),
        (["--config", CONFIGS[0], "--gammas", "1,x", "--out", "o"], "--gammas"),
        (["--config", CONFIGS[0], "--gammas", "0,2", "--out", "o"], "--gammas"),
        (["--config", CONFIGS[0], "--batch-sizes", "", "--out", "o"], "--batch-sizes"),
        (["--config", CONFIGS[0], "--n-per-category", "0", "--out", "o"], "--n-per-category"),
        (["--config", CONFIGS[0], "--gammas", "2", "--out", "o"], "speculative config"),
        (["--config", CONFIGS[0]], "--out"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, words, capsys, tmp_path):
    argv = [a if a != "o" else str(tmp_path / "o") for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and words in err, err


# ---- aggregation, summary, plots, Ctrl-C on synthetic rows (no model) ---------------------------
def _row(cat, n, tps, steps, drafted=0, accepted=0, per_pos=(), ids=None):
    return {
        "category": cat,
        "question_id": 1,
        "num_prompt_tokens": 40,
        "num_generated_tokens": n,
        "ttft_s": 0.1,
        "decode_s": (n - 1) / tps,
        "wall_s": 0.0,
        "tokens_per_s": tps,
        "e2e_tokens_per_s": n / (0.1 + (n - 1) / tps),
        "num_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "accepted_per_position": list(per_pos),
        "token_ids": ids or [1, 2, 3],
    }


def test_aggregate_figures():
    base = [_row("qa", 9, 10.0, 8), _row("rag", 9, 20.0, 8)]
    spec = [
        _row("qa", 9, 20.0, 4, 8, 4, (0.5, 0.5)),
        _row("rag", 9, 20.0, 4, 8, 4, (1.0, 0.0), ids=[9]),
    ]
    o = bench.aggregate(spec, base, 2)
    assert o["tokens_per_s"] == 20.0 and o["baseline_tokens_per_s"] == 15.0
    assert o["speedup"] == pytest.approx(20 / 15)
    assert o["mean_accepted_length"] == 2.0 and o["acceptance_rate"] == 0.5
    assert o["accepted_per_position"] == [0.75, 0.25]
    assert o["outputs_match_baseline"] is False and o["match_rate"] == 0.5
    # step cost: (16/20·... ) method s/step over plain s/step
    assert o["step_cost_ratio"] == pytest.approx((0.4 + 0.4) / 8 / ((0.8 + 0.4) / 16))
    assert o["predicted_speedup"] == pytest.approx(2.0 / o["step_cost_ratio"], rel=1e-6)


def test_interrupt_writes_partial_results(tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "q.jsonl")
    out = tmp_path / "out"

    def fake_load(self):
        self.engines = {"baseline": None, "smollm2-135m-ngram": None}
        self.ids = [[1]] * len(self.prompts)
        self.peers = None

    def fake_main(self):
        for p in self.prompts[:3]:
            self.rows.setdefault("baseline", []).append(_row(p["category"], 9, 10.0, 8))
            self.rows.setdefault("smollm2-135m-ngram", []).append(
                _row(p["category"], 9, 15.0, 4, 12, 4, (0.6, 0.3, 0.1, 0.0))
            )
            self.summarise()
            self.write(plots=False)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.Bench, "load", fake_load)
    monkeypatch.setattr(bench.Bench, "run_main", fake_main)
    code = cli.main(
        ["--config", *CONFIGS, "--data", str(data), "--n-per-category", "1", "--out", str(out)]
    )
    assert code == 130
    r = json.loads((out / "results.json").read_text())
    assert r["status"] == "interrupted"
    assert r["overall"]["num_prompts"] == 3 and r["overall"]["speedup"] == pytest.approx(1.5)
    assert set(r["categories"]) == {"mt_bench", "translation", "summarization"}
    assert r["configs"]["smollm2-135m"]["overall"]["speedup"] == pytest.approx(1.0)
    assert (out / "summary.md").is_file() and (out / "category_speedup.png").is_file()
    assert "partial results" in capsys.readouterr().err


# ---- one real run -------------------------------------------------------------------------------
def test_bench_cli_end_to_end(tmp_path, smollm2, smollm2_hf):
    data = write_jsonl(tmp_path / "q.jsonl")
    out = tmp_path / "out"
    argv = [
        "--config",
        *CONFIGS,
        "--data",
        str(data),
        "--n-per-category",
        "1",
        "--max-new-tokens",
        "8",
        "--peers",
        "hf",
        "--hf-threads",
        "1",
        "--gammas",
        "2,4",
        "--sweep-prompts",
        "1",  # γ=4: the config's own, compiled
        "--batch-sizes",
        "1,2",
        "--batch-rounds",
        "1",
        "--batch-max-new-tokens",
        "8",
        "--out",
        str(out),
    ]
    assert cli.main(argv, target=smollm2, hf_model=smollm2_hf) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["status"] == "complete"
    assert r["settings"]["num_prompts"] == 6 and r["settings"]["sampling"] == "greedy"
    assert r["machine"]["jax_version"] and r["machine"]["devices"]
    keys = {
        "tokens_per_s",
        "baseline_tokens_per_s",
        "speedup",
        "mean_accepted_length",
        "acceptance_rate",
        "outputs_match_baseline",
        "e2e_tokens_per_s",
    }
    assert set(r["categories"]) == {c for c in bench.SPEC_BENCH_CATEGORIES}
    for obj in [r["overall"], *r["categories"].values()]:
        assert keys <= set(obj)
        assert obj["outputs_match_baseline"] is True
        assert obj["tokens_per_s"] > 0 and obj["baseline_tokens_per_s"] > 0
    assert r["overall"]["config"] == "smollm2-135m-ngram"
    plain = r["configs"]["smollm2-135m"]["overall"]
    assert plain["speedup"] == pytest.approx(1.0) and plain["mean_accepted_length"] == 1.0
    hf = r["peers"]["hf"]
    assert set(hf["methods"]) == {"hf_plain", "hf_prompt_lookup"}
    assert hf["methods"]["hf_plain"]["overall"]["match_rate_vs_our_baseline"] == 1.0
    assert "smollm2-135m-ngram" in hf["info"]["not_applicable"]
    assert [p["gamma"] for p in r["gamma_sweep"]["points"]] == [2, 4]
    assert all(p["outputs_match_baseline"] for p in r["gamma_sweep"]["points"])
    assert r["gamma_sweep"]["formula"]["optimal_gamma"] >= 1
    assert [p["batch_size"] for p in r["batch_sweep"]["points"]] == [1, 2]
    assert all(p["outputs_match"] for p in r["batch_sweep"]["points"])
    for png in (
        "category_speedup",
        "accepted_length_hist",
        "per_position_acceptance",
        "gamma_sweep",
        "batch_sweep",
    ):
        assert (out / f"{png}.png").stat().st_size > 1000
    md = (out / "summary.md").read_text()
    assert "| smollm2-135m-ngram |" in md and "hf_plain" in md and "γ sweep" in md


def test_results_machine_attention_is_what_compiled(tmp_path, monkeypatch):
    """results.json's machine.attention is the baseline's compiled decode program's (the
    engine's compiled_attention), not the target's setting (here "pallas_tpu")."""
    from types import SimpleNamespace

    data = write_jsonl(tmp_path / "q.jsonl")
    out = tmp_path / "out"

    def fake_load(self):
        self.target = SimpleNamespace(attention="pallas_tpu", layout="stacked")
        compiled = {"prefill": "xla", "decode": "xla"}
        self.engines = {"baseline": SimpleNamespace(compiled_attention=compiled)}
        self.ids = [[1]] * len(self.prompts)
        self.peers = None

    def fake_main(self):
        p = self.prompts[0]
        self.rows.setdefault("baseline", []).append(_row(p["category"], 9, 10.0, 8))
        self.summarise()

    monkeypatch.setattr(bench.Bench, "load", fake_load)
    monkeypatch.setattr(bench.Bench, "run_main", fake_main)
    monkeypatch.setattr(bench.Bench, "run_sweeps", lambda self: None, raising=False)
    cli.main(["--config", CONFIGS[0], "--data", str(data), "--n-per-category", "1",
                "--out", str(out), "--no-plots"])
    r = json.loads((out / "results.json").read_text())
    assert r["machine"]["attention"] == "xla"
    assert r["machine"]["attention_compiled"] == {"baseline": {"prefill": "xla", "decode": "xla"}}
