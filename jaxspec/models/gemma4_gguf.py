"""Gemma 4 (text) GGUF files as llama.cpp's `convert_hf_to_gguf.py` writes them (architecture
`gemma4`, `conversion/gemma.py`'s `Gemma4Model`): its metadata read into a `Gemma4Config`, its
tensor names mapped onto our leaves, so the params equal those read from the Hugging Face
checkpoint it was converted from (tests/test_gemma4_gguf.py, fixture written by the real
converter: scripts/gemma4_gguf_fixtures.py).

What the converter does (learned by running it):
  * norms are stored as they are (its Gemma 4 `norm_shift` is 0, where Gemma 2/3's add 1: a
    reader sharing Gemma 3's offset breaks every norm);
  * per-layer dims go to metadata: `head_count_kv` and `feed_forward_length` become per-layer
    arrays, `key_length` / `key_length_swa` the global / sliding head dims,
    `attention.sliding_window_pattern` the layer types, `attention.shared_kv_layers` the KV-
    sharing tail (those layers get no `attn_k` / `attn_v`), `embedding_length_per_layer_input`
    the per-layer input width;
  * proportional RoPE is written as a `rope_freqs` tensor of frequency factors, 1 for a rotated
    pair and 1e30 for an unrotated one: the rotated share of the global head dim is read there;
  * values equal to keys (`attention_k_eq_v`) leave the global layers without `attn_v`;
  * the MoE block keeps transformers' fused [E, 2F, D] gate/up, the router's scale becomes
    `ffn_gate_inp.scale`, the per-expert scale `ffn_down_exps.scale`.
"""

from __future__ import annotations

import numpy as np

from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.models import gemma4_config, registry
from jaxspec.models.gemma4_config import Gemma4Config

NORM_SHIFT = 0.0  # what llama.cpp added to Gemma 4's norms (Gemma 2/3: 1)
UNROTATED = 1e30  # the frequency factor llama.cpp writes for a pair that does not rotate

GLOBAL_NAMES = {"per_layer_token_embd.weight": "ple_embed",
                "per_layer_model_proj.weight": "ple_model_proj",
                "per_layer_proj_norm.weight": "ple_proj_norm", "rope_freqs.weight": "rope_freqs"}
# llama.cpp's names (`blk.<i>.` + this) -> our leaves
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_output.weight": "wo", "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm", "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down", "post_ffw_norm.weight": "post_mlp_norm",
    "layer_output_scale.weight": "layer_scalar", "inp_gate.weight": "ple_gate",
    "proj.weight": "ple_proj", "post_norm.weight": "ple_norm", "ffn_gate_inp.weight": "router",
    "ffn_gate_inp.scale": "router_scale", "ffn_down_exps.scale": "expert_scale",
    "ffn_gate_up_exps.weight": "we_gate_up", "ffn_down_exps.weight": "we_down",
    "post_ffw_norm_1.weight": "post_mlp_norm_1", "pre_ffw_norm_2.weight": "moe_norm",
    "post_ffw_norm_2.weight": "post_moe_norm",
}


def tensor_name(name: str) -> str | None:
    return GLOBAL_NAMES.get(name) or registry.gguf_tensor_name(name, LAYER_NAMES)


def refuse(source: str, what: str):
    raise JaxspecError(f"{source}: {what} is not supported: Gemma 4 GGUF in jaxspec reads "
                       f"{gemma4_config.SUPPORTED}, as llama.cpp's converter writes them")


def rotated_share(header, head_dim: int, source: str) -> float:
    """The rotated share of the global head dim from `rope_freqs` (factors 1 then 1e30, one per
    pair); no tensor: every dim rotates."""
    t = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return 1.0
    f = np.asarray(t.dequantize(), np.float64).reshape(-1)
    rotated = int(np.sum(f == 1.0))
    if f.shape != (head_dim // 2,) or not (f[:rotated] == 1.0).all() or not (
            f[rotated:] >= UNROTATED).all():
        refuse(source, "rope_freqs other than proportional RoPE's (1 per rotated pair, then "
                       "1e30)")
    return 2 * rotated / head_dim


def per_layer(f: validate.Fields, key: str, n: int, default=validate.MISSING) -> list[int]:
    """A per-layer metadata value: one integer per layer, or one for all."""
    values = f.int_list(key, default, lo=1, hi=validate.MAX_DIM, scalar_ok=True)
    if len(values) == 1:
        values = values * n
    if len(values) != n:
        f.fail(key, values, f"give one value or one per layer ({n})")
    return values


