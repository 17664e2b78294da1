"""A SmolLM2 server's start and memory, measured from outside: `python -m jaxspec.serve` with
its caches private (JAXSPEC_CACHE_DIR: the serving-program store and the XLA cache), started
cold (empty caches, every program compiled) or warm (the same directory again: a restart);
seconds to /ready with the server's own lines timed on the way (model loaded, engine built,
programs loaded/compiled), resident memory (VmRSS) at ready, then after a soak of mixed
requests from 2 clients (chat, streamed, sampled, penalties + logprobs, echo + logprobs) with
every status counted and /health's pages and unprepared program calls. Then SIGTERM.

    python scripts/measure_server_start.py --cache out/srv-default --soak-s 120   # cold, then:
    python scripts/measure_server_start.py --cache out/srv-default --soak-s 120   # warm restart
    python scripts/measure_server_start.py --cache out/srv-small --soak-s 0 \\
        serving.slots=1 serving.max_context=256                            # a reduced config
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

KEYS = ("loading", "building the engine", "programs loaded", "resident memory", "ready",
        "listening")


def rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:")) / 1e9


def post(url: str, path: str, body: dict) -> int:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def mixed(i: int) -> tuple[str, dict]:
    text = f"Tell me about lighthouses, part {i}."
    kinds = [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                       "max_tokens": 24}),
             ("/v1/completions", {"prompt": text, "max_tokens": 16, "stream": True}),
             ("/v1/completions", {"prompt": text, "max_tokens": 16, "temperature": 0.8,
                                  "seed": i, "top_p": 0.9}),
             ("/v1/completions", {"prompt": text, "max_tokens": 12, "presence_penalty": 0.5,
                                  "repetition_penalty": 1.2, "logprobs": 3}),
             ("/v1/completions", {"prompt": text * (1 + i % 5), "max_tokens": 1, "echo": True,
                                  "logprobs": 1})]
    path, body = kinds[i % len(kinds)]
    return path, {"temperature": 0} | body


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=60) as r:
        return json.loads(r.read())


def soak(url: str, seconds: float) -> collections.Counter:
    codes, stop = collections.Counter(), time.time() + seconds

    def client(k: int) -> None:
        i = k
        while time.time() < stop:
            try:
                codes[post(url, *mixed(i))] += 1
            except OSError as e:  # the server went away: counted, the soak ends
                codes[type(e).__name__] += 1
                return
            i += 2

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True, help="the private cache directory (kept)")
    ap.add_argument("--soak-s", type=float, default=120.0)
    ap.add_argument("--config", default="configs/smollm2-135m.yaml")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    env = dict(os.environ, JAXSPEC_CACHE_DIR=os.path.abspath(a.cache), JAXSPEC_PROGRESS="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "jaxspec.serve", "--config", a.config,
                             "--port", "0", *a.overrides], text=True, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []
    threading.Thread(target=lambda: lines.extend((time.time() - t0, ln) for ln in proc.stderr),
                     daemon=True).start()
    while proc.poll() is None and not any(ln.strip() == "jaxspec.serve: ready" for _, ln in lines):
        time.sleep(0.2)
    ready_s = time.time() - t0
    assert proc.poll() is None, "".join(ln for _, ln in lines)[-3000:]
    url = next(ln.split("listening on ", 1)[1].strip() for _, ln in lines if "listening on" in ln)
    for at, ln in lines:
        if any(k in ln for k in KEYS) and "so far" not in ln:
            print(f"  {at:7.1f} s  {ln.strip()[:150]}")
    print(f"ready in {ready_s:.1f} s; RSS at ready {rss(proc.pid):.2f} GB; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    try:
        if a.soak_s > 0:
            codes = soak(url, a.soak_s)
            at_end, h = rss(proc.pid), health(url)
            while h["heap_released_at_call"] != h["device_calls"]:  # idle: freed heap returned
                time.sleep(0.2)
                h = health(url)
            print(f"soak {a.soak_s:.0f} s: {sum(codes.values())} requests {dict(codes)}; RSS "
                  f"{at_end:.2f} GB at its end, {rss(proc.pid):.2f} GB idle; pages free {h['free_pages']}/{h['kv_pages']}; calls "
                  f"prepared {h.get('program_calls_prepared')} unprepared "
                  f"{h.get('program_calls_unprepared')}; load {os.getloadavg()[0]:.1f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
        print(f"exit {code}")
        if code:
            print("".join(ln for _, ln in lines[-80:]))


if __name__ == "__main__":
    main()
