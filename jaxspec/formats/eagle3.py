"""EAGLE-3 draft heads in the two published layouts, both read and written:

  eagle3       the original / SpecForge layout: config.json with `architectures:
               ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, optional
               `eagle_config.eagle_aux_hidden_state_layer_ids`, `norm_before_residual`; tensors
               `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optional
               `embed_tokens.weight`.
  speculators  vLLM's `speculators` layout: `speculators_model_type: "eagle3"`,
               `transformer_layer_config`, `speculators_config`, top-level
               `eagle_aux_hidden_state_layer_ids`; tensors under `layers.0.*`, optional
               `input_norm.weight` (norm_before_fc) and `fc.bias` (older exports).

`d2t` is stored as offsets (target id = i + d2t[i]) and `t2d` as a bool mask over the target
vocabulary; jaxspec keeps absolute ids. Tapped layers: ids in a checkpoint are read as vLLM reads
them (id i = the input of target layer i = HF `hidden_states[i]`, jaxspec's `hidden_layers`);
without ids both vLLM and SGLang tap the inputs of layers 2, L//2, L-3. SGLang reads explicit ids
as layer OUTPUTS (it taps `hidden_states[i + 1]`), and SpecForge-trained heads name them so:
`speculative.eagle.eagle3_layer_ids: output` (or speculative.eagle3.) reads them that way (default `input`, vLLM's reading).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.draft_vocab import check_d2t
from jaxspec.drafters.eagle3 import Eagle3Drafter, default_layers
from jaxspec import validate
from jaxspec.errors import JaxspecError, short
from jaxspec.formats import tensors as T
from jaxspec.models.decoder import ModelConfig, RopeScaling

LAYOUTS = ("eagle3", "speculators")
PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}
LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "hidden_norm.weight": "hidden_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
TOP_NAMES = {
    "fc.weight": "fc",
    "fc.bias": "fc_bias",
    "input_norm.weight": "input_norm",
    "embed_tokens.weight": "embed",
    "norm.weight": "norm",
    "lm_head.weight": "lm_head",
}
IGNORED = ("verifier_norm.weight", "verifier_lm_head.weight")  # speculators training buffers


@dataclasses.dataclass(frozen=True)
class Eagle3Head:
    """A layout-free EAGLE-3 head: the layer config, flags and numpy params (jaxspec names)."""

    cfg: ModelConfig  # the drafter layer; vocab_size = the TARGET vocabulary, num_layers = 1
    draft_vocab: int
    target_hidden: int
    layer_ids: tuple[int, ...] | None  # None: the default low/mid/high for the target
    norm_before_residual: bool
    norm_before_fc: bool
    params: dict  # fc, [fc_bias], [input_norm], [embed], layer{...}, norm, lm_head, d2t (absolute)
    extra: dict = dataclasses.field(default_factory=dict, compare=False)  # verifier info


def detect(config: dict) -> str | None:
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    archs = config.get("architectures") or []
    if any("Eagle3" in a for a in archs) and "speculators_model_type" not in config:
        return "eagle3"
    return None


def _rope(f: validate.Fields, lc: dict, where) -> tuple[float, RopeScaling | None]:
    key = "rope_parameters" if f.given("rope_parameters") else "rope_scaling"
    rope = f.dict(key, {})
    rf = validate.Fields(rope, f.source, f"{key}.")
    theta = rf.float("rope_theta", None) if rf.given("rope_theta") else f.float("rope_theta", 10000.0)
    if not theta > 0:
        f.fail("rope_theta", theta, "use a finite number > 0")
    kind = rf.str("rope_type", None) if rf.given("rope_type") else rf.str("type", "default")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise JaxspecError(f"{where}: rope scaling {short(kind)} is not supported (default or llama3)")
    return theta, RopeScaling(
        factor=rf.float("factor", lo=0.0, lo_open=True),
        low_freq_factor=rf.float("low_freq_factor", 1.0, lo=0.0, lo_open=True),
        high_freq_factor=rf.float("high_freq_factor", 4.0, lo=0.0, lo_open=True),
        original_max_position_embeddings=rf.int("original_max_position_embeddings", 8192, lo=1),
    )


def layer_config(lc: dict, where) -> ModelConfig:
    """The decoder layer's config, every field type- and range-checked (`jaxspec.validate`)."""
    f = validate.Fields(lc, f"{where}/config.json")
    dim = dict(lo=1, hi=validate.MAX_DIM)
    h, heads, kv, head_dim = validate.attention_dims(f)
    theta, scaling = _rope(f, lc, where)
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise JaxspecError(f"{where}: hidden_act={short(act)} is not supported (silu)")
    if f.bool("attention_bias", False) or f.bool("mlp_bias", False):
        raise JaxspecError(f"{where}: attention/mlp biases are not supported in EAGLE-3 heads")
    return ModelConfig(
        vocab_size=f.int("vocab_size", **dim),
        hidden_size=h,
        intermediate_size=f.int("intermediate_size", **dim),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
        max_position_embeddings=f.int("max_position_embeddings", 2048, lo=1, hi=(1 << 31) - 1),
        dtype="float32",
    )


