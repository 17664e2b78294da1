"""python -m jaxspec.bench.serve: continuous batching against static batching under Poisson
arrivals, on Spec-Bench dev prompts (evaluation only) with mixed output lengths, per method.

Each method's engine is built once; for every arrival rate the same requests (same prompts, lengths
and arrival times) run through the continuous scheduler and the static baseline (the same programs,
admitting only into an empty batch, each call over every slot: a lockstep batch). Reported per run:
throughput (generated tokens / makespan), TTFT and time per output token (p50 / p99), the KV cache
layout the scheduler's state held, and each request's peak KV pages and bytes against its length
(memory proportional to length: bytes = pages x the pool's bytes per page, read from the device
arrays), next to what a contiguous max_context row would hold, and the prefix cache's share: prompt
tokens whose k/v came from it and the most distinct pages rows held at once (a shared page once).
`--system-prompt TEXT` puts one fixed text before every prompt (a shared system prompt);
`--workload agent` serves the agent sessions' calls instead (data/agent_sessions.jsonl: a system
prompt and tool schema repeated in every call, each call's prompt the conversation so far);
`--prefix-cache on off` runs both (A/B); `--admission one batched` runs one-at-a-time and
batched admission (`--max-batched-tokens N`: under that budget per round) on the same requests,
each run reporting the programs lowered while it ran (the warm-up compiles every prefill, tail and
chunk program first: `Scheduler.compile_prefills`). Every greedy run's outputs are compared with the first
greedy run's of the same model (`outputs_identical_to_first_greedy_run`): batching, cache and
method must not change a token. Arguments are parsed before jax is imported."""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import json
import sys
import threading
import time

from jaxspec.cli_support import ArgumentParser
from jaxspec.cli_support import run as run_cli
from jaxspec.errors import JaxspecError

LENGTHS = (8, 16, 32)  # mixed output lengths, cycled (--lengths)


