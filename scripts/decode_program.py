"""One config's decode program on one prompt, for before/after checks between source trees: compiles
it (Engine.warmup; run under XLA's dump flags to get its optimised HLO), then runs it a few times
and prints each call's process CPU seconds (all threads) and decode steps, a figure that moves
less with the shared machine's load than wall time does. Uses only API older trees have too.

    JAXSPEC_XLA_CACHE=0 XLA_FLAGS="--xla_dump_to=/tmp/hlo_main --xla_dump_hlo_as_text \\
        --xla_dump_hlo_module_re=.*decode.*" PYTHONPATH=$PWD \\
        python scripts/decode_program.py configs/smollm2-135m.yaml configs/smollm2-135m-eagle.yaml
    # in each tree (PYTHONPATH and cwd = that tree), then diff the two
    # *jit_decode.cpu_after_optimizations.txt with `, metadata={...}` stripped
"""

from __future__ import annotations

import argparse
import resource
import time


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="+")
    p.add_argument("--prompt", default="What is the capital of France? Explain its history in "
                   "detail.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()

    from jaxspec.build import build_engine
    from jaxspec.config import load_config
    from jaxspec.loading import load_model

    cfgs = [load_config(c) for c in args.configs]
    m = cfgs[0].model
    target = load_model(m.name, dtype=m.dtype, layout=m.layout)
    engines = [build_engine(c, target=target) for c in cfgs]
    ids = engines[0].encode(args.prompt)
    for e in engines:
        e.warmup(ids, max_new_tokens=args.max_new_tokens)
    print("layout", target.layout)
    for k in range(args.calls):
        for name, e in zip(args.configs, engines):
            c0, w0 = cpu_seconds(), time.perf_counter()
            r = e.generate([ids], max_new_tokens=args.max_new_tokens)[0]
            print(f"call {k} {name}: cpu {cpu_seconds() - c0:.3f} s, wall "
                  f"{time.perf_counter() - w0:.3f} s, steps {r.metrics['num_steps']}", flush=True)


if __name__ == "__main__":
    main()
