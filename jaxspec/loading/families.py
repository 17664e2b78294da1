"""Checkpoints of the non-Llama families: Gemma 2, Gemma 3 (text) and Phi-3.

    HF dirs   config.json `model_type` gemma2 | gemma3_text | gemma3 (text part of the multimodal
              config, `text_config`; its vision tower is skipped) | phi3
    GGUF      `general.architecture` gemma3 (and gemma2), read by `loading.gguf_header`

Each reader returns (config, flat tensors under our names, tokenizer, eos ids) like the Llama
readers in `loading/__init__.py`, which dispatches here by `model_type` / architecture.

Phi-3's fused projections are split on load (qkv_proj -> wq, wk, wv; gate_up_proj -> w_gate,
w_up), so Phi-3 runs as a Llama-family model (with its sliding window): every layout, the CPU
kernels (which fuse them again) and the sharding rules apply unchanged.

llama.cpp stores Gemma norm weights as (1 + w); transformers' GGUF reader subtracts the one again
(`Gemma2TensorProcessor`), and so do we. GGUF metadata does not carry Gemma 3's local RoPE base,
its local/global pattern or query_pre_attn_scalar: transformers' Gemma3TextConfig defaults
(10000, every 6th layer global, 256) fill them, as they do for transformers' own GGUF load.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.models import phi3, registry
from jaxspec.models.phi3 import phi3_config_from_hf  # re-export: Phi-3's home is models/phi3.py
from jaxspec.models.gemma import GemmaConfig, GemmaTarget

HF_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3", "phi3")
GGUF_ARCHITECTURES = ("gemma2", "gemma3")
FAMILIES = ("gemma2", "gemma3", "phi3")  # registry names of the families read here
_GEMMA3_DEFAULTS = {"rope_local_theta": 10000.0, "rope_theta": 1_000_000.0, "pattern": 6,
                    "query_pre_attn_scalar": 256}

_GEMMA_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_PHI3_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.qkv_proj.weight": "wqkv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_up_proj.weight": "w_gate_up",
    "mlp.down_proj.weight": "w_down",
}
_GLOBAL_NAMES = {"embed_tokens.weight": "embed", "norm.weight": "final_norm"}
# text-model prefixes: plain CausalLM, Gemma 3 multimodal (transformers 4.x and 5.x)
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_SKIPPED = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\..*|.*rotary_emb\.inv_freq")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}


def hf_model_type(hf: dict) -> str | None:
    """The family this loader handles for a config.json, or None (a Llama-family config)."""
    kind = hf.get("model_type")
    if kind in HF_MODEL_TYPES:
        return kind
    archs = " ".join(hf.get("architectures") or ())
    for arch, kind in (("Gemma3", "gemma3"), ("Gemma2", "gemma2"), ("Phi3", "phi3")):
        if arch in archs:
            return "gemma3_text" if kind == "gemma3" and "text_config" not in hf else kind
    return None


# ------------------------------------------------------------------------------------- configs


def gemma_config_from_hf(hf: dict, *, dtype: str, source: str) -> GemmaConfig:
    """Gemma 2 / Gemma 3 config.json (transformers 4.x keys or 5.x `rope_parameters`)."""
    kind = hf_model_type(hf)
    if kind == "gemma3":  # multimodal: the text decoder's config is nested
        hf = dict(hf.get("text_config") or {})
        kind = "gemma3_text"
    family = "gemma2" if kind == "gemma2" else "gemma3"
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise JaxspecError(f"{source}: hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
    if hf.get("attention_bias"):
        raise JaxspecError(f"{source}: attention_bias=true is not supported for {family}")
    if hf.get("use_bidirectional_attention"):
        raise JaxspecError(f"{source}: use_bidirectional_attention=true is an encoder: not supported")
    f = validate.Fields(hf, source)
    dim = dict(lo=1, hi=validate.MAX_DIM)
    n = f.int("num_hidden_layers", lo=1, hi=validate.MAX_LAYERS)
    hidden, heads, kv_heads, head_dim = validate.attention_dims(f)
    layer_types = hf.get("layer_types")
    if layer_types is None:  # the BC pattern: every `pattern`-th layer global
        pattern = f.int("sliding_window_pattern", 2 if family == "gemma2" else 6, lo=1, hi=n + 1)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        f.fail("layer_types", layer_types, "use a list of 'sliding_attention' / 'full_attention'")
    bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if bad or len(layer_types) != n:
        raise JaxspecError(f"{source}: layer_types {bad or len(layer_types)} not understood")
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    theta, local_theta, linear = _gemma_rope(hf, family, source)
    window = f.int("sliding_window", None, lo=1)
    if window is None:
        sliding = (False,) * n
    return GemmaConfig(
        family=family,
        vocab_size=f.int("vocab_size", **dim),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size", **dim),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=f.float("query_pre_attn_scalar", 256.0, lo=0.0, lo_open=True),
        sliding_window=window,
        sliding_layers=sliding,
        rope_theta=theta,
        rope_local_theta=local_theta,
        rope_linear_factor=linear,
        attn_logit_softcapping=_softcap(f, "attn_logit_softcapping", hf, 50.0 if family == "gemma2" else None),
        final_logit_softcapping=_softcap(f, "final_logit_softcapping", hf, 30.0 if family == "gemma2" else None),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings=f.bool("tie_word_embeddings", True),
        max_position_embeddings=f.int("max_position_embeddings", 8192, lo=1, hi=(1 << 31) - 1),
        dtype=dtype,
    )


def _softcap(f: validate.Fields, key: str, hf: dict, default: float | None) -> float | None:
    """A soft-capping value: absent -> the family's default, null -> off, else a number > 0."""
    if key in hf and hf[key] is None:
        return None
    return f.float(key, default, lo=0.0, lo_open=True) if default is not None or f.given(key) else None


