"""One of two processes forming a (2, 4) mesh over the loopback address (4 simulated CPU devices
each, gloo collectives), run by tests/test_sharding.py:

    python tests/multihost_check.py PROCESS_ID PORT

Each process builds the same tiny model, joins through `jaxspec.distributed.start` (JAX's own
`jax.distributed.initialize`), hands over its own rows of the batch and gets every row back;
only process 0 prints the tokens (one JSON line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")

from jaxspec import distributed
from jaxspec.config import DistributedConfig, MeshConfig


def main(process_id: int, port: int) -> None:
    cfg = DistributedConfig(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert distributed.start(cfg)
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    plan = distributed.mesh_plan(MeshConfig(data=2, model=4))

    import mesh_check  # after jax.distributed: it builds models on the devices

    target = mesh_check.model()
    out = {}
    for name, drafter, dparams, _ in mesh_check.drafters(target)[:2]:  # plain, ngram
        out[name] = mesh_check.generate(target, drafter, dparams, plan)
    local_rows = plan.put_batch(__import__("numpy").arange(8)).addressable_shards
    out["local_rows"] = sorted({int(s.data[0]) for s in local_rows})
    if distributed.is_primary():
        print(json.dumps(out), flush=True)
    else:
        print(json.dumps({"local_rows": out["local_rows"]}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
