"""DSpark heads in the speculators 0.9.0 layout (`speculators.models.dspark`, what vLLM loads):
config.json (`speculators_model_type: "dspark"`, `transformer_layer_config` = the draft layers'
HF config, block_size, aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor,
markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov,
speculators_config) and model.safetensors (the DFlash backbone's names, markov_head.*,
confidence_head.proj.*; the target's embedding and LM head are not stored).

    drafter, dparams = read(path, target)          # checked against the target, one-line errors
    write(path, drafter, dparams)                  # loadable by DSparkDraftModel.from_pretrained

Not read (one-line refusals): a reduced draft vocabulary (draft_vocab_size < vocab_size), sliding
draft layers, target_hidden_size other than the target's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec import validate
from jaxspec.drafters import dflash_forward as net
from jaxspec.drafters import dspark_heads as hd
from jaxspec.drafters.dspark import DSparkDrafter
from jaxspec.errors import JaxspecError
from jaxspec.formats import tensors as T
from jaxspec.formats.dflash import _LAYER
from jaxspec.formats.eagle3 import layer_config

KNOWN_TYPES = ("eagle3", "dspark", "peagle")  # speculators_model_type values jaxspec reads
_MARKOV = {"w1": "markov_head.markov_w1.weight", "w2": "markov_head.markov_w2.weight",
           "gate_w": "markov_head.gate_proj.weight", "gate_b": "markov_head.gate_proj.bias",
           "joint_w": "markov_head.joint_proj.weight", "joint_b": "markov_head.joint_proj.bias"}
_CONF = {"w": "confidence_head.proj.weight", "b": "confidence_head.proj.bias"}
_IGNORED = ("rotary_emb.inv_freq", "embed_tokens.weight", "lm_head.weight",
            "verifier_lm_head.weight", "verifier_norm.weight")


def detect(config: dict) -> str | None:
    """'dspark' for its layout; a one-line refusal for a speculators type jaxspec does not read."""
    kind = config.get("speculators_model_type")
    if kind == "dspark":
        return "dspark"
    if kind is not None and kind not in KNOWN_TYPES:
        raise JaxspecError(
            f"speculators checkpoint of type {kind!r} is not supported: jaxspec reads "
            f"speculators types {', '.join(KNOWN_TYPES)}"
        )
    return None


def read_spec(config: dict, where: str) -> tuple[net.DFlashSpec, hd.HeadSpec]:
    """(backbone spec, heads spec) from config.json, every field checked."""
    f = validate.Fields(config, f"{where}/config.json")
    lc = f.dict("transformer_layer_config", None)
    if lc is None:
        raise JaxspecError(f"{where}: speculators config.json lacks transformer_layer_config")
    n_layers = validate.Fields(lc, f"{where}/config.json").int(
        "num_hidden_layers", lo=1, hi=validate.MAX_LAYERS)
    cfg = dataclasses.replace(layer_config(lc, where), num_layers=n_layers, qk_norm=True)
    if any(t != "full_attention" for t in lc.get("layer_types") or []):
        raise JaxspecError(f"{where}: sliding draft layers are not supported for dspark: use a "
                           f"head whose layer_types are all full_attention")
    vocab = f.int("draft_vocab_size", cfg.vocab_size, lo=1, hi=validate.MAX_DIM)
    if vocab != cfg.vocab_size:
        raise JaxspecError(f"{where}: draft_vocab_size {vocab} < vocab_size {cfg.vocab_size} "
                           f"(a reduced draft vocabulary) is not supported: use a full-vocab head")
    ths = config.get("target_hidden_size")
    if ths is not None and ths != cfg.hidden_size:
        raise JaxspecError(f"{where}: target_hidden_size {ths} differs from the draft's hidden "
                           f"size {cfg.hidden_size}: not supported")
    ids = config.get("aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and ids and all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise JaxspecError(f"{where}: aux_hidden_state_layer_ids must be a list of layer ids")
    mask = config.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < cfg.vocab_size:
        raise JaxspecError(f"{where}: mask_token_id={mask!r} must be a token id below "
                           f"vocab_size {cfg.vocab_size}")
    rank = f.int("markov_rank", 256, lo=0, hi=validate.MAX_DIM)
    kind = f.str("markov_head_type", "vanilla")
    if kind not in hd.MARKOV_TYPES:
        raise JaxspecError(f"{where}: markov_head_type={kind!r} is unknown: use one of "
                           f"{', '.join(hd.MARKOV_TYPES)}")
    heads = hd.HeadSpec(markov_rank=rank, markov_type=kind,
                        confidence=f.bool("enable_confidence_head", True),
                        confidence_with_markov=f.bool("confidence_head_with_markov", True),
                        sample_from_anchor=f.bool("sample_from_anchor", True))
    if heads.confidence and heads.confidence_with_markov and rank == 0:
        raise JaxspecError(f"{where}: confidence_head_with_markov needs markov_rank > 0")
    spec = net.DFlashSpec(layer=cfg, num_layers=n_layers, target_layer_ids=tuple(ids),
                          block_size=f.int("block_size", 8, lo=1, hi=1024), mask_token_id=mask,
                          causal=(False,) * n_layers, windows=(None,) * n_layers)
    if spec.block_size < 2 and not heads.sample_from_anchor:
        raise JaxspecError(f"{where}: block_size 1 drafts nothing without sample_from_anchor")
    return spec, heads


def check_target(spec: net.DFlashSpec, target, where: str) -> None:
    """Refuse a head that does not fit the target (models.base.Target), naming the mismatch."""
    if spec.layer.hidden_size != target.hidden_size:
        raise JaxspecError(f"{where}: the DSpark head's hidden size is {spec.layer.hidden_size}, "
                           f"the target's {target.hidden_size}: use a head trained for this model")
    if spec.layer.vocab_size != target.vocab_size:
        raise JaxspecError(f"{where}: the DSpark head is for a vocabulary of "
                           f"{spec.layer.vocab_size} tokens, the target has {target.vocab_size}: "
                           f"use a head trained for this model's tokenizer")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < target.num_layers]
    if bad or len(set(spec.target_layer_ids)) != len(spec.target_layer_ids):
        raise JaxspecError(f"{where}: aux_hidden_state_layer_ids {list(spec.target_layer_ids)} "
                           f"must be distinct layer inputs 0..{target.num_layers - 1} of this "
                           f"target: use a head for this model")


def _shapes(spec: net.DFlashSpec, heads: hd.HeadSpec) -> dict:
    c = spec.layer
    d, hd_, v, r = c.hidden_size, c.head_dim, c.vocab_size, heads.markov_rank
    shapes = {"fc.weight": (d, len(spec.target_layer_ids) * d), "hidden_norm.weight": (d,),
              "norm.weight": (d,)}
    lshape = {"attn_norm": (d,), "wq": (c.num_heads * hd_, d), "wk": (c.num_kv_heads * hd_, d),
              "wv": (c.num_kv_heads * hd_, d), "wo": (d, c.num_heads * hd_), "q_norm": (hd_,),
              "k_norm": (hd_,), "mlp_norm": (d,), "w_gate": (c.intermediate_size, d),
              "w_up": (c.intermediate_size, d), "w_down": (d, c.intermediate_size)}
    for i in range(spec.num_layers):
        shapes |= {f"layers.{i}.{_LAYER[k]}": s for k, s in lshape.items()}
    if r:
        shapes |= {_MARKOV["w1"]: (v, r), _MARKOV["w2"]: (v, r)}
        if heads.markov_type == "gated":
            shapes |= {_MARKOV["gate_w"]: (r, d + r), _MARKOV["gate_b"]: (r,)}
        if heads.markov_type == "rnn":
            shapes |= {_MARKOV["joint_w"]: (3 * r, 2 * r + d), _MARKOV["joint_b"]: (3 * r,)}
    if heads.confidence:
        shapes |= {_CONF["w"]: (1, d + (r if heads.confidence_with_markov else 0)),
                   _CONF["b"]: (1,)}
    return shapes


def read(path, target) -> tuple[DSparkDrafter, dict]:
    """(drafter, dparams) from a speculators-layout directory; target: the models.base.Target."""
    path = Path(path)
    where = str(path)
    spec, heads = read_spec(T.read_config(path), where)
    check_target(spec, target, where)
    got = T.read_tensors(path)
    shapes = _shapes(spec, heads)
    T.check_names(where, got, shapes, optional=_IGNORED)
    for name, shape in shapes.items():
        T.check_tensor(where, name, got[name], shape)
    a = lambda name: jnp.asarray(np.asarray(got[name], np.float32))  # noqa: E731
    layers = tuple({k: a(f"layers.{i}.{ref}") for k, ref in _LAYER.items()}
                   for i in range(spec.num_layers))
    dparams = {"fc": a("fc.weight"), "hidden_norm": a("hidden_norm.weight"),
               "norm": a("norm.weight"), "layers": layers}
    if heads.markov_rank:
        dparams["markov"] = {k: a(ref) for k, ref in _MARKOV.items() if ref in shapes}
    if heads.confidence:
        dparams["confidence"] = {k: a(ref) for k, ref in _CONF.items()}
    return DSparkDrafter(spec, target.vocab_size, heads=heads), dparams


def to_config(spec: net.DFlashSpec, heads: hd.HeadSpec) -> dict:
    """config.json for the head (the reference's fields; a Qwen3 config for the layers)."""
    c = spec.layer
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    layer = {"model_type": "qwen3", "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_hidden_layers": spec.num_layers,
             "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
             "head_dim": c.head_dim, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
             "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
             "attention_bias": False, "tie_word_embeddings": False, "rope_parameters": rope,
             "layer_types": ["full_attention"] * spec.num_layers}
    drafts = spec.block_size - (0 if heads.sample_from_anchor else 1)
    return {
        "architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark",
        "speculators_version": "0.9.0", "transformer_layer_config": layer,
        "draft_vocab_size": c.vocab_size, "block_size": spec.block_size,
        "target_hidden_size": None, "aux_hidden_state_layer_ids": list(spec.target_layer_ids),
        "mask_token_id": spec.mask_token_id, "sliding_window_non_causal": False,
        "sample_from_anchor": heads.sample_from_anchor, "markov_rank": heads.markov_rank,
        "markov_head_type": heads.markov_type, "enable_confidence_head": heads.confidence,
        "confidence_head_with_markov": heads.confidence_with_markov,
        "tie_word_embeddings": False, "dtype": "float32",
        "speculators_config": {
            "algorithm": "dspark", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": None, "architectures": []}},
    }


def write(path, drafter: DSparkDrafter, dparams) -> Path:
    """The head in the speculators layout at `path` (config.json + model.safetensors)."""
    path = Path(path)
    f = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out = {"fc.weight": f(dparams["fc"]), "hidden_norm.weight": f(dparams["hidden_norm"]),
           "norm.weight": f(dparams["norm"])}
    for i, lp in enumerate(dparams["layers"]):
        out |= {f"layers.{i}.{ref}": f(lp[k]) for k, ref in _LAYER.items()}
    out |= {_MARKOV[k]: f(w) for k, w in dparams.get("markov", {}).items()}
    out |= {_CONF[k]: f(w) for k, w in dparams.get("confidence", {}).items()}
    T.write_safetensors(path, out)
    T.write_config(path, to_config(drafter.spec, drafter.heads))
    return path