def make_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m jaxspec.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["configs/smollm2-135m.yaml",
                                                    "configs/smollm2-135m-ngram.yaml"])
    p.add_argument("--prompts", default="data/spec_bench_dev.jsonl")
    p.add_argument("--workload", choices=("spec-bench", "agent"), default="spec-bench",
                   help="agent: the agent sessions' calls (chat-rendered) as the prompts")
    p.add_argument("--agent-data", default="data/agent_sessions.jsonl")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0], help="requests/s")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16, help="KV slots per page")
    p.add_argument("--kv-pages", type=int, help="pages in the pool (default: slots x max_context)")
    p.add_argument("--kv-layout", nargs="+", choices=("paged", "contiguous"), default=["paged"],
                   help="KV cache layouts to run (each with static and continuous batching)")
    p.add_argument("--prefix-cache", nargs="+", choices=("on", "off"), default=["on"],
                   help="share KV pages of common prompt prefixes (each setting is run)")
    p.add_argument("--system-prompt", default="",
                   help="a fixed text put before every prompt (a shared system prompt)")
    p.add_argument("--prefill-chunk", type=int,
                   help="prompt tokens per prefill chunk (default: whole prompts)")
    p.add_argument("--admission", nargs="+", choices=("one", "batched"), default=["one"],
                   help="prefill admitted requests one a call, or several a call "
                        "(serving.batch_prefill); each is run")
    p.add_argument("--max-batched-tokens", type=int,
                   help="batched admission's prompt-token budget per round "
                        "(serving.max_batched_tokens; default: none)")
    p.add_argument("--batching", nargs="+", choices=("continuous", "static"),
                   default=["continuous", "static"], help="batching modes to run")
    p.add_argument("--steps-per-call", type=int, default=8, help="decode steps per device call")
    p.add_argument("--max-prompt", type=int, default=192, help="prompt tokens kept (the head)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                   help="output lengths (max_tokens), cycled over the requests")
    p.add_argument("--out", help="write the runs as JSON here")
    return p


def _pct(xs, q):
    import numpy as np

    return float(np.percentile(xs, q)) if xs else 0.0


def load_prompts(path: str, n: int) -> list[str]:
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        p = Path("../shared/data") / Path(path).name
    if not p.is_file():
        raise JaxspecError(f"--prompts {path}: no such file (the Spec-Bench dev set)")
    out = []
    for line in p.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            turns = row.get("turns") or [row.get("prompt") or row.get("text")]
            out.append(str(turns[0]))
        if len(out) == n:
            break
    return out


def memory_figures(server, done) -> dict:
    """Per request (length, peak pages, peak bytes), bytes per token of length fitted through
    the origin, and the bytes a contiguous max_context row holds; from the scheduler's arrays."""
    s = server.scheduler
    sizes = s.kv_bytes()
    page_bytes = sizes.get("kv_page_bytes", 0)
    row = page_bytes * s.max_pages  # a contiguous cache holds max_context slots per row
    per_req = [(d.num_prompt_tokens + d.num_generated_tokens, d.metrics["kv_pages"],
                d.metrics["kv_pages"] * page_bytes if s.kv_layout == "paged" else row)
               for d in done]
    lengths = sum(n for n, _, _ in per_req)
    return {
        "kv_layout": s.kv_layout, "kv_pool_bytes": sizes.get("kv_cache_bytes", 0),
        "kv_page_bytes": page_bytes, "kv_page_size": s.pool.page_size,
        "kv_bytes_per_request_mean": sum(b for *_, b in per_req) / max(1, len(per_req)),
        "kv_bytes_per_token": sum(b for *_, b in per_req) / max(1, lengths),
        "kv_contiguous_row_bytes": row,
        "kv_peak_used_pages": s.stats.peak_used_pages,
        "kv_peak_used_bytes": s.stats.peak_used_pages * page_bytes,
        "prefix_cache": s.prefix_cache,
        "prompt_tokens": sum(d.num_prompt_tokens for d in done),
        "prefix_cached_tokens": sum(d.metrics.get("prefix_cached_tokens", 0) for d in done),
        "pages_per_request": per_req,
    }


LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # a program lowered


def run_once(server, requests, arrivals):
    """Submit each request at its arrival time; wait for all. -> figures of the run, with the
    programs lowered while it ran (after the warm-up: 0 when it covered every shape)."""
    import jax.monitoring

    lowered = []

    def listener(event: str, seconds: float, **kw) -> None:
        if event == LOWERING_EVENT:
            lowered.append(str(kw.get("fun_name", "")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fig = _run_once(server, requests, arrivals)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return fig | {"programs_lowered_in_run": len(lowered),
                  "lowered_in_run": sorted(set(lowered))}


def _run_once(server, requests, arrivals):
    streams, t0 = [None] * len(requests), time.perf_counter()

    def feed():
        for i, ((ids, sampling), at) in enumerate(zip(requests, arrivals)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            streams[i] = server.submit(ids, sampling)

    feeder = threading.Thread(target=feed)
    feeder.start()
    feeder.join()
    done = [s.result() for s in streams]
    makespan = time.perf_counter() - t0
    tokens = sum(d.num_generated_tokens for d in done)
    ttft = [d.time_to_first_token_s for d in done]
    tpot = [d.time_per_output_token_s for d in done if d.num_generated_tokens > 1]
    return memory_figures(server, done) | {
        "token_ids": [d.token_ids for d in done],
        "throughput_tok_s": tokens / makespan, "tokens": tokens, "makespan_s": makespan,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "acceptance": sum(d.metrics.get("num_accepted_tokens", 0) for d in done)
        / max(1, sum(d.metrics.get("num_draft_tokens", 0) for d in done)),
        "plain_fraction": _mean([d.metrics["adaptive_plain_fraction"] for d in done
                                 if "adaptive_plain_fraction" in d.metrics]),
        "prefill_calls": server.scheduler.stats.prefill_calls,
        "max_round_prefill_tokens": server.scheduler.stats.max_round_prefill_tokens,
        "prefill_s": server.scheduler.stats.prefill_s,
        "decode_s": server.scheduler.stats.decode_s,
        # what ran: device calls by (rows, page-table slots) of the compiled program
        "calls_by_shape": {f"{r}x{c}": n for (r, c), n in
                           sorted(server.scheduler.stats.calls_by_shape.items())},
    }


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def compile_all(engine, requests, caches, admissions, budget, serving) -> None:
    """Compile what the runs will, untimed: every prompt (and tail) bucket at every admission
    width (Scheduler.compile_prefills), every call width with every page-table width
    (Scheduler.compile_programs), for each cache layout and admission."""
    from jaxspec.serving import Sampling, Server

    for (layout, cached), admission in [(c, a) for c in caches for a in admissions]:
        with Server(engine, paged=layout == "paged", prefix_cache=cached == "on",
                    batch_prefill=admission == "batched",
                    max_batched_tokens=budget if admission == "batched" else None,
                    **serving) as server:
            server.scheduler.compile_programs()
            server.scheduler.compile_prefills([len(ids) for ids, _ in requests])
            for ids, _ in requests:
                server.generate(ids, Sampling(max_tokens=2))


def runs_at(rate, engine, path, config, requests, caches, args, budget, serving,
            greedy_outputs) -> list[dict]:
    """The timed runs at one arrival rate (Poisson arrivals, seed 0), one per cache layout,
    batching and admission; greedy runs of a model checked against its first greedy run."""
    import numpy as np

    from jaxspec.serving import Server

    runs = []
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(requests))).tolist()
    for (layout, cached), batching, admission in [
            (c, b, a) for c in caches for b in args.batching for a in args.admission]:
        static = batching == "static"
        with Server(engine, static=static, paged=layout == "paged",
                    prefix_cache=cached == "on", batch_prefill=admission == "batched",
                    max_batched_tokens=budget if admission == "batched" else None,
                    **serving) as server:
            fig = run_once(server, requests, arrivals)
        fig |= {"config": path, "method": engine.method, "rate": rate,
                "batching": batching, "admission": admission, "prefix": cached,
                "max_batched_tokens": budget if admission == "batched" else None}
        outputs = fig.pop("token_ids")
        if config.sampling.temperature == 0:
            first = greedy_outputs.setdefault(config.model.name, outputs)
            fig["outputs_identical_to_first_greedy_run"] = outputs == first
            if outputs != first:
                print(f"warning: {path} at {rate} req/s ({fig['batching']}, {layout}): "
                      "greedy outputs differ from the first greedy run's", file=sys.stderr)
        runs.append(fig)
        print(json.dumps({k: v for k, v in fig.items() if k != "pages_per_request"}),
              flush=True)
    return runs


def run(argv=None) -> int:
    args = make_parser().parse_args(argv)
    import dataclasses


    from jaxspec.build import build_engine
    from jaxspec.cli_support import enable_compilation_cache
    from jaxspec.config import load_config
    from jaxspec.serving import Sampling

    enable_compilation_cache()
    if args.workload == "agent":
        from jaxspec.bench.agent import prompt_ids, read_sessions

        calls = read_sessions(args.agent_data)[: args.requests]
    else:
        texts = load_prompts(args.prompts, args.requests)
    runs, target, greedy_outputs = [], None, {}  # model -> its first greedy run's tokens:
    # every greedy run of that model (any method, batching, cache) must produce the very same
    serving = dict(slots=args.slots, max_context=args.max_context, page_size=args.page_size,
                   kv_pages=args.kv_pages, steps_per_call=args.steps_per_call,
                   prefill_chunk=args.prefill_chunk)
    budget = args.max_batched_tokens  # batched admission's only
    if budget is not None and budget < 1:
        raise JaxspecError(f"--max-batched-tokens {budget}: use a token count >= 1")
    for path in args.configs:
        config = load_config(path)
        config = dataclasses.replace(config, generation=dataclasses.replace(
            config.generation, max_context=args.max_context))
        engine = build_engine(config, target)
        target = engine.model
        if args.workload == "agent":
            prompts = [prompt_ids(engine.model.tokenizer, c["messages"], c["prefix"])
                       for c in calls]
        else:
            prompts = [engine.encode(args.system_prompt + text) for text in texts]
        requests = [(ids[: args.max_prompt],
                     Sampling(max_tokens=args.lengths[i % len(args.lengths)]))
                    for i, ids in enumerate(prompts)]
        # a contiguous cache has no pages to share: run once there
        caches = [(k, c) for k in args.kv_layout
                  for c in (args.prefix_cache if k == "paged" else args.prefix_cache[:1])]
        compile_all(engine, requests, caches, args.admission, budget, serving)
        for rate in args.rates:
            runs += runs_at(rate, engine, path, config, requests, caches, args, budget, serving,
                            greedy_outputs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


def main(argv=None) -> int:
    return run_cli(run, argv)  # one error line and exit 2 on bad input, 130 on Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
