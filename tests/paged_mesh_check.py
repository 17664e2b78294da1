"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_paged_forward.py runs
it as a subprocess): the TPU paged kernel (interpret mode) on a pool sharded over kv heads on a
(data 2, model 2) mesh, per head shard under shard_map. Prints JSON: the largest difference from
the gathered reference, the same with a shifted table (the control), and whether the lowered
program splits the kernel into a manual (shard_map) computation."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import test_paged_forward as t
from jaxspec.models import attention_kernels as ak

mesh = Mesh(np.array(jax.devices()).reshape(2, 4)[:, :2], ("data", "model"))
kp, vp = t.pools(seed=2)
table = t.shuffled_table(2)
q, kw, vw, pos, args = t.case("verify", seed=2)
want = t.reference(q, kp, vp, table, kw, vw, pos, args)
out = {}
with ak.kernel_mesh(mesh):
    f = jax.jit(lambda *a: t.paged(*a, args, "pallas_tpu", interpret=True))
    kps, vps = (jax.device_put(x, NamedSharding(mesh, P("model"))) for x in (kp, vp))
    out["diff"] = float(jnp.abs(f(q, kps, vps, table, kw, vw, pos) - want).max())
    wrong = f(q, kps, vps, jnp.roll(table, 1, axis=1), kw, vw, pos)
    out["shifted_diff"] = float(jnp.abs(wrong - want).max())
    text = f.lower(q, kps, vps, table, kw, vw, pos).as_text()
    out["manual"] = "sdy.manual_computation" in text or "shard_map" in text
print(json.dumps(out))
