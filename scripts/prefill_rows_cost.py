"""python scripts/prefill_rows_cost.py: seconds per prefill call at 1, 2 and 4 rows (whole prompts
of the 128-token bucket, and 64-token tails over written pages), SmolLM2-135M, the serving
scheduler's paged programs (first call of each shape untimed). Figures: BENCHMARKS.md."""
import dataclasses, time, json
import jax, jax.numpy as jnp, numpy as np
from jaxspec.build import build_engine
from jaxspec.config import load_config
from jaxspec.cli_support import enable_compilation_cache
from jaxspec.decode.sampling import SamplingParams
from jaxspec.serving import paged_cache
from jaxspec.serving.scheduler import Scheduler
enable_compilation_cache()
config = load_config("configs/smollm2-135m.yaml")
config = dataclasses.replace(config, generation=dataclasses.replace(config.generation, max_context=512))
engine = build_engine(config)
sched = Scheduler(engine, slots=4, max_context=512, batch_prefill=True)
out = {}
for tail in (None, 64):
    spec = sched.spec if tail is None else dataclasses.replace(sched.spec, target=paged_cache.TailTarget(sched.spec.target, tail))
    for rows in (1, 2, 4):
        pool = engine.empty_cache(sched.spec.target, 1, 512)
        k, v = pool.k, pool.v
        times = []
        for rep in range(4):
            table = np.arange(rows * sched.max_pages, dtype=np.int32).reshape(rows, -1) % sched.pool.num_pages
            starts = np.full((rows,), 0 if tail is None else 64, np.int32)
            cache = type(pool)(k, v, jnp.asarray(table), jnp.asarray(starts))
            prompt = jnp.ones((rows, 128), jnp.int32)
            sp = SamplingParams.rows([(0.0, 0, 1.0, 0.0)] * rows)
            t0 = time.perf_counter()
            st = engine.prefill_rows(spec, prompt, jnp.full((rows,), 120, jnp.int32), jnp.full((rows,), 8, jnp.int32), sp, sched.key, jnp.zeros((rows,), jnp.int32), 512, cache=cache)
            jax.block_until_ready(st.tokens)
            times.append(time.perf_counter() - t0)
            k, v = st.cache.k, st.cache.v
        out[f"{'whole128' if tail is None else 'tail64'} rows={rows}"] = round(min(times[1:]), 4)
        print(json.dumps(out), flush=True)
