"""Qwen3-MoE (Qwen3-30B-A3B and kin): Qwen3's attention layer (q/k norms, grouped kv heads, no
biases) with a routed mixture of experts (`models/moe.py`) in place of the gated MLP on its
sparse layers: softmax top-k routing per token, `norm_topk_prob` renorming the k weights, no
shared expert. Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a
dense gated MLP of `intermediate_size`.

The attention half is the Llama family's (`models/llama.py` runs the layer loop, every cache
layout, trees, the paged pool and the CPU attention kernel of the packed layout); this module
hands it the MLP block (`llama.forward(..., mlp=...)`). Params, per layer:

    Llama's attention leaves (attn_norm, wq, wk, wv, wo, q_norm, k_norm, mlp_norm), then
    sparse layers:  {"router": [E, D], "we_gate": [E, F, D], "we_up": [E, F, D],
                     "we_down": [E, D, F]}      (F = moe_intermediate_size)
    dense layers:   {"w_gate", "w_up", "w_down"} as Llama's

This module is Qwen3-MoE's one home: config reader (a dict in), tensor-name map, the per-expert
tensors stacked on load (`stack_experts`), the target and its `register_family` call.
`loading/family_files.py` opens the files (the HF layout registered below).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.models import base, blocks, llama, moe, registry
from jaxspec.models.decoder import ModelConfig, linear, param_tree_axes, stack_layers

Params = dict[str, Any]

ROUTING = "softmax top-k routing per token (norm_topk_prob true or false), no shared experts"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig(ModelConfig):
    """A Qwen3 layer stack whose `moe_layers` run routed experts. Hashable (a jit static)."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")

    def is_moe(self, i: int) -> bool:
        return self.moe_layers[i]


# ------------------------------------------------------------------------------------ params


def _layer_shapes(cfg: MoeConfig, i: int) -> dict[str, tuple[int, ...]]:
    dense = llama.param_shapes(dataclasses.replace(cfg, num_layers=1))["layers"][0]
    if not cfg.is_moe(i):
        return dense
    attn = {k: v for k, v in dense.items() if k not in ("w_gate", "w_up", "w_down")}
    return attn | moe.layer_shapes(cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)


def param_shapes(cfg: MoeConfig) -> Params:
    shapes: Params = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "final_norm": (cfg.hidden_size,),
        "layers": tuple(_layer_shapes(cfg, i) for i in range(cfg.num_layers)),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def param_axes(cfg: MoeConfig, *, stacked: bool = False) -> Params:
    dense = llama.param_axes(dataclasses.replace(cfg, num_layers=1))["layers"][0]
    if stacked:  # one layer kind for all (refused otherwise when stacking)
        layer = _layer_axes(dense, cfg.is_moe(0))
        return param_tree_axes(layer, cfg, stacked=True, tied=cfg.tie_word_embeddings)
    axes = param_tree_axes({}, cfg, stacked=False, tied=cfg.tie_word_embeddings)
    axes["layers"] = tuple(_layer_axes(dense, cfg.is_moe(i)) for i in range(cfg.num_layers))
    return axes


def _layer_axes(dense: dict, sparse: bool) -> dict:
    if not sparse:
        return dict(dense)
    return {k: v for k, v in dense.items() if k not in ("w_gate", "w_up", "w_down")} | moe.LAYER_AXES


