"""Published drafter layouts on SmolLM2-135M: export the shipped Medusa heads to vLLM's layout,
write SmolLM2-sized heads in every other layout (random weights: load time does not depend on
them), and time `jaxspec.formats.load_drafter_checkpoint` for each, next to the orbax loads of
the shipped checkpoints. Writes out/formats/{...}, out/formats/medusa-vllm.yaml (a bench config
for the re-imported Medusa) and out/formats/dev.jsonl (one dev-set question per category).

    python scripts/bench_formats.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from jaxspec import formats
from jaxspec.export import export
from jaxspec.formats import tensors as T
from jaxspec.loading import load_model

OUT = Path("out/formats")


def eagle3_tensors(cfg, nd, rng, pre):
    h, n, k, hd, f, v = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    r = lambda *s: (0.02 * rng.standard_normal(s)).astype(np.float32)
    ids = np.sort(rng.choice(v, nd, replace=False))
    t2d = np.zeros(v, bool)
    t2d[ids] = True
    return {
        "fc.weight": r(h, 3 * h),
        "norm.weight": np.ones(h, np.float32),
        "lm_head.weight": r(nd, h),
        pre + "input_layernorm.weight": np.ones(h, np.float32),
        pre + "hidden_norm.weight": np.ones(h, np.float32),
        pre + "post_attention_layernorm.weight": np.ones(h, np.float32),
        pre + "self_attn.q_proj.weight": r(n * hd, 2 * h),
        pre + "self_attn.k_proj.weight": r(k * hd, 2 * h),
        pre + "self_attn.v_proj.weight": r(k * hd, 2 * h),
        pre + "self_attn.o_proj.weight": r(h, n * hd),
        pre + "mlp.gate_proj.weight": r(f, h),
        pre + "mlp.up_proj.weight": r(f, h),
        pre + "mlp.down_proj.weight": r(h, f),
        "d2t": (ids - np.arange(nd)).astype(np.int64),
        "t2d": t2d,
    }


def layer_json(cfg):
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
    }


def write_all(target, rng):
    cfg = target.cfg
    nd = 8192
    e = OUT / "eagle3"
    T.write_safetensors(e, eagle3_tensors(cfg, nd, rng, "midlayer."))
    T.write_config(
        e, {"architectures": ["LlamaForCausalLMEagle3"], **layer_json(cfg), "draft_vocab_size": nd}
    )
    s = OUT / "speculators"
    T.write_safetensors(s, eagle3_tensors(cfg, nd, rng, "layers.0."))
    T.write_config(
        s,
        {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_json(cfg),
            "draft_vocab_size": nd,
            "norm_before_residual": True,
        },
    )
    # FasterDecoding: 2 heads x 1 block, full-vocabulary projections, float16 (as it ships)
    import torch

    d, v = cfg.hidden_size, cfg.vocab_size
    sd = {}
    for i in range(2):
        sd[f"{i}.0.linear.weight"] = torch.zeros(d, d, dtype=torch.float16)
        sd[f"{i}.0.linear.bias"] = torch.zeros(d, dtype=torch.float16)
        sd[f"{i}.1.weight"] = (0.02 * torch.randn(v, d)).half()
    for name, save in (
        ("medusa_fd-pt", lambda p: torch.save(sd, p / "medusa_lm_head.pt")),
        (
            "medusa_fd-safetensors",
            lambda p: T.write_safetensors(p, {k: t.numpy() for k, t in sd.items()}),
        ),
    ):
        p = OUT / name
        p.mkdir(parents=True, exist_ok=True)
        save(p)
        T.write_config(p, {"medusa_num_heads": 2, "medusa_num_layers": 1})
    m = OUT / "mtp"
    pre = f"model.layers.{cfg.num_layers}."
    r = lambda *sh: (0.02 * rng.standard_normal(sh)).astype(np.float32)
    one = lambda: np.ones(cfg.hidden_size, np.float32)
    h, n, k, hd, f = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    T.write_safetensors(
        m,
        {
            pre + "enorm.weight": one(),
            pre + "hnorm.weight": one(),
            pre + "eh_proj.weight": r(h, 2 * h),
            pre + "shared_head.norm.weight": one(),
            pre + "input_layernorm.weight": one(),
            pre + "self_attn.q_proj.weight": r(n * hd, h),
            pre + "self_attn.k_proj.weight": r(k * hd, h),
            pre + "self_attn.v_proj.weight": r(k * hd, h),
            pre + "self_attn.o_proj.weight": r(h, n * hd),
            pre + "post_attention_layernorm.weight": one(),
            pre + "mlp.gate_proj.weight": r(f, h),
            pre + "mlp.up_proj.weight": r(f, h),
            pre + "mlp.down_proj.weight": r(h, f),
        },
    )
    T.write_config(
        m,
        {
            **layer_json(cfg),
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": cfg.num_layers,
            "num_nextn_predict_layers": 1,
        },
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    target = load_model("smollm2-135m", layout="auto")
    t0 = time.perf_counter()
    export("checkpoints/smollm2-135m-medusa", "medusa", OUT / "medusa-vllm", target=target)
    export_s = time.perf_counter() - t0
    write_all(target, np.random.default_rng(0))
    rows = []
    cases = [
        ("jaxspec (orbax, shipped)", "eagle", "checkpoints/smollm2-135m-eagle"),
        ("jaxspec (orbax, shipped)", "medusa", "checkpoints/smollm2-135m-medusa"),
        ("medusa (vLLM, exported shipped)", "medusa", OUT / "medusa-vllm"),
        ("eagle3 (original)", "eagle", OUT / "eagle3"),
        ("speculators", "eagle", OUT / "speculators"),
        ("medusa_fd (.pt, torch.load weights_only)", "medusa", OUT / "medusa_fd-pt"),
        ("medusa_fd (safetensors)", "medusa", OUT / "medusa_fd-safetensors"),
        ("mtp", "mtp", OUT / "mtp"),
    ]
    for label, method, path in cases:
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            _, dparams = formats.load_drafter_checkpoint(method, path, target)
            import jax

            jax.block_until_ready(dparams)
            times.append(time.perf_counter() - t)
        mb = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6
        rows.append((label, method, str(path), mb, min(times), float(np.median(times))))
    print(f"export of the shipped Medusa to vLLM's layout: {export_s:.2f} s (incl. orbax load)")
    print("| layout | method | checkpoint | MB on disk | load s (min) | load s (median) |")
    print("|---|---|---|---|---|---|")
    for label, method, path, mb, lo, med in rows:
        print(f"| {label} | {method} | `{path}` | {mb:.1f} | {lo:.3f} | {med:.3f} |")
    # bench inputs: the re-imported Medusa config, one dev-set question per category
    cfg = (
        Path("configs/smollm2-135m-medusa.yaml")
        .read_text()
        .replace(
            "checkpoint: checkpoints/smollm2-135m-medusa", f"checkpoint: {OUT / 'medusa-vllm'}"
        )
    )
    (OUT / "medusa-vllm.yaml").write_text(cfg)
    seen, lines = set(), []
    for line in Path(__file__).resolve().parents[1].joinpath("data", "spec_bench_dev.jsonl").read_text().splitlines():
        q = json.loads(line)
        if q["category"] not in seen:
            seen.add(q["category"])
            lines.append(line)
    (OUT / "dev.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / 'medusa-vllm.yaml'} and {OUT / 'dev.jsonl'} ({len(lines)} questions)")


if __name__ == "__main__":
    main()
