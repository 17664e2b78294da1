"""Regenerate tests/data/gguf/qwen3_5*.gguf and qwen3_next.gguf: tiny random Qwen3.5 (dense),
Qwen3.5-MoE and Qwen3-Next checkpoints written by transformers, converted by llama.cpp's own `convert_hf_to_gguf.py` (the
copy vendored in the llama-cpp-python sdist), with transformers' logits and greedy tokens beside
them (`qwen3_5_reference.npz`) for tests/test_qwen3_5_gguf.py.

The converter runs unchanged except that it writes no vocabulary (the tiny checkpoints have no
tokenizer; its tokenizer code reads the Hub's): the tensor names and value changes under test
(A_log -> -exp(A_log), (1 + w) norms stored as w + 1, value heads regrouped, conv squeezed,
experts stacked) are all its own.

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/sdist
    python scripts/qwen3_5_gguf_fixtures.py --sdist /tmp/sdist/llama_cpp_python-0.3.36.tar.gz \
        [--only qwen3_next]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).parents[1] / "tests" / "data" / "gguf"
VOCAB = 96
PROMPT = [5, 17, 42, 8, 91, 33, 17, 42, 8, 60, 12, 77]
NEW = 24
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 48}

# run inside the sdist's llama.cpp: the real converter, its vocabulary step skipped
RUNNER = """
import sys
from conversion import qwen
for cls in (qwen.Qwen3_5TextModel, qwen.Qwen3_5MoeTextModel, qwen.Qwen3NextModel):
    cls.set_vocab = lambda self: None
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
convert_hf_to_gguf.main()
"""


FAMILIES = {"qwen3_5": 3, "qwen3_5_moe": 7, "qwen3_next": 11}  # name -> torch seed


def hf_model(name: str):
    import torch
    import transformers as tr

    torch.manual_seed(FAMILIES[name])
    if name == "qwen3_next":  # llama.cpp's `qwen3next`: fused qkvz / ba split by the converter
        model = tr.Qwen3NextForCausalLM(tr.Qwen3NextConfig(**COMMON, **MOE,
                                                           intermediate_size=64))
    elif name == "qwen3_5_moe":
        model = tr.Qwen3_5MoeForCausalLM(tr.Qwen3_5MoeTextConfig(**COMMON, **MOE))
    else:
        model = tr.Qwen3_5ForCausalLM(tr.Qwen3_5TextConfig(**COMMON, intermediate_size=96))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                continue
            if "norm" in name:  # (1 + w) norms around 0, the gated norm's w around 1
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.3 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3 if "embed" in name else 0.2)
    model.set_attn_implementation("eager")
    return model.eval()


def reference(model) -> dict:
    """Logits of the prompt (one forward) and NEW greedy tokens, transformers' own."""
    import torch

    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0].numpy()
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return {"logits": logits.astype(np.float32), "greedy": out[0, len(PROMPT):].numpy()}


def llama_cpp_dir(sdist: Path, work: Path) -> Path:
    if sdist.is_dir():
        return sdist
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and (
            m.name.endswith("convert_hf_to_gguf.py") or "/conversion/" in m.name
            or "/gguf-py/" in m.name)]
        tar.extractall(work, members=members, filter="data")
    return next(work.glob("*/vendor/llama.cpp"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, required=True,
                    help="llama-cpp-python 0.3.36 sdist (.tar.gz) or its vendor/llama.cpp dir")
    ap.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES),
                    help="regenerate these fixtures (the others' references are kept)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    ref_file = OUT / "qwen3_5_reference.npz"
    refs = dict(np.load(ref_file)) if ref_file.exists() else {}
    refs["prompt"] = np.asarray(PROMPT, np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        conv = llama_cpp_dir(args.sdist, tmp / "src")
        for name in args.only:
            model = hf_model(name)
            model.save_pretrained(tmp / name)
            for k, v in reference(model).items():
                refs[f"{name}/{k}"] = v
            out = OUT / f"{name}.gguf"
            subprocess.run([sys.executable, "-c", RUNNER, str(tmp / name), "--outfile", str(out),
                            "--outtype", "f32", "--no-mtp"], cwd=conv, check=True)
            print(f"wrote {out} ({out.stat().st_size} bytes)")
    np.savez_compressed(ref_file, **refs)


if __name__ == "__main__":
    main()
