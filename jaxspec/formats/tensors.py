"""Tensor files of published drafter checkpoints, and the checks every reader applies.

Read: every `*.safetensors` in a directory (memory-mapped numpy; bfloat16 via ml_dtypes), or, when
there is none, PyTorch `.pt`/`.bin` files through `torch.load(weights_only=True)` -- plain tensors
only, never arbitrary unpickling. Write: one `model.safetensors` (safetensors' own numpy writer).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.loading.safetensors_file import SafetensorsFile


def read_config(path: Path) -> dict:
    if not (path / "config.json").exists():
        raise JaxspecError(
            f"{path / 'config.json'} is missing: a published drafter checkpoint needs its config.json"
        )
    return validate.read_json(path / "config.json", "drafter config.json")


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(file)
    return {name: f.tensor(name) for name in f.names()}


def _read_torch(file: Path) -> dict[str, np.ndarray]:
    import torch  # optional dependency: only for .pt/.bin checkpoints

    try:
        sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- UnpicklingError for non-tensors, or damage
        raise JaxspecError(
            f"{file} cannot be read with torch.load(weights_only=True) ({type(e).__name__}): "
            f"jaxspec reads plain tensor state dicts only; convert it to safetensors"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise JaxspecError(f"{file} is not a state dict of tensors: convert it to safetensors")
    out = {}
    for k, v in sd.items():
        v = v.detach().cpu()
        out[k] = (
            v.float().numpy().astype(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else v.numpy()
        )
    return out


def read_tensors(
    path: Path, torch_files: tuple[str, ...] = ("*.pt", "*.bin")
) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint directory `path`, by name."""
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        validate.regular_file(f, "safetensors file", max_bytes=None)
    reader = _read_safetensors
    if not files:
        files = sorted(f for pattern in torch_files for f in path.glob(pattern))
        reader = _read_torch
    if not files:
        raise JaxspecError(f"{path} has no *.safetensors (or .pt/.bin) tensor files")
    out: dict[str, np.ndarray] = {}
    for f in files:
        for k, v in reader(f).items():
            if k in out:
                raise JaxspecError(
                    f"{path}: tensor {k} is stored twice ({f.name} and another file)"
                )
            out[k] = v
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata=metadata or {"format": "pt"},
    )


def write_config(path: Path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- checks ---------------------------------------------------------------------------------


def _names(names, n=4) -> str:
    names = sorted(names)
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def check_names(where, got, required, optional=()) -> None:
    """Refuse missing or unexpected tensors, naming them."""
    missing = set(required) - set(got)
    if missing:
        raise JaxspecError(
            f"{where}: missing tensors {_names(missing)}: the checkpoint is incomplete or not "
            f"in this layout"
        )
    extra = set(got) - set(required) - set(optional)
    if extra:
        raise JaxspecError(
            f"{where}: unexpected tensors {_names(extra)}: this variant of the layout is not "
            f"supported (or checkpoint_format names the wrong layout)"
        )


def check_tensor(where, name, a: np.ndarray, shape, kind="float") -> None:
    """kind: float (any float dtype) | int | bool (bool or 0/1 integers)."""
    if tuple(a.shape) != tuple(shape):
        raise JaxspecError(
            f"{where}: tensor {name} has shape {list(a.shape)}, expected {list(shape)} from "
            f"config.json: the weights and the config disagree"
        )
    ok = {
        "float": np.issubdtype(a.dtype, np.floating) or a.dtype == ml_dtypes.bfloat16,
        "int": np.issubdtype(a.dtype, np.integer),
        "bool": a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer),
    }[kind]
    if not ok:
        raise JaxspecError(f"{where}: tensor {name} has dtype {a.dtype}, expected a {kind} tensor")
    if kind == "float" and not np.isfinite(np.asarray(a, np.float32)).all():
        raise JaxspecError(
            f"{where}: tensor {name} holds NaN or inf values: the checkpoint is corrupt; "
            f"re-download or re-train it"
        )
