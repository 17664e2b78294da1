"""Step-cost curves and decode speed on an accelerator for real model shapes with random weights.

What speculative decoding gains on a device is set by two numbers: how many tokens a step commits
(the drafter's acceptance, a property of the model and the text) and what a verify step over a
window of w positions costs against a one-token step (a property of the device, the shapes and
the program). This measures the second for real shapes (SmolLM2-135M, Llama-3.2-1B,
Llama-3.1-8B) with random bfloat16 weights in the accelerator layout (unrolled: per-layer
weights) and the stacked one, attention on the device's kernels (the implementation read from
the compiled program), each step beside jaxspec.tools.step_model's prediction, so it runs where no
checkpoint can be brought (the weights do not change a step's cost), and then the whole loop:
plain decoding's tokens/s and n-gram speculation's steps on a repetitive prompt, side by side.

    python scripts/bench_device_shapes.py OUT_DIR [--shapes smollm2-135m,llama-3.1-8b]
        [--batches 1,8,32] [--widths 1,2,4,8,16] [--budget-s 420]

Writes OUT_DIR/shapes.json and OUT_DIR/shapes.md (a table per shape). Refuses (exit 3) on a CPU
backend unless --allow-cpu (the smoke test uses it with a tiny shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

SHAPES = {  # the published configs' sizes (config.json of each model)
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                         tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                         rope_theta=500000.0),
}


@dataclasses.dataclass(frozen=True)
class RandomModel:  # the fields of jaxspec.loading.LoadedModel the engine and calibration read
    cfg: object
    params: dict
    name: str
    tokenizer: object = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def target(self):
        from jaxspec.models import llama

        return llama.LlamaTarget(self.cfg)


def random_model(name: str, dtype: str, layout: str = "unrolled"):
    import jax

    from jaxspec.models import decoder, llama

    cfg = llama.ModelConfig(**SHAPES[name], dtype=dtype, max_position_embeddings=8192)
    params = llama.init_params(cfg, jax.random.key(0), scale=0.02)
    params = decoder.stack_layers(params) if layout == "stacked" else params
    jax.block_until_ready(params)
    return RandomModel(cfg=cfg, params=params, name=name)


def predicted(model, layout: str, batch: int, width: int, fill: int) -> dict:
    """The step's prediction by jaxspec.tools.step_model, from this device's own compile of the
    same forward (bytes, kernels, host syncs), beside the measurement; {} off a known device."""
    import jax

    from jaxspec.tools import accel_roofline, aot

    name = aot.target_of_device(jax.devices()[0].device_kind)
    if name is None:
        return {}
    place = accel_roofline.Placement(aot.target(name), jax.devices()[:1], None)
    r = accel_roofline.measure(place, model.target, layout, "decode" if width == 1 else "verify",
                               batch, width, fill + 64, fill)
    return {k: r[k] for k in ("predicted_ms", "floor_ms", "bytes_moved", "kernels", "host_syncs")}


def cost_curve(model, batches, widths, fill, layout="unrolled") -> list[dict]:
    """A verify step over each window width at each batch, in one-token steps (width 1 = 1.0),
    each with the step model's prediction beside it (widths 1 and 5 only: compiles cost)."""
    from jaxspec.decode import calibration

    rows = []
    for b in batches:
        seconds = calibration.measure_verify(model, b, widths, fill)
        base = seconds[0]
        for w, s in zip(widths, seconds):
            rows.append({"batch": b, "width": w, "fill": fill, "step_ms": 1e3 * s,
                         "cost": s / base if base else float("nan"), "layout": layout,
                         **(predicted(model, layout, b, w, fill) if w in (1, 5) else {})})
    return rows


def loop_speed(model, batch: int, new_tokens: int) -> list[dict]:
    """Plain decoding and n-gram speculation (γ 4, n 1..3) over one repetitive prompt per row."""
    import numpy as np

    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.engine.runner import Engine

    rng = np.random.default_rng(0)
    motif = [int(t) for t in rng.integers(1, model.cfg.vocab_size, size=12)]
    prompts = [motif * 8 for _ in range(batch)]
    out = []
    for label, engine in (
        ("plain", Engine(model)),
        ("ngram γ4", Engine(model, NgramDrafter(model.cfg.vocab_size, 1, 3),
                            num_speculative_tokens=4)),
    ):
        engine.generate(prompts, max_new_tokens=new_tokens, batch_size=batch)  # compile, warm
        t0 = time.perf_counter()
        results = engine.generate(prompts, max_new_tokens=new_tokens, batch_size=batch)
        wall = time.perf_counter() - t0
        tokens = sum(r.num_generated_tokens for r in results)
        out.append({
            "method": label, "batch": batch, "new_tokens": new_tokens,
            "decode_tok_s": sum(r.decode_tokens_per_s for r in results) / len(results) * batch,
            "wall_tok_s": tokens / wall,
            "mean_accepted": float(np.mean([r.metrics["mean_accepted_length"] for r in results])),
            "steps": int(sum(r.metrics["num_steps"] for r in results)),
            "attention": results[0].metrics.get("attention", ""),
            "layout": results[0].metrics.get("layout", ""),
            "same_tokens_as_plain": None,
            "token_ids": [r.token_ids for r in results],
        })
    out[1]["same_tokens_as_plain"] = out[1].pop("token_ids") == out[0]["token_ids"]
    out[0].pop("token_ids")
    out[0]["same_tokens_as_plain"] = True
    return out


