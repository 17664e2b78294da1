"""python scripts/serve_long_request.py: one long-context request through the real server
(`python -m jaxspec.serve` over loopback), with the memory it took (issue 61).

Starts the server on a free port with one slot of `--context` KV slots (prompts in chunks of
`--chunk` tokens, precompile off: the request's own programs compile on arrival), sends one
/v1/completions request whose prompt is `--tokens` tokens of Spec-Bench questions run together,
and prints one JSON line: prompt tokens the server counted, completion tokens, wall seconds, the
server process's peak resident memory (VmHWM), the KV pool's size (pages x page bytes from the
config) and /health. The server is stopped at the end.

    PYTHONPATH=$PWD python scripts/serve_long_request.py --config configs/smollm2-135m.yaml \\
        --tokens 8000 --context 8192
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, body: dict | None = None, timeout: float = 5.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2-135m.yaml")
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens")
    ap.add_argument("--context", type=int, default=8192, help="serving.max_context")
    ap.add_argument("--chunk", type=int, default=2048, help="serving.prefill_chunk")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()

    import gguf

    from jaxspec.config import load_config
    from jaxspec.loading import resolve
    from jaxspec.loading.tokenizer import load_gguf_tokenizer

    sys.path.insert(0, os.path.dirname(__file__))
    from bench_context import prompt_ids

    path = resolve(load_config(args.config).model.name).path  # a GGUF (the shipped models)
    tokenizer = load_gguf_tokenizer(path, gguf.GGUFReader(path))
    prompt = tokenizer.decode(prompt_ids(tokenizer, args.tokens))
    port = free_port()
    cmd = [sys.executable, "-m", "jaxspec.serve", "--config", args.config, "--port", str(port),
           "--quiet", "-o", "serving.slots=1", "-o", f"serving.max_context={args.context}",
           "-o", f"serving.prefill_chunk={args.chunk}", "-o", "serving.precompile=false",
           "-o", "serving.prefix_cache=false", "-o", f"serving.request_timeout_s={args.timeout}"]
    server = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if get(base + "/ready").get("status") == "ready":
                    break
            except OSError:
                pass
            time.sleep(1)
        t0 = time.perf_counter()
        out = get(base + "/v1/completions", {"model": "any", "prompt": prompt,
                                             "max_tokens": args.max_tokens, "temperature": 0},
                  timeout=args.timeout)
        wall = time.perf_counter() - t0
        health = get(base + "/health")
        print(json.dumps({
            "config": args.config, "max_context": args.context, "prefill_chunk": args.chunk,
            "prompt_tokens": out["usage"]["prompt_tokens"],
            "completion_tokens": out["usage"]["completion_tokens"],
            "finish_reason": out["choices"][0]["finish_reason"], "wall_s": round(wall, 1),
            "server_peak_rss_mb": round(peak_rss_mb(server.pid), 1),
            "kv_pages": health.get("kv_pages"), "health": health,
        }), flush=True)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
