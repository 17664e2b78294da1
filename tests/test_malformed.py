"""Malformed inputs, every file kind and every entry point: each case is generated small here,
run through the command line in-process (the entry point's `main(argv)`), and must exit 2 with
exactly one `error:` line that names the problem, no traceback, within a time and memory bound.
Cases fail before anything is compiled, so the module stays fast.

Also: outputs never destroy what jaxspec did not write, no code runs from a checkpoint, NaN never
becomes a token, Ctrl-C exits 130, and two hypothesis properties over config.json / GGUF
metadata mutations (load or a JaxspecError, nothing else).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from jaxspec.errors import JaxspecError

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV = 64, 16, 32, 2, 2, 1
HEAD_DIM = HIDDEN // HEADS
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "eos_token_id": 1,
}
RSS_GROWTH_BYTES = 1 << 30  # a case may not raise the process's peak memory by more


@pytest.fixture(autouse=True)
def _no_xla_cache(monkeypatch):
    monkeypatch.setenv("JAXSPEC_XLA_CACHE", "0")  # in-process CLI runs leave jax's config alone


# ---- writing small inputs -------------------------------------------------------------------


def hf_tensors(rng, layers=LAYERS) -> dict[str, np.ndarray]:
    def w(*shape):
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)

    t = {
        "model.embed_tokens.weight": w(VOCAB, HIDDEN),
        "model.norm.weight": 1 + w(HIDDEN),
        "lm_head.weight": w(VOCAB, HIDDEN),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + w(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
        }
    return t


def write_safetensors(file: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(file))


def raw_safetensors(file: Path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    """A safetensors file with exactly this header (and header length), for damaged headers."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if length is None else length
    file.write_bytes(struct.pack("<Q", n) + body + data)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("good") / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    write_safetensors(d / "model.safetensors", hf_tensors(np.random.default_rng(0)))
    return d


