"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, model_type qwen3_5_moe_text; the text part of the
multimodal qwen3_5_moe): Qwen3.5's hybrid decoder (`models/qwen3_5.py`: Gated DeltaNet linear
layers and gated full attention, the exact state rollback) with every layer's MLP a routed
mixture of experts (`models/moe.py`: softmax top-k per token, the k weights renormed) plus a
shared expert behind a one-logit sigmoid gate.

Params: Qwen3.5's per-layer leaves with the MLP's `w_gate/w_up/w_down` replaced by

    {"router": [E, D], "we_gate", "we_up": [E, F, D], "we_down": [E, D, F],
     "ws_gate", "ws_up": [Fs, D], "ws_down": [D, Fs], "ws_router": [1, D]}

(F = moe_intermediate_size, Fs = shared_expert_intermediate_size). The forward, cache, commit
and traits are Qwen3.5's (`Qwen35Config.num_experts > 0` routes the MLP); the native MTP head
(`mtp.*`, its decoder layer an MoE layer too) drafts through `drafters/qwen3_5_mtp.py`.

This module is the family's one home: config reader, tensor-name map, target and its
`register_family` call with the HF layout the loader reads.
"""

from __future__ import annotations

import dataclasses
import re

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.models import moe, qwen3_5, qwen3_5_gguf, registry
from jaxspec.models.qwen3_5 import Qwen35Config, Qwen35Target

ROUTING = ("softmax top-k routing per token with the k weights renormed, one shared expert "
           "behind a sigmoid gate, experts on every layer")
# config keys of routings jaxspec does not implement, and their neutral value
_UNSUPPORTED_ROUTING = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                        "n_shared_experts": 1, "decoder_sparse_step": 1, "mlp_only_layers": []}


def qwen3_5_moe_config_from_hf(hf: dict, *, dtype: str, source: str,
                               family: str = "Qwen3.5-MoE") -> Qwen35Config:
    """config.json of Qwen3_5MoeForCausalLM (or the multimodal qwen3_5_moe's `text_config`;
    Qwen3-Next's too, `family` naming it in refusals), every field checked; a routing this
    family does not implement is refused in one line."""
    text = qwen3_5.text_config(hf)
    for key, neutral in _UNSUPPORTED_ROUTING.items():
        if text.get(key) not in (None, neutral):
            raise JaxspecError(f"{source}: {key}={validate.short(text[key])} is a routing jaxspec "
                               f"does not implement: {family} supports {ROUTING}")
    f = validate.Fields(text, source)
    scoring = f.str("scoring_func", "softmax")
    if scoring != "softmax":
        raise JaxspecError(f"{source}: scoring_func={scoring!r} is not supported: {family} "
                           f"supports {ROUTING}")
    if f.given("norm_topk_prob") and not f.bool("norm_topk_prob", True):
        raise JaxspecError(f"{source}: norm_topk_prob=false is not supported: {family} "
                           f"supports {ROUTING}")
    experts = f.int("num_experts", lo=1, hi=1 << 16)
    width = f.int("moe_intermediate_size", lo=1, hi=validate.MAX_DIM)
    shared = f.int("shared_expert_intermediate_size", lo=1, hi=validate.MAX_DIM)
    top_k = f.int("num_experts_per_tok", lo=1, hi=experts)
    dense = dict(text, intermediate_size=text.get("intermediate_size", width))  # unused by MoE
    cfg = qwen3_5.hybrid_config_from_hf(hf, dense, dtype=dtype, source=source)
    return dataclasses.replace(cfg, num_experts=experts, top_k=top_k, moe_intermediate_size=width,
                               shared_expert_intermediate_size=shared)


_MLP_NAMES = {
    "mlp.gate.weight": "router",
    "mlp.shared_expert.gate_proj.weight": "ws_gate",
    "mlp.shared_expert.up_proj.weight": "ws_up",
    "mlp.shared_expert.down_proj.weight": "ws_down",
    "mlp.shared_expert_gate.weight": "ws_router",
    "mlp.experts.gate_up_proj": "we_gate_up",  # fused [E, 2F, D] (transformers' own layout)
    "mlp.experts.down_proj": "we_down",
}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")  # published layout
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def our_layer_name(rest: str) -> str | None:
    """A layer tensor's HF name (after `layers.i.`) -> our leaf (`we_gate.7`: expert 7's gate,
    stacked by `moe.stack_expert_tensors`); None: unknown."""
    if rest in _MLP_NAMES:
        return _MLP_NAMES[rest]
    m = _EXPERT.fullmatch(rest)
    if m:
        return f"we_{m.group(2)}.{m.group(1)}"
    return None if rest in _DENSE_MLP else qwen3_5.HF_LAYER_NAMES.get(rest)


def hf_name_of(leaf: str) -> str:
    """Our layer leaf (per-expert `we_gate.7` included) -> its published name (inverse)."""
    m = re.fullmatch(r"we_(gate|up|down)\.(\d+)", leaf)
    if m:
        return f"mlp.experts.{m.group(2)}.{m.group(1)}_proj.weight"
    names = {v: k for k, v in qwen3_5.HF_LAYER_NAMES.items() if k not in _DENSE_MLP}
    return names.get(leaf) or {v: k for k, v in _MLP_NAMES.items()}[leaf]


def _tensor_name(hf_name: str) -> str | None:
    return registry.hf_tensor_name(hf_name, our_layer_name, prefixes=qwen3_5.HF_PREFIXES)


def convert(flat: dict, cfg: Qwen35Config, source: str) -> dict:
    """Per-expert (or fused) expert tensors stacked to [E, ...], then Qwen3.5's conv reshape."""
    flat = moe.stack_expert_tensors(flat, cfg.num_experts, cfg.moe_intermediate_size, source)
    return qwen3_5.convert(flat, cfg, source)


