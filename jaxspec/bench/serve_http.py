"""python -m jaxspec.bench.serve_http: jaxspec.bench.serve's Poisson load (same prompts, output
lengths, arrival times: numpy's default_rng(0)) sent over HTTP to any OpenAI-compatible server,
so `python -m jaxspec.serve` and `vllm serve` are measured by one client (issue 45).

    python -m jaxspec.bench.serve_http --url http://127.0.0.1:8000 --label jaxspec-plain \\
        --tokenizer .venv-vllm/models/smollm2-135m-instruct --rates 1 4 --requests 12 --out F.json

Each request: POST /v1/completions with the prompt as token ids (the chat template applied here,
once, so both servers get the very same ids), greedy, `max_tokens` cycled from --lengths, streamed
(SSE). TTFT = send -> first streamed piece; TPOT = (last piece - first piece) / (tokens - 1), the
token count from the final `usage`. Throughput = generated tokens / makespan. The completion texts
are kept so runs against different servers can be compared (greedy: they must be equal).
Loopback only: the URL's host must be 127.0.0.1 or localhost. Bad input: one line, exit 2.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import http.client
import json
import sys
import threading
import time
from typing import Any
from urllib.parse import urlparse

from jaxspec.cli_support import ArgumentParser
from jaxspec.cli_support import run as run_cli
from jaxspec.errors import JaxspecError

LENGTHS = (8, 16, 32)  # as jaxspec.bench.serve


def make_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m jaxspec.bench.serve_http",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server base URL (loopback), e.g. "
                   "http://127.0.0.1:8000")
    p.add_argument("--label", required=True, help="name of this server/method in the output")
    p.add_argument("--model", help="the model id to send (default: the server's first model)")
    p.add_argument("--tokenizer", required=True, help="HF dir whose tokenizer + chat template "
                   "turn the prompts into ids (the converted model dir)")
    p.add_argument("--prompts", default="data/spec_bench_dev.jsonl")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0], help="requests/s")
    p.add_argument("--max-prompt", type=int, default=192, help="prompt tokens kept (the head)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--warmup", type=int, help="untimed requests first (default: every prompt "
                   "once, as jaxspec.bench.serve: a server compiles each prompt bucket once)")
    p.add_argument("--out", help="append the runs (JSON lines) to this file")
    return p


def arrivals(rate: float, n: int) -> list[float]:
    """The same arrival times as jaxspec.bench.serve: cumulative exponential gaps, seed 0."""
    import numpy as np

    rng = np.random.default_rng(0)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()


def pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def parse_sse(lines) -> tuple[list[tuple[float, str]], dict | None]:
    """SSE lines (bytes or str, each with its arrival time: (t, line)) -> ([(t, text piece)],
    final usage or None). Pieces with no choice text (e.g. a usage-only chunk) are not pieces."""
    pieces, usage = [], None
    for t, raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if obj.get("usage"):
            usage = obj["usage"]
        for choice in obj.get("choices") or []:
            text = choice.get("text")
            if text:
                pieces.append((t, text))
    return pieces, usage


def request_figures(t_send: float, pieces, usage, t_end: float) -> dict[str, Any]:
    n = int((usage or {}).get("completion_tokens") or 0)
    first = pieces[0][0] if pieces else t_end
    last = pieces[-1][0] if pieces else t_end
    return {
        "ttft_s": first - t_send,
        "tpot_s": (last - first) / (n - 1) if n > 1 else None,
        "tokens": n,
        "text": "".join(p for _, p in pieces),
        "end_s": t_end,
    }


def post_stream(host: str, port: int, body: dict) -> tuple[float, list, dict | None, float]:
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise JaxspecError(f"{host}:{port} answered {resp.status}: {resp.read()[:200]!r}")
    stamped = []
    for line in resp:
        stamped.append((time.perf_counter(), line))
    conn.close()
    pieces, usage = parse_sse(stamped)
    return t0, pieces, usage, time.perf_counter()


def run_rate(host, port, model, prompts, lengths, rate) -> dict[str, Any]:
    times = arrivals(rate, len(prompts))
    results: list[dict | None] = [None] * len(prompts)
    errors: list[str] = []
    t_start = time.perf_counter()

    def one(i):
        try:
            body = {"model": model, "prompt": prompts[i], "max_tokens": lengths[i % len(lengths)],
                    "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0, pieces, usage, t1 = post_stream(host, port, body)
            results[i] = request_figures(t0, pieces, usage, t1)
        except Exception as e:  # noqa: BLE001 - reported with the run
            errors.append(f"request {i}: {e}")

    threads = []
    for i, at in enumerate(times):
        delay = t_start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    if errors:
        raise JaxspecError(f"{len(errors)} requests failed: {errors[0]}")
    makespan = max(r["end_s"] for r in results) - t_start
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    return {
        "rate": rate, "requests": len(prompts), "tokens": tokens, "makespan_s": makespan,
        "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "texts": [r["text"] for r in results],
    }


def chat_prompts(tokenizer_dir: str, path: str, n: int, max_prompt: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from jaxspec.bench.serve import load_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for text in load_prompts(path, n):
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append([int(t) for t in ids][:max_prompt])
    return out


def first_model(host: str, port: int) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    return models["data"][0]["id"]


def run(argv=None) -> int:
    args = make_parser().parse_args(argv)
    url = urlparse(args.url)
    if url.hostname not in ("127.0.0.1", "localhost") or not url.port:
        raise JaxspecError(f"--url {args.url}: use a loopback URL with a port, "
                           "e.g. http://127.0.0.1:8000")
    host, port = url.hostname, url.port
    prompts = chat_prompts(args.tokenizer, args.prompts, args.requests, args.max_prompt)
    model = args.model or first_model(host, port)
    warmup = len(prompts) if args.warmup is None else args.warmup
    for i in range(warmup):  # untimed: first calls (compiles, caches) out of the window
        post_stream(host, port, {"model": model, "prompt": prompts[i % len(prompts)],
                                 "max_tokens": 8, "temperature": 0.0, "stream": True,
                                 "stream_options": {"include_usage": True}})
    for rate in args.rates:
        fig = {"label": args.label, "url": args.url, "model": model,
               "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        fig |= run_rate(host, port, model, prompts, args.lengths, rate)
        print(json.dumps({k: v for k, v in fig.items() if k != "texts"}), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(fig) + "\n")
    return 0


def main(argv=None) -> int:
    return run_cli(run, argv)  # one error line and exit 2 on bad input, 130 on Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