@pytest.fixture(scope="module")
def tok_dir(good_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint with a tiny word-level tokenizer (text prompts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = Path(shutil.copytree(good_dir, tmp_path_factory.mktemp("tok") / "ckpt"))
    vocab = {"<unk>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(d)
    return d


@pytest.fixture
def ckpt(good_dir, tmp_path) -> Path:
    return Path(shutil.copytree(good_dir, tmp_path / "ckpt"))


def set_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


DELETE = object()


# ---- running a CLI in-process ---------------------------------------------------------------


def run_cli(main, argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def refused(main, argv, match: str) -> str:
    """Run; require exit 2, exactly one `error:` line containing `match`, no traceback, and
    bounded peak memory (a size field taken at its word would allocate it). Returns the error
    line. A hang is caught by pytest-timeout, not by a wall-clock bound under the suite's load."""
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rc, out, err = run_cli(main, argv)
    peak1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2, (rc, out[-500:], err[-2000:])
    assert "Traceback" not in err and len(errors) == 1, err[-2000:]
    assert match in errors[0], errors[0]
    assert len(errors[0]) < 2100
    assert peak1 - peak0 < RSS_GROWTH_BYTES, (peak1 - peak0) / 2**20
    return errors[0]


def generate_main(argv):
    from jaxspec.generate import main

    return main(argv)


def gen_argv(model, *extra):
    return [
        "--model",
        str(model),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        "model.layout=unrolled",
        "model.dtype=float32",
        *extra,
    ]


# ---- the valid inputs load (so every refusal below is the case's own) ------------------------


def test_the_unmutated_inputs_load(good_dir, tmp_path):
    from jaxspec.loading import load_model

    m = load_model(good_dir, layout="unrolled")
    assert m.cfg.num_layers == LAYERS and m.eos_token_ids == (1,)
    g = load_model(write_gguf(tmp_path / "m.gguf"), layout="unrolled")
    assert g.cfg.num_layers == LAYERS and g.cfg.num_kv_heads == KV


# ---- config.json ----------------------------------------------------------------------------

CONFIG_CASES = {
    "list": (lambda d: (d / "config.json").write_text("[1, 2]"), "not an object"),
    "not utf-8": (lambda d: (d / "config.json").write_bytes(b'{"a": "\xff\xfe"}'), "not UTF-8"),
    "not json": (lambda d: (d / "config.json").write_text("{vocab_size: 3"), "not valid JSON"),
    "NaN literal": (
        lambda d: (d / "config.json").write_text(
            json.dumps(CONFIG).replace('"rope_theta": 10000.0', '"rope_theta": NaN')
        ),
        "NaN",
    ),
    "rope_theta 0": (dict(rope_theta=0.0), "rope_theta"),
    "rope_theta < 0": (dict(rope_theta=-5.0), "rope_theta"),
    "rope_theta string": (dict(rope_theta="1e4"), "rope_theta"),
    "eps < 0": (dict(rms_norm_eps=-1e-5), "rms_norm_eps"),
    "eps 0": (dict(rms_norm_eps=0), "rms_norm_eps"),
    "heads missing": (dict(num_attention_heads=DELETE), "lacks num_attention_heads"),
    "heads 0": (dict(num_attention_heads=0), "num_attention_heads"),
    "4 heads 3 kv": (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    "kv heads 0": (dict(num_key_value_heads=0), "num_key_value_heads"),
    "layers as string": (dict(num_hidden_layers="2"), "num_hidden_layers"),
    "layers 10^7": (dict(num_hidden_layers=10_000_000), "num_hidden_layers"),
    "layers 3 of 2": (dict(num_hidden_layers=3), "num_hidden_layers=3"),
    "hidden as bool": (dict(hidden_size=True), "hidden_size"),
    "vocab 0": (dict(vocab_size=0), "vocab_size"),
    "head_dim 0": (dict(head_dim=0), "head_dim"),
    "max_pos -1": (dict(max_position_embeddings=-1), "max_position_embeddings"),
    "rope_parameters list": (dict(rope_parameters=[1, 2]), "rope_parameters"),
    "llama3 without factor": (dict(rope_scaling={"rope_type": "llama3"}), "factor"),
    "yarn": (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
    "eos string": (dict(eos_token_id="</s>"), "eos_token_id"),
    "eos negative": (dict(eos_token_id=-1), "eos_token_id"),
    "eos beyond vocab": (dict(eos_token_id=[1, 10**6]), "eos_token_id"),
    "eos bool": (dict(eos_token_id=True), "eos_token_id"),
    "architectures string": (dict(architectures="LlamaForCausalLM"), "architectures"),
    "hidden_act number": (dict(hidden_act=5), "hidden_act"),
    "tie as string": (dict(tie_word_embeddings="yes"), "tie_word_embeddings"),
    "mtp layers string": (dict(num_nextn_predict_layers="1"), "num_nextn_predict_layers"),
    "fifo": (
        lambda d: (os.remove(d / "config.json"), os.mkfifo(d / "config.json")),
        "not a regular file",
    ),
    "urandom link": (
        lambda d: (os.remove(d / "config.json"), os.symlink("/dev/urandom", d / "config.json")),
        "not a regular file",
    ),
    "sparse 1 TB": (lambda d: os.truncate(d / "config.json", 1 << 40), "bytes, more than"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_json(ckpt, case):
    change, match = CONFIG_CASES[case]
    if callable(change):
        change(ckpt)
    else:
        set_config(ckpt, **change)
    refused(generate_main, gen_argv(ckpt), match)


# Gemma 3's config.json goes through its own family reader (loading/families.py): the same
# typed, range-checked reads, refused before any tensor is opened.
GEMMA_CONFIG = {
    "model_type": "gemma3_text", "vocab_size": 64, "hidden_size": HIDDEN, "intermediate_size": FFN,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV,
    "head_dim": HEAD_DIM, "sliding_window": 8, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
}
GEMMA_CASES = {
    "layers as string": (dict(num_hidden_layers="2"), "num_hidden_layers"),
    "layers 10^7": (dict(num_hidden_layers=10_000_000), "num_hidden_layers"),
    "heads 0": (dict(num_attention_heads=0), "num_attention_heads"),
    "4 heads 3 kv": (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    "vocab as bool": (dict(vocab_size=True), "vocab_size"),
    "window 0": (dict(sliding_window=0), "sliding_window"),
    "rope_theta -1": (dict(rope_theta=-1.0), "rope_theta"),
    "local theta string": (dict(rope_local_base_freq="1e4"), "rope_theta"),
    "eps 0": (dict(rms_norm_eps=0), "rms_norm_eps"),
    "scalar 0": (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    "layer_types number": (dict(layer_types=5), "layer_types"),
    "softcap string": (dict(final_logit_softcapping="30"), "final_logit_softcapping"),
}


@pytest.mark.parametrize("case", GEMMA_CASES)
def test_gemma_config_json(tmp_path, case):
    change, match = GEMMA_CASES[case]
    d = tmp_path / "gemma"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GEMMA_CONFIG | change))
    refused(generate_main, gen_argv(d), match)


def test_generation_config_and_eos(ckpt):
    g = ckpt / "generation_config.json"
    for text, match in [
        ("{", "not valid JSON"),
        ("[1]", "not an object"),
        ('{"eos_token_id": "x"}', "eos_token_id"),
        ('{"eos_token_id": [1, 64]}', "eos_token_id"),
        ('{"eos_token_id": -3}', "eos_token_id"),
    ]:
        g.write_text(text)
        refused(generate_main, gen_argv(ckpt), match)
    g.unlink()
    os.mkfifo(g)
    refused(generate_main, gen_argv(ckpt), "not a regular file")


# ---- safetensors headers and indexes --------------------------------------------------------


def _entries(rng=None):
    t = hf_tensors(rng or np.random.default_rng(1))
    header, data, off = {}, b"", 0
    for name, a in t.items():
        b = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        data, off = data + b, off + len(b)
    return header, data


def _damage(ckpt, edit):
    header, data = _entries()
    first = "model.embed_tokens.weight"
    length = edit(header, header[first])
    raw_safetensors(ckpt / "model.safetensors", header, data, length)


SAFETENSORS_CASES = {
    "header length 2^63": (lambda h, e: 1 << 63, "not a readable safetensors"),
    "header length past the file": (lambda h, e: 10**9, "not a readable safetensors"),
    "I32 weight": (lambda h, e: e.update(dtype="I32"), "must be a float"),
    "BOOL weight": (
        lambda h, e: e.update(
            dtype="BOOL", data_offsets=[e["data_offsets"][0], e["data_offsets"][0] + VOCAB * HIDDEN]
        ),
        "must be a float",
    ),
    "unknown dtype": (lambda h, e: e.update(dtype="Q4"), "does not read"),
    "shape -1": (lambda h, e: e.update(shape=[-1, HIDDEN]), "shape"),
    "shape strings": (lambda h, e: e.update(shape=["64", "16"]), "shape"),
    "offsets beyond file": (lambda h, e: e.update(data_offsets=[0, 10**9]), "outside"),
    "offsets one int": (lambda h, e: e.update(data_offsets=5), "data_offsets"),
    "byte count mismatch": (lambda h, e: e.update(shape=[VOCAB, HIDDEN - 1]), "bytes"),
    "overlapping tensors": (
        lambda h, e: h["model.norm.weight"].update(data_offsets=[0, HIDDEN * 4]),
        "share bytes",
    ),
    "entry not an object": (lambda h, e: h.update({"model.norm.weight": [1, 2]}), "not an object"),
    "metadata not strings": (lambda h, e: h.update({"__metadata__": {"a": 1}}), "__metadata__"),
}


@pytest.mark.parametrize("case", SAFETENSORS_CASES)
def test_safetensors_header(ckpt, case):
    edit, match = SAFETENSORS_CASES[case]
    _damage(ckpt, edit)
    refused(generate_main, gen_argv(ckpt), match)


def test_safetensors_files(ckpt):
    st = ckpt / "model.safetensors"
    raw_safetensors(st, b"[1, 2, 3]")
    refused(generate_main, gen_argv(ckpt), "not a JSON object")
    raw_safetensors(st, b"\xff\xfe{")
    refused(generate_main, gen_argv(ckpt), "not a readable safetensors")
    st.unlink()
    os.symlink("/dev/urandom", st)
    refused(generate_main, gen_argv(ckpt), "not a regular file")
    st.unlink()
    os.mkfifo(st)
    refused(generate_main, gen_argv(ckpt), "not a regular file")
    st.unlink()
    refused(generate_main, gen_argv(ckpt), "no *.safetensors")
    t = hf_tensors(np.random.default_rng(2))
    t["model.norm.weight"][3] = np.nan
    write_safetensors(st, t)
    refused(generate_main, gen_argv(ckpt), "NaN or inf")


INDEX_CASES = {
    "not json": ("{", "not valid JSON"),
    "weight_map list": ({"weight_map": [1]}, "weight_map"),
    "parent path": ({"weight_map": {"model.norm.weight": "../../x.safetensors"}}, "outside"),
    "absolute path": ({"weight_map": {"model.norm.weight": "/etc/passwd"}}, "outside"),
    "missing tensor": ({"weight_map": {"model.nope.weight": "model.safetensors"}}, "does not hold"),
    "missing shard": ({"weight_map": {"model.norm.weight": "b.safetensors"}}, "missing"),
    "file name a number": ({"weight_map": {"model.norm.weight": 7}}, "not a file name"),
}


@pytest.mark.parametrize("case", INDEX_CASES)
def test_safetensors_index(ckpt, case):
    body, match = INDEX_CASES[case]
    (ckpt / "model.safetensors.index.json").write_text(
        body if isinstance(body, str) else json.dumps(body)
    )
    refused(generate_main, gen_argv(ckpt), match)


def test_index_link_out_of_the_directory(ckpt, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(ckpt / "model.safetensors", outside)
    os.symlink(outside, ckpt / "shard.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = list(hf_tensors(np.random.default_rng(0)))
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "shard.safetensors" for n in names}})
    )
    refused(generate_main, gen_argv(ckpt), "link outside")


# ---- tokenizer files: no code from a checkpoint ---------------------------------------------


def test_auto_map_tokenizer_code_never_runs(ckpt, tmp_path):
    marker = tmp_path / "ran.txt"
    (ckpt / "evil_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    (ckpt / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "EvilTokenizer",
                "auto_map": {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]},
            }
        )
    )
    refused(generate_main, gen_argv(ckpt), "never runs code")
    assert not marker.exists()
    # the library path (trust_remote_code=False) refuses it too, without a prompt or a marker
    from jaxspec.loading.tokenizer import load_dir_tokenizer

    with pytest.raises(JaxspecError, match="auto_map"):
        load_dir_tokenizer(ckpt)
    assert not marker.exists()


def test_transformers_itself_is_asked_not_to_run_code(ckpt, tmp_path, monkeypatch):
    """Below jaxspec's auto_map check: transformers gets trust_remote_code=False."""
    from jaxspec.loading import tokenizer as tok_mod

    marker = tmp_path / "ran.txt"
    (ckpt / "evil_tokenizer.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (ckpt / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "EvilTokenizer",
                "auto_map": {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]},
            }
        )
    )
    monkeypatch.setattr(tok_mod, "check_tokenizer_config", lambda cfg, source: None)
    with pytest.raises(JaxspecError, match="cannot load the tokenizer"):
        tok_mod.load_dir_tokenizer(ckpt)
    assert not marker.exists()