def _gemma_rope(hf: dict, family: str, source: str) -> tuple[float, float | None, float]:
    """(global theta, local theta, global linear factor) from either config generation."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # 5.x, per layer type
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
    else:  # 4.x: rope_theta, rope_local_base_freq, rope_scaling (global layers)
        full = dict(hf.get("rope_scaling") or {}) | {"rope_theta": hf.get("rope_theta", params.get("rope_theta"))}
        local = {"rope_theta": hf.get("rope_local_base_freq")}
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise JaxspecError(f"{source}: rope_parameters / rope_scaling must be JSON objects")
    default = 10000.0 if family == "gemma2" else _GEMMA3_DEFAULTS["rope_theta"]
    positive = dict(lo=0.0, lo_open=True)
    full_f = validate.Fields(full, source, "rope (global layers).")
    theta = full_f.float("rope_theta", default, **positive)
    linear = 1.0
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        linear = full_f.float("factor", **positive)
    elif kind != "default":
        raise JaxspecError(f"{source}: rope type {kind!r} is not supported for {family} (default, linear)")
    if (local.get("rope_type") or "default") != "default":
        raise JaxspecError(f"{source}: scaled rope on sliding layers is not supported")
    if family == "gemma2":
        return theta, None, linear
    local_f = validate.Fields(local, source, "rope (sliding layers).")
    return theta, local_f.float("rope_theta", _GEMMA3_DEFAULTS["rope_local_theta"], **positive), linear


# ------------------------------------------------------------------------------------- tensors


def hf_tensors(path: Path, kind: str, cfg) -> dict[str, np.ndarray]:
    """Every text-decoder tensor under our flat names (memory-mapped); Phi-3's fused ones split."""
    from jaxspec.loading.safetensors_dir import tensor_index

    names = _PHI3_LAYER_NAMES if kind == "phi3" else _GEMMA_LAYER_NAMES
    flat: dict[str, np.ndarray] = {}
    unknown = []
    for hf_name, shard in tensor_index(path).items():
        if _SKIPPED.fullmatch(hf_name):
            continue
        ours = _our_hf_name(hf_name, names)
        if ours is None:
            unknown.append(hf_name)
            continue
        if ours == "lm_head" and cfg.tie_word_embeddings:
            continue
        flat[ours] = shard.tensor(hf_name)
    if unknown:
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise JaxspecError(
            f"{path}: unexpected tensors {', '.join(sorted(unknown)[:3])}{more}: this {kind} "
            f"variant is not supported"
        )
    return phi3.split_fused(flat, cfg) if kind == "phi3" else flat


def _our_hf_name(hf_name: str, layer_names: dict) -> str | None:
    if hf_name == "lm_head.weight":
        return "lm_head"
    for prefix in _PREFIXES:
        if not hf_name.startswith(prefix):
            continue
        rest = hf_name[len(prefix):]
        if rest in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[rest]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if m and m.group(2) in layer_names:
            return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


# ---------------------------------------------------------------------------------------- GGUF


