"""Checkpoints: orbax training state (exact resume) and shipped drafter checkpoints.

Shipped drafter checkpoint (a directory):
  meta.json   {"format": "jaxspec-drafter", "version": 1, "method", "arch": {...},
               "target": fingerprint, "params_sha256", "training": {...}}
  params/     orbax StandardCheckpointer tree of the trained params (no target weights: the
              frozen embedding / LM-head rows are taken from the target at load time)

A checkpoint for another target (hidden size, vocabulary, layer count or the fingerprint's probe
values differ) or a corrupt / incomplete one is a `JaxspecError` with the fix in one line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import kernels
from jaxspec.errors import JaxspecError
from jaxspec.output_dir import replace_dir

FORMAT = "jaxspec-drafter"
VERSION = 1
_REPO = Path(__file__).resolve().parents[2]


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


# ---- target fingerprint -------------------------------------------------------------------


def fingerprint(cfg, params) -> dict[str, Any]:
    """Shape facts plus a few weight values (robust to float32/bfloat16 loading)."""
    embed = np.asarray(jnp.asarray(params["embed"], jnp.float32))
    layers = params["layers"]
    if isinstance(layers, dict):  # stacked
        wq = layers["wq"][0]
    elif "wqkv" in layers[0]:  # packed (CPU kernel) layout: wq's rows come first
        wq = kernels.unpack(layers[0]["wqkv"])
    else:
        wq = layers[0]["wq"]
    rows = [i % cfg.vocab_size for i in (0, 1, 100, 1000, 10000, 30000)]
    probe = np.concatenate(
        [
            embed[rows, :4].ravel(),
            np.asarray(jnp.asarray(params["final_norm"], jnp.float32))[:8],
            np.asarray(jnp.asarray(wq, jnp.float32))[0, :8],
        ]
    )
    return {
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_layers,
        "probe": [round(float(x), 6) for x in probe],
    }


def check_fingerprint(stored: dict, cfg, params, where: str) -> None:
    mine = fingerprint(cfg, params)
    for key in ("hidden_size", "vocab_size", "num_layers"):
        if stored.get(key) != mine[key]:
            raise JaxspecError(
                f"drafter checkpoint {where} was trained for a target with {key}={stored.get(key)}, "
                f"but this target has {key}={mine[key]}: use a checkpoint trained for this model "
                f"(or train one with python -m jaxspec.train)"
            )
    a, b = np.asarray(stored.get("probe", []), np.float32), np.asarray(mine["probe"], np.float32)
    if a.shape != b.shape or not np.allclose(a, b, rtol=2e-2, atol=2e-2):
        raise JaxspecError(
            f"drafter checkpoint {where} was trained for a different target (its weight "
            f"fingerprint differs from this model's): use a checkpoint trained for this model "
            f"(or train one with python -m jaxspec.train)"
        )


# ---- shipped drafter checkpoints ----------------------------------------------------------


def params_sha256(params) -> str:
    h = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda kv: str(kv[0])):
        a = np.asarray(leaf)
        h.update(str(path).encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def save_drafter(
    path, method: str, params, arch: dict, target_fp: dict, training: dict, *, force: bool = False
) -> Path:
    """Write a drafter checkpoint to `path`, atomically. An existing `path` must be empty or a
    jaxspec checkpoint, and replacing a checkpoint needs `force` (`output_dir.replace_dir`)."""
    params = jax.device_get(params)
    with replace_dir(path, force=force, what="export_dir") as tmp:
        _write_drafter(tmp, method, params, arch, target_fp, training)
    return Path(path).resolve()


def _write_drafter(path: Path, method, params, arch, target_fp, training) -> None:
    ckptr = _ocp().StandardCheckpointer()
    ckptr.save(path.resolve() / "params", params)
    ckptr.wait_until_finished()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "method": method,
        "arch": arch,
        "target": target_fp,
        "params_sha256": params_sha256(params),
        "training": training,
    }
    (path / "meta.json").write_text(json.dumps(meta, indent=1))


def resolve_path(path) -> Path:
    """A checkpoint path as given, else relative to the repository (configs name `checkpoints/...`)."""
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (_REPO / p).exists():
        return _REPO / p
    return p


def read_meta(path, method: str) -> dict:
    p = resolve_path(path)
    fix = f"train one with python -m jaxspec.train --config configs/train/smollm2-135m-{method}.yaml"
    if not p.is_dir():
        raise JaxspecError(f"drafter checkpoint {path} does not exist: {fix}")
    try:
        meta = json.loads((p / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise JaxspecError(
            f"drafter checkpoint {path} has no readable meta.json ({type(e).__name__}): it is not "
            f"a complete jaxspec drafter checkpoint; {fix}"
        ) from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise JaxspecError(f"{path} is not a jaxspec drafter checkpoint (format v{VERSION}): {fix}")
    if meta.get("method") != method:
        raise JaxspecError(
            f"drafter checkpoint {path} holds a '{meta.get('method')}' drafter, not '{method}': "
            f"set speculative.method: {meta.get('method')} or point to a {method} checkpoint"
        )
    return meta


def load_drafter(path, method: str, target_cfg, target_params) -> tuple[dict, Any]:
    """(meta, params as numpy-backed jax arrays). Checks target fingerprint and integrity."""
    p = resolve_path(path).resolve()  # orbax wants absolute paths
    meta = read_meta(path, method)
    check_fingerprint(meta["target"], target_cfg, target_params, str(path))
    try:
        params = _ocp().StandardCheckpointer().restore(p / "params")
    except Exception as e:  # orbax/tensorstore raise many types on missing or damaged files
        raise JaxspecError(
            f"drafter checkpoint {path} is corrupt or incomplete ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120] if str(e) else ''}): re-export or re-train it"
        ) from None
    if params_sha256(params) != meta.get("params_sha256"):
        raise JaxspecError(
            f"drafter checkpoint {path} is corrupt: its params do not match the checksum in "
            f"meta.json; re-export or re-train it"
        )
    return meta, jax.tree.map(jnp.asarray, params)


# ---- training state (orbax CheckpointManager) ---------------------------------------------


def manager(directory, max_to_keep: int = 2):
    ocp = _ocp()
    return ocp.CheckpointManager(
        Path(directory).resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep)
    )


def save_state(mngr, step: int, state) -> None:
    ocp = _ocp()
    mngr.save(step, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()


def restore_state(mngr, abstract_state):
    """(step, state) of the latest checkpoint, or (0, None)."""
    ocp = _ocp()
    step = mngr.latest_step()
    if step is None:
        return 0, None
    try:
        state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))
    except Exception as e:
        raise JaxspecError(
            f"training checkpoint step {step} in {mngr.directory} is corrupt or from another "
            f"config ({type(e).__name__}): delete that directory to start over"
        ) from None
    return step, state
