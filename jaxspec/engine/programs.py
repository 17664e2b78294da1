"""The compiled-program cache: a batch shape's prefill and decode programs compiled ahead of time
(lowered on the batch's arguments, the decode program on the prefill's abstract output: nothing
runs), once per shape, so timings exclude compilation; and what attention each program holds,
read from its compiled HLO (jaxspec.hlo.compiled_attention), not from a setting.

    programs = Programs()
    seconds = programs.compile(key, prefill_args, capacity, decode_args_for, sharded=False)
    programs.attention   # {"prefill": ..., "decode": ...} of the last shape compiled or reused
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import jax

from jaxspec import hlo
from jaxspec.decode import speculate


class Programs:
    def __init__(self):
        self.attention: dict[str, str] = {}  # the last shape's, per program
        self._by_key: dict[Hashable, dict[str, str]] = {}
        self._decode: dict[Hashable, str] = {}  # decode programs compiled, by decode key

    def warm(self, key: Hashable) -> bool:
        """Whether this shape is compiled; if so its attention becomes `attention`."""
        if key not in self._by_key:
            return False
        self.attention = self._by_key[key]
        return True

    def compile(
        self,
        key: Hashable,
        prefill_args: tuple,  # speculate.prefill_jit's positional arguments
        capacity: int,
        decode_args_for: Callable,  # abstract prefill state -> speculate.decode_jit's arguments
        sharded: bool,  # the arguments are placed on a mesh (keep the output shardings)
        penalties=None,  # the rows' penalties.Penalties (None: off)
        grammar=None,  # constrain.loop.Grammar of the batch (None: no constraint)
        decode_key: Hashable = None,  # the decode program's shape (None: `key`'s own)
    ) -> float:
        """Compile this shape's programs (nothing if warm) -> seconds spent (0.0 if warm). Prefill
        widths finer than the cache's size share one decode program (`decode_key`)."""
        if self.warm(key):
            return 0.0
        t0 = time.perf_counter()
        lowered = speculate.prefill_jit.lower(*prefill_args, capacity=capacity, penalties=penalties,
                                              grammar=grammar)
        prefill_attention = hlo.compiled_attention(lowered.as_text())
        shardings = lowered.compile().output_shardings
        state = jax.tree.map(  # on one device the real call's arrays are uncommitted: no sharding
            lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where if sharded else None),
            lowered.out_info, shardings,
        )
        decode_key = key if decode_key is None else decode_key
        if decode_key not in self._decode:
            decode = speculate.decode_jit.lower(*decode_args_for(state))
            decode.compile()
            self._decode[decode_key] = hlo.compiled_attention(decode.as_text())
        self.attention = {"prefill": prefill_attention, "decode": self._decode[decode_key]}
        self._by_key[key] = self.attention
        return time.perf_counter() - t0