def test_tokenizer_files(ckpt):
    tc = ckpt / "tokenizer_config.json"
    for text, match in [
        ("{", "not valid JSON"),
        ('{"chat_template": 5}', "chat_template"),
        ('{"eos_token": 3}', "eos_token"),
        ('{"tokenizer_class": ["x"]}', "tokenizer_class"),
    ]:
        tc.write_text(text)
        refused(generate_main, gen_argv(ckpt), match)
    tc.unlink()
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    refused(generate_main, gen_argv(ckpt), "cannot load the tokenizer")
    (ckpt / "tokenizer.json").unlink()
    os.mkfifo(ckpt / "tokenizer.json")
    refused(generate_main, gen_argv(ckpt), "not a regular file")


# ---- GGUF metadata ----------------------------------------------------------------------------


def write_gguf(path: Path, **meta) -> Path:
    """A tiny llama GGUF (F32 tensors, no tokenizer); `meta` overrides metadata (key without the
    `llama.` prefix; a value of DELETE drops the key)."""
    import gguf

    arch = meta.pop("architecture", "llama")
    w = gguf.GGUFWriter(str(path), arch)
    values = {
        "block_count": LAYERS,
        "context_length": 128,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 10000.0,
    } | meta
    for key, value in values.items():
        if value is DELETE:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, list):
            w.add_array(full, value)
        elif value < 0:
            w.add_int32(full, value)
        else:
            w.add_uint32(full, value)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    sub = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, a in hf_tensors(np.random.default_rng(3)).items():
        if name in names:
            gname = names[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{sub[rest.removesuffix('.weight')]}.weight"
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GGUF_CASES = {
    "head_count 0": (dict(**{"attention.head_count": 0}), "head_count"),
    "head_count string": (dict(**{"attention.head_count": "2"}), "head_count"),
    "kv heads 0": (dict(**{"attention.head_count_kv": 0}), "head_count_kv"),
    "block_count 10^6": (dict(block_count=10**6), "block_count"),
    "block_count 3 of 2": (dict(block_count=3), "block_count=3"),
    "rope_freq_base NaN": (dict(**{"rope.freq_base": math.nan}), "rope.freq_base"),
    "rope_freq_base 0": (dict(**{"rope.freq_base": 0.0}), "rope.freq_base"),
    "eps negative": (dict(**{"attention.layer_norm_rms_epsilon": -1.0}), "epsilon"),
    "context_length negative": (dict(context_length=-5), "context_length"),
    "embedding_length missing": (dict(embedding_length=DELETE), "embedding_length"),
    "architecture gpt2": (dict(architecture="gpt2"), "not supported"),
}


GEMMA_GGUF_CASES = {
    "block_count 10^6": (dict(block_count=10**6), "block_count"),
    "head_count 0": (dict(**{"attention.head_count": 0}), "head_count"),
    "head_count string": (dict(**{"attention.head_count": "2"}), "head_count"),
    "freq_base NaN": (dict(**{"rope.freq_base": math.nan}), "rope.freq_base"),
    "eps negative": (dict(**{"attention.layer_norm_rms_epsilon": -1.0}), "epsilon"),
}


@pytest.mark.parametrize("case", GEMMA_GGUF_CASES)
def test_gemma_gguf_metadata(tmp_path, case):
    meta, match = GEMMA_GGUF_CASES[case]
    path = write_gguf(tmp_path / "g.gguf", architecture="gemma3", **dict(meta))
    refused(generate_main, gen_argv(path), match)


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_metadata(tmp_path, case):
    meta, match = GGUF_CASES[case]
    path = write_gguf(tmp_path / "m.gguf", **dict(meta))
    refused(generate_main, gen_argv(path), match)


def test_gguf_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    refused(generate_main, gen_argv(bad), "not a readable GGUF")
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    refused(generate_main, gen_argv(fifo), "not a regular file")


# ---- published drafter configs (EAGLE-3, Medusa, MTP) through jaxspec.export -------------------


def export_main(argv):
    from jaxspec.export import main

    return main(argv)


def medusa_fd_dir(path: Path, heads=2, layers=1, **config) -> Path:
    rng = np.random.default_rng(4)
    path.mkdir(parents=True, exist_ok=True)
    t = {}
    for i in range(heads):
        for j in range(layers):
            t[f"{i}.{j}.linear.weight"] = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
            t[f"{i}.{j}.linear.bias"] = rng.standard_normal(HIDDEN).astype(np.float32)
        t[f"{i}.{layers}.weight"] = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    write_safetensors(path / "model.safetensors", t)
    cfg = {
        "medusa_num_heads": heads,
        "medusa_num_layers": layers,
        "hidden_size": HIDDEN,
        "vocab_size": VOCAB,
    } | config
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def eagle3_dir(path: Path, ids=(1, 0, 1), **config) -> Path:
    from jaxspec.formats.eagle3 import PREFIX

    rng = np.random.default_rng(5)
    h, th, nd, n, k, hd = 16, HIDDEN, 8, 2, 1, 8

    def w(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    pre = PREFIX["eagle3"]
    t = {
        "fc.weight": w(h, 3 * th),
        "norm.weight": 1 + w(h),
        "lm_head.weight": w(nd, h),
        pre + "input_layernorm.weight": 1 + w(h),
        pre + "hidden_norm.weight": 1 + w(h),
        pre + "post_attention_layernorm.weight": 1 + w(h),
        pre + "self_attn.q_proj.weight": w(n * hd, 2 * h),
        pre + "self_attn.k_proj.weight": w(k * hd, 2 * h),
        pre + "self_attn.v_proj.weight": w(k * hd, 2 * h),
        pre + "self_attn.o_proj.weight": w(h, n * hd),
        pre + "mlp.gate_proj.weight": w(2 * h, h),
        pre + "mlp.up_proj.weight": w(2 * h, h),
        pre + "mlp.down_proj.weight": w(h, 2 * h),
    }
    d2t = np.arange(0, 2 * nd, 2, dtype=np.int64)
    t["d2t"] = d2t - np.arange(nd)
    t2d = np.zeros(VOCAB, bool)
    t2d[d2t] = True
    t["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", t)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "num_attention_heads": n,
        "num_key_value_heads": k,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "draft_vocab_size": nd,
        "target_hidden_size": th,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)},
    } | config
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_valid_drafters_export(tmp_path):
    rc, out, err = run_cli(
        export_main,
        [
            "--checkpoint",
            str(medusa_fd_dir(tmp_path / "m")),
            "--format",
            "medusa",
            "--out",
            str(tmp_path / "o1"),
        ],
    )
    assert rc == 0, err
    rc, out, err = run_cli(
        export_main,
        [
            "--checkpoint",
            str(eagle3_dir(tmp_path / "e")),
            "--format",
            "speculators",
            "--out",
            str(tmp_path / "o2"),
        ],
    )
    assert rc == 0, err
    mode = (tmp_path / "o2" / "model.safetensors").stat().st_mode & 0o777
    mask = os.umask(0)
    os.umask(mask)
    assert mode == 0o666 & ~mask  # the user's umask, not mkstemp's 0600