def init_params(cfg: MoeConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random params (tests): matrices N(0, scale), norms one."""
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    leaves, treedef = jax.tree.flatten(param_shapes(cfg), is_leaf=is_shape)
    keys = jax.random.split(key, len(leaves))
    out = [jnp.ones(s, cfg.compute_dtype) if len(s) == 1
           else (scale * jax.random.normal(k, s)).astype(cfg.compute_dtype)
           for s, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


def check_stackable(cfg: MoeConfig, source: str) -> None:
    """The stacked layout scans one layer kind: refuse a dense/sparse mix in one line."""
    if len(set(cfg.moe_layers)) > 1:
        raise JaxspecError(
            f"{source}: layers mix dense MLPs (mlp_only_layers / decoder_sparse_step) and experts, "
            f"which the stacked layout cannot scan: load with layout 'unrolled' or 'auto'"
        )


# ----------------------------------------------------------------------------------- forward


def mlp_block(cfg: MoeConfig):
    """The MLP half of a layer, `(lp, y [B, T, D]) -> [B, T, D]`: routed experts where the layer
    has a router, else the gated MLP (its packed CPU-kernel panels included)."""

    def run(lp: Params, y: jax.Array) -> jax.Array:
        if "router" in lp:
            return moe.moe_block(lp, y, top_k=cfg.top_k, norm_topk=cfg.norm_topk_prob)
        if "w_gate_up" in lp:
            gate, up = jnp.split(linear(y, lp["w_gate_up"]), 2, axis=-1)
        else:
            gate, up = linear(y, lp["w_gate"]), linear(y, lp["w_up"])
        return linear(blocks.swiglu(gate, up), lp["w_down"])

    return run


@dataclasses.dataclass(frozen=True)
class MoeTarget(llama.LlamaTarget):
    """Qwen3-MoE as a `models.base.Target`: the Llama target's attention, cache, commit, head and
    traits, with routed experts in the MLP half. `layer_weights` is withheld (its layers have no
    Llama-named MLP for a trained head to start from)."""

    cfg: MoeConfig
    name: str = "qwen3_moe"
    layer_weights = None  # trait absent (models/base.py)

    def forward(self, params, tokens, cache, *, positions=None, window_mask=None,
                write_cache=True, taps=()):
        out = llama.forward(params, tokens, cache, self.cfg, tuple(taps), write_cache, positions,
                            window_mask, mlp=mlp_block(self.cfg))
        return base.TargetOutput(out.hidden, out.layer_hidden, out.window_kv, out.cache)

    def init_params(self, key: jax.Array, layout: str = "unrolled") -> Params:
        params = init_params(self.cfg, key)
        if layout == "stacked":
            check_stackable(self.cfg, "init_params")
            return stack_layers(params)
        return params

    def param_axes(self, params: Params) -> Params:
        return param_axes(self.cfg, stacked=isinstance(params["layers"], dict))

    def prefix(self, num_layers: int) -> MoeTarget:
        out = super().prefix(num_layers)
        return dataclasses.replace(out, cfg=dataclasses.replace(
            out.cfg, moe_layers=self.cfg.moe_layers[:num_layers]))

    def experts_woken(self, tokens: int) -> float:
        """Expected distinct experts one sparse layer runs for `tokens` routed tokens."""
        return moe.experts_woken(tokens, self.cfg.top_k, self.cfg.num_experts)


# ------------------------------------------------------------------------------ config, names

_UNSUPPORTED_ROUTING = {  # config keys of routings jaxspec does not implement, and their neutral value
    "shared_expert_intermediate_size": 0, "n_shared_experts": 0, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0,
}


def qwen3_moe_config_from_hf(hf: dict, *, dtype: str, source: str) -> MoeConfig:
    """config.json of a qwen3_moe checkpoint, every field checked; a routing this module does not
    implement is refused in one line (before any tensor is read)."""
    f = validate.Fields(hf, source)
    for key, neutral in _UNSUPPORTED_ROUTING.items():
        if hf.get(key) not in (None, neutral):
            raise JaxspecError(
                f"{source}: {key}={validate.short(hf[key])} is a routing jaxspec does not "
                f"implement: Qwen3-MoE supports {ROUTING}"
            )
    scoring = f.str("scoring_func", "softmax")
    if scoring != "softmax":
        raise JaxspecError(f"{source}: scoring_func={scoring!r} is not supported: Qwen3-MoE "
                           f"supports {ROUTING}")
    if f.bool("use_sliding_window", False):
        raise JaxspecError(f"{source}: use_sliding_window=true is not supported on qwen3_moe")
    base_cfg = _attention_config(hf, f, dtype=dtype, source=source)
    e = f.int("num_experts", None, lo=1, hi=1 << 16) if f.given("num_experts") else \
        f.int("num_local_experts", lo=1, hi=1 << 16)
    top_k = f.int("num_experts_per_tok", lo=1, hi=e)
    step = f.int("decoder_sparse_step", 1, lo=1, hi=validate.MAX_LAYERS)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        f.fail("mlp_only_layers", only, "use a list of layer indices")
    n = base_cfg.num_layers
    return MoeConfig(
        **{k.name: getattr(base_cfg, k.name) for k in dataclasses.fields(ModelConfig)},
        num_experts=e, top_k=top_k,
        moe_intermediate_size=f.int("moe_intermediate_size", lo=1, hi=validate.MAX_DIM),
        norm_topk_prob=f.bool("norm_topk_prob", False),
        moe_layers=tuple(i not in only and (i + 1) % step == 0 for i in range(n)),
    )


def _attention_config(hf: dict, f: validate.Fields, *, dtype: str, source: str) -> ModelConfig:
    """Qwen3's attention stack (q/k norms, no biases, plain RoPE) from config.json."""
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise JaxspecError(f"{source}: hidden_act={act!r} is not supported (silu)")
    if f.bool("attention_bias", False):
        raise JaxspecError(f"{source}: attention_bias=true is not supported on qwen3_moe")
    given = f.given("rope_parameters")
    rope = f.dict("rope_parameters", None) if given else f.dict("rope_scaling", {})
    rf = validate.Fields(rope, source, "rope_parameters." if given else "rope_scaling.")
    kind = rf.str("rope_type", None) if rf.given("rope_type") else rf.str("type", "default")
    if kind != "default":
        raise JaxspecError(f"{source}: rope scaling {validate.short(kind)} is not supported on "
                           f"qwen3_moe (only 'default')")
    theta = rf.float("rope_theta", None) if rf.given("rope_theta") else f.float("rope_theta", 1e6)
    if not theta > 0.0:
        f.fail("rope_theta", theta, "use a finite number > 0")
    return ModelConfig(
        vocab_size=f.int("vocab_size", lo=1, hi=validate.MAX_DIM), **validate.decoder_dims(f),
        rope_theta=theta, rms_norm_eps=f.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings=f.bool("tie_word_embeddings", False), qk_norm=True,
        max_position_embeddings=f.int("max_position_embeddings", 2048, lo=1, hi=(1 << 31) - 1),
        dtype=dtype)


HF_ATTENTION_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down", "mlp.gate.weight": "router",
}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = {"mlp.experts.gate_up_proj": "we_gate_up", "mlp.experts.down_proj": "we_down"}


