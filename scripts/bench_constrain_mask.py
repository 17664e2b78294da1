"""Cost of the constraint mask per decode step on this machine: allowed + mask_probs + advance for
B rows over a real-size vocabulary (49152, SmolLM2's), tables of a small JSON schema.

    python scripts/bench_constrain_mask.py
"""

import time

import jax
import jax.numpy as jnp

from jaxspec.constrain import Constraint, compile_tables, constraint_regex, mask

V = 49152
CHARS = {i + 1: bytes([c]) for i, c in enumerate(range(32, 127))}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@jax.jit
def masked_step(tables, states, logits):
    probs = jax.nn.softmax(logits, -1)
    p = mask.mask_probs(probs, mask.allowed(tables, states))
    tok = jnp.argmax(p, -1).astype(jnp.int32)
    return mask.advance(tables, states, tok)


@jax.jit
def plain_step(logits):
    return jnp.argmax(jax.nn.softmax(logits, -1), -1).astype(jnp.int32)


def timed(fn, *args, reps=200):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e6


tables = compile_tables(constraint_regex(Constraint(json_schema=SCHEMA)), CHARS, 0, V)
print(f"states {tables.num_states}, table {tables.next.nbytes / 2**20:.1f} MiB, backend {jax.default_backend()}")
for batch in (1, 8):
    logits = jax.random.normal(jax.random.key(0), (batch, V))
    states = jnp.full((batch,), tables.initial, jnp.int32)
    plain, masked = timed(plain_step, logits), timed(masked_step, tables, states, logits)
    print(f"B={batch}: softmax+argmax {plain:.0f} us, with mask+advance {masked:.0f} us, mask adds {masked - plain:.0f} us")
