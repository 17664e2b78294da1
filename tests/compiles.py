"""Counting the programs JAX lowers, through its public monitoring events: a jitted function
called on a new shape, or retraced because a static argument or a closed-over value changed,
lowers a program (jaxpr -> MLIR, an event carrying the function's name); a call served by jit's
cache lowers nothing. What "no recompilation across requests" means, counted rather than timed."""

from __future__ import annotations

import collections
import contextlib

import jax.monitoring

LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@contextlib.contextmanager
def counting_lowerings():
    """with counting_lowerings() as lowered: ...; lowered("decode") -> programs of the jitted
    functions named `decode` (jaxspec.decode.speculate.decode_jit's) lowered inside the block;
    lowered() -> every program lowered."""
    by_name: collections.Counter[str] = collections.Counter()

    def listener(event: str, seconds: float, **kw) -> None:
        if event == LOWERING_EVENT:
            by_name[str(kw.get("fun_name", ""))] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield lambda *names: sum(n for k, n in by_name.items()
                                 if not names or any(k in (m, f"jit({m})") for m in names))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
