"""What structured output on by default costs a server's plain requests: one engine, two
servers (serving.structured on and off), the same plain greedy request sent to each in turn
(order alternating), decode seconds per token compared pair by pair in the same run. Also the
start-up cost of the grammar table (the table's construction time and its device bytes) and
one constrained request on the "on" server (it must compile nothing after the warm-up).
Not a timed test: figures go to docs/history/BENCHMARKS-session-*.md.

    python scripts/bench_structured_serving.py --config configs/smollm2-135m-ngram.yaml --reps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax.monitoring

from jaxspec.build import build_engine
from jaxspec.config import load_config
from jaxspec.constrain.host import make_constraint
from jaxspec.serving import grammars
from jaxspec.serving.api import Server
from jaxspec.serving.requests import Sampling

LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # one event per program lowered
PROMPT = "Explain speculative decoding in three short sentences."
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"]}  # small: its compile stays inside the server's budget


def table_cost(engine, slots: int) -> dict:
    """Seconds to build the grammar slots (vocabulary scan, empty table upload) and their bytes."""
    start = time.perf_counter()
    g = grammars.GrammarSlots(engine, slots)
    for t in g.tables:
        t.block_until_ready()
    return {"start_s": round(time.perf_counter() - start, 2),
            "table_bytes": int(sum(t.nbytes for t in g.tables))}


def paired(servers: dict, reps: int, max_tokens: int) -> list[dict]:
    """Each rep: the same plain request on both servers (order alternating) -> per-token seconds."""
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0)
    rows = []
    for rep in range(reps):
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")
        row = {}
        for name in order:
            done = servers[name].generate(PROMPT, sampling)
            row[name] = done.time_per_output_token_s
            row[name + "_text"] = done.text
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m-ngram.yaml")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=4)
    args = p.parse_args(argv)
    config = load_config(args.config)
    engine = build_engine(config)
    cost = table_cost(engine, args.slots)
    settings = dict(slots=args.slots, max_context=512, precompile=False)
    servers = {name: Server(engine, config.serving, structured=on, **settings)
               for name, on in (("off", False), ("on", True))}
    try:
        paired(servers, 1, args.max_tokens)  # warm-up: compiles (or loads) both servers' programs
        rows = paired(servers, args.reps, args.max_tokens)
        print(json.dumps({"per_token_s": [(r["off"], r["on"]) for r in rows]}), flush=True)
        lowered = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, secs, **kw: lowered.append(kw.get("fun_name")) if event == LOWERING else None)
        fmt = Sampling(max_tokens=24, temperature=0.0)
        c = make_constraint(json_schema=SCHEMA)
        t0 = time.perf_counter()
        stream = servers["on"].submit_all(PROMPT + " Answer as JSON.", [fmt], [None], constraint=c)[0]
        constrained = stream.result()
        constrained_s = time.perf_counter() - t0
    finally:
        for s in servers.values():
            s.close()
    ratios = [r["on"] / r["off"] for r in rows]
    print(json.dumps({
        "config": args.config, "slots": args.slots, "max_tokens": args.max_tokens,
        "grammar_slots": cost,
        "per_token_s_off": [round(r["off"], 5) for r in rows],
        "per_token_s_on": [round(r["on"], 5) for r in rows],
        "on_over_off_median": round(statistics.median(ratios), 4),
        "same_text": all(r["on_text"] == r["off_text"] for r in rows),
        "constrained_request_s": round(constrained_s, 2),
        "constrained_text": constrained.text,
        "programs_lowered_by_the_constrained_request": lowered,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
