"""P-EAGLE heads in the speculators 0.9.0 layout (`speculators.models.peagle`, what vLLM loads):
EAGLE-3's speculators layout (formats/eagle3.py reads and writes all of it) with
`speculators_model_type: "peagle"`, `mask_token_id` and the tensor `mask_hidden` [1, 1, n·Dt].

    drafter, dparams = read(path, target_cfg)      # checked against the target, one-line errors
    write(path, drafter, dparams, target_cfg)      # loadable by PEagleDraftModel.from_pretrained

Not read (one-line refusals, before any compile): per-feature fc norms (`fc_norm: true`), draft
stacks of more than one layer (formats/eagle3.py), a mask token outside the target vocabulary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec import validate
from jaxspec.drafters.peagle import PEagleDrafter
from jaxspec.errors import JaxspecError, short
from jaxspec.formats import eagle3
from jaxspec.formats import tensors as T


def detect(config: dict) -> str | None:
    return "peagle" if config.get("speculators_model_type") == "peagle" else None


def read(path, target_cfg, layer_ids: str = "input") -> tuple[PEagleDrafter, dict]:
    """(drafter, dparams) from a speculators P-EAGLE directory; target_cfg: the target's config."""
    path = Path(path)
    where = str(path)
    config = T.read_config(path)
    f = validate.Fields(config, f"{where}/config.json")
    if f.bool("fc_norm", False):
        raise JaxspecError(f"{where}: fc_norm (a norm per tapped feature before fc) is not "
                           f"supported for peagle: use a head trained without it")
    mask = config.get("mask_token_id")
    vocab = target_cfg.vocab_size
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < vocab:
        raise JaxspecError(f"{where}: mask_token_id={short(mask)} must be a token id below the "
                           f"target's vocab_size {target_cfg.vocab_size}: use a head for this model")
    raw = T.read_tensors(path)
    if "mask_hidden" not in raw:
        raise JaxspecError(f"{where}: a P-EAGLE checkpoint needs the tensor mask_hidden")
    mask_hidden = raw.pop("mask_hidden")
    head = eagle3.read(path, "speculators", raw=raw)
    T.check_tensor(where, "mask_hidden", mask_hidden, (1, 1, 3 * head.target_hidden))
    chain, dparams = eagle3.to_drafter(head, target_cfg, where, layer_ids)
    fields = {fl.name: getattr(chain, fl.name) for fl in dataclasses.fields(chain)
              if fl.name != "name"}
    dparams["mask_hidden"] = jnp.asarray(np.asarray(mask_hidden, np.float32).reshape(-1))
    return PEagleDrafter(**fields, mask_token=mask), dparams


def write(path, drafter: PEagleDrafter, dparams, target_cfg, verifier: str | None = None) -> Path:
    """The head in the speculators P-EAGLE layout at `path` (config.json + model.safetensors)."""
    path = Path(path)
    chain = {k: a for k, a in dparams.items() if k != "mask_hidden"}
    head = eagle3.from_params(drafter, chain, target_cfg)
    eagle3.write(head, path, "speculators", verifier)
    tensors = T.read_tensors(path)
    tensors["mask_hidden"] = np.asarray(dparams["mask_hidden"], np.float32).reshape(1, 1, -1)
    config = T.read_config(path)
    config |= {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
               "mask_token_id": drafter.mask_token, "embed_requires_grad": True}
    config["speculators_config"]["algorithm"] = "peagle"
    for f in path.glob("*.safetensors"):
        f.unlink()
    T.write_safetensors(path, tensors)
    T.write_config(path, config)
    return path
