"""Faults on a real `python -m jaxspec.serve` subprocess (issue 57): a bounded soak of mixed
requests with resident memory and KV pages checked flat, SIGTERM mid-stream (the stream ends
with a finish reason, exit 0), SIGKILL mid-stream then a restart that loads every program from
the kept store (nothing compiled, the same greedy text), the serving loop's death (exit 3), and
SIGTERM during the warm-up (exit 0 at once).
One tiny checkpoint and one cache directory serve the whole module: the first start compiles,
the later ones load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")

SOAK_S = float(os.environ.get("JAXSPEC_SOAK_S", "20"))  # BENCHMARKS.md ran it for longer
# few programs to compile cold (2 x (2 decode + 4 prompt buckets)): no prefix-cache tails
ARGS = ("serving.slots=2", "serving.max_context=64", "serving.prefix_cache=false",
        "serving.drain_s=0", "--port", "0")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import make_tiny_checkpoint, save_byte_tokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1)
    return save_byte_tokenizer(path)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


class Served:
    """A `python -m jaxspec.serve` subprocess: its stderr lines, URL and resident memory."""

    def __init__(self, checkpoint, cache, code: str | None = None, wait: str = "ready"):
        env = dict(os.environ, JAXSPEC_CACHE_DIR=str(cache), JAXSPEC_PROGRESS="0")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the module's own, kept across restarts
        argv = [f"model.name={checkpoint}", *ARGS]
        head = ["-c", f"{code}\nimport sys; from jaxspec.serve import main; sys.exit(main("
                      f"{argv!r}))"] if code else ["-m", "jaxspec.serve", *argv]
        self.proc = subprocess.Popen([sys.executable, *head], text=True, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr),
                                       daemon=True)
        self.reader.start()
        self.url = self._wait_ready(wait)

    def _wait_ready(self, line: str, within_s: float = 600) -> str:
        """Its URL once stderr has the line `jaxspec.serve: {line}` ("ready", or "listening
        ...": the warm-up then runs)."""
        deadline = time.time() + within_s
        while time.time() < deadline and self.proc.poll() is None:
            if any(ln.strip().startswith(f"jaxspec.serve: {line}") for ln in list(self.lines)):
                break
            time.sleep(0.2)
        url = next((ln.split("listening on ", 1)[1].strip() for ln in list(self.lines)
                    if "listening on http://" in ln), None)
        assert url is not None and self.proc.poll() is None, self.log()
        return url

    def log(self) -> str:
        return "".join(self.lines)[-4000:]

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def settled_rss(self, within_s: float = 120) -> int:
        """Resident memory once the idle server has handed its freed heap back after its last
        device call (/health's heap_released_at_call == device_calls): what it holds, not the
        allocator's free lists of the last burst."""
        deadline = time.time() + within_s
        while (h := self.health())["heap_released_at_call"] != h["device_calls"]:
            assert time.time() < deadline, h
            time.sleep(0.2)
        return self.rss()

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait(timeout=60)
        self.reader.join(timeout=10)
        return code


def complete(url, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16,
                                                  "temperature": 0} | body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream_then(url, action, max_tokens: int = 36) -> list[dict]:
    """A streamed request; `action()` runs once its first text chunk arrives. -> its events
    (the JSON ones; "[DONE]" as the string)."""
    events, acted = [], False
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if not acted:
                    acted = True
                    action()
    except httpx.HTTPError:  # SIGKILL: the connection drops
        pass
    return events


def mixed(i: int) -> dict:
    """The soak's i-th request: streamed or not, greedy or sampled, penalties, stops, n."""
    kinds = [{"max_tokens": 24}, {"max_tokens": 8, "stream": True},
             {"max_tokens": 16, "temperature": 0.8, "seed": i, "top_p": 0.9},
             {"max_tokens": 12, "presence_penalty": 0.5, "repetition_penalty": 1.2},
             {"max_tokens": 20, "stop": ["e"], "n": 2},
             {"max_tokens": 6, "logit_bias": {"65": 5}}]
    return {"prompt": f"{PROMPT} {i}", "temperature": 0} | kinds[i % len(kinds)]


def soak(url, seconds: float) -> int:
    """Mixed requests from 3 clients for `seconds`; -> how many were answered (all 200)."""
    done, bad, stop = [0], [], time.time() + seconds

    def client(k):
        i = k
        while time.time() < stop:
            r = httpx.post(url + "/v1/completions", json=mixed(i), timeout=300)
            if r.status_code != 200:
                bad.append(r.text[:300])
            done[0] += 1
            i += 3

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 300)
    assert not bad, bad[:3]
    return done[0]


