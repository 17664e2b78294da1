"""Build a runtime drafter from a shipped checkpoint: (drafter, drafter_params) for the engine.

The checkpoint holds only the trained params and the draft-vocabulary map; the frozen pieces (the
target's embedding and its LM-head rows for the draft vocabulary) come from the target itself,
after the target fingerprint check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.drafters.draft_vocab import check_d2t
from jaxspec.errors import JaxspecError
from jaxspec.loading.params import check_finite
from jaxspec.models import base
from jaxspec.train import checkpoint as ckpt
from jaxspec.train import methods as methods_lib


def load_trained_drafter(method: str, path, target):
    """method: a registered trained method (train.registry.METHODS: eagle, eagle3, medusa,
    draft_model); target: LoadedModel (or anything with .target, .params and, for the
    checkpoint's fingerprint, .cfg)."""
    if path is None:
        raise JaxspecError(
            f"speculative.{method}.checkpoint is required for method '{method}': point it to a trained "
            f"drafter, e.g. checkpoints/smollm2-135m-{'draft' if method == 'draft_model' else method}"
        )
    meta, stored = ckpt.load_drafter(path, method, target.cfg, target.params)
    if method not in methods_lib.METHODS:
        raise JaxspecError(
            f"drafter checkpoint {path}: method '{method}' has no trained head registered "
            f"(register_drafter(..., train=...)): use one of {', '.join(methods_lib.METHODS)}"
        )
    m = methods_lib.from_arch(method, meta["arch"])
    t = target.target
    d2t = jnp.asarray(check_d2t(stored.pop("d2t"), t.vocab_size, str(path)))
    if isinstance(stored.get("layers"), list):  # orbax stores tuples as lists
        stored["layers"] = tuple(stored["layers"])
    for key, leaf in jax.tree_util.tree_leaves_with_path(stored):
        check_finite(jax.tree_util.keystr(key), leaf, f"drafter checkpoint {path}")
    params = jax.tree.map(lambda x: jnp.asarray(x, base.compute_dtype(t)), stored)  # target's dtype
    expected, _ = jax.eval_shape(lambda: m.init(target, d2t, jax.random.key(0)))
    got = jax.tree.map(lambda x: x.shape, params)
    want = jax.tree.map(lambda x: x.shape, expected)
    if got != want:
        raise JaxspecError(
            f"drafter checkpoint {path} does not fit this target: its param shapes differ from "
            f"the expected ones ({_first_difference(got, want)}); use a checkpoint trained for "
            f"this model"
        )
    d2t_np = jax.device_get(d2t)
    frozen = methods_lib.frozen_pieces(target, d2t_np)
    return m.drafter(t), m.runtime(params, frozen)


def _first_difference(got, want) -> str:
    g = dict(jax.tree_util.tree_leaves_with_path(got, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)))
    w = dict(jax.tree_util.tree_leaves_with_path(want, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)))
    gs = {jax.tree_util.keystr(k): v for k, v in g.items()}
    ws = {jax.tree_util.keystr(k): v for k, v in w.items()}
    for k in sorted(set(gs) | set(ws)):
        if gs.get(k) != ws.get(k):
            return f"{k}: {gs.get(k)} vs expected {ws.get(k)}"
    return "tree structure differs"
