"""DFlash / DFlash 2 heads in the authors' Hugging Face layout (z-lab `dflash`, what vLLM and
SGLang load): config.json (a Qwen3 config with `architectures: [DFlashDraftModel |
DFlash2DraftModel]`, `num_target_layers`, `dflash_config`) and safetensors.

    drafter, dparams = read(path, target)          # checked against the target, one-line errors
    write(path, drafter, dparams, target)          # loadable by DFlashDraftModel.from_pretrained

`dflash_config` (each key may also sit at the top level): target_layer_ids (default: the
reference's spread over num_target_layers), block_size (16), mask_token_id, input_embedding_scale
(1), output_multiplier (1), final_logit_softcapping; DFlash 2 adds conv_kernel_size,
conv_group_size, selector_rank, selector_top_k. Per layer: layer_types[i] == "sliding_attention"
slides by sliding_window and is causal unless `is_causal` says otherwise.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec import validate
from jaxspec.drafters import dflash_forward as net
from jaxspec.drafters.dflash import DFlashDrafter
from jaxspec.errors import JaxspecError
from jaxspec.formats import tensors as T
from jaxspec.formats.eagle3 import layer_config

ARCHITECTURES = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2}
_LAYER = {  # jaxspec name -> reference name under layers.{i}.
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_CONVS = {"attn_conv": "attention_conv", "mlp_conv": "mlp_conv"}
_SELECTOR = {  # the authors' files store the codebooks without ".weight" (their key_mapping)
    "pred": "candidate_selector.predecessor_codebook",
    "succ": "candidate_selector.successor_codebook",
    "proj": "candidate_selector.hidden_projection.weight",
}


def detect(config: dict) -> str | None:
    archs = config.get("architectures") or []
    return "dflash" if any(a in ARCHITECTURES for a in archs) else None


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's spread of tapped target layers (output of layer i) when none are given."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _value(config: dict, dc: dict, name, default=None):
    return dc.get(name, config.get(name, default))


def read_spec(config: dict, where: str) -> tuple[net.DFlashSpec, int, int]:
    """(spec, version, num_target_layers) from config.json, every field checked."""
    f = validate.Fields(config, f"{where}/config.json")
    version = next(ARCHITECTURES[a] for a in config.get("architectures") or [] if a in ARCHITECTURES)
    dc = f.dict("dflash_config", {})
    n_layers = f.int("num_hidden_layers", lo=1, hi=validate.MAX_LAYERS)
    n_target = f.int("num_target_layers", lo=1, hi=validate.MAX_LAYERS)
    cfg = layer_config(config, where)
    cfg = dataclasses.replace(cfg, num_layers=n_layers, qk_norm=True)
    g = validate.Fields(dc | {k: config[k] for k in config if k not in dc}, f"{where}/config.json")
    ids = _value(config, dc, "target_layer_ids") or default_layer_ids(n_target, n_layers)
    if not (isinstance(ids, (list, tuple)) and ids and all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    )):
        raise JaxspecError(f"{where}: dflash_config.target_layer_ids must be a list of layer ids")
    mask = _value(config, dc, "mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < cfg.vocab_size:
        raise JaxspecError(
            f"{where}: dflash_config.mask_token_id={mask!r} must be a token id below vocab_size "
            f"{cfg.vocab_size}"
        )
    types = config.get("layer_types") or ["full_attention"] * n_layers
    if len(types) != n_layers:
        raise JaxspecError(f"{where}: layer_types has {len(types)} entries for {n_layers} layers")
    is_causal = config.get("is_causal")
    sliding = [t == "sliding_attention" for t in types]
    window = config.get("sliding_window")
    if any(sliding) and not (isinstance(window, int) and window >= 1):
        raise JaxspecError(f"{where}: sliding layers need sliding_window, an integer >= 1")
    cap = _value(config, dc, "final_logit_softcapping")
    two = {}
    if version == 2:
        two = {k: g.int(k, lo=1, hi=validate.MAX_DIM) for k in
               ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
        if cfg.hidden_size % two["conv_group_size"]:
            raise JaxspecError(f"{where}: conv_group_size must divide hidden_size {cfg.hidden_size}")
    spec = net.DFlashSpec(
        layer=cfg,
        num_layers=n_layers,
        target_layer_ids=tuple(ids),
        block_size=g.int("block_size", 16, lo=2, hi=1024),
        mask_token_id=mask,
        causal=tuple(s if is_causal is None else bool(is_causal) for s in sliding),
        windows=tuple(window if s else None for s in sliding),
        input_embedding_scale=g.float("input_embedding_scale", 1.0),
        output_multiplier=g.float("output_multiplier", 1.0),
        final_logit_softcapping=None if cap is None else float(cap),
        **two,
    )
    return spec, version, n_target


def check_target(spec: net.DFlashSpec, n_target: int, target, where: str) -> None:
    """Refuse a head built for another target, naming the mismatch (target: models.base.Target)."""
    if spec.layer.hidden_size != target.hidden_size:
        raise JaxspecError(
            f"{where}: the DFlash head's hidden size is {spec.layer.hidden_size}, the target's "
            f"{target.hidden_size}: use a head trained for this model"
        )
    if spec.layer.vocab_size != target.vocab_size:
        raise JaxspecError(
            f"{where}: the DFlash head is for a vocabulary of {spec.layer.vocab_size} tokens, the "
            f"target has {target.vocab_size}: use a head trained for this model's tokenizer"
        )
    if n_target != target.num_layers:
        raise JaxspecError(
            f"{where}: the DFlash head was built for a target of {n_target} layers "
            f"(num_target_layers), this target has {target.num_layers}: use a head for this model"
        )
    bad = [i for i in spec.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise JaxspecError(
            f"{where}: target_layer_ids {bad} lie outside the target's layers "
            f"0..{target.num_layers - 1}: use a head for this model"
        )


def read(path, target) -> tuple[DFlashDrafter, dict]:
    """(drafter, dparams) from an authors'-layout directory; target: the models.base.Target."""
    path = Path(path)
    where = str(path)
    config = T.read_config(path)
    spec, version, n_target = read_spec(config, where)
    check_target(spec, n_target, target, where)
    got = T.read_tensors(path)
    got = {k.removeprefix("model."): v for k, v in got.items()}
    c = spec.layer
    d, hd = c.hidden_size, c.head_dim
    shapes = {"fc.weight": (d, len(spec.target_layer_ids) * d), "hidden_norm.weight": (d,),
              "norm.weight": (d,)}
    lshape = {"attn_norm": (d,), "wq": (c.num_heads * hd, d), "wk": (c.num_kv_heads * hd, d),
              "wv": (c.num_kv_heads * hd, d), "wo": (d, c.num_heads * hd), "q_norm": (hd,),
              "k_norm": (hd,), "mlp_norm": (d,), "w_gate": (c.intermediate_size, d),
              "w_up": (c.intermediate_size, d), "w_down": (d, c.intermediate_size)}
    for i in range(spec.num_layers):
        shapes |= {f"layers.{i}.{_LAYER[k]}": s for k, s in lshape.items()}
        if version == 2:
            kc, gc = spec.conv_kernel_size, d // spec.conv_group_size
            for ref in _CONVS.values():
                shapes[f"layers.{i}.{ref}.base_kernel"] = (2, kc, d)
                shapes[f"layers.{i}.{ref}.kernel_projection.weight"] = (2 * kc * gc, d)
    if version == 2:
        for k in ("pred", "succ"):  # either spelling: with or without ".weight"
            if _SELECTOR[k] + ".weight" in got:
                got[_SELECTOR[k]] = got.pop(_SELECTOR[k] + ".weight")
        r = spec.selector_rank
        shapes |= {_SELECTOR["pred"]: (c.vocab_size, r), _SELECTOR["succ"]: (c.vocab_size, r),
                   _SELECTOR["proj"]: (r, d)}
    T.check_names(where, got, shapes, optional=("rotary_emb.inv_freq",))
    for name, shape in shapes.items():
        T.check_tensor(where, name, got[name], shape)
    a = lambda name: jnp.asarray(np.asarray(got[name], np.float32))  # noqa: E731
    layers = []
    for i in range(spec.num_layers):
        lp = {k: a(f"layers.{i}.{ref}") for k, ref in _LAYER.items()}
        if version == 2:
            for k, ref in _CONVS.items():
                lp[k] = {"base": a(f"layers.{i}.{ref}.base_kernel"),
                         "proj": a(f"layers.{i}.{ref}.kernel_projection.weight")}
        layers.append(lp)
    dparams = {"fc": a("fc.weight"), "hidden_norm": a("hidden_norm.weight"),
               "norm": a("norm.weight"), "layers": tuple(layers)}
    if version == 2:
        dparams["selector"] = {k: a(ref) for k, ref in _SELECTOR.items()}
    return DFlashDrafter(spec, target.vocab_size), dparams


