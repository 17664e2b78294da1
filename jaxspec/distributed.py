"""Multi-host runs through JAX's own runtime (`jax.distributed`), and the mesh a config asks for.

    start(config.distributed)       # before anything touches a device: one call per process
    plan = mesh_plan(config.mesh)   # None for 1 x 1: plain single-device arrays

Every process runs the same program: each loads the weights onto its own devices, hands over only
its own rows of the batch (`MeshPlan.put_batch`), and the results are gathered to every process;
only process 0 prints (`is_primary`). CPU processes exchange data with gloo collectives (JAX's
default), so two local processes can form one mesh over the loopback address.
"""

from __future__ import annotations

import os

from jaxspec.errors import JaxspecError

ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


def settings(cfg) -> dict:
    """Config values, else the environment variables; None where neither says (JAX detects)."""
    out = {}
    for key, env in ENV.items():
        value = getattr(cfg, key)
        if value is None and os.environ.get(env):
            raw = os.environ[env]
            if key != "coordinator_address" and not raw.strip().isdigit():
                raise JaxspecError(f"{env}={raw!r} is invalid: use a non-negative integer")
            value = raw if key == "coordinator_address" else int(raw)
        out[key] = value
    return out


def start(cfg) -> bool:
    """`jax.distributed.initialize` when a coordinator or several processes are configured.
    Returns whether it ran (False: a single process, nothing to do)."""
    import jax

    s = settings(cfg)
    if s["coordinator_address"] is None and (s["num_processes"] or 1) <= 1:
        return False
    if jax.distributed.is_initialized():
        return True
    try:
        jax.distributed.initialize(**s)
    except (RuntimeError, ValueError) as e:
        raise JaxspecError(
            f"jax.distributed.initialize({', '.join(f'{k}={v!r}' for k, v in s.items())}) failed: "
            f"{' '.join(str(e).split())[:200]} -- check distributed.* and that every process runs"
        ) from None
    return True


def is_primary() -> bool:
    import jax

    return jax.process_index() == 0


def mesh_plan(cfg):
    """config.mesh -> a sharding.MeshPlan over the first data*model devices; None for 1 x 1."""
    import jax

    n, procs = jax.device_count(), jax.process_count()
    if procs > 1 and cfg.data * cfg.model != n:
        raise JaxspecError(
            f"mesh data={cfg.data} x model={cfg.model} must cover all {n} devices of the {procs} "
            f"processes: set mesh.data * mesh.model = {n}"
        )
    if cfg.data * cfg.model == 1:
        return None
    from jaxspec.sharding import MeshPlan, make_mesh  # jax: only when a mesh is asked for

    return MeshPlan(make_mesh(cfg.data, cfg.model), shard_drafter=cfg.shard_drafter)
