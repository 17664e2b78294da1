"""Writes tests/data/reference/gemma3_270m_greedy.json: transformers' own greedy tokens for the
real Gemma 3 270M GGUF (its own load of the file, float32, EOS off), which tests/test_families.py
compares jaxspec's greedy tokens with.

transformers' load of the 262k-vocabulary GGUF took ~70 s of the suite's time on every run; the
file it answers for is pinned by its name, size and sha256 (the test refuses another file), and
transformers' parity with jaxspec on the same family runs live in the suite on tiny checkpoints
(test_families.py's logits and greedy past the window, test_gemma_gguf.py's GGUF logits).
Rerun after changing the prompts, the checkpoint or the transformers version:

    python scripts/gemma3_270m_reference.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "gemma3_270m_greedy.json"
PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Speculative decoding is a technique that")
NEW_TOKENS = 16


def file_identity(path: Path) -> dict:
    """name, size and sha256 of the checkpoint file (what the reference answers for)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from jaxspec.loading.registry import find_packaged_file, short_names
    from jaxspec.loading.tokenizer import quiet

    model_file = short_names()["gemma3-270m"]
    path = find_packaged_file(model_file)
    if path is None:
        raise SystemExit(f"Gemma 3 270M is not installed: {model_file.install_hint}")
    torch.set_num_threads(1)
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, min_length=0, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    model.generation_config.eos_token_id = None  # an unset field would fall back to it
    rows = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), generation_config=gen)
        rows.append({"prompt": text, "prompt_ids": ids, "greedy": out[0, len(ids):].tolist()})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "what": "transformers' greedy tokens (generate, do_sample=False, EOS off, float32) for "
                "the real Gemma 3 270M GGUF; written by scripts/gemma3_270m_reference.py",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "checkpoint": file_identity(path), "new_tokens": NEW_TOKENS, "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
