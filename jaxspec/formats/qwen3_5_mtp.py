"""Qwen3.5's native MTP head stored with the target (the published layout, as vLLM and SGLang
read it): config.json declares `mtp_num_hidden_layers` (top level or `text_config`), and the
checkpoint holds

    mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight   [D]
    mtp.fc.weight                                                     [D, 2D]
    mtp.layers.0.<a Qwen3.5 full-attention decoder layer's tensors>   (models/qwen3_5.py names)
    mtp.norm.weight                                                   [D]

beside the target's own tensors (skipped here). The embedding and LM head are the target's.
On Qwen3.5-MoE the layer's MLP is its routed experts (one tensor per expert, as published) and
the shared expert. jaxspec reads one MTP layer (the published checkpoints ship one);
`to_tensors` puts the head back in the same names (an export of the head alone).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.qwen3_5_mtp import Qwen35MtpDrafter
from jaxspec.errors import JaxspecError
from jaxspec.formats import tensors as T
from jaxspec.models import moe, qwen3_5, qwen3_5_moe

PREFIX = "mtp."
TOP = {
    "pre_fc_norm_embedding.weight": "pre_fc_norm_embedding",
    "pre_fc_norm_hidden.weight": "pre_fc_norm_hidden",
    "fc.weight": "fc",
    "norm.weight": "norm",
}
LAYER = "layers.0."


def layer_names(cfg: qwen3_5.Qwen35Config) -> dict[str, str]:
    """A full-attention layer's published tensor names (after `mtp.layers.0.`) -> our leaves; on
    Qwen3.5-MoE one name per expert (`mlp.experts.j.gate_proj.weight` -> `we_gate.j`)."""
    leaves = qwen3_5.layer_shapes(cfg, cfg.layer_types.index("full_attention"))
    if not cfg.is_moe:
        return {hf: ours for hf, ours in qwen3_5.HF_LAYER_NAMES.items() if ours in leaves}
    per_expert = [f"{leaf}.{j}" for leaf in ("we_gate", "we_up", "we_down")
                  for j in range(cfg.num_experts)]
    ours = [leaf for leaf in leaves if not leaf.startswith("we_")] + per_expert
    return {qwen3_5_moe.hf_name_of(leaf): leaf for leaf in ours}


def shapes(cfg: qwen3_5.Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Published name (without `mtp.`) -> shape, for the target config `cfg`."""
    d = cfg.hidden_size
    full = qwen3_5.layer_shapes(cfg, cfg.layer_types.index("full_attention"))
    leaf_shape = lambda ours: (full[ours] if ours in full  # noqa: E731  (one expert's slice)
                               else full[ours.rsplit(".", 1)[0]][1:])
    out = {"pre_fc_norm_embedding.weight": (d,), "pre_fc_norm_hidden.weight": (d,),
           "fc.weight": (d, 2 * d), "norm.weight": (d,)}
    return out | {LAYER + hf: leaf_shape(ours) for hf, ours in layer_names(cfg).items()}


def read(path, target_cfg, where=None, num_layers: int = 1):
    """-> (Qwen35MtpDrafter, dparams) for the Qwen3.5 target `target_cfg`, validated: a layer
    count other than 1, a non-Qwen3.5 target, missing, extra or misshapen `mtp.*` tensors are
    refused in one line before anything is built."""
    path = Path(path)
    where = where or str(path)
    if num_layers != 1:
        raise JaxspecError(f"{where}: mtp_num_hidden_layers={num_layers} is not supported: "
                           f"jaxspec reads the Qwen3.5 MTP head of one layer (the published one)")
    if not isinstance(target_cfg, qwen3_5.Qwen35Config):
        raise JaxspecError(f"{where}: the Qwen3.5 MTP head (mtp.* tensors) drafts for its own "
                           f"Qwen3.5 target, not this one: load the Qwen3.5 checkpoint as target")
    raw = {k[len(PREFIX):]: a for k, a in T.read_tensors(path).items() if k.startswith(PREFIX)}
    want = shapes(target_cfg)
    T.check_names(f"{where} ({PREFIX}*)", raw, set(want))
    for name, a in raw.items():
        T.check_tensor(where, PREFIX + name, a, want[name])
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))
    dparams = {ours: f32(raw[hf]) for hf, ours in TOP.items()}
    layer = {ours: raw[LAYER + hf] for hf, ours in layer_names(target_cfg).items()}
    if target_cfg.is_moe:  # per-expert tensors -> [E, ...] leaves
        layer = moe.stack_expert_tensors(layer, target_cfg.num_experts,
                                         target_cfg.moe_intermediate_size, where)
    dparams["layer"] = {ours: f32(w) for ours, w in layer.items()}
    drafter = Qwen35MtpDrafter(cfg=target_cfg, target_vocab=target_cfg.vocab_size,
                               hidden_layers=(target_cfg.num_layers,))
    return drafter, dparams


def to_tensors(cfg: qwen3_5.Qwen35Config, dparams) -> dict[str, np.ndarray]:
    """The head's params back in the published names (`mtp.*`), float32."""
    out = {PREFIX + hf: np.asarray(dparams[ours], np.float32) for hf, ours in TOP.items()}
    layer = moe.unstack_expert_tensors(dparams["layer"]) if cfg.is_moe else dparams["layer"]
    for hf, ours in layer_names(cfg).items():
        out[PREFIX + LAYER + hf] = np.asarray(layer[ours], np.float32)
    return out
