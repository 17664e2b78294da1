"""The compiled decode programs of one code tree, for before/after checks of a refactor: the
optimised HLO of the jitted decode loop (tiny random Llama, batch 2, capacity 200) for plain
decoding, n-gram and an EAGLE-like head at fixed γ = 3, source-location tables and metadata
stripped, written to PREFIX_<method>.hlo. Two trees whose files differ only in instruction
names compile the same programs.

    PYTHONPATH=/path/to/tree python scripts/refactor_hlo.py /tmp/before   # in each tree
    diff /tmp/before_ngram.hlo /tmp/after_ngram.hlo
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import eagle_like, tiny_model  # noqa: E402

from jaxspec.decode import speculate  # noqa: E402
from jaxspec.drafters.ngram import NgramDrafter  # noqa: E402
from jaxspec.engine.runner import Engine  # noqa: E402
from jaxspec.decode.sampling import SamplingParams  # noqa: E402


def main(prefix: str) -> None:
    m = tiny_model(seed=0, layers=2)
    methods = {"plain": (None, None), "ngram": (NgramDrafter(64, 1, 3), None), "eagle": eagle_like(m)}
    b, sp = 2, SamplingParams.make()
    for name, (drafter, dparams) in methods.items():
        e = Engine(m, drafter, dparams, num_speculative_tokens=3 if drafter else 0)
        args = (m.params, dparams, jnp.zeros((b, 32), jnp.int32), jnp.full((b,), 5, jnp.int32),
                jnp.full((b,), 8, jnp.int32), sp, jax.random.key(0), jnp.arange(b, dtype=jnp.int32))
        state = jax.eval_shape(lambda *a: speculate.prefill(e.spec, *a, capacity=200), *args)
        text = speculate.decode_jit.lower(e.spec, m.params, dparams, state, sp, jnp.int32(1))
        text = text.compile().as_text()
        text = re.sub(r", metadata=\{[^}]*\}", "", text)
        lines = [ln for ln in text.splitlines() if not re.match(r"^\d+ (\"|\{)", ln)]
        body = re.sub(r",? ?stack_frame_id=\d+", "", "\n".join(lines))
        Path(f"{prefix}_{name}.hlo").write_text(body + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
