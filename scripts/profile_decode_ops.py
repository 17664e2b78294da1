"""Where a decode step's time goes, per compiled op: each config's decode program traced with
jax.profiler (XLA:CPU records one event per thunk: every fusion, dot, FFI kernel call), self time
per op summed over a few greedy calls and divided by their decode steps.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \\
    JAXSPEC_XLA_CACHE=0 PYTHONPATH=$PWD python scripts/profile_decode_ops.py \\
        configs/smollm2-135m-eagle.yaml configs/smollm2-135m-dflash.yaml --dump DIR

Prints, per config: ms per decode step by op class (ffi_call: the CPU panel / attention kernels;
ynn_fusion, dot: XLA's own matmuls; copy*: copies ...) and the top ops; with --dump (the XLA
dump of this same run, each config compiled afresh) each top op's output shape. Run one config
per process when reading shapes: op names repeat across programs.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile


def self_times(trace_dir: str) -> collections.Counter:
    """op name -> microseconds of self time (its events minus their nested children's)."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    events = [e for e in json.load(gzip.open(path))["traceEvents"]
              if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    out = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            out[e["name"]] += e["dur"]
            if stack:
                out[stack[-1]["name"]] -= e["dur"]
            stack.append(e)
    return out


def shapes(dump: str | None) -> dict[str, str]:
    found: dict[str, str] = {}
    for f in glob.glob(f"{dump}/*after_optimizations.txt") if dump else ():
        for line in open(f):
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+)", line)
            if m:
                found.setdefault(m.group(1), m.group(2))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+")
    p.add_argument("--prompt", default="What is the capital of France? Explain its history in "
                   "detail.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--dump", help="the XLA dump directory of this run (output shapes)")
    a = p.parse_args()

    import jax
    from jaxspec.build import build_engine
    from jaxspec.config import load_config
    from jaxspec.loading import load_model

    cfgs = [load_config(c) for c in a.configs]
    target = load_model(cfgs[0].model.name, dtype=cfgs[0].model.dtype, layout=cfgs[0].model.layout)
    engines = [build_engine(c, target=target) for c in cfgs]
    ids = engines[0].encode(a.prompt)
    for e in engines:
        e.warmup(ids, max_new_tokens=a.max_new_tokens)
        e.generate([ids], max_new_tokens=a.max_new_tokens)
    shape = shapes(a.dump)
    for name, e in zip(a.configs, engines):
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            steps = sum(e.generate([ids], max_new_tokens=a.max_new_tokens)[0].metrics["num_steps"]
                        for _ in range(a.calls))
            jax.profiler.stop_trace()
            t = self_times(d)
        ms = lambda us: us / 1e3 / steps  # noqa: E731
        classes = collections.Counter()
        for op, us in t.items():
            classes[re.sub(r"[.\d]+$", "", op)] += us
        print(f"{name}: {steps} decode steps, {ms(sum(t.values())):.1f} ms of ops per step")
        print("  by class: " + ", ".join(f"{k} {ms(v):.1f}" for k, v in classes.most_common(6)))
        for op, us in t.most_common(a.top):
            print(f"  {ms(us):7.2f} ms  {op:28s} {shape.get(op, '')}")


if __name__ == "__main__":
    main()