def to_config(spec: net.DFlashSpec, num_target_layers: int) -> dict:
    """config.json for `spec` (the authors' fields; a Qwen3 config underneath)."""
    c = spec.layer
    sliding = any(w is not None for w in spec.windows)
    dc = {"target_layer_ids": list(spec.target_layer_ids), "block_size": spec.block_size,
          "mask_token_id": spec.mask_token_id}
    if spec.input_embedding_scale != 1.0:
        dc["input_embedding_scale"] = spec.input_embedding_scale
    if spec.output_multiplier != 1.0:
        dc["output_multiplier"] = spec.output_multiplier
    if spec.final_logit_softcapping:
        dc["final_logit_softcapping"] = spec.final_logit_softcapping
    if spec.version == 2:
        dc |= {"conv_kernel_size": spec.conv_kernel_size, "conv_group_size": spec.conv_group_size,
               "selector_rank": spec.selector_rank, "selector_top_k": spec.selector_top_k}
    out = {
        "architectures": ["DFlashDraftModel" if spec.version == 1 else "DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": num_target_layers,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in spec.windows],
        "dflash_config": dc,
        "torch_dtype": "float32",
    }
    if c.rope_scaling is not None:
        s = c.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "rope_theta": c.rope_theta,
                               "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings":
                                   s.original_max_position_embeddings}
    if sliding:
        out["sliding_window"] = next(w for w in spec.windows if w)
        out["use_sliding_window"] = True
    # the reference derives causality from the layer type unless is_causal says
    if any(cz != (w is not None) for cz, w in zip(spec.causal, spec.windows)):
        if len(set(spec.causal)) != 1:
            raise JaxspecError("this DFlash head's per-layer causality has no config.json spelling")
        out["is_causal"] = spec.causal[0]
    return out


def write(path, drafter: DFlashDrafter, dparams, num_target_layers: int) -> Path:
    """The head in the authors' layout at `path` (config.json + model.safetensors)."""
    path = Path(path)
    spec = drafter.spec
    f = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out = {"fc.weight": f(dparams["fc"]), "hidden_norm.weight": f(dparams["hidden_norm"]),
           "norm.weight": f(dparams["norm"])}
    for i, lp in enumerate(dparams["layers"]):
        out |= {f"layers.{i}.{ref}": f(lp[k]) for k, ref in _LAYER.items()}
        if spec.version == 2:
            for k, ref in _CONVS.items():
                out[f"layers.{i}.{ref}.base_kernel"] = f(lp[k]["base"])
                out[f"layers.{i}.{ref}.kernel_projection.weight"] = f(lp[k]["proj"])
    if spec.version == 2:
        out |= {ref: f(dparams["selector"][k]) for k, ref in _SELECTOR.items()}
    T.write_safetensors(path, out)
    T.write_config(path, to_config(spec, num_target_layers))
    return path