def gemma_config_from_gguf(header, *, dtype: str, source: str) -> GemmaConfig:
    """Gemma 2 / 3 hyperparameters from GGUF metadata, gaps filled as transformers fills them."""
    arch = str(header.fields["general.architecture"].value)

    def raw(key):
        field = header.fields.get(f"{arch}.{key}")
        return validate.MISSING if field is None else field.contents()

    f = validate.Fields(raw, source, f"{arch}.")
    dim = dict(lo=1, hi=validate.MAX_DIM)

    n = f.int("block_count", lo=1, hi=validate.MAX_LAYERS)
    hidden, heads, kv_heads, head_dim = validate.attention_dims(f, validate.GGUF_ATTENTION)
    embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise JaxspecError(f"{source} has no token_embd.weight: the file is incomplete")
    pattern = 2 if arch == "gemma2" else _GEMMA3_DEFAULTS["pattern"]
    window = f.int("attention.sliding_window", 0, lo=0) or None
    sliding = tuple(bool((i + 1) % pattern) and window is not None for i in range(n))
    names = {t.name for t in header.tensors}
    return GemmaConfig(
        family=arch,
        vocab_size=int(embed.shape[0]),
        hidden_size=hidden,
        intermediate_size=f.int("feed_forward_length", **dim),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=float(_GEMMA3_DEFAULTS["query_pre_attn_scalar"]),
        sliding_window=int(window) if window else None,
        sliding_layers=sliding,
        rope_theta=f.float("rope.freq_base", 10000.0 if arch == "gemma2" else 1e6, lo=0.0, lo_open=True),
        rope_local_theta=None if arch == "gemma2" else _GEMMA3_DEFAULTS["rope_local_theta"],
        attn_logit_softcapping=(f.float("attn_logit_softcapping", 50.0, lo=0.0, lo_open=True)
                                if arch == "gemma2" else None),
        final_logit_softcapping=(f.float("final_logit_softcapping", 30.0, lo=0.0, lo_open=True)
                                 if arch == "gemma2" else None),
        rms_norm_eps=f.float("attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=f.int("context_length", 8192, lo=1, hi=(1 << 31) - 1),
        dtype=dtype,
    )


def gguf_tensors(header, cfg: GemmaConfig, *, source: str, lazy: bool = False) -> dict:
    """Every tensor dequantized under our names (norms back from llama.cpp's 1 + w to w)."""
    from jaxspec.loading.gguf_file import SUPPORTED_TYPES, LazyTensor

    out_dtype = np.dtype(cfg.compute_dtype)
    flat = {}
    for t in header.tensors:
        ours = _our_gguf_name(t.name)
        if ours is None:
            raise JaxspecError(f"{source}: unexpected tensor {t.name}: this model variant is not supported")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise JaxspecError(
                f"{source}: tensor {t.name} is {t.tensor_type.name}, which jaxspec cannot dequantize"
            )

        def read(t=t, ours=ours):
            w = t.dequantize()
            if ours.endswith("norm"):
                w = w.astype(np.float32) - 1.0
            return w.astype(out_dtype, copy=False)

        flat[ours] = LazyTensor(t.shape, read) if lazy else read()
    return flat


def _our_gguf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "embed"
    if name == "output_norm.weight":
        return "final_norm"
    if name == "output.weight":
        return "lm_head"
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return f"layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def gguf_tokenizer(path: Path, header):
    """The GGUF's tokenizer, built from the parsed metadata by transformers' own converter (no
    second parse of the file) and cached like `loading.tokenizer.load_gguf_tokenizer`'s."""
    from jaxspec.loading import tokenizer as tk

    if "tokenizer.ggml.model" not in header.fields:
        return None
    cache = tk._cache_dir(path)
    if cache is not None and (cache / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        try:
            with tk.quiet():
                return AutoTokenizer.from_pretrained(cache)
        except Exception:  # noqa: BLE001 — a damaged cache entry: rebuild it
            pass
    tok = tk.tokenizer_from_metadata(header)
    template = header.fields.get("tokenizer.chat_template")
    if template is not None and not tok.chat_template:
        tok.chat_template = template.contents()
    if cache is not None:
        tk._save(tok, cache)
    return tok


def gguf_eos(header, vocab_size: int, source: str) -> list[int]:
    """The EOS-like ids the file names, each checked against the vocabulary."""
    fields = validate.Fields(
        lambda k: header.fields[k].contents() if k in header.fields else validate.MISSING, source
    )
    return [i for k in ("eos", "eot", "eom")
            for i in validate.token_ids(fields, f"tokenizer.ggml.{k}_token_id", vocab_size)]


# ------------------------------------------------------------------------------------ readers


def read_hf_dir(path: Path, hf: dict, dtype: str):
    """(config, flat tensors, tokenizer, eos ids, architecture) of a gemma2 / gemma3(_text) / phi3
    directory."""
    from jaxspec.loading.tokenizer import load_dir_tokenizer

    kind = hf_model_type(hf)
    source = str(path / "config.json")
    if kind == "phi3":
        cfg = phi3_config_from_hf(hf, dtype=dtype, source=source)
    else:
        cfg = gemma_config_from_hf(hf, dtype=dtype, source=source)
    flat = hf_tensors(path, kind, cfg)
    arch = "phi3" if kind == "phi3" else cfg.family
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    fields = validate.Fields(hf if "eos_token_id" in hf else text, source)
    eos = validate.token_ids(fields, "eos_token_id", cfg.vocab_size)
    gen = path / "generation_config.json"
    if gen.exists():
        gen_fields = validate.Fields(validate.read_json(gen, "generation_config.json"), str(gen))
        eos += validate.token_ids(gen_fields, "eos_token_id", cfg.vocab_size)
    return cfg, flat, load_dir_tokenizer(path), eos, arch


def read_gguf(path: Path, dtype: str, lazy: bool = False):
    """(config, flat tensors, tokenizer, eos ids, architecture) of a gemma2 / gemma3 GGUF file."""
    from jaxspec.loading.gguf_header import GGUFHeader

    header = GGUFHeader(path)
    cfg = gemma_config_from_gguf(header, dtype=dtype, source=str(path))
    flat = gguf_tensors(header, cfg, source=str(path), lazy=lazy)
    return cfg, flat, gguf_tokenizer(path, header), gguf_eos(header, cfg.vocab_size, str(path)), cfg.family


def assemble(cfg, flat: dict, *, source: str) -> dict:
    """Check names and shapes against the family's `param_shapes`, refuse NaN/inf, then nest
    (`layers.3.wq` -> params["layers"][3]["wq"]), as `loading.params.assemble` does for Llama."""
    from jaxspec.loading.params import check_finite
    from jaxspec.models import gemma

    shapes = gemma.param_shapes(cfg)
    want = {k: v for k, v in shapes.items() if k != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        want |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    missing, extra = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
    if missing:
        raise JaxspecError(f"{source} lacks tensors {', '.join(missing[:4])}: the checkpoint is "
                           f"incomplete or does not match its config")
    if extra:
        raise JaxspecError(f"{source} has tensors {', '.join(extra[:4])} that {cfg.family} does "
                           f"not use: the model variant is not supported")
    for key, shape in want.items():
        got = tuple(flat[key].shape)
        if got != tuple(shape):
            raise JaxspecError(f"{source}: tensor {key} has shape {got}, config implies "
                               f"{tuple(shape)}: the checkpoint does not match its config")
        if not getattr(flat[key], "lazy", False):
            check_finite(key, flat[key], source)
    params = {k: flat[k] for k in want if not k.startswith("layers.")}
    params["layers"] = tuple(
        {k.split(".", 2)[2]: flat[k] for k in want if k.startswith(f"layers.{i}.")}
        for i in range(cfg.num_layers)
    )
    return params


def owns(cfg) -> bool:
    """Whether `cfg` is a family config this module assembles (Phi-3 assembles as Llama)."""
    return isinstance(cfg, GemmaConfig)


def target_for(cfg, arch: str):
    """The `models.base.Target` that runs a loaded config."""
    from jaxspec.models.llama import LlamaTarget

    if isinstance(cfg, GemmaConfig):
        return GemmaTarget(cfg, name=arch)
    return phi3.phi3_target(cfg) if arch == "phi3" else LlamaTarget(cfg, name=arch)


def _gemma_target_from_hf(hf: dict, *, dtype: str, source: str) -> GemmaTarget:
    cfg = gemma_config_from_hf(hf, dtype=dtype, source=source)
    return GemmaTarget(cfg, name=cfg.family)


def _gemma_target_from_gguf(header, *, dtype: str, source: str) -> GemmaTarget:
    cfg = gemma_config_from_gguf(header, dtype=dtype, source=source)
    return GemmaTarget(cfg, name=cfg.family)


for _family in (
    registry.Family("gemma2", ("gemma2",), ("gemma2",), _gemma_target_from_hf, _gemma_target_from_gguf),
    registry.Family("gemma3", ("gemma3", "gemma3_text"), ("gemma3",), _gemma_target_from_hf,
                    _gemma_target_from_gguf),
):
    registry.register_family(_family)
