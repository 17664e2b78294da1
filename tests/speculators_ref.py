"""What the tests of the speculators-layout drafters (test_dspark.py, test_peagle.py) share: the
reference package imported without its training-only dependencies, the error measure, the tiny
targets in both frameworks, a checkpoint with an edited config, and the read-back checks.

Error measure: max |ours - theirs| / max |theirs| over the compared values.
"""

from __future__ import annotations

import json
import shutil
import sys
import types

import jax
import numpy as np
import pytest


class Lazy:
    """A reference module imported on its first attribute read, by a test rather than at
    collection (every xdist worker collects every module: speculators' and dflash's imports,
    ~3 s each, were paid by the worker that runs none of their tests too)."""

    def __init__(self, load):
        object.__setattr__(self, "_load", load)
        object.__setattr__(self, "_module", None)

    def _get(self):
        if self._module is None:
            object.__setattr__(self, "_module", self._load())
        return self._module

    def __getattr__(self, name):
        return getattr(self._get(), name)

    def __setattr__(self, name, value):  # a test swapping a reference function sets it there
        setattr(self._get(), name, value)


def import_reference(module: str):
    """speculators.models.<module> (0.9.0); its package imports two training-data packages
    (datasets, hs_connectors) that the model code never calls: stand-ins when they are not
    installed. Skips where speculators itself is not installed."""
    class _Absent(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    for name in ("datasets", "hs_connectors"):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = _Absent(name)
    return pytest.importorskip(f"speculators.models.{module}")


def rel_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def load_targets(torch, dirs: dict) -> dict:
    """{name: (the transformers model, jaxspec's unrolled model)} for {name: checkpoint dir}."""
    from transformers import AutoModelForCausalLM

    from jaxspec.loading import load_model

    out = {}
    for name, path in dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (hf, load_model(path, layout="unrolled"))
    return out


def edited(src, dst, **changes):
    """A copy of checkpoint directory src at dst with its config.json updated by changes."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def assert_same_tensors(loaded, theirs: dict) -> None:
    """Every tensor of theirs (name -> torch tensor) equal to the loaded model's."""
    mine = loaded.state_dict()
    for k, v in theirs.items():
        np.testing.assert_array_equal(mine[k].numpy(), v.numpy(), err_msg=k)


def same_params(a, b) -> bool:
    return jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), a, b))


def training_inputs(model, records, drafter):
    """(tokens [1, T], a training batch, the frozen tables) for the first distilled row of
    `records` on `model` (.target, .params): the target's own taps at the drafter's layers, flat
    soft targets, the full vocabulary as the draft one (`train.methods.frozen_pieces`)."""
    import jax.numpy as jnp

    from jaxspec.train.methods import frozen_pieces

    t = model.target
    tok = jnp.asarray(records["tokens"][0, : int(records["lengths"][0])][None], jnp.int32)
    taps = t.forward(model.params, tok, t.init_cache(model.params, 1, 64),
                     taps=drafter.hidden_layers).taps
    batch = {"tokens": tok, "lengths": jnp.asarray([tok.shape[1]]),
             "hidden": jnp.stack([jnp.asarray(x, jnp.float32) for x in taps]),
             "topk_ids": jnp.zeros((*tok.shape, 4), jnp.int32),
             "topk_probs": jnp.full((*tok.shape, 4), 0.25)}
    return tok, batch, frozen_pieces(model, jnp.arange(t.vocab_size))
