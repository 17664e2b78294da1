"""Gemma 4 (text) from GGUF (`models/gemma4_gguf.py`) against transformers.

tests/data/gguf/gemma4.gguf is a tiny random Gemma 4 converted by llama.cpp's own
convert_hf_to_gguf.py (scripts/gemma4_gguf_fixtures.py regenerates it, with transformers' prompt
logits and 24 greedy tokens in gemma4_reference.npz): sliding and full layers with their own
head dims (16 / 32) and kv heads (2 / 1), proportional RoPE on a quarter of the global dims (the
converter's `rope_freqs` tensor), values equal to keys on global layers (no `attn_v`), the last
two layers sharing k/v, per-layer input embeddings, a double-wide MLP on the sharing layers, the
MoE block, final soft-cap. Its logits equal transformers' and the engine's greedy tokens equal
transformers' generate; readers that drop one of the converter's conventions (norms read with
Gemma 3's +1 offset, the rope_freqs share ignored) fail; llama.cpp's `gemma4` tokenizer metadata
builds the tokenizer; files jaxspec cannot read are refused in one line naming what it reads.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.loading import load_model
from jaxspec.models import base

GGUF = Path(__file__).parent / "data" / "gguf" / "gemma4.gguf"


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(GGUF.with_name("gemma4_reference.npz")))


def prompt_logits(loaded, prompt) -> np.ndarray:  # [T, V]
    cache = loaded.target.init_cache(loaded.params, 1, 64)
    out = loaded.target.forward(loaded.params, jnp.asarray(prompt)[None], cache)
    return np.asarray(loaded.target.logits(loaded.params, out.hidden))[0]


def test_gguf_from_llama_cpps_converter_matches_transformers(reference):
    from jaxspec.engine.runner import Engine

    loaded = load_model(GGUF)
    cfg = loaded.target.cfg
    assert loaded.target.name == "gemma4" and loaded.layout == "unrolled"
    assert cfg.sliding == (True, False, True, True, False)
    assert cfg.heads == ((2, 16), (1, 32), (2, 16), (2, 16), (1, 32))
    assert cfg.kv_source == (0, 1, 2, 2, 1) and cfg.k_eq_v == (False, True, False, False, True)
    assert cfg.rope_global_partial == 0.25 and cfg.mlp_width == (64, 64, 64, 128, 128)
    assert (cfg.ple_dim, cfg.num_experts, cfg.top_k) == (8, 4, 2)
    prompt = [int(t) for t in reference["prompt"]]
    ref = reference["logits"]
    assert np.abs(prompt_logits(loaded, prompt) - ref).max() < 2e-4 * np.abs(ref).max()
    model = base.Model(target=loaded.target, params=loaded.params, eos_token_ids=(-1,))
    (out,) = Engine(model).generate([prompt], max_new_tokens=len(reference["greedy"]))
    assert out.token_ids == [int(t) for t in reference["greedy"]]


@pytest.mark.parametrize("broken", ["norms read with Gemma 3's +1", "rope_freqs ignored"])
def test_gguf_read_without_a_converter_convention_fails(monkeypatch, reference, broken):
    from jaxspec.models import gemma4_gguf

    if broken.startswith("norms"):
        monkeypatch.setattr(gemma4_gguf, "NORM_SHIFT", 1.0)
    else:
        monkeypatch.setattr(gemma4_gguf, "rotated_share", lambda header, head_dim, source: 1.0)
    loaded = load_model(GGUF)
    ref = reference["logits"]
    assert np.abs(prompt_logits(loaded, [int(t) for t in reference["prompt"]]) - ref).max() > 1e-2


def rewrite(path: Path, *, fields: dict | None = None, tensors=lambda name, x: x, add=None):
    """A copy of the fixture with metadata values replaced, tensors changed (None: dropped) and
    `add(writer)` writing more metadata."""
    import gguf

    src = gguf.GGUFReader(GGUF)
    w = gguf.GGUFWriter(str(path), "gemma4")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (fields or {}).get(key, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)
    if add is not None:
        add(w)
    for t in src.tensors:
        x = tensors(t.name, np.array(t.data))
        if x is not None:
            w.add_tensor(t.name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case, what", [
    ("scaled rope_freqs", "rope_freqs other than proportional"),
    ("partial sliding RoPE", "partial RoPE on sliding layers"),
    ("MoE on some layers", "the MoE block on some layers only"),
])
def test_unreadable_gguf_is_refused_in_one_line(tmp_path, case, what):
    if case == "scaled rope_freqs":
        path = rewrite(tmp_path / "x.gguf", tensors=lambda n, x: x * 0.5 if n == "rope_freqs.weight"
                       else x)
    elif case == "partial sliding RoPE":
        path = rewrite(tmp_path / "x.gguf", fields={"gemma4.rope.dimension_count_swa": 8})
    else:
        path = rewrite(tmp_path / "x.gguf",
                       tensors=lambda n, x: None if n.startswith("blk.0.ffn_gate_inp.") else x)
    with pytest.raises(JaxspecError) as e:
        load_model(path)
    msg = str(e.value)
    assert what in msg and "Gemma 4 GGUF in jaxspec reads" in msg and "\n" not in msg


def test_gemma4_tokenizer_metadata_builds_the_tokenizer(tmp_path):
    """llama.cpp writes Gemma 4's vocabulary as tokenizer model `gemma4` (the fixture has none:
    a 96-token one is added here); the loaded model's tokenizer round-trips text and its EOS is
    the file's."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *"\u2581abcdefghijklmnopqrstuvwxyz",
              "\u2581the", "\u2581a", "he", "th", "in"]
    tokens += [f"<0x{i:02X}>" for i in range(96 - len(tokens))]

    def add(w):
        w.add_tokenizer_model("gemma4")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * 4 + [-float(i) for i in range(92)])
        w.add_token_types([3, 3, 3, 2] + [6 if t.startswith("<0x") else 1 for t in tokens[4:]])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)

    loaded = load_model(rewrite(tmp_path / "tok.gguf", add=add))
    ids = loaded.tokenizer.encode("the heat", add_special_tokens=False)
    assert loaded.tokenizer.decode(ids) == "the heat" and max(ids) < 96
    assert tuple(loaded.eos_token_ids) == (1,)