def our_layer_name(rest: str) -> str | None:
    """A layer tensor's HF name (after `layers.i.`) -> ours: `we_gate.7` for expert 7's gate
    (stacked by `stack_experts`), the fused [E, ...] layout too; None: unknown."""
    if rest in HF_ATTENTION_NAMES:
        return HF_ATTENTION_NAMES[rest]
    m = _EXPERT.fullmatch(rest)
    if m:
        return f"we_{m.group(2)}.{m.group(1)}"
    return _FUSED.get(rest)


def stack_experts(flat: dict, cfg: MoeConfig, source: str) -> dict:
    """`layers.i.we_gate.j` per-expert tensors -> `layers.i.we_gate` [E, F, D] (and up, down);
    a fused gate_up [E, 2F, D] split (`moe.stack_expert_tensors`). Every expert must be present."""
    return moe.stack_expert_tensors(flat, cfg.num_experts, cfg.moe_intermediate_size, source)


# llama.cpp's names (`blk.<i>.` + this) -> our leaves; its experts are stored stacked [E, ...]
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_output.weight": "wo", "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm", "ffn_norm.weight": "mlp_norm",
    "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "we_gate",
    "ffn_up_exps.weight": "we_up", "ffn_down_exps.weight": "we_down",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}


def gguf_fields(header, source: str, experts: bool):
    """(validate.Fields over `<arch>.` keys, decoder dims, vocabulary rows, tensor names) of a
    GGUF header; with experts, a missing `feed_forward_length` (no dense layer) reads the
    expert width."""
    arch = str(header.fields["general.architecture"].value)

    def raw(key):
        field = header.fields.get(f"{arch}.{key}")
        if field is None and key == "feed_forward_length" and experts:  # no dense layer: unused
            field = header.fields.get(f"{arch}.expert_feed_forward_length")
        return validate.MISSING if field is None else field.contents()

    f = validate.Fields(raw, source, f"{arch}.")
    embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise JaxspecError(f"{source} has no token_embd.weight: the file is incomplete")
    return (f, validate.decoder_dims(f, gguf=True), int(embed.shape[0]),
            {t.name for t in header.tensors})