DRAFTER_CASES = {
    "medusa heads 10^7": (
        lambda p: medusa_fd_dir(p, medusa_num_heads=10**7),
        "medusa",
        "medusa_num_heads",
    ),
    "medusa heads string": (
        lambda p: medusa_fd_dir(p, medusa_num_heads="2"),
        "medusa",
        "medusa_num_heads",
    ),
    "medusa layers 0": (
        lambda p: medusa_fd_dir(p, medusa_num_layers=0),
        "medusa",
        "medusa_num_layers",
    ),
    "medusa vocab bool": (lambda p: medusa_fd_dir(p, vocab_size=True), "medusa", "vocab_size"),
    "medusa inf weight": (
        lambda p: _poison(medusa_fd_dir(p), "0.0.linear.weight", np.inf),
        "medusa",
        "NaN or inf",
    ),
    "eagle3 layer ids bools": (
        lambda p: eagle3_dir(p, ids=(True, False, True)),
        "speculators",
        "eagle_aux_hidden_state_layer_ids",
    ),
    "eagle3 layer ids strings": (
        lambda p: eagle3_dir(p, ids=("1", "0", "1")),
        "speculators",
        "eagle_aux_hidden_state_layer_ids",
    ),
    "eagle3 hidden string": (
        lambda p: eagle3_dir(p, hidden_size="16"),
        "speculators",
        "hidden_size",
    ),
    "eagle3 heads 0": (
        lambda p: eagle3_dir(p, num_attention_heads=0),
        "speculators",
        "num_attention_heads",
    ),
    "eagle3 rope_theta -1": (lambda p: eagle3_dir(p, rope_theta=-1.0), "speculators", "rope_theta"),
    "eagle3 draft vocab string": (
        lambda p: eagle3_dir(p, draft_vocab_size="8"),
        "speculators",
        "draft_vocab_size",
    ),
    "eagle3 eagle_config list": (
        lambda p: eagle3_dir(p, eagle_config=[1]),
        "speculators",
        "eagle_config",
    ),
    "eagle3 NaN weight": (
        lambda p: _poison(eagle3_dir(p), "fc.weight", np.nan),
        "speculators",
        "NaN or inf",
    ),
    "mtp layers as string": (
        lambda p: medusa_fd_dir(p, medusa_num_heads=DELETE_KEY, num_nextn_predict_layers="1"),
        "medusa",
        "not a drafter layout",
    ),
    "config a list": (
        lambda p: (medusa_fd_dir(p), (p / "config.json").write_text("[]")),
        "medusa",
        "not an object",
    ),
}
DELETE_KEY = None