def _layout_config(config: dict, layout: str, where: str):
    """(layer config, aux layer ids, norm_before_residual, extra) as `layout` stores them."""
    fields = validate.Fields(config, f"{where}/config.json")
    if layout == "speculators":
        lc = config.get("transformer_layer_config")
        if not isinstance(lc, dict):
            raise JaxspecError(f"{where}: speculators config.json lacks transformer_layer_config")
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        nbr = fields.bool("norm_before_residual", True)  # (vLLM's default when absent)
        return lc, ids, nbr, {"speculators_config": config.get("speculators_config")}
    eagle_cfg = fields.dict("eagle_config", {})
    ids = eagle_cfg.get(
        "eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")
    )
    return config, ids, fields.bool("norm_before_residual", False), {}


def _layer_ids(ids, where: str) -> tuple[int, ...] | None:
    """The three tapped target layers, checked (None: the default taps)."""
    if ids is None:
        return None
    ok = isinstance(ids, list) and len(ids) == 3 and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < validate.MAX_LAYERS
        for i in ids
    )
    if not ok:
        raise JaxspecError(
            f"{where}: eagle_aux_hidden_state_layer_ids must be 3 layer indices (integers "
            f">= 0, not true/false or strings), got {short(ids)}"
        )
    return tuple(ids)


def _tensor_shapes(cfg: ModelConfig, pre: str, nd: int, th: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's expected shape (hidden h, draft vocabulary nd, target hidden th)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    n, k, hd, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "fc.weight": (h, 3 * th),
        "fc.bias": (h,),
        "input_norm.weight": (3 * th,),
        "embed_tokens.weight": (v, h),
        "norm.weight": (h,),
        "lm_head.weight": (nd, h),
        pre + "input_layernorm.weight": (h,),
        pre + "hidden_norm.weight": (h,),
        pre + "self_attn.q_proj.weight": (n * hd, 2 * h),
        pre + "self_attn.k_proj.weight": (k * hd, 2 * h),
        pre + "self_attn.v_proj.weight": (k * hd, 2 * h),
        pre + "self_attn.o_proj.weight": (h, n * hd),
        pre + "post_attention_layernorm.weight": (h,),
        pre + "mlp.gate_proj.weight": (f, h),
        pre + "mlp.up_proj.weight": (f, h),
        pre + "mlp.down_proj.weight": (h, f),
        "d2t": (nd,),
        "t2d": (v,),
    }


def _params(raw: dict, pre: str, nd: int, v: int, where: str) -> dict:
    """The checked tensors as jaxspec's params; d2t as absolute target ids (the files store
    offsets), checked against t2d."""
    params: dict = {"layer": {}}
    for name, a in raw.items():
        if name.startswith(pre):
            params["layer"][LAYER_NAMES[name[len(pre) :]]] = np.asarray(a, np.float32)
        elif name in TOP_NAMES:
            params[TOP_NAMES[name]] = np.asarray(a, np.float32)
    if "d2t" in raw:
        d2t = np.arange(nd, dtype=np.int64) + raw["d2t"].astype(np.int64)
        check_d2t(d2t, v, f"{where}: d2t (target id = i + d2t[i])")
        t2d = raw["t2d"].astype(bool)
        if t2d.sum() != nd or not t2d[d2t].all():
            raise JaxspecError(
                f"{where}: t2d does not mark exactly the target ids d2t maps to: the vocabulary "
                f"maps are inconsistent (re-export them together)"
            )
        params["d2t"] = d2t.astype(np.int32)
    else:
        params["d2t"] = np.arange(nd, dtype=np.int32)
    return params


