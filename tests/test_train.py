"""Training on tiny synthetic targets: the loss falls, resume after a kill is exact, shipped
checkpoints reject corruption and other targets with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.train.data import DataConfig, generate_records
from jaxspec.train.load import load_trained_drafter
from jaxspec.train.train import TrainConfig, train
from tiny import tiny_model

ARGS = {
    "eagle": {"hidden_layers": (1, 2, 3), "input_scale": 1.0, "ttt_steps": 2},
    "medusa": {"num_heads": 2},
    "draft_model": {"layers_from": (0, 3)},
}


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1, scale=0.5, eos=(-1,))


@pytest.fixture(scope="module")
def records(target):
    """The tiny target's own greedy continuations of random prompts, recorded like real data."""
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 64, size=int(n)))) for n in rng.integers(4, 12, 16)]
    dc = DataConfig(layers=(1, 2, 3, 4), top_k=4, gen_steps=20)
    return generate_records(target, prompts, dc, np.asarray([-1]))


def config(tmp_path, method, **kw):
    base = dict(method=method, ckpt_dir=str(tmp_path / f"ckpt-{method}"), steps=12,
                batch_size=4, seq_len=32, lr=3e-3, warmup=2, save_every=4, eval_every=0,
                draft_vocab=48, method_args=ARGS[method])
    return TrainConfig(**(base | kw))


def run(tc, target, records, **kw):
    return train(tc, target=target, data=records, eval_prompts=[], log=lambda *a: None,
                 progress=False, **kw)


@pytest.mark.parametrize("method", ["eagle", "medusa", "draft_model"])
def test_loss_falls(tmp_path, target, records, method):
    lr = {"medusa": 3e-2}.get(method, 3e-3)
    out = run(config(tmp_path, method, steps=20, save_every=0, lr=lr), target, records)
    losses = [h["loss"] for h in out.history]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


def test_resume_after_kill_is_exact(tmp_path, target, records):
    whole = run(config(tmp_path / "a", "eagle", steps=8), target, records)
    killed = run(config(tmp_path / "b", "eagle", steps=8), target, records, stop_at=6)
    assert killed.stopped and not whole.stopped  # checkpoint at step 4 exists; steps 5-6 are lost with the kill
    resumed = run(config(tmp_path / "b", "eagle", steps=8), target, records)
    assert resumed.history[0]["step"] == 5
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and a different run really differs (the comparison can fail)
    other = run(config(tmp_path / "c", "eagle", steps=8, seed=3), target, records)
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(whole.params), jax.tree.leaves(other.params)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, target, records):
    out = tmp_path_factory.mktemp("export") / "medusa"
    tc = config(tmp_path_factory.mktemp("run"), "medusa", steps=2, export_dir=str(out))
    run(tc, target, records)
    return out


