"""A sharded mesh of 8 simulated CPU devices gives the same tokens as one device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxspec.sharding import ShardingRules

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import jax
    from tiny import tiny_model
    from jaxspec.engine import Engine
    from jaxspec.drafters.draft_model import layer_skip_drafter
    from jaxspec.sampling import SamplingParams
    from jaxspec.sharding import make_mesh, shard_params
    assert jax.device_count() == 8, jax.devices()
    target = tiny_model(seed=0)
    prompts = [[1, 2, 3, 4, 5], list(range(3, 20)), [7, 8, 9], list(range(10, 40))]
    sp = SamplingParams.make(temperature=0.8, top_p=0.9)
    def run(model):
        out = []
        for drafter in (None, layer_skip_drafter(model.cfg, 2)):
            eng = Engine(model, drafter, num_speculative_tokens=3 if drafter else 0)
            for s in (SamplingParams.make(), sp):
                res = eng.generate(prompts, max_new_tokens=24, sampling=s, batch_size=4)
                out.append([r.token_ids for r in res])
        return out
    single = run(target)
    mesh = make_mesh(data=2, model=4)
    sharded = target.__class__(target.cfg, shard_params(target.params, target.cfg, mesh))
    wq = sharded.params["layers"][0]["wq"]
    assert len(wq.sharding.device_set) == 8 and wq.addressable_shards[0].data.shape[0] == 16
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else mesh:
        meshed = run(sharded)
    assert meshed == single, (meshed, single)
    print("SHARDED_OK")
    """
)


def test_mesh_of_eight_devices_gives_the_same_tokens():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert "SHARDED_OK" in proc.stdout, proc.stderr[-3000:]


def test_rules_refuse_one_mesh_axis_twice():
    rules = ShardingRules(embed="model")
    with pytest.raises(ValueError, match="two dims to one mesh axis"):
        rules.spec("vocab", "embed")
    assert tuple(ShardingRules().spec("batch", None, "heads")) == ("data", None, "model")
