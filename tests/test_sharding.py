"""Sharded meshes of 8 simulated CPU devices: the same tokens as one device, whole heads per device,
cache / tokens / drafter state sharded inside and after the loop, two all-reduces per layer; and
every bad mesh refused with its numbers. The 8-device runs are subprocesses (tests/mesh_check.py):
the device count is fixed before jax starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import AbstractMesh

from jaxspec.config import Config, MeshConfig, load_config
from jaxspec.errors import JaxspecError
from jaxspec.models import llama
from jaxspec.sharding import ShardingRules, check_batch, check_model, make_mesh, param_shardings

ROOT = Path(__file__).resolve().parents[1]


MODES = "parity,inside,collectives,loading,smollm2,copies,kernels,cli"


@pytest.fixture(scope="module")
def mesh_checks() -> dict:
    """Every 8-device check in one subprocess (one jax start, not seven): {mode: its result}.
    The HLO-reading modes (collectives, copies) compile with roofline's read-only compiler
    options (tests/codegen.py HLO_CODEGEN), which override the XLA_FLAGS code generation: they
    read the optimised HLO users' compiles give whatever JAXSPEC_TEST_FAST_CODEGEN sets; kernels'
    exported programs do not depend on XLA:CPU's code generation, and its interpret-mode values
    are compared within a tolerance."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXSPEC_PROGRESS="0")  # the CLI's one error line
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run(
        [sys.executable, "tests/mesh_check.py", MODES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(*(line for line in proc.stderr.splitlines() if line.startswith("mesh_check seconds")))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mesh_check_meshes() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import mesh_check

    return mesh_check.MESHES


def check(mesh_checks: dict, mode: str) -> dict:
    out = mesh_checks[mode]
    assert "error" not in out, out.get("error")
    return out


def test_meshes_give_the_tokens_of_one_device_for_every_method(mesh_checks):
    """Against one device, greedy, 8 mixed prompts: plain, ngram, a draft model and EAGLE on
    (2, 4), the draft model and EAGLE also sharded by the target's rules there; plain on (1, 8)
    and (8, 1), EAGLE on (1, 8), ngram on (8, 1) (mesh_check.MESHES)."""
    out = check(mesh_checks, "parity")["same"]
    assert len(out) == sum(len(m) for m in mesh_check_meshes().values()), out
    assert all(out.values()), {k: v for k, v in out.items() if not v}


def test_params_cache_tokens_and_drafter_state_stay_sharded_in_the_loop(mesh_checks):
    out = check(mesh_checks, "inside")
    # (2, 4) mesh, 8 query heads of 8 dims: wq [64, 64] -> 2 whole heads (16 rows) per device;
    # 4 kv heads -> 1 per device; cache [B=8, K=4, S, H] -> [4, 1, S, 8] per device.
    assert out["wq_shard"] == [16, 64]
    assert out["wk_shard"] == [8, 64]
    assert out["cache_shard"][:2] == [4, 1]
    for where in ("inside", "after"):
        assert out[where]["cache"] == "('data', 'model')", out
        assert out[where]["tokens"] == "('data',)", out
    assert out["inside"]["drafter_state"] == "('data', 'model')", out  # draft model, shard_drafter


def test_decode_step_needs_two_all_reduces_per_layer(mesh_checks):
    """Collectives in the optimised HLO of the decode loop, for 2 and 4 layers: each layer adds
    exactly 2 all-reduces (attention out, mlp down) and nothing else; the rest is a constant
    (embedding lookup over the vocab shards, argmax, the loop condition, and on a data axis the
    attention's block-loop bound: the max of the rows' lengths, one scalar per step). ngram verifies one of
    3 window widths (a lax.switch, one branch runs per step): 2 per layer per branch."""
    out = check(mesh_checks, "collectives")
    for mesh in ("1x8", "2x4"):
        two, four = out[f"2 {mesh} plain"], out[f"4 {mesh} plain"]
        assert four["all-reduce"] - two["all-reduce"] == 2 * 2, out
        assert two["all-reduce"] <= 2 * 2 + 5, out
        for op in ("reduce-scatter", "collective-permute", "all-to-all"):
            assert four[op] == two[op] <= 2, out  # none per layer, a few small ones per step
        # all-gathers: none per layer on 2x4 (kv heads split); on 1x8 the 4 kv heads are
        # replicated and the window's own k/v (T rows, not the cache) are gathered: <= 2 per layer
        per_layer_gathers = (four["all-gather"] - two["all-gather"]) / 2
        assert per_layer_gathers <= (2 if mesh == "1x8" else 0) and two["all-gather"] <= 4, out
    two, four = out["2 2x4 ngram"], out["4 2x4 ngram"]
    assert four["all-reduce"] - two["all-reduce"] == 2 * 2 * 3, out
    assert four["all-gather"] == two["all-gather"], out


def _cfg(heads=9, kv_heads=3, head_dim=64) -> llama.ModelConfig:
    return llama.ModelConfig(
        vocab_size=49152, hidden_size=heads * head_dim, intermediate_size=1536, num_layers=2,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
    )


def test_shardings_split_whole_heads_only():
    """SmolLM2's 9 heads / 3 kv heads on a 3-way model axis: 3 whole q heads and 1 kv head per
    device. wq [576, 576] is also divisible by 4 and 8, but those would cut heads: refused."""
    cfg = _cfg()
    mesh = AbstractMesh((1, 3), ("data", "model"))
    s = param_shardings(cfg, mesh)
    layer = s["layers"][0]
    assert tuple(layer["wq"].spec) == ("model", None)
    assert tuple(layer["wk"].spec) == ("model", None)
    assert tuple(layer["wo"].spec) == (None, "model")
    assert tuple(layer["w_down"].spec) == (None, "model")
    # 8 heads / 2 kv heads on 4: q split by heads, k/v (2 heads) replicated, not cut mid-head
    layer = param_shardings(_cfg(8, 2), AbstractMesh((2, 4), ("data", "model")))["layers"][0]
    assert tuple(layer["wq"].spec) == ("model", None)
    assert tuple(layer["wk"].spec) == (None, None)
    stacked = param_shardings(_cfg(8, 2), AbstractMesh((2, 4), ("data", "model")), stacked=True)
    assert tuple(stacked["layers"]["wq"].spec) == (None, "model", None)


def test_bad_meshes_are_refused_with_their_numbers():
    with pytest.raises(JaxspecError, match=r"mesh model=4 cannot split num_heads=9 .*\(1, 3, 9\)"):
        check_model(_cfg(), AbstractMesh((1, 4), ("data", "model")))
    with pytest.raises(JaxspecError, match=r"batch of 3 rows does not divide over mesh data=2"):
        check_batch(3, AbstractMesh((2, 4), ("data", "model")))
    import jax

    n = jax.device_count()
    with pytest.raises(JaxspecError, match=rf"needs {2 * n + 2} devices but {n} are available"):
        make_mesh(2, n + 1)
    with pytest.raises(JaxspecError, match=r"mesh.model=0 is invalid: use an integer >= 1"):
        load_config(None, ["mesh.model=0"])
    assert Config().mesh == MeshConfig(data=1, model=1)


def test_rules_refuse_one_mesh_axis_twice():
    rules = ShardingRules(embed="model")
    with pytest.raises(ValueError, match="two dims to one mesh axis"):
        rules.spec("vocab", "embed")
    assert tuple(ShardingRules().spec("batch", None, "heads")) == ("data", None, "model")


def test_loading_builds_each_leaf_on_its_shards(mesh_checks):
    """An HF checkpoint loaded onto a (2, 4) mesh, unrolled and stacked: the peak bytes on any
    device while loading stay within its final shards plus one layer tensor; the old path (load
    onto one device, then shard) puts the whole model on device 0 and breaks that bound."""
    out = check(mesh_checks, "loading")
    for layout in ("unrolled", "stacked"):
        r = out[layout]
        assert r["sharded"] and r["same_values"] and r["tokens_match"], r
        assert r["final"] < r["total"] / 3, r  # really split (4-way model axis, norms replicated)
        assert r["peak"] <= r["final"] + r["largest_layer_tensor"], r
    r = out["unrolled"]
    assert out["load_then_shard_peak"] > r["final"] + r["largest_tensor"], out


def _run_two_processes(env) -> list[str]:
    """Process 0 hosts jax.distributed's coordinator on a port chosen just before: if another
    process took that port in between (it must be named to both processes before either binds
    it), the coordinator fails to bind and the pair is run again on a new port, at most 3 times."""
    import socket

    for _attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        procs = [
            subprocess.Popen(
                [sys.executable, "tests/multihost_check.py", str(i), port],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for i in range(2)
        ]
        results = []  # (exit status, stdout, stderr) per process
        for p in procs:
            try:
                out, err = p.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            results.append((p.returncode, out, err))
        if any("address already in use" in err.lower() for _, _, err in results):
            continue
        for rc, _, err in results:
            assert rc == 0, err[-3000:]
        return [out for _, out, _ in results]
    raise AssertionError("the coordinator's port was taken 3 times in a row")


def test_two_processes_form_one_mesh_and_match_one_process(mesh_checks):
    """Two CPU processes on the loopback address, 4 simulated devices each, joined through
    jax.distributed into one (2, 4) mesh: each hands over its own 4 rows of the batch, the rows
    are gathered, only process 0 prints, and the tokens equal a one-process, one-device run (the
    one mesh_check's parity mode compares its meshes with: mesh_check.generate, one device)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )
    outs = [json.loads(out.strip().splitlines()[-1]) for out in _run_two_processes(env)]
    first, second = outs
    assert first["local_rows"] == [0] and second["local_rows"] == [4]  # process-local rows
    assert set(second) == {"local_rows"}  # process 1 printed no results
    one_device = check(mesh_checks, "parity")["one_device"]
    assert set(one_device) == {"plain", "ngram"}, one_device
    for name, tokens in one_device.items():
        assert first[name] == tokens, name


def test_smollm2_loads_onto_a_mesh_by_whole_kv_heads_and_keeps_its_tokens(mesh_checks):
    """The real GGUF (9 heads, 3 kv heads) on (2, 3): one kv head per device, dequantised one
    tensor at a time onto the mesh; n-gram speculation there equals plain decoding on one device."""
    out = check(mesh_checks, "smollm2")
    assert out == {"same": True, "layout": "unrolled", "wk_shard": [64, 576]}, out


def test_cli_refuses_bad_meshes_in_one_line(mesh_checks):
    """`python -m jaxspec.generate` with a mesh the devices cannot hold, a bad axis or process id,
    a batch the data axis does not divide, a model axis that cuts SmolLM2's heads: exit 2 and one
    line naming the numbers (mesh_check.CLI_ERRORS, run on 8 devices through `generate.main`)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import mesh_check

    out = check(mesh_checks, "cli")
    assert len(out) == len(mesh_check.CLI_ERRORS), out
    for argv, fragment in mesh_check.CLI_ERRORS:
        rc, err = out[" ".join(argv)]
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        assert fragment in lines[0], (argv, lines[0])


def test_decode_loops_copy_no_cache_on_meshes(mesh_checks):
    """The whole decode loop's optimised HLO (draft, verify, commit) on (1, 4) and (2, 4) meshes,
    one row per device, unrolled and stacked (packed is refused on a mesh), every method (a draft
    model and EAGLE also sharded by the target's rules), at a CPU engine's odd capacity and a
    device's, every pair of these settings (mesh_check.copy_cases): no buffer as large as a
    layer's cache shard is copied, zero-filled or gathered.
    Before: SmolLM2 on mesh.model=3 copied each layer's k and v 4x a step (the one-pass read of
    a capacity no block divides); the stacked write's [L*B*K, S, H] view gathered the whole stack
    every layer; layer_skip's and a sharded EAGLE's caches were gathered to replicate them."""
    sys.path.insert(0, str(ROOT / "tests"))
    import mesh_check

    out = check(mesh_checks, "copies")
    assert len(out) == len(mesh_check.copy_cases()), sorted(out)
    bad = {k: v for k, v in out.items() if (v["copies"], v["zero_fills"]) != (0, 0)}
    assert bad == {}, bad


def test_copy_cases_hold_every_pair_of_settings():
    """mesh_check.copy_cases() (the decode loops whose HLO is read for copies) holds every
    (layout, method), (layout, mesh) and (method, mesh) pair at the CPU capacity, and plain
    decoding at the device capacity with every layout and every mesh."""
    import itertools

    sys.path.insert(0, str(ROOT / "tests"))
    import mesh_check

    odd, device = mesh_check.COPY_CAPACITIES
    factors = (mesh_check.COPY_LAYOUTS, mesh_check.COPY_METHODS, mesh_check.COPY_MESHES)
    cases = mesh_check.copy_cases()
    at_odd = [c[:3] for c in cases if c[3] == odd]
    for i, j in itertools.combinations(range(3), 2):
        assert {(c[i], c[j]) for c in at_odd} == set(itertools.product(factors[i], factors[j]))
    at_device = [c for c in cases if c[3] == device]
    assert {c[1] for c in at_device} == {"plain"}
    assert {c[0] for c in at_device} == set(factors[0]) and {c[2] for c in at_device} == set(factors[2])


def test_attention_kernels_run_on_each_devices_head_shard(mesh_checks):
    """Plain decoding of a bf16 model on a (2, 4) mesh, exported for TPU and CUDA, unrolled and
    stacked: every attention kernel call (prefill and decode) takes a per-device shard of the
    cache (1/8 of it: rows over "data", kv heads over "model"), never the whole cache, which
    GSPMD would first gather to every device (a custom call has no partitioning rule). In
    interpret mode on the mesh the sharded GPU kernels give the XLA path's values (the TPU
    interpreter hangs under shard_map on simulated devices)."""
    out = check(mesh_checks, "kernels")
    want = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
    for layout in ("unrolled", "stacked"):
        for platform in ("tpu", "cuda"):
            r = out[f"{layout} {platform}"]
            for program in ("prefill", "decode"):
                p = r[program]
                assert p["attention"] == want[platform] and p["calls"] > 0, r
                # the cache part on its shard; no call on anything larger (the whole cache)
                assert r["cache_per_device"] in p["largest"], r
                assert max(p["largest"]) == r["cache_per_device"] < r["cache_global"], r
    errors = out["interpret"]
    assert len(errors) == 2 and max(errors.values()) < 1e-5, errors
