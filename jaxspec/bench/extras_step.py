"""What the server's always-on extras cost per decode step: the serving decode program (the
scheduler's, `Engine.serving_spec` over the paged target) on the embedded SmolLM2-135M with no
extras, with penalties + logit_bias (neutral per-row values) + the top-20 logprob record, and
with the structured-output grammar added (a full-size `serving.grammars` table, every row free).
Paired: the variants run in alternation, round by round, on the same prompts; milliseconds per
step (median of rounds) and each variant's ratio to "off". Greedy tokens must match (neutral
values change no logit). Markdown table for BENCHMARKS.md.

    python -m jaxspec.bench.extras_step                  # slots 8, 32 steps a call, 5 rounds
    python -m jaxspec.bench.extras_step --smoke          # one short round (checks the command)
"""

from __future__ import annotations

# Imported inside functions: jax and the engine load only when a run starts, so --help answers
# in a second (tests/test_help.py).

import argparse
import dataclasses
import statistics
import time

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The story should have a beginning, a middle and an end.")


def _variants(engine, spec_on, slots: int):
    """name -> (spec, penalties maker, grammar maker) of the three decode programs compared."""
    from jaxspec.decode import penalties as penalties_lib
    from jaxspec.serving.grammars import GrammarSlots

    off = dataclasses.replace(spec_on, logprobs=None)
    pen = lambda: engine.row_penalties([penalties_lib.OFF] * slots)  # noqa: E731
    table = GrammarSlots(engine, slots)
    free = lambda: table.rows([None] * slots)  # noqa: E731
    none = lambda: None  # noqa: E731
    return {"off": (off, none, none), "penalties+logprobs": (spec_on, pen, none),
            "+ grammar (free rows)": (spec_on, pen, free)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxspec.bench.extras_step",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    rounds, steps = (1, 4) if a.smoke else (a.rounds, a.steps)

    import jax  # after argument parsing: --help loads no jax (tests/test_help.py)
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.build import build_engine
    from jaxspec.config import load_config
    from jaxspec.decode.sampling import SamplingParams
    from jaxspec.serving.paged_cache import PagedTarget

    engine = build_engine(load_config(None, ["sampling.temperature=0",
                                             f"generation.max_context={a.context}"]))
    spec_on = engine.serving_spec(PagedTarget(engine.target, 16))
    ids = engine.model.tokenizer(PROMPT)["input_ids"]
    b = a.slots
    prompt = jnp.asarray(np.tile(np.asarray(ids, np.int32), (b, 1)))
    lengths = jnp.full((b,), len(ids), jnp.int32)
    sp = SamplingParams.rows([(0.0, 0, 1.0, 0.0)] * b)
    variants = _variants(engine, spec_on, b)

    def run(spec, pen, grammar):
        state = engine.prefill_rows(spec, prompt, lengths, jnp.full((b,), a.context - len(ids) - 8,
                                                                    jnp.int32), sp,
                                    jax.random.key(0), jnp.arange(b, dtype=jnp.int32), a.context,
                                    penalties=pen(), grammar=grammar())
        state = engine.decode_rows(spec, state, sp, 1)  # the first step apart
        jax.block_until_ready(state.tokens)
        t0 = time.perf_counter()
        state = engine.decode_rows(spec, state, sp, steps)
        tokens = np.asarray(state.tokens)
        return (time.perf_counter() - t0) / steps, tokens

    outs = {n: run(*v)[1] for n, v in variants.items()}  # compiles; greedy tokens compared
    if len({o.tobytes() for o in outs.values()}) != 1:
        raise SystemExit("the extras at their neutral values changed the greedy tokens")
    times = {n: [] for n in variants}
    names = list(variants)
    for r in range(rounds):  # interleaved, the order rotated: drift hits every variant alike
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(run(*variants[n])[0])
    med = {n: statistics.median(t) for n, t in times.items()}
    ratio = {n: statistics.median(x / o for x, o in zip(t, times["off"])) for n, t in times.items()}
    low = {n: min(t) for n, t in times.items()}  # the least disturbed round (a shared CPU)
    print(f"backend {jax.default_backend()}, SmolLM2-135M, serving decode program (paged), "
          f"{b} rows, {steps} steps a call, {rounds} rounds")
    print("| extras | ms/step median | median of paired ratios | ms/step min | ratio of mins |\n"
          "|---|---|---|---|---|")
    for n, t in med.items():
        print(f"| {n} | {t * 1e3:.2f} | {ratio[n]:.3f}x | {low[n] * 1e3:.2f} | "
              f"{low[n] / low['off']:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
