"""The vLLM side of `python -m jaxspec.bench --peers vllm`: ONE vLLM engine (one method), run in
the vLLM peer's own venv (scripts/setup_vllm_peer.sh), driven over a line protocol so that the
bench can interleave it prompt by prompt with jaxspec's engines. Imports nothing from jaxspec (the
vLLM venv has no jax); everything it knows comes from its one JSON argument:

    .venv-vllm/bin/python jaxspec/bench/vllm_runner.py '{"model": DIR, "dtype": "float32",
        "speculative_config": null | {...}, "max_model_len": 1024, "threads": 1,
        "warmup_prompt_token_ids": [...]}'

Protocol (stdout carries only these JSON lines; vLLM's own output is sent to stderr):
  -> {"event": "ready", "startup_s", "warmup_s", "vllm_version", "torch_threads"}
  <- {"id": ..., "prompt_token_ids": [...], "max_new_tokens": M, "stop_token_ids": [...]}
  -> {"event": "result", "id", "token_ids", "ttft_s", "decode_s", "num_steps", "wall_s", "cpu_s"}
  <- EOF: exit 0.      On a failure: {"event": "error", "error": "..."} and exit 1.

Timing comes from stepping vLLM's own engine (LLMEngine.step, DELTA outputs): ttft_s is the time
to the output carrying the first token (prefill), decode_s the time from there to the last one,
num_steps the outputs after the first (one per target forward: with speculation each carries the
accepted drafts plus one token, so (tokens - 1) / num_steps is the mean accepted length).
cpu_s: CPU seconds the runner and its engine processes spent on the request (all threads; on a
shared machine wall time also measures the neighbours).
"""

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print("usage: python jaxspec/bench/vllm_runner.py SPEC_JSON  (in the vLLM venv; "
              "started by python -m jaxspec.bench --peers vllm)")
        return 0 if len(argv) == 2 else 2
    # Keep the protocol channel clean: fd 1 becomes stderr for every library print and log.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = json.loads(argv[1])
    try:
        engine, info = start(spec)
        emit(proto, {"event": "ready", **info})
        for line in sys.stdin:
            if line.strip():
                emit(proto, {"event": "result", **generate(engine, json.loads(line))})
    except Exception as e:  # reported on the channel: the bench prints it as one line
        emit(proto, {"event": "error", "error": f"{type(e).__name__}: {' '.join(str(e).split())}"})
        return 1
    return 0


def emit(proto, obj: dict) -> None:
    proto.write(json.dumps(obj) + "\n")
    proto.flush()


def start(spec: dict):
    """Build the engine (vLLM's start-up: weights, torch.compile, KV space) and warm it up on
    one prompt; both timed and reported apart from the measured requests."""
    import torch

    t0 = time.perf_counter()
    from vllm import LLM, __version__

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        seed=0,
        max_model_len=spec.get("max_model_len", 1024),
        max_num_seqs=spec.get("max_num_seqs", 1),
        enable_prefix_caching=False,  # every prompt is computed, as in jaxspec's batch-1 bench
        enforce_eager=spec.get("enforce_eager", False),
        # batch 1 x 1k tokens of SmolLM2 is ~50 MB of KV: 256 MiB, not the CPU default of GiBs
        kv_cache_memory_bytes=int(spec.get("kv_cache_memory_bytes", 256 << 20)),
        speculative_config=spec.get("speculative_config"),
    )
    engine = llm.llm_engine
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = spec.get("warmup_prompt_token_ids") or [1, 2, 3, 4]
    for _ in range(2):
        generate(engine, {"id": "warmup", "prompt_token_ids": warm, "max_new_tokens": 16})
    info = {
        "startup_s": startup,
        "warmup_s": time.perf_counter() - t0,
        "vllm_version": __version__,
        "torch_threads": torch.get_num_threads(),
        "speculative_config": spec.get("speculative_config"),
    }
    engine._jaxspec_llm = llm  # keep the LLM (and its engine process) alive
    return engine, info


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live descendant (vLLM's engine core
    runs in a child process), read from /proc (0.0 where it cannot be read)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, ticks
    mine, total, grew = {os.getpid()}, 0, True
    while grew:
        more = {pid for pid, (ppid, _) in stats.items() if ppid in mine and pid not in mine}
        mine |= more
        grew = bool(more)
    total = sum(stats[pid][1] for pid in mine if pid in stats)
    return total / tick


def generate(engine, req: dict) -> dict:
    """One greedy request through the engine, stepped to completion."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(req["max_new_tokens"]),
        stop_token_ids=list(req.get("stop_token_ids") or []),
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    rid = f"r{time.monotonic_ns()}"
    tokens: list[int] = []
    stamps: list[float] = []  # time of each output that carried tokens
    cpu0 = tree_cpu_seconds()
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": list(req["prompt_token_ids"])}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = out.outputs[0].token_ids if out.outputs else []
            if new:
                tokens += list(new)
                stamps.append(time.perf_counter())
    wall = time.perf_counter() - t0
    cpu = tree_cpu_seconds() - cpu0
    ttft = stamps[0] - t0 if stamps else wall
    return {
        "id": req.get("id"),
        "token_ids": tokens,
        "ttft_s": ttft,
        "decode_s": stamps[-1] - stamps[0] if stamps else 0.0,
        "num_steps": max(len(stamps) - 1, 0),
        "wall_s": wall,
        "cpu_s": cpu,
    }


if __name__ == "__main__":  # vLLM spawns its engine process: nothing may run on import
    sys.exit(main(sys.argv))
