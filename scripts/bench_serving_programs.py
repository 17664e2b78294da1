"""What the serving program cuts cost in decode speed, paired in one process on the embedded
SmolLM2-135M (the default serving config: 4 slots, max_context 1024, pages of 16): the same
greedy requests through a `Scheduler` whose decode calls are compiled as today's set (an
all-greedy twin beside each "any" program, page tables 4/8/16/32/64 pages) and as the cut
sets (one sampling mode; page tables in steps of 4x; one full-width table). Rounds interleave
the variants; decode tokens per CPU second of decode calls (process time, all threads) (median of rounds) and each
variant's ratio to today's, at a short, a middle and a long prompt. Every variant's tokens
must equal today's (greedy). Markdown rows for BENCHMARKS.

    python scripts/bench_serving_programs.py              # 3 rounds, 4 rows, 64 new tokens
    python scripts/bench_serving_programs.py --smoke      # one short round (checks the script)
    python scripts/bench_serving_programs.py --ttft       # whole prompts as power-of-two tails

--ttft: the time to first token (CPU seconds, all threads) of one new prompt (no cached prefix) with the prefix cache on
(`admission.whole_as_tail`: the prompt runs as a tail from 0, padded to a power of two) against
off (the whole-prompt program, padded to `prompt_bucket`: at most 1.25x), paired, at lengths
just past a power of two (the most padding) and between.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from jaxspec.build import build_engine
from jaxspec.config import load_config
from jaxspec.decode.sampling_settings import Sampling
from jaxspec.engine.prepare import prompt_bucket
from jaxspec.serving.admission import tail_bucket
from jaxspec.serving.batch import program_widths
from jaxspec.serving.scheduler import Scheduler

STORY = ("Write a long story about a lighthouse keeper who finds a message in a bottle. The "
         "keeper's name is Ada, and she has kept the light for twenty years. ")


class Sink:
    def __init__(self):
        self.done = None

    def push(self, piece):
        pass

    def finish(self, completion):
        self.done = completion


def variants(per_row: int) -> dict:
    """name -> (one sampling mode, page-table widths)."""
    return {"today (greedy twin, x2 tables)": (False, program_widths(per_row, 4)),
            "one mode, x2 tables": (True, program_widths(per_row, 4)),
            "one mode, x4 tables": (True, tuple(w for w in program_widths(per_row, 4)
                                                if w in (4, 16, 64, 256, per_row))),
            "one mode, one table": (True, (per_row,))}


def run(engine, one_mode: bool, tables, prompt: str, rows: int, new: int):
    sched = Scheduler(engine, slots=4, max_context=1024)
    sched.device.shape = dataclasses.replace(sched.device.shape, one_mode=one_mode,
                                             table_widths=tables)
    cpu = [0.0]  # process CPU seconds in decode calls (every thread: steadier than wall
    decode = sched.device.decode  # time on a loaded machine)

    def timed(*args):
        t = time.process_time()
        out = decode(*args)
        cpu[0] += time.process_time() - t
        return out

    sched.device.decode = timed
    sinks = [Sink() for _ in range(rows)]
    for i, sink in enumerate(sinks):
        sched.enqueue(sched.new_request(prompt + f" Chapter {i + 1}.", Sampling(max_tokens=new),
                                        sink))
    while sched.busy:
        sched.run_once()
    tokens = sum(len(s.done.token_ids) for s in sinks)
    return tokens / cpu[0], [s.done.token_ids for s in sinks]


def ttft(engine, prefix_cache: bool, n: int, salt: int) -> float:
    sched = Scheduler(engine, slots=4, max_context=1024, prefix_cache=prefix_cache)
    ids = [(salt * 7919 + 31 * i) % 40000 + 100 for i in range(n)]  # a prompt never seen
    sink = Sink()
    sched.enqueue(sched.new_request(ids, Sampling(max_tokens=1), sink))
    t = time.process_time()
    while sched.busy:
        sched.run_once()
    return time.process_time() - t  # CPU seconds to the first (only) token: the prefill


def main_ttft(engine, rounds: int, lengths=(136, 264, 400)) -> None:
    salt = 0
    for n in lengths:
        times = {True: [], False: []}
        for r in range(rounds + 1):  # round 0 compiles
            for on in (True, False):
                salt += 1
                t = ttft(engine, on, n, salt)
                print(f"  {n} round {r} prefix cache {on}: {t:.3f} cpu-s", file=sys.stderr, flush=True)
                if r:
                    times[on].append(t)
        on, off = (statistics.median(times[k]) for k in (True, False))
        print(f"| {n} | tail {tail_bucket(n)} | whole {prompt_bucket(n)} | {on:.3f} | {off:.3f} | "
              f"{on / off:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--ttft", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="+", default=[136, 264, 400], help="--ttft's")
    a = ap.parse_args()
    rounds, new = (1, 8) if a.smoke else (a.rounds, a.new)
    engine = build_engine(load_config("configs/smollm2-135m.yaml", []))
    if a.ttft:
        return main_ttft(engine, rounds, a.lengths)
    prompts = {"short": STORY, "middle": STORY * 8, "long": STORY * 18}
    vs = variants(1024 // 16)
    for label, prompt in prompts.items():
        speeds = {name: [] for name in vs}
        for r in range(rounds + 1):  # round 0 compiles
            for name, (one_mode, tables) in vs.items():
                tps, out = run(engine, one_mode, tables, prompt, a.rows, new)
                print(f"  {label} round {r} {name}: {tps:.1f} tok/cpu-s", file=sys.stderr, flush=True)
                if name.startswith("today"):
                    want = out
                assert out == want, f"{name} changed the greedy tokens at the {label} prompt"
                if r:
                    speeds[name].append(tps)
        base = statistics.median(speeds[next(iter(vs))])
        n = len(engine.encode(prompt))
        for name, xs in speeds.items():
            med = statistics.median(xs)
            print(f"| {label} ({n} tokens) | {name} | {med:.1f} | {med / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