def _poison(path: Path, name: str, value) -> Path:
    from safetensors.numpy import load_file

    t = load_file(str(path / "model.safetensors"))
    t[name] = t[name].copy()
    t[name].flat[0] = value
    write_safetensors(path / "model.safetensors", t)
    return path


@pytest.mark.parametrize("case", DRAFTER_CASES)
def test_drafter_configs(tmp_path, case):
    make, fmt, match = DRAFTER_CASES[case]
    make(tmp_path / "d")
    cfg_file = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if isinstance(cfg, dict) and cfg.get("medusa_num_heads", 0) is None:
        cfg.pop("medusa_num_heads")
        cfg_file.write_text(json.dumps(cfg))
    refused(
        export_main,
        ["--checkpoint", str(tmp_path / "d"), "--format", fmt, "--out", str(tmp_path / "out")],
        match,
    )
    assert not (tmp_path / "out").exists()


# ---- outputs: nothing deleted that jaxspec did not write --------------------------------------


def test_export_refuses_a_directory_it_did_not_write(tmp_path):
    src = medusa_fd_dir(tmp_path / "m")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["--checkpoint", str(src), "--format", "medusa", "--out", str(out)]
    refused(export_main, argv, "not a checkpoint jaxspec wrote")
    refused(export_main, [*argv, "--force"], "not a checkpoint jaxspec wrote")
    assert (out / "notes.txt").read_text() == "mine"
    refused(export_main, [*argv[:-1], "."], "current directory")
    out2 = tmp_path / "out2"
    assert run_cli(export_main, [*argv[:-1], str(out2)])[0] == 0
    refused(export_main, [*argv[:-1], str(out2)], "--force")
    assert run_cli(export_main, [*argv[:-1], str(out2), "--force"])[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out", "out2"]  # no temp dirs left


def test_save_drafter_never_deletes_foreign_files(tmp_path):
    from jaxspec.train import checkpoint as ckpt

    params = {"w": np.ones((2, 3), np.float32)}
    args = ("medusa", params, {"arch": 1}, {"hidden_size": 1}, {})
    d = tmp_path / "dir"
    d.mkdir()
    (d / "unrelated.txt").write_text("keep me")
    with pytest.raises(JaxspecError, match="not a checkpoint jaxspec wrote"):
        ckpt.save_drafter(d, *args, force=True)
    assert (d / "unrelated.txt").read_text() == "keep me"
    new = tmp_path / "new"
    ckpt.save_drafter(new, *args)
    with pytest.raises(JaxspecError, match="--force"):
        ckpt.save_drafter(new, *args)
    before = json.loads((new / "meta.json").read_text())
    ckpt.save_drafter(new, "medusa", {"w": np.zeros((2, 3), np.float32)}, *args[2:], force=True)
    assert json.loads((new / "meta.json").read_text())["params_sha256"] != before["params_sha256"]
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        with pytest.raises(JaxspecError, match="current directory"):
            ckpt.save_drafter(".", *args, force=True)
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "new"]