def config_from_gguf(header, *, dtype: str, source: str) -> Gemma4Config:
    """`gemma4` metadata, every field checked; which layers own k/v, and which have values equal
    to their keys, read from the tensors present."""
    arch = str(header.fields["general.architecture"].value)
    f = validate.Fields(lambda k: header.fields[f"{arch}.{k}"].contents()
                        if f"{arch}.{k}" in header.fields else validate.MISSING, source, f"{arch}.")
    names = {t.name: t for t in header.tensors}
    if "token_embd.weight" not in names:
        raise JaxspecError(f"{source} has no token_embd.weight: the file is incomplete")
    n = f.int("block_count", lo=1, hi=validate.MAX_LAYERS)
    pattern = f.raw("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n or not all(
            isinstance(p, bool) for p in pattern):
        f.fail("attention.sliding_window_pattern", pattern, f"give {n} true/false values")
    sliding = tuple(pattern)
    heads_n = f.int("attention.head_count", lo=1, hi=validate.MAX_DIM)
    dims = {s: f.int(f"attention.key_length{s}", lo=2, hi=validate.MAX_DIM) for s in ("", "_swa")}
    for s, d in dims.items():
        if f.int(f"attention.value_length{s}", d) != d:
            refuse(source, f"attention.value_length{s} != key_length{s}")
    if f.int("rope.dimension_count_swa", dims["_swa"]) != dims["_swa"]:
        refuse(source, "partial RoPE on sliding layers (rope.dimension_count_swa)")
    if f.int("rope.dimension_count", dims[""]) != dims[""]:
        refuse(source, "rope.dimension_count != key_length (a share is read from rope_freqs)")
    kv = per_layer(f, "attention.head_count_kv", n)
    heads = tuple((kv[i], dims["_swa" if sliding[i] else ""]) for i in range(n))
    if any(heads_n % k for k, _ in heads):
        f.fail("attention.head_count_kv", kv, f"kv heads must divide head_count={heads_n}")
    shared = f.int("attention.shared_kv_layers", 0, lo=0, hi=n - 1)
    kv_source = gemma4_config.kv_sources(sliding, shared, lambda w: refuse(source, w))
    for i in range(n):
        if (f"blk.{i}.attn_k.weight" in names) != (kv_source[i] == i):
            refuse(source, f"layer {i} with{'out' if kv_source[i] == i else ''} its own attn_k "
                           f"(attention.shared_kv_layers={shared})")
    no_v = {sliding[i] for i in range(n) if kv_source[i] == i}
    no_v = {s for s in no_v if not any(f"blk.{i}.attn_v.weight" in names for i in range(n)
                                       if kv_source[i] == i and sliding[i] == s)}
    if True in no_v:
        refuse(source, "sliding layers without attn_v")
    k_eq_v = tuple(False in no_v and not s for s in sliding)  # transformers' per-layer flags
    moe = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(n)]
    if any(moe) and not all(moe):
        refuse(source, "the MoE block on some layers only")
    ple = f.int("embedding_length_per_layer_input", 0, lo=0, hi=validate.MAX_DIM)
    experts = f.int("expert_count", lo=1, hi=1 << 16) if all(moe) else 0
    return Gemma4Config(
        vocab_size=int(names["token_embd.weight"].shape[0]),
        hidden_size=f.int("embedding_length", lo=1, hi=validate.MAX_DIM), num_layers=n,
        num_heads=heads_n, sliding=sliding, heads=heads, kv_source=kv_source, k_eq_v=k_eq_v,
        mlp_width=tuple(per_layer(f, "feed_forward_length", n)),
        sliding_window=f.int("attention.sliding_window", lo=1),
        rope_local_theta=f.float("rope.freq_base_swa", 10000.0, lo=0.0, lo_open=True),
        rope_global_theta=f.float("rope.freq_base", 1e6, lo=0.0, lo_open=True),
        rope_global_partial=rotated_share(header, dims[""], source),
        ple_dim=ple, ple_vocab=int(names["per_layer_token_embd.weight"].shape[0])
        if ple and "per_layer_token_embd.weight" in names else 0,
        num_experts=experts,
        top_k=f.int("expert_used_count", lo=1, hi=experts) if experts else 0,
        moe_intermediate_size=f.int("expert_feed_forward_length", lo=1, hi=validate.MAX_DIM)
        if experts else 0,
        final_logit_softcapping=f.float("final_logit_softcapping", None, lo=0.0, lo_open=True)
        if f.given("final_logit_softcapping") else None,
        rms_norm_eps=f.float("attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0,
                             lo_open=True),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=f.int("context_length", 8192, lo=1, hi=(1 << 31) - 1),
        dtype=dtype)


def convert(flat: dict, cfg: Gemma4Config, source: str) -> dict:
    """`rope_freqs` dropped (read into the config), norms back from llama.cpp's (NORM_SHIFT + w),
    the fused expert gate/up split (lazy tensors stay lazy: rebuilt as their own type)."""
    out = {}
    for key, w in flat.items():
        if key == "rope_freqs":
            continue
        if NORM_SHIFT and key.endswith("norm"):
            shift = lambda x: (x.astype(np.float32) - NORM_SHIFT).astype(x.dtype)  # noqa: E731
            w = (type(w)(w.shape, lambda w=w: shift(w[...])) if getattr(w, "lazy", False)
                 else shift(w))
        out[key] = w
    return gemma4_config.split_fused(out, cfg)