def qwen3_moe_config_from_gguf(header, *, dtype: str, source: str) -> MoeConfig:
    """llama.cpp's `qwen3moe` metadata (the k expert weights renormed, as its graph does);
    a layer is sparse where the file holds its router (`ffn_gate_inp`)."""
    f, dims, vocab, names = gguf_fields(header, source, experts=True)
    experts = f.int("expert_count", lo=1, hi=1 << 16)
    return MoeConfig(
        vocab_size=vocab, **dims,
        rope_theta=f.float("rope.freq_base", 1e6, lo=0.0, lo_open=True),
        rms_norm_eps=f.float("attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0,
                             lo_open=True),
        tie_word_embeddings="output.weight" not in names, qk_norm=True,
        max_position_embeddings=f.int("context_length", 2048, lo=1, hi=(1 << 31) - 1),
        dtype=dtype, num_experts=experts, top_k=f.int("expert_used_count", lo=1, hi=experts),
        moe_intermediate_size=f.int("expert_feed_forward_length", lo=1, hi=validate.MAX_DIM),
        norm_topk_prob=True,
        moe_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in names
                         for i in range(dims["num_layers"])))


def check_layout(cfg: MoeConfig, layout: str, note: str, source: str, mesh=None):
    """(layout, why): stacked only when every layer has experts; packed keeps experts as arrays."""
    if layout == "stacked":
        check_stackable(cfg, source)
    if layout == "packed":  # the CPU kernels pack attention and dense MLPs; experts stay arrays
        note += " (experts as XLA arrays)"
    return layout, note


def _target_from_hf(hf: dict, *, dtype: str, source: str) -> MoeTarget:
    return MoeTarget(qwen3_moe_config_from_hf(hf, dtype=dtype, source=source))


def _target_from_gguf(header, *, dtype: str, source: str) -> MoeTarget:
    return MoeTarget(qwen3_moe_config_from_gguf(header, dtype=dtype, source=source))


registry.register_family(registry.Family(
    "qwen3_moe", ("qwen3_moe",), ("qwen3moe",), _target_from_hf, _target_from_gguf,
    hf=registry.FileLayout(
        config=qwen3_moe_config_from_hf,
        tensor_name=lambda n: registry.hf_tensor_name(n, our_layer_name),
        param_shapes=param_shapes, target=lambda cfg, arch: MoeTarget(cfg, name=arch),
        convert=stack_experts, layout=check_layout, architecture=lambda cfg: "qwen3_moe"),
    gguf=registry.FileLayout(
        config=qwen3_moe_config_from_gguf,
        tensor_name=lambda n: registry.gguf_tensor_name(n, GGUF_LAYER_NAMES),
        param_shapes=param_shapes, target=lambda cfg, arch: MoeTarget(cfg, name=arch),
        layout=check_layout, architecture=lambda cfg: "qwen3_moe")))