def test_sigterm_during_the_warm_up_exits_0_without_waiting_for_it(checkpoint, tmp_path):
    """SIGTERM while the warm-up compiles (a cold cache of its own, signalled at 'listening'):
    the process says so and exits 0 at once, not aborted by its compiling thread torn down
    (seen without the fix: "terminate called ...", exit -6)."""
    served = Served(checkpoint, tmp_path, wait="listening")
    try:
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=60) == 0, served.log()
    finally:
        served.close()
    err = "".join(served.lines)
    assert "stopped during the warm-up" in err and "terminate called" not in err, err[-2000:]


def test_soak_keeps_memory_and_pages_flat_then_sigterm_mid_stream_exits_0(checkpoint, cache):
    """Cold start (every program compiled into the store), a warm-up round, then two soak
    halves: resident memory (read once the idle server freed its heap) grows < 64 MB between
    them, every KV page is free after each, and
    every device call ran a program prepared before /ready (none compiled later); then SIGTERM mid-stream: the stream ends with a finish reason and [DONE], exit 0."""
    served = Served(checkpoint, cache)
    try:
        assert any(" compiled in " in ln for ln in served.lines), served.log()
        pages = served.health()["kv_pages"]
        soak(served.url, 4)  # the first requests of each kind allocate the pool and tables
        first, rss_a = soak(served.url, SOAK_S / 2), served.settled_rss()
        assert served.health()["free_pages"] == pages
        second, rss_b = soak(served.url, SOAK_S / 2), served.settled_rss()
        assert served.health()["free_pages"] == pages
        assert first > 0 and second > 0
        assert rss_b - rss_a < 64 << 20, (rss_a, rss_b)
        h = served.health()  # every call ran a program prepared before /ready
        assert h["program_calls_prepared"] > 0 and h["program_calls_unprepared"] == 0, h
        events = stream_then(served.url, lambda: served.proc.send_signal(signal.SIGTERM))
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] in ("abort", "length", "stop")
        assert served.proc.wait(timeout=120) == 0, served.log()
    finally:
        served.close()
    assert "Traceback" not in "".join(served.lines)


def test_sigkill_mid_stream_then_restart_loads_every_program(checkpoint, cache):
    """SIGKILL mid-stream leaves the store whole: the restart loads every program (0 compiled)
    and answers a greedy request with the text it gave before the kill."""
    served = Served(checkpoint, cache)
    try:
        before = complete(served.url)["choices"][0]["text"]
        stream_then(served.url, lambda: served.proc.send_signal(signal.SIGKILL))
        assert served.proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        served.close()
    again = Served(checkpoint, cache)
    try:
        warm = next(ln for ln in again.lines if " compiled in " in ln)
        assert " and 0 compiled in " in warm, warm
        assert complete(again.url)["choices"][0]["text"] == before
    finally:
        again.close()


def test_the_serving_loop_dying_exits_3_after_ending_the_stream(checkpoint, cache):
    """The device call raises inside a real server: the stream in flight ends with "error"
    and [DONE], the cause is on stderr, and the process exits 3 for its supervisor."""
    code = ("from jaxspec.engine.runner import Engine\n"
            "def broken(*a, **k): raise ZeroDivisionError('injected')\n"
            "Engine.decode_rows = broken")
    served = Served(checkpoint, cache, code)
    try:
        events = stream_then(served.url, lambda: None, max_tokens=8)
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-3]["choices"][0]["finish_reason"] == "error"
        assert served.proc.wait(timeout=120) == 3, served.log()
    finally:
        served.close()
    err = "".join(served.lines)
    assert "the serving loop stopped: ZeroDivisionError: injected" in err
