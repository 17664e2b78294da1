"""Serving on a (2, 4) mesh of 8 simulated CPU devices (a subprocess: tests/serving_mesh_check.py,
the device count is fixed before jax starts): the scheduler runs unchanged with its page pool
sharded over kv heads (one of the tiny model's 4 kv heads per device, rows over "data"), greedy
output equals one-device runs for plain decoding and n-gram speculation, and no decode
program the scheduler compiles copies, zero-fills or gathers a buffer as large as a device's
pool shard or its rows' contiguous view (read in the optimised HLO with the codegen the
one-device HLO checks use). The controls, run in the same subprocess after the real thing and undone after, fail them:
`replicated` (the pool whole on every device) the shard checks, `view` (the forward reading
gathered views of the pages) the copy check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, "tests/serving_mesh_check.py", "view", "replicated"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_mesh_serving_greedy_equals_solo_runs_on_a_paged_pool(served, method):
    out = served[method]
    assert out["kv_layout"] == "paged", out
    assert out["same"], out


def test_the_pool_stays_sharded_over_kv_heads(served):
    for out in (served["plain"], served["ngram"]):
        assert out["pool_spec"] == "('model',)", out
        assert out["pool_shard"][0] == 1, out  # [K/4, NP, P, H]: one kv head per device


def test_no_decode_program_copies_the_pool_on_a_mesh(served):
    copies = served["ngram"]["copies"]
    assert len(copies) == 12, copies  # widths 1, 2, 4 x tables of 4, 8, 16, 25 pages
    assert {k: v for k, v in copies.items() if v} == {}, copies


def test_the_replicated_control_fails_the_shard_checks(served):
    """The pool kept whole on every device: all four kv heads on each, the spec empty."""
    out = served["control_replicated"]
    assert out["kv_layout"] == "paged", out
    assert out["pool_spec"] == "()" and out["pool_shard"][0] == 4, out


def test_the_view_control_fails_the_copy_check(served):
    """The forward reading gathered views of the pages: the copy check finds the views' copies in
    the 4-wide whole-row program (12 of them), where the paged read's programs have none. (At
    widths 1 and 2 it finds none: the check reads copies of a row view's exact shape, and those
    narrower programs build theirs otherwise; docs/testing.md lists the gap.)"""
    copies = served["control_view"]["copies"]
    assert set(copies) == {"1x25", "2x25", "4x25"} and copies["4x25"], copies


def test_a_round_carries_its_requests_and_cancellations_whole():
    """`lockstep.exchange` (one process: it broadcasts to itself) returns process 0's events for
    payloads of every padding, and `apply` queues a follower's copies with process 0's seeds
    and flags the cancelled ones."""
    import collections
    import types

    from jaxspec.serving import lockstep
    from jaxspec.serving.requests import Sampling

    for n in (1, 3, 4, 5, 700):
        events = {"new": [("r1", list(range(n)), Sampling(max_tokens=3, stop=("x",)), 11, 2,
                           b"salt")],
                  "cancel": ["r0"]}
        assert lockstep.exchange(False, events) == (False, events)
    assert lockstep.exchange(True) == (True, {})
    sched = types.SimpleNamespace(queue=collections.deque(), active={}, prefilling={})
    lockstep.apply(sched, events)
    (req,) = sched.queue
    assert (req.id, req.prompt_ids, req.seed, req.priority, req.cache_salt) == (
        "r1", list(range(700)), 11, 2, b"salt")
    assert req.text.stops == ("x",) and not req.cancelled
    lockstep.apply(sched, {"cancel": ["r1"]})
    assert req.cancelled


# ---- python -m jaxspec.serve over two processes (jax.distributed on loopback) ----------------

PROMPTS = ("Hello there", "The quick brown fox", "1 2 3 4")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama (4 heads, 2 kv heads) with the byte tokenizer, as `model.name`."""
    from conftest import make_tiny_checkpoint, save_byte_tokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1)
    return save_byte_tokenizer(path)


def _serve(args: list[str], devices: int):
    """`python -m jaxspec.serve ARGS --port 0` with `devices` simulated CPU devices ->
    (process, its stderr lines as they come)."""
    import threading

    env = dict(os.environ, JAX_PLATFORMS="cpu", TRANSFORMERS_VERBOSITY="error")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    proc = subprocess.Popen([sys.executable, "-m", "jaxspec.serve", *args, "--port", "0"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, lines


def _ready_url(proc, lines, within_s: float = 900) -> str:
    """The URL a server printed once it says ready (bounded: fails after `within_s`)."""
    import time

    deadline = time.time() + within_s
    while time.time() < deadline and proc.poll() is None:
        if any(ln.split(": ", 1)[-1].strip() == "ready" for ln in list(lines)):
            return next(ln.split("listening on ", 1)[1].strip() for ln in list(lines)
                        if "listening on http://" in ln)
        time.sleep(0.5)
    raise AssertionError("the server did not get ready:\n" + "".join(lines)[-3000:])


def _answers(url: str, model: str) -> list[str]:
    """The prompts sent at once (they share the batch), greedy: the texts in prompt order."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def ask(prompt):
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, PROMPTS))


def one_device_answers(overrides: list[str]) -> list[str]:
    """The greedy texts of PROMPTS from the engine `python -m jaxspec.serve OVERRIDES` builds, in
    this process on one device, each prompt alone (a served row's text is its solo run's:
    test_server.py over loopback, test_serving.py in the scheduler): a third server process less."""
    from jaxspec.config import load_config
    from jaxspec.serve import serving_engine

    engine, _ = serving_engine(load_config(None, overrides))
    tok = engine.model.tokenizer
    return [engine.decode_text(engine.generate([tok.encode(p)], max_new_tokens=8)[0].token_ids)
            for p in PROMPTS]


def test_two_process_serving_answers_as_one_process(tiny_checkpoint):
    """Two processes of 2 simulated CPU devices each, joined over loopback into one (2, 2) mesh
    (a kv head per device): process 0 serves HTTP and schedules, process 1 follows its rounds;
    the greedy answers equal one process's on one device (the engine the same command builds).
    SIGTERM to process 0 stops both (exit 0); every wait is bounded."""
    import signal
    import socket

    base = [f"model.name={tiny_checkpoint}", "serving.slots=2", "serving.max_context=128",
            "serving.precompile=false"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mesh = ["mesh.data=2", "mesh.model=2", f"distributed.coordinator_address=127.0.0.1:{port}",
            "distributed.num_processes=2"]
    procs = [_serve([*base, *mesh, f"distributed.process_id={i}"], 2) for i in range(2)]
    try:
        want = one_device_answers(base)  # while the two processes start
        got = _answers(_ready_url(*procs[0]), str(tiny_checkpoint))
        assert got == want and all(got), (got, want)
        procs[0][0].send_signal(signal.SIGTERM)
        for proc, lines in procs:
            assert proc.wait(timeout=180) == 0, "".join(lines)[-3000:]
        followed = "".join(procs[1][1])
        assert "process 0 closed after" in followed and " 0 rounds" not in followed, followed
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
