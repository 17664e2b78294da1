"""DeepSeek-V3-style MTP modules stored with the target: config.json with
`num_nextn_predict_layers` (>= 1) and `num_hidden_layers` L; the first module's tensors are
`model.layers.{L}.{enorm,hnorm,eh_proj}.weight`, its decoder block under `model.layers.{L}.`
(Llama names: input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj), `model.layers.{L}.shared_head.norm.weight`, optional
`model.layers.{L}.shared_head.head.weight` and `model.layers.{L}.embed_tokens.weight` (else the
target's). The directory may be the target's own (its other tensors are skipped) or hold only
the MTP tensors. Read only (jaxspec trains no MTP modules). Qwen3.5's native `mtp.*` layout
(`mtp_num_hidden_layers`) is read by formats/qwen3_5_mtp.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.mtp import MtpDrafter
from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.formats import tensors as T
from jaxspec.formats.eagle3 import layer_config

BLOCK = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
TOP = {
    "enorm.weight": "enorm",
    "hnorm.weight": "hnorm",
    "eh_proj.weight": "eh_proj",
    "shared_head.norm.weight": "head_norm",
    "shared_head.head.weight": "head",
    "embed_tokens.weight": "embed",
}


def detect(config: dict) -> str | None:
    n = config.get("num_nextn_predict_layers")
    if native_mtp_layers(config):  # Qwen3.5 / Qwen3-Next: read by formats/qwen3_5_mtp.py
        return "mtp"
    return "mtp" if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def native_mtp_layers(config: dict) -> int:
    """The Qwen3.5 / Qwen3-Next MTP layers a config declares (`mtp_num_hidden_layers`, top level
    or `text_config`): the `mtp.*` layout, read by formats/qwen3_5_mtp.py (0: none declared)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = text.get("mtp_num_hidden_layers", config.get("mtp_num_hidden_layers"))
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 0


def undeclared_mtp_layers(config: dict, path: Path) -> int:
    """Qwen3-Next's published checkpoints hold the `mtp.*` head without declaring
    `mtp_num_hidden_layers` (llama.cpp's converter counts it from the tensors, vLLM takes one):
    1 for a qwen3_next checkpoint whose tensors include `mtp.fc.weight`, else 0."""
    from jaxspec.loading.safetensors_dir import tensor_index  # names only (file headers)

    if config.get("model_type") != "qwen3_next":
        return 0
    try:
        return int("mtp.fc.weight" in tensor_index(Path(path)))
    except JaxspecError:  # no safetensors files: not an MTP checkpoint (refused below)
        return 0


def read(path, target_cfg, where=None):
    """-> (MtpDrafter, dparams) for `target_cfg`, validated."""
    path = Path(path)
    where = where or str(path)
    config = T.read_config(path)
    native = native_mtp_layers(config) or undeclared_mtp_layers(config, path)
    if native:  # Qwen3.5 / Qwen3-Next: the mtp.* layout
        # imported only for a Qwen3.5 checkpoint: its reader loads the hybrid model modules
        from jaxspec.formats import qwen3_5_mtp

        return qwen3_5_mtp.read(path, target_cfg, where, native)
    if not detect(config):
        raise JaxspecError(
            f"{where}: config.json has no num_nextn_predict_layers >= 1 (DeepSeek-V3) or "
            f"mtp_num_hidden_layers >= 1 (Qwen3.5): not an MTP checkpoint; point "
            f"speculative.mtp.checkpoint to one, or use another speculative.method"
        )
    cfg = layer_config(config, where)
    num_layers = validate.Fields(config, f"{where}/config.json").int(
        "num_hidden_layers", lo=1, hi=validate.MAX_LAYERS
    )
    if num_layers != target_cfg.num_layers:
        raise JaxspecError(
            f"{where}: the MTP module follows a {num_layers}-layer model, the target has "
            f"{target_cfg.num_layers} layers: use the MTP weights of this model"
        )
    if cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
        raise JaxspecError(
            f"{where}: the MTP module has hidden size {cfg.hidden_size} and vocabulary "
            f"{cfg.vocab_size}, the target {target_cfg.hidden_size} and {target_cfg.vocab_size}: "
            f"use the MTP weights of this model"
        )
    pre = f"model.layers.{num_layers}."
    raw = {
        k[len(pre) :]: a
        for k, a in T.read_tensors(path).items()
        if k.startswith(pre) and not k.endswith("rotary_emb.inv_freq")
    }
    required = set(BLOCK) | {
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
    }
    T.check_names(
        f"{where} ({pre}*)", raw, required, {"shared_head.head.weight", "embed_tokens.weight"}
    )
    h, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    n, k, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (v, h),
        "embed_tokens.weight": (v, h),
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (n * hd, h),
        "self_attn.k_proj.weight": (k * hd, h),
        "self_attn.v_proj.weight": (k * hd, h),
        "self_attn.o_proj.weight": (h, n * hd),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    for name, a in raw.items():
        T.check_tensor(where, pre + name, a, shapes[name])
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))
    dparams = {TOP[k]: f32(a) for k, a in raw.items() if k in TOP}
    dparams["layer"] = {BLOCK[k]: f32(a) for k, a in raw.items() if k in BLOCK}
    drafter = MtpDrafter(
        cfg=dataclasses.replace(cfg, num_layers=1),
        target_vocab=target_cfg.vocab_size,
        hidden_layers=(target_cfg.num_layers,),
    )
    return drafter, dparams