# ---- the train CLI ------------------------------------------------------------------------------


def train_main(argv):
    from jaxspec.train.__main__ import main

    return main(argv)


@pytest.fixture
def train_yaml(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard_00000.npz").write_bytes(b"")  # present: the refusals below come first
    p = tmp_path / "t.yaml"
    p.write_text(
        f"kind: train\nmethod: medusa\ndata_dir: {data}\neval_prompts: 0\n"
        f"export_dir: {tmp_path / 'export'}\nckpt_dir: {tmp_path / 'ck'}\n"
    )
    return p


TRAIN_CASES = {
    "missing config": (lambda p: ["--config", str(p.parent / "nope.yaml")], "does not exist"),
    "no config": (lambda p: [], "--config is required"),
    "bad yaml": (lambda p: (p.write_text("a: [1,\n"), ["--config", str(p)])[1], "not valid YAML"),
    "python tag": (
        lambda p: (
            p.write_text("kind: !!python/object/apply:os.system ['true']\n"),
            ["--config", str(p)],
        )[1],
        "not valid YAML",
    ),
    "a list": (lambda p: (p.write_text("- 1\n"), ["--config", str(p)])[1], "must be a mapping"),
    "steps=abc": (lambda p: ["--config", str(p), "steps=abc"], "steps"),
    "method=foo": (lambda p: ["--config", str(p), "method=foo"], "method"),
    "batch_size=0": (lambda p: ["--config", str(p), "batch_size=0"], "batch_size"),
    "seq_len=-1": (lambda p: ["--config", str(p), "seq_len=-1"], "seq_len"),
    "lr=nan": (lambda p: ["--config", str(p), "lr=.nan"], "lr"),
    "lr=inf": (lambda p: ["--config", str(p), "lr=.inf"], "lr"),
    "clip=0": (lambda p: ["--config", str(p), "clip=0"], "clip"),
    "weight_decay=-1": (lambda p: ["--config", str(p), "weight_decay=-1"], "weight_decay"),
    "unknown key": (lambda p: ["--config", str(p), "stepz=3"], "unknown keys"),
    "not key=value": (lambda p: ["--config", str(p), "steps"], "not key=value"),
    "kind=foo": (lambda p: ["--config", str(p), "kind=foo"], "kind"),
    "missing data_dir": (
        lambda p: ["--config", str(p), f"data_dir={p.parent / 'none'}"],
        "data_dir",
    ),
    "missing gsm8k": (
        lambda p: ["--config", str(p), "eval_prompts=2", "gsm8k_path=/nope.jsonl"],
        "gsm8k_path",
    ),
    "export_dir=.": (lambda p: ["--config", str(p), "export_dir=."], "current directory"),
    "export_dir foreign": (
        lambda p: ["--config", str(p), f"export_dir={p.parent / 'data'}"],
        "not a checkpoint jaxspec wrote",
    ),
    "data kind bad type": (
        lambda p: (p.write_text("kind: data\ntop_k: many\n"), ["--config", str(p)])[1],
        "top_k",
    ),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_cli(train_yaml, case):
    argv, match = TRAIN_CASES[case]
    refused(train_main, argv(train_yaml), match)


def test_train_lists_its_keys():
    rc, out, err = run_cli(train_main, ["--list-keys"])
    assert rc == 0 and "export_dir" in out and "lr" in out and "gen_gsm8k" in out


def test_shipped_training_configs_export_under_out():
    import yaml

    for p in sorted(Path("configs/train").glob("smollm2-135m-*.yaml")):
        export = yaml.safe_load(p.read_text()).get("export_dir")
        assert export is None or export.startswith("out/"), (p, export)


# ---- generate / bench / roofline: flags, prompts, resources -------------------------------------


def test_generate_inputs(tok_dir, tmp_path, monkeypatch):
    from jaxspec import limits

    good_dir = tok_dir
    # the tiny model's cache at 10^6 rows is a few GB: price it against 2 GiB free, as a host
    # that size would have (the real machine's free memory varies with its other users)
    monkeypatch.setattr(limits, "free_memory_bytes", lambda: (2 << 30, "host RAM"))
    refused(generate_main, gen_argv(good_dir, "--batch-size", "1000000", "--json"), "batch")
    refused(generate_main, gen_argv(good_dir, "generation.max_context=100000000"), "max_context")
    refused(generate_main, ["--model", str(good_dir), "--prompt", "a\udcff b"], "not valid Unicode")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x \\ud800 y"}\n')
    refused(
        generate_main,
        ["--model", str(good_dir), "--prompts-file", str(prompts)],
        "not valid Unicode",
    )
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    refused(
        generate_main, ["--model", str(good_dir), "--prompts-file", str(fifo)], "not a regular file"
    )
    refused(
        generate_main,
        gen_argv(good_dir, "speculative.method=ngram", "speculative.tree.choices=[[0],[9000]]"),
        "rank 9000",
    )
    refused(generate_main, gen_argv(good_dir, "speculative.tree.choices=[[true]]"), "choices")


def test_nested_anchor_yaml_fails_fast(tmp_path):
    """1.1 KB of nested anchors expand to ~10^9 strings if printed; the error must stay short."""
    items = ["&a0 [" + ", ".join(["xxxxxxxxxx"] * 10) + "]"]
    for i in range(1, 10):
        items.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    p = tmp_path / "bomb.yaml"
    p.write_text("model:\n  name: [" + ", ".join(items) + "]\n")
    assert len(p.read_text()) < 1500
    refused(generate_main, ["--config", str(p), "--prompt", "hi"], "model.name")


def test_bench_and_roofline_fail_in_one_line(tmp_path):
    from jaxspec.bench.cli import main as bench_main
    from jaxspec.tools.roofline import main as roofline_main

    refused(
        bench_main,
        ["--config", "c.yaml", "--out", str(tmp_path), "--no-such-flag"],
        "unrecognized arguments",
    )
    refused(roofline_main, ["--batch", "x"], "")
    refused(roofline_main, ["model.nope=1"], "unknown key")


# ---- NaN never becomes a token ------------------------------------------------------------------


def test_draw_refuses_non_finite_weights():
    import jax.numpy as jnp

    from jaxspec.decode.sampling import INVALID_TOKEN, check_tokens, draw

    w = jnp.asarray([0.1, 0.5, 0.4])
    assert int(draw(jnp.float32(0.3), w)) == 1
    for bad in ([jnp.nan] * 3, [0.0] * 3, [0.2, jnp.nan, 0.3], [0.2, jnp.inf, 0.3]):
        assert int(draw(jnp.float32(0.3), jnp.asarray(bad, jnp.float32))) == INVALID_TOKEN
    with pytest.raises(JaxspecError, match="non-finite"):
        check_tokens(np.asarray([3, INVALID_TOKEN]))


def test_nan_weights_stop_generation_with_an_error():
    """A model whose weights turn NaN after loading (the loader refuses NaN files): the engine
    stops with an error instead of emitting the fallback token ids."""
    import dataclasses

    import jax.numpy as jnp

    from jaxspec.engine.runner import Engine
    from tiny import tiny_model

    m = tiny_model(seed=1, vocab=32, layers=1, hidden=16)
    params = dict(m.params) | {"final_norm": jnp.full_like(m.params["final_norm"], jnp.nan)}
    engine = Engine(dataclasses.replace(m, params=params))
    with pytest.raises(JaxspecError, match="non-finite"):
        engine.generate([[1, 2, 3]], max_new_tokens=3)


def test_memory_is_priced_before_allocation():
    from jaxspec.limits import check_cache_fits, kv_cache_bytes
    from jaxspec.models.llama import LlamaTarget, ModelConfig

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=30,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    )
    target, params = LlamaTarget(cfg), {"layers": ()}  # unrolled layout; only shapes are read
    lengths = 2 * 4  # int32[B]
    assert kv_cache_bytes(target, params, 2, 100) == 2 * 30 * 2 * 100 * 4 * 64 * 4 + lengths
    check_cache_fits(target, params, 1, 1024, free=1 << 30)
    with pytest.raises(JaxspecError, match="lower generation.batch_size"):
        check_cache_fits(target, params, 1_000_000, 1024, free=1 << 30)


# ---- Ctrl-C ---------------------------------------------------------------------------------------

SLOW_COMPILE = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from jaxspec.cli_support import run

    def main(argv):
        def f(x):
            for i in range(3000):  # a long unrolled program: seconds of XLA compilation
                x = jnp.sin(x @ x) + i
            return x
        print("compiling", flush=True)
        jax.jit(f).lower(jnp.ones((8, 8))).compile()
        print("compiled", flush=True)
        time.sleep(30)
        return 0

    sys.exit(run(main))
""")


@pytest.mark.parametrize("when", ["compiling", "python"])
def test_ctrl_c_exits_130_without_a_traceback(tmp_path, when):
    env = os.environ | {"JAXSPEC_XLA_CACHE": "0", "PYTHONPATH": os.getcwd()}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    script = (
        SLOW_COMPILE
        if when == "compiling"
        else SLOW_COMPILE.replace("jax.jit(f).lower(jnp.ones((8, 8))).compile()", "time.sleep(30)")
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "compiling"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)  # the bound on a hang, not a speed claim
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "compiled" not in out, err[-2000:]


# ---- properties: any single-field mutation loads or is one JaxspecError ---------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.sampled_from([0, 1, 2, 3, 4, 64, 10**7])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
CONFIG_KEYS = [
    *CONFIG,
    "head_dim",
    "rope_scaling",
    "rope_parameters",
    "num_nextn_predict_layers",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "attention_bias",
]


def _loads_or_refuses(path) -> None:
    from jaxspec.loading import load_model

    try:
        m = load_model(path, layout="unrolled")
    except JaxspecError as e:
        assert "\n" not in str(e).strip() and len(str(e)) < 2000
    else:  # what loaded is sane: positive sizes, finite hyperparameters, ids in the vocabulary
        c = m.cfg
        assert min(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) >= 1
        assert math.isfinite(c.rope_theta) and c.rope_theta > 0 and c.rms_norm_eps > 0
        assert all(0 <= i < c.vocab_size for i in m.eos_token_ids)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=st.sampled_from(CONFIG_KEYS), value=JSON_VALUES)
def test_config_json_mutations(good_dir, tmp_path_factory, key, value):
    d = Path(shutil.copytree(good_dir, tmp_path_factory.mktemp("mut") / "ckpt"))
    cfg = json.loads((d / "config.json").read_text()) | {key: value}
    (d / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity written as JSON literals
    _loads_or_refuses(d)
    shutil.rmtree(d.parent)


GGUF_KEYS = [
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "attention.key_length",
    "rope.dimension_count",
]
GGUF_VALUES = (
    st.integers(-(2**31), 2**31 - 1)
    | st.integers(0, 2**32 - 1)
    | st.floats(width=32, allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.booleans()
    | st.lists(st.integers(0, 10), min_size=1, max_size=3)
    | st.sampled_from([0, 1, 2, 3, 16, 10**6])
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=st.sampled_from(GGUF_KEYS), value=GGUF_VALUES)
def test_gguf_metadata_mutations(tmp_path_factory, key, value):
    d = tmp_path_factory.mktemp("gguf")
    _loads_or_refuses(write_gguf(d / "m.gguf", **{key: value}))
    shutil.rmtree(d)


# ---- failures that must not repeat on every run ---------------------------------------------------


def test_a_bad_cxx_fails_once_and_is_remembered(tmp_path, monkeypatch):
    from jaxspec import kernels

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd[0])
        return subprocess.CompletedProcess(cmd, 1, "", "g++: fatal error: bad flags")

    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/opt/broken/g++")
    monkeypatch.setattr(kernels.subprocess, "run", fake_run)
    for _ in range(3):
        with pytest.raises(OSError, match="bad flags"):
            kernels.build_library()
    assert calls == ["/opt/broken/g++"]  # built once; the next runs read the remembered failure


CACHE_SCRIPT = textwrap.dedent("""
    import warnings
    import jax, jax.numpy as jnp
    from jaxspec.cli_support import enable_compilation_cache
    enable_compilation_cache()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.float32(2.0)).block_until_ready()
    print(sum("persistent compilation cache" in str(x.message) for x in w))