def read(path, layout: str, raw: dict | None = None) -> Eagle3Head:
    """Parse and self-check a checkpoint directory in `layout` (eagle3 | speculators). raw: its
    tensors already read, less those a derived layout took (formats/peagle.py: mask_hidden)."""
    path = Path(path)
    where = str(path)
    config = T.read_config(path)
    lc, ids, nbr, extra = _layout_config(config, layout, where)
    top = validate.Fields(config, f"{where}/config.json")
    if validate.Fields(lc, f"{where}/config.json").int("num_hidden_layers", 1) != 1:
        raise JaxspecError(
            f"{where}: num_hidden_layers={lc['num_hidden_layers']}: jaxspec reads one-layer "
            f"EAGLE-3 heads only"
        )
    cfg = layer_config(lc, where)
    h, v = cfg.hidden_size, cfg.vocab_size
    nd = top.int("draft_vocab_size", v, lo=1, hi=v)
    th = top.int("target_hidden_size", h, lo=1, hi=validate.MAX_DIM)
    nbf = top.bool("norm_before_fc", False)
    ids = _layer_ids(ids, where)

    raw = T.read_tensors(path) if raw is None else raw
    raw = {
        k.removeprefix("model."): a
        for k, a in raw.items()
        if k not in IGNORED and not k.endswith("rotary_emb.inv_freq")  # buffers old .bin files hold
    }
    pre = PREFIX[layout]
    layer_req = {pre + k for k in LAYER_NAMES}
    top_req = {"fc.weight", "norm.weight", "lm_head.weight"} | (
        {"input_norm.weight"} if nbf else set()
    )
    vocab_req = {"d2t", "t2d"} if nd != v else set()
    optional = {"fc.bias", "embed_tokens.weight"} | ({"d2t", "t2d"} if nd == v else set())
    T.check_names(where, raw, layer_req | top_req | vocab_req, optional)
    shapes = _tensor_shapes(cfg, pre, nd, th)
    kinds = {"d2t": "int", "t2d": "bool"}
    for name, a in raw.items():
        T.check_tensor(where, name, a, shapes[name], kinds.get(name, "float"))
    return Eagle3Head(cfg, nd, th, ids, nbr, nbf, _params(raw, pre, nd, v, where), extra)


LAYER_ID_CONVENTIONS = ("input", "output")


def check_target(head: Eagle3Head, target_cfg, where, layer_ids: str = "input") -> tuple[int, ...]:
    """Refuse a head built for another target; returns the tapped layers (HF hidden_states
    indices). layer_ids: how to read explicit ids -- "input" (vLLM: id i = the input of layer i)
    or "output" (SGLang / SpecForge: id i = the output of layer i, hidden_states[i + 1])."""
    if head.target_hidden != target_cfg.hidden_size:
        raise JaxspecError(
            f"{where}: the EAGLE-3 head reads target features of size {head.target_hidden}, but "
            f"the target's hidden size is {target_cfg.hidden_size}: use a head trained for this model"
        )
    if head.cfg.vocab_size != target_cfg.vocab_size:
        raise JaxspecError(
            f"{where}: the EAGLE-3 head is for a vocabulary of {head.cfg.vocab_size} tokens, the "
            f"target has {target_cfg.vocab_size}: use a head trained for this model's tokenizer"
        )
    if "embed" not in head.params and head.cfg.hidden_size != target_cfg.hidden_size:
        raise JaxspecError(
            f"{where}: no embed_tokens.weight and the head's hidden size {head.cfg.hidden_size} "
            f"differs from the target's {target_cfg.hidden_size}: add the head's embed_tokens.weight"
        )
    if layer_ids not in LAYER_ID_CONVENTIONS:
        raise JaxspecError(f"eagle3_layer_ids={layer_ids!r} is invalid: use input or output")
    shift = 1 if layer_ids == "output" and head.layer_ids is not None else 0
    ids = tuple(i + shift for i in head.layer_ids or default_layers(target_cfg.num_layers))
    bad = [i for i in ids if not 0 <= i < target_cfg.num_layers]
    if bad:
        raise JaxspecError(
            f"{where}: tapped target layer {bad[0] - shift} ({layer_ids} convention) is beyond the "
            f"target's {target_cfg.num_layers} layers: the head is for a deeper model"
        )
    return ids