def test_exported_checkpoint_loads(exported, target):
    drafter, dparams = load_trained_drafter("medusa", exported, target)
    assert drafter.num_heads == 2 and dparams["head"].shape == (48, target.cfg.hidden_size)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_checkpoint_is_a_clear_error(exported, target, tmp_path):
    bad = _copy(exported, tmp_path / "bad")
    files = sorted((p for p in (bad / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    files[-1].write_bytes(bytes(data))
    with pytest.raises(JaxspecError, match="corrupt"):
        load_trained_drafter("medusa", bad, target)

    gone = _copy(exported, tmp_path / "gone")
    for p in (gone / "params").rglob("*"):
        if p.is_file():
            p.unlink()
    with pytest.raises(JaxspecError, match="corrupt or incomplete"):
        load_trained_drafter("medusa", gone, target)

    no_meta = _copy(exported, tmp_path / "no_meta")
    (no_meta / "meta.json").unlink()
    with pytest.raises(JaxspecError, match="no readable meta.json"):
        load_trained_drafter("medusa", no_meta, target)

    with pytest.raises(JaxspecError, match="holds a 'medusa' drafter, not 'eagle'"):
        load_trained_drafter("eagle", exported, target)
    with pytest.raises(JaxspecError, match="does not exist"):
        load_trained_drafter("medusa", tmp_path / "nowhere", target)


def test_checkpoint_for_another_target_is_a_clear_error(exported):
    wider = tiny_model(seed=1, scale=0.5, hidden=32)
    with pytest.raises(JaxspecError, match="hidden_size=64, but this target has hidden_size=32"):
        load_trained_drafter("medusa", exported, wider)
    bigger_vocab = tiny_model(seed=1, scale=0.5, vocab=80)
    with pytest.raises(JaxspecError, match="vocab_size"):
        load_trained_drafter("medusa", exported, bigger_vocab)
    same_shape_other_weights = tiny_model(seed=2, scale=0.5)
    with pytest.raises(JaxspecError, match="fingerprint differs"):
        load_trained_drafter("medusa", exported, same_shape_other_weights)


def test_meta_records_target_and_training(exported):
    meta = json.loads((exported / "meta.json").read_text())
    assert meta["method"] == "medusa" and meta["target"]["hidden_size"] == 64
    assert meta["arch"]["draft_vocab"] == 48 and meta["training"]["steps"] == 2


def test_templated_prompts_draw_only_on_gsm8k_train_text():
    from jaxspec.train import prompts

    rows = [{"question": f"q{i}?"} for i in range(200)]
    train, held_out = prompts.split_gsm8k(rows)
    made = prompts.templated([r["question"] for r in train], 60)
    assert len(made) == 60 and len(set(made)) == 60
    assert not any(r["question"] in p for r in held_out for p in made)  # held-out stays unseen
    assert sum("French" in p or "German" in p or "Spanish" in p for p in made) >= 6  # translation
    assert sum(any(t in p for t in prompts.TOPICS) for p in made) == 20  # every third: open writing


def test_tail_window_keeps_each_rows_last_positions(records):
    from jaxspec.train.data import tail_window

    cut = tail_window(records, 10)
    for i, n in enumerate(records["lengths"]):
        m = min(int(n), 10)
        assert cut["lengths"][i] == m
        np.testing.assert_array_equal(cut["tokens"][i, :m], records["tokens"][i, n - m : n])
        np.testing.assert_array_equal(cut["hidden"][:, i, :m], records["hidden"][:, i, n - m : n])
        np.testing.assert_array_equal(cut["topk_ids"][i, :m], records["topk_ids"][i, n - m : n])
    assert tail_window(records, records["tokens"].shape[1]) is records


def test_warm_start_begins_from_the_export_and_rejects_another_arch(tmp_path, target, records, exported):
    src = run(config(tmp_path / "src", "eagle", steps=3, export_dir=str(tmp_path / "exp")), target, records)
    warm = run(config(tmp_path / "warm", "eagle", steps=1, lr=0.0, init_from=str(tmp_path / "exp")), target, records)
    for a, b in zip(jax.tree.leaves(src.params), jax.tree.leaves(warm.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # lr 0: still the export
    cold = run(config(tmp_path / "cold", "eagle", steps=1, lr=0.0), target, records)
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(src.params), jax.tree.leaves(cold.params)))
    with pytest.raises(JaxspecError, match="does not match this drafter's architecture"):
        run(config(tmp_path / "bad", "medusa", steps=1, init_from=str(exported),
                   method_args={"num_heads": 3}), target, records)  # exported with 2 heads


def test_passage_tasks_cover_the_request_kinds():
    from jaxspec.train import prompts

    passages = [(s, f"Text about {s}. " * 20) for s, _ in prompts.passage_prompts()]
    made = prompts.passage_tasks(passages, 300)
    assert len(made) == 300
    kinds = {
        "summary": sum(p.startswith(("Summarize:", "Write a short summary")) for p in made),
        "translation": sum(p.startswith("Translate German to English") for p in made),
        "multi-passage": sum(p.count("Text about") >= 60 for p in made),
        "short question": sum(p.endswith("?") and len(p) < 120 for p in made),
    }
    assert all(n >= 40 for n in kinds.values()), kinds
    translations = [p for p in made if p.startswith("Translate")]
    assert len(set(translations)) == len(translations)  # each German sentence once


def test_load_shards_drops_repeated_rows(tmp_path, records):
    from jaxspec.train.data import load_shards

    for name, rows in (("a", [0, 1, 2, 1]), ("b", [2, 3])):  # row 1 twice in a, row 2 again in b
        d = tmp_path / name
        d.mkdir()
        np.savez(d / "shard_00000.npz", kind=np.array("gen"), **{
            k: np.take(v, rows, axis=1 if k == "hidden" else 0) for k, v in records.items()})
    data = load_shards(f"{tmp_path / 'a'},{tmp_path / 'b'}")
    np.testing.assert_array_equal(data["tokens"], records["tokens"][[0, 1, 2, 3]])
    np.testing.assert_array_equal(data["hidden"], records["hidden"][:, [0, 1, 2, 3]])
    assert len(load_shards(tmp_path / "a", window=8)["lengths"]) == 3


def test_passage_tasks_draws_give_new_pairings():
    from jaxspec.train import prompts

    passages = [(s, f"Text {i}. " * 30) for i, (s, _) in enumerate(prompts.passage_prompts())]
    fixed, drawn = prompts.passage_tasks(passages, 300), prompts.passage_tasks(passages, 300, draw=1)
    assert drawn == prompts.passage_tasks(passages, 300, draw=1)  # reproducible
    assert not any(p.startswith("Translate") for p in drawn)  # German sentences: draw 0 only
    multi = [p for p in drawn if p.count("Text") >= 90]  # questions after three passages
    assert len(multi) >= 40 and not set(multi) & set(fixed)