""")


def test_a_truncated_xla_cache_entry_is_replaced(tmp_path):
    env = os.environ | {"JAXSPEC_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.getcwd()}
    for k in ("JAX_COMPILATION_CACHE_DIR", "JAXSPEC_XLA_CACHE"):
        env.pop(k, None)

    def warnings_of_a_run() -> int:
        done = subprocess.run(
            [sys.executable, "-c", CACHE_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert warnings_of_a_run() == 0
    entries = sorted((tmp_path / "xla").glob("jit__lambda*-cache"))
    assert entries
    os.truncate(entries[0], 20)
    assert warnings_of_a_run() == 1  # jax warns and recompiles once ...
    assert warnings_of_a_run() == 0  # ... and the entry it wrote back is read from then on


def test_an_entry_left_without_its_access_time_does_not_break_a_size_limited_cache(tmp_path):
    """A Ctrl-C between JAX's two writes of an entry of a size-limited cache leaves it without its
    `-atime` file; JAX's eviction then fails every later write. jaxspec restores the file."""
    env = os.environ | {"JAXSPEC_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.getcwd(),
                        "JAX_COMPILATION_CACHE_MAX_SIZE": "4000000000"}
    for k in ("JAX_COMPILATION_CACHE_DIR", "JAXSPEC_XLA_CACHE"):
        env.pop(k, None)
    script = CACHE_SCRIPT.replace("* 3 + 1", "* {} + 1")

    def warnings_of_a_run(scale: int) -> int:
        done = subprocess.run([sys.executable, "-c", script.replace("{}", str(scale))], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert warnings_of_a_run(3) == 0
    (atime,) = (tmp_path / "xla").glob("jit__lambda*-atime")
    atime.unlink()  # what the interrupted writer leaves
    assert warnings_of_a_run(5) == 0  # a new program is written, nothing fails
    assert len(list((tmp_path / "xla").glob("jit__lambda*-cache"))) == 2