@dataclasses.dataclass(frozen=True)
class Qwen35MoeTarget(Qwen35Target):
    """Qwen3.5-MoE as a `models.base.Target`: Qwen3.5's, plus the experts a step wakes."""

    name: str = "qwen3_5_moe"

    def experts_woken(self, tokens: int) -> float:
        """Expected distinct experts one layer runs for `tokens` routed tokens."""
        return moe.experts_woken(tokens, self.cfg.top_k, self.cfg.num_experts)


def _target_from_hf(hf: dict, *, dtype: str, source: str) -> Qwen35MoeTarget:
    return Qwen35MoeTarget(qwen3_5_moe_config_from_hf(hf, dtype=dtype, source=source))


def _target_from_gguf(header, *, dtype: str, source: str) -> Qwen35MoeTarget:
    return Qwen35MoeTarget(qwen3_5_gguf.config_from_gguf(header, dtype=dtype, source=source))


registry.register_family(registry.Family(
    "qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), ("qwen35moe",), _target_from_hf,
    _target_from_gguf,
    hf=registry.HfLayout(
        config=qwen3_5_moe_config_from_hf, tensor_name=_tensor_name,
        param_shapes=qwen3_5.param_shapes, target=lambda cfg, arch: Qwen35MoeTarget(cfg),
        skip=qwen3_5.HF_SKIPPED, convert=convert, layout=qwen3_5.check_layout,
        architecture=lambda cfg: "qwen3_5_moe"),
    gguf=registry.FileLayout(
        config=qwen3_5_gguf.config_from_gguf,
        tensor_name=lambda n: registry.gguf_tensor_name(n, qwen3_5_gguf.GGUF_LAYER_NAMES),
        param_shapes=qwen3_5.param_shapes, target=lambda cfg, arch: Qwen35MoeTarget(cfg),
        convert=qwen3_5_gguf.convert, layout=qwen3_5.check_layout,
        architecture=lambda cfg: "qwen3_5_moe")))
