"""Plain decoding on SmolLM2-135M against transformers' generate and the memory-bandwidth floor.

    python scripts/bench_plain.py [--max-new-tokens 128] [--prompts 4] [--batch-sizes 1,8]
                                  [--layouts packed,unrolled]

Same weights (the embedded GGUF, dequantised to float32), same chat-templated prompts, greedy,
side by side in one run. Our figure is decode tokens/s (generated tokens after the first over
decode wall time; compilation and prefill excluded); HF's is new tokens over generate() wall time
minus its own measured prefill (a 1-token generate), so both count decode only.
The floor: float32 bytes of the weights one step reads (every matmul weight and the LM head; the
embedding table only by row) / measured read bandwidth (an XLA reduction over that many bytes).
Layouts: "packed" (the CPU panel kernel, what configs use on a CPU) and "unrolled" (XLA's own
matmuls), each its own row, same prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.engine.runner import Engine
from jaxspec.loading import load_model

DATA = Path(__file__).resolve().parents[1] / "data" / "spec_bench_dev.jsonl"


def read_bandwidth_gbs(nbytes: int) -> float:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = min(_timed(lambda: total(x).block_until_ready()) for _ in range(5))
    return nbytes / best / 1e9


def step_weight_bytes(params) -> int:
    """Bytes one decode step must read: all weights but the embedding table (a row lookup), which
    counts once when it doubles as the (tied) LM head."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if "lm_head" in params:
        total -= params["embed"].size * params["embed"].dtype.itemsize
    return total


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def hf_decode_tokens_per_s(model, tok, prompts, max_new, batch):
    import torch

    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rates = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        while len(chunk) < batch:
            chunk = chunk + chunk[: batch - len(chunk)]
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p in chunk]
        enc = tok(texts, return_tensors="pt", padding=True)
        kw = dict(do_sample=False, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            prefill = _timed(lambda: model.generate(**enc, max_new_tokens=1, **kw))
            t = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=max_new, min_new_tokens=max_new, **kw)
            wall = time.perf_counter() - t
        new = (out.shape[1] - enc["input_ids"].shape[1]) * batch
        rates.append((new - batch) / max(wall - prefill, 1e-9))
    return float(np.mean(rates))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--layouts", default="packed,unrolled")
    args = ap.parse_args()
    rows = [json.loads(line) for line in DATA.open()]
    prompts = [r["turns"][0] for r in rows[:: max(1, len(rows) // args.prompts)]][: args.prompts]
    batches = [int(b) for b in args.batch_sizes.split(",")]

    models = {layout: load_model("smollm2-135m", layout=layout) for layout in args.layouts.split(",")}
    model = next(iter(models.values()))
    weight_bytes = step_weight_bytes(load_model("smollm2-135m", layout="unrolled").params)
    bw = read_bandwidth_gbs(weight_bytes)
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    hf = None
    if not args.no_hf:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(os.cpu_count() or 1)
        src = Path(model.source_path)
        hf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                  torch_dtype=torch.float32).eval()
        hf_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    print(f"weights {weight_bytes / 1e6:.0f} MB, XLA read bandwidth {bw:.1f} GB/s, "
          f"floor {floor_ms:.1f} ms/token at batch 1")
    print("| batch | layout | jaxspec decode tok/s | ms/step | x floor | HF decode tok/s | jaxspec / HF |")
    print("|---|---|---|---|---|---|---|")
    for b in batches:
        batch_prompts = (prompts * b)[: max(b, len(prompts))]
        theirs = hf_decode_tokens_per_s(hf, hf_tok, batch_prompts, args.max_new_tokens, b) if hf else 0
        for layout, m in models.items():
            engine = Engine(m)
            engine.generate(batch_prompts[:b], max_new_tokens=args.max_new_tokens, batch_size=b)
            res = engine.generate(batch_prompts, max_new_tokens=args.max_new_tokens, batch_size=b)
            ours = float(np.mean([r.decode_tokens_per_s for r in res])) * b
            ms_step = b / ours * 1e3
            ratio = f"{ours / theirs:.2f}x" if theirs else "-"
            print(f"| {b} | {layout} | {ours:.1f} | {ms_step:.1f} | {ms_step / floor_ms:.2f} | "
                  f"{theirs:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
