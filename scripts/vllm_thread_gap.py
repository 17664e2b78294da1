"""Why jaxspec's plain decoding trails vLLM's on this machine (issue 45): both engines' batch-1
step time under the same cores, thread counts and competing load, interleaved, with the float32
weight-bandwidth floor measured in the same rounds.

    taskset -c 0   python scripts/vllm_thread_gap.py --out bench_out/gap/cpu0.jsonl
    taskset -c 0,1 python scripts/vllm_thread_gap.py --out bench_out/gap/cpu01.jsonl

Run under `taskset`: the affinity is the experiment's one knob on threads, inherited by both
engines. XLA:CPU sizes its intra-op pool (which jaxspec's panel-matmul kernel and XLA's own ops
split work over) from the process's allowed CPUs; vLLM's OpenMP threads are bound to the same
list (VLLM_CPU_OMP_THREADS_BIND, set here from the affinity). The competing load: `--busy K...`
CPU-bound spinners (child processes, same affinity), added per condition and killed after it,
so the cost curve of each engine against oversubscription is measured, not guessed, on a
machine whose other tenants add their own (recorded: the 1-minute load average per round).

Per condition and round: one prompt through jaxspec plain (Engine, packed layout, greedy), the
same token ids through vLLM plain (the peer runner, stepped engine), order alternating by round,
and the faster of one XLA `jnp.sum` and one numpy sum over the step's weight bytes (the floor:
reading every float32 weight once). ms/token = decode time / (tokens - 1).
"CPU cores held": each engine's CPU seconds (all its threads and processes) over its wall seconds
for the request: how much of the contended cores it got, next to how fast it went.
Writes one JSON line per measurement (FILE is replaced) and prints the median table
(jaxspec.bench.vllm_tables gap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def spinners(k: int) -> list[subprocess.Popen]:
    code = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(k)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))

    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_plain import step_weight_bytes

    from jaxspec.bench.vllm_peer import Runner, model_dir
    from jaxspec.engine.runner import Engine
    from jaxspec.loading import load_model

    rows = [json.loads(line) for line in (ROOT / "data/spec_bench_dev.jsonl").open()]
    texts = [r["turns"][0] for r in rows[:: len(rows) // 6]][:6]
    model = load_model("smollm2-135m", layout="packed")
    engine = Engine(model)
    prompts = [engine.encode(t) for t in texts]
    wbytes = step_weight_bytes(load_model("smollm2-135m", layout="unrolled").params)
    floor_x = jnp.ones((wbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(floor_x).block_until_ready()
    floor_np = np.ones((wbytes // 4,), np.float32)
    engine.generate([prompts[0]], max_new_tokens=args.max_new_tokens)  # compiles out of the window

    t0 = time.perf_counter()
    vllm = Runner("vllm_plain", {"model": str(model_dir()), "dtype": "float32",
                                 "speculative_config": None, "enforce_eager": args.vllm_eager,
                                 "warmup_prompt_token_ids": prompts[0]},
                  Path(args.out).with_suffix(".vllm.log"), None)
    ready = vllm.read()
    head = {"cpus": cpus, "xla_devices": len(jax.devices()), "weight_bytes": wbytes,
            "vllm_startup_s": ready.get("startup_s"), "vllm_warmup_s": ready.get("warmup_s"),
            "vllm_torch_threads": ready.get("torch_threads"), "vllm_eager": args.vllm_eager,
            "vllm_ready_wall_s": time.perf_counter() - t0}
    print(json.dumps(head), flush=True)
    out = open(args.out, "w")  # noqa: SIM115
    out.write(json.dumps({"event": "start", **head}) + "\n")

    import psutil

    def vllm_cpu_s() -> float:  # the runner and its engine processes, all threads
        root = psutil.Process(vllm.proc.pid)
        procs = [root, *root.children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    def ours(ids):
        c = time.process_time()
        w = time.perf_counter()
        r = engine.generate([ids], max_new_tokens=args.max_new_tokens)[0]
        cpu, wall = time.process_time() - c, time.perf_counter() - w
        return r.num_generated_tokens, 1e3 / r.decode_tokens_per_s, r.token_ids, cpu / wall

    def theirs(ids):
        c = vllm_cpu_s()
        w = time.perf_counter()
        ev = vllm.request({"id": "gap", "prompt_token_ids": ids,
                           "max_new_tokens": args.max_new_tokens,
                           "stop_token_ids": list(model.eos_token_ids)})
        cpu, wall = vllm_cpu_s() - c, time.perf_counter() - w
        n = len(ev["token_ids"])
        return n, 1e3 * ev["decode_s"] / max(n - 1, 1), ev["token_ids"], cpu / wall

    try:
        for k in args.busy:
            busy = spinners(k)
            time.sleep(1.0)
            try:
                for rnd in range(args.rounds):
                    for i, ids in enumerate(prompts[:2]):
                        order = [("jaxspec", ours), ("vllm", theirs)]
                        if (rnd + i) % 2:
                            order.reverse()
                        got = {}
                        for name, fn in order:
                            n, ms, toks, cores = fn(ids)
                            got[name] = toks
                            rec = {"busy": k, "round": rnd, "prompt": i, "engine": name,
                                   "tokens": n, "ms_per_token": ms, "cpu_cores_used": cores,
                                   "load1": os.getloadavg()[0]}
                            out.write(json.dumps(rec) + "\n")
                        t = time.perf_counter()
                        total(floor_x).block_until_ready()
                        t1 = time.perf_counter()
                        floor_np.sum()
                        fl = min(t1 - t, time.perf_counter() - t1) * 1e3
                        out.write(json.dumps({"busy": k, "round": rnd, "prompt": i,
                                              "engine": "floor", "ms_per_token": fl,
                                              "same_tokens": got["jaxspec"] == got["vllm"]})
                                  + "\n")
                        out.flush()
            finally:
                stop(busy)
    finally:
        vllm.close()
        out.close()
    from jaxspec.bench.vllm_tables import gap_lines, read_jsonl

    print("\n".join(gap_lines(read_jsonl(Path(args.out)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