def markdown(report: dict) -> str:
    lines = [f"device: {report['device']} ({report['backend']}, jax {report['jax']}), "
             f"dtype {report['dtype']}, matmul precision {report.get('precision', 'default')}, "
             "random weights", ""]
    for shape, r in report["shapes"].items():
        if "error" in r:
            lines += [f"### {shape}: {r['error']}", ""]
            continue
        lines += [f"### {shape} ({r['params_b']:.2f} B params)", "",
                  "| batch | window | step ms | cost (plain steps) | predicted ms | floor ms |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {c['batch']} | {c['width']} | {c['step_ms']:.3f} | {c['cost']:.2f} | "
                  f"{c.get('predicted_ms', '-')} | {c.get('floor_ms', '-')} |"
                  for c in r.get("cost_curve", [])]
        if r.get("loop"):
            lines += ["", "| method | batch | decode tok/s | wall tok/s | mean accepted "
                      "| attention (compiled) | layout | = plain |", "|---|---:|---:|---:|---:|---|---|---|"]
            lines += [f"| {x['method']} | {x['batch']} | {x['decode_tok_s']:.0f} | "
                      f"{x['wall_tok_s']:.0f} | {x['mean_accepted']:.2f} | {x['attention']} | "
                      f"{x['layout']} | {x['same_tokens_as_plain']} |" for x in r["loop"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--widths", default="1,2,4,8,16")
    p.add_argument("--layouts", default="unrolled,stacked",
                   help="params layouts: unrolled (the accelerator layout), stacked (lax.scan)")
    p.add_argument("--fill", type=int, default=1024, help="tokens each row holds (cost curve)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget-s", type=float, default=420.0, help="no new shape after this")
    p.add_argument("--precision", default=None, choices=["highest", "high", "default"],
                   help="jax_default_matmul_precision (highest: float32 matmuls without TF32, "
                   "to tell a near-tie from a real difference in the token comparison)")
    p.add_argument("--loop-only", action="store_true", help="skip the cost curves")
    p.add_argument("--allow-cpu", action="store_true")
    args = p.parse_args(argv)
    import jax

    if args.precision:
        jax.config.update("jax_default_matmul_precision", args.precision)
    backend = jax.default_backend()
    if backend == "cpu" and not args.allow_cpu:
        print("error: jax's backend is the CPU: these are device figures (--allow-cpu to smoke)",
              file=sys.stderr)
        return 3
    start = time.perf_counter()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    report = {"device": jax.devices()[0].device_kind, "backend": backend, "jax": jax.__version__,
              "dtype": args.dtype, "precision": args.precision or "default", "shapes": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for shape, layout in [(s, lay) for s in args.shapes.split(",")
                          for lay in args.layouts.split(",")]:
        base_shape, shape = shape, f"{shape} {layout}"
        if time.perf_counter() - start > args.budget_s:
            report["shapes"][shape] = {"error": "skipped: over the time budget"}
            continue
        print(f"== {shape} ({time.perf_counter() - start:.0f} s)", flush=True)
        try:
            model = random_model(base_shape, args.dtype, layout)
            n = sum(x.size for x in jax.tree.leaves(model.params))
            r = report["shapes"][shape] = {"params_b": n / 1e9}
            if not args.loop_only:
                r["cost_curve"] = cost_curve(model, ints(args.batches), ints(args.widths),
                                             args.fill, layout)
            print(markdown({**report, "shapes": {shape: r}}), flush=True)
            r["loop"] = [row for b in (1, 8) for row in loop_speed(model, b, args.new_tokens)]
            del model
        except Exception as e:  # one shape's failure is reported, the others still run
            report["shapes"].setdefault(shape, {})["error"] = f"{type(e).__name__}: {e}"[:500]
        (args.out / "shapes.json").write_text(json.dumps(report, indent=1))
        (args.out / "shapes.md").write_text(markdown(report))
        print(markdown({**report, "shapes": {shape: report["shapes"][shape]}}), flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