def to_drafter(
    head: Eagle3Head, target_cfg, where="EAGLE-3 head", layer_ids: str = "input"
) -> tuple[Eagle3Drafter, dict]:
    ids = check_target(head, target_cfg, where, layer_ids)
    drafter = Eagle3Drafter(
        cfg=dataclasses.replace(head.cfg, vocab_size=head.draft_vocab),
        target_vocab=target_cfg.vocab_size,
        hidden_layers=ids,
        norm_before_residual=head.norm_before_residual,
        norm_before_fc=head.norm_before_fc,
    )
    p = head.params
    dparams = {k: jnp.asarray(a, jnp.float32) for k, a in p.items() if k not in ("layer", "d2t")}
    dparams["layer"] = {k: jnp.asarray(a, jnp.float32) for k, a in p["layer"].items()}
    dparams["d2t"] = jnp.asarray(p["d2t"], jnp.int32)
    return drafter, dparams


def from_params(drafter: Eagle3Drafter, dparams, target_cfg, extra=None) -> Eagle3Head:
    """An Eagle3Head from a runtime drafter (e.g. one trained with `method: eagle3`)."""
    params = {k: np.asarray(a) for k, a in dparams.items() if k != "layer"}
    params["layer"] = {k: np.asarray(a, np.float32) for k, a in dparams["layer"].items()}
    params["d2t"] = np.asarray(params["d2t"], np.int32)
    cfg = dataclasses.replace(drafter.cfg, vocab_size=target_cfg.vocab_size)
    # default taps are left out of the config: vLLM and SGLang agree on the default only
    ids = tuple(drafter.hidden_layers)
    ids = None if ids == default_layers(target_cfg.num_layers) else ids
    return Eagle3Head(
        cfg,
        int(params["lm_head"].shape[0]),
        target_cfg.hidden_size,
        ids,
        drafter.norm_before_residual,
        drafter.norm_before_fc,
        params,
        extra or {},
    )


def _layer_config(cfg: ModelConfig) -> dict:
    out = {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return out


def write(head: Eagle3Head, out, layout: str, verifier: str | None = None) -> Path:
    """Write `head` as safetensors + config.json in `layout` (eagle3 | speculators)."""
    out = Path(out)
    if "fc_bias" in head.params:
        raise JaxspecError(
            "this EAGLE-3 head has an fc bias (an older speculators export), which vLLM's and "
            "SGLang's EAGLE-3 do not have: it cannot be written exactly"
        )
    if head.norm_before_fc and layout == "eagle3":
        raise JaxspecError(
            "this EAGLE-3 head normalises its features before fc (speculators norm_before_fc), "
            "which the original layout cannot express: export with --format speculators"
        )
    pre = PREFIX[layout]
    inv_layer = {v: k for k, v in LAYER_NAMES.items()}
    inv_top = {v: k for k, v in TOP_NAMES.items()}
    tensors = {
        pre + inv_layer[k]: np.asarray(a, np.float32) for k, a in head.params["layer"].items()
    }
    for k, a in head.params.items():
        if k in inv_top:
            tensors[inv_top[k]] = np.asarray(a, np.float32)
    d2t = np.asarray(head.params["d2t"], np.int64)
    tensors["d2t"] = d2t - np.arange(len(d2t), dtype=np.int64)
    t2d = np.zeros(head.cfg.vocab_size, bool)
    t2d[d2t] = True
    tensors["t2d"] = t2d
    lc = _layer_config(head.cfg)
    common = {
        "draft_vocab_size": head.draft_vocab,
        "target_hidden_size": head.target_hidden,
        "norm_before_residual": head.norm_before_residual,
    }
    if layout == "eagle3":
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **lc,
            **common,
            "torch_dtype": "float32",
        }
        if head.layer_ids is not None:
            config["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": list(head.layer_ids),
                "use_aux_hidden_state": True,
            }
    else:
        spec = head.extra.get("speculators_config") or {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        }
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": lc,
            **common,
            "norm_before_fc": head.norm_before_fc,
            "speculators_config": spec,
        }
        if head.layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(head.layer_ids)
    T.write_safetensors(out, tensors)
    T.write_config(out, config)
    return out
