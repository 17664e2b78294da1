"""Regenerate tests/data/gguf/gemma4.gguf: a tiny random Gemma 4 (text) checkpoint written by
transformers, converted by llama.cpp's own `convert_hf_to_gguf.py` (the copy vendored in the
llama-cpp-python sdist, `conversion/gemma.py`'s `Gemma4Model`), with transformers' logits and
greedy tokens beside it (`gemma4_reference.npz`) for tests/test_gemma4_gguf.py.

The converter runs unchanged except that it writes no vocabulary (the tiny checkpoint has no
tokenizer; its tokenizer code reads the Hub's). Its embedding step trims the table to the
tokenizer's size, read from tokenizer.json: a stub naming VOCAB tokens keeps every row.

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/sdist
    python scripts/gemma4_gguf_fixtures.py --sdist /tmp/sdist/llama_cpp_python-0.3.36.tar.gz
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from qwen3_5_gguf_fixtures import NEW, OUT, PROMPT, llama_cpp_dir, reference

VOCAB = 96
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "full_attention"]

# run inside the sdist's llama.cpp: the real converter, its vocabulary step skipped
RUNNER = """
import sys
from conversion import gemma
gemma.Gemma4Model.set_vocab = lambda self: None
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
convert_hf_to_gguf.main()
"""


def hf_model(seed: int = 5):
    """Every Gemma 4 ingredient the converter keeps: sliding and full layers with their own head
    dims and kv heads, proportional RoPE on the global layers, the last two layers sharing k/v,
    per-layer input embeddings, a double-wide MLP on the sharing layers, the MoE block, soft-cap,
    values equal to keys on the global layers (no `attn_v` written for them): tests/test_gemma4.py's
    shape, a narrower MLP."""
    import torch
    import transformers as tr

    torch.manual_seed(seed)
    cfg = tr.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=6,
        layer_types=LAYER_TYPES, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=16, final_logit_softcapping=30.0,
        pad_token_id=0, bos_token_id=2, eos_token_id=1)
    model = tr.Gemma4ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = "norm" in name or "scale" in name  # multipliers drawn around one
            p.copy_((1.0 if scale else 0.0) + 0.3 * torch.randn_like(p))
        model.model.embed_tokens.weight.mul_(0.05 / 0.3)
    model.set_attn_implementation("eager")
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, required=True,
                    help="llama-cpp-python 0.3.36 sdist (.tar.gz) or its vendor/llama.cpp dir")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        conv = llama_cpp_dir(args.sdist, tmp / "src")
        model = hf_model()
        model.save_pretrained(tmp / "gemma4")
        stub = {"model": {"vocab": {f"t{i}": i for i in range(VOCAB)}}, "added_tokens": []}
        (tmp / "gemma4" / "tokenizer.json").write_text(json.dumps(stub))
        refs = {"prompt": np.asarray(PROMPT, np.int32), **reference(model)}
        assert len(refs["greedy"]) == NEW
        out = OUT / "gemma4.gguf"
        subprocess.run([sys.executable, "-c", RUNNER, str(tmp / "gemma4"), "--outfile", str(out),
                        "--outtype", "f32"], cwd=conv, check=True)
        print(f"wrote {out} ({out.stat().st_size} bytes)")
    np.savez_compressed(OUT / "gemma4_reference.npz", **refs)


if __name__ == "__main__":
    main()
