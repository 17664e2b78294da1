"""Write a GGUF model (default: the shipped SmolLM2-135M-Instruct) as an HF safetensors dir:
weights dequantised by transformers' own GGUF reader (the same float32 values jaxspec's loader
computes), tokenizer and chat template included. vLLM's CPU backend reads this, not the GGUF.

    python scripts/gguf_to_hf.py --out .venv-vllm/models/smollm2-135m-instruct [--gguf FILE]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory to write (created)")
    ap.add_argument("--gguf", help="GGUF file (default: the shipped smollm2-135m)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.gguf:
        gguf = Path(args.gguf)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from jaxspec.loading import resolve

        gguf = resolve("smollm2-135m").path
    if not gguf.is_file():
        print(f"error: {gguf}: no such GGUF file (pass --gguf FILE)", file=sys.stderr)
        return 2
    out = Path(args.out)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, args.dtype)
    )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tok, "chat_template", None):
        print(f"error: {gguf} carries no chat template", file=sys.stderr)
        return 2
    # The weights are already dequantised; only the GGUF marker blocks saving them as such.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"wrote {out} ({args.dtype}) from {gguf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
