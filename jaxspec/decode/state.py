"""The decode loop's data: its state (a pytree carried through `lax.while_loop`) and its static
spec (part of the jit key), shared by the fixed-plan loop (speculate.py) and adaptive
speculation's loop (adaptive/loop.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jaxspec.decode import adaptive
from jaxspec.decode.drafter import Drafter, traits
from jaxspec.models import base


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    tokens: jax.Array  # int32[B, W]
    lengths: jax.Array  # int32[B] committed tokens
    max_lengths: jax.Array  # int32[B] prompt length + max_new_tokens
    done: jax.Array  # bool[B]
    cache: Any  # the target's cache (target.init_cache); lengths == self.lengths - 1
    drafter_state: Any
    key: jax.Array  # base PRNG key
    row_ids: jax.Array  # int32[B] request ids: a row's randomness depends on its id only
    row_steps: jax.Array  # int32[B] target forwards this row took part in (also its key counter)
    # metrics, per row
    num_draft: jax.Array  # int32[B] draft nodes verified
    num_accepted: jax.Array  # int32[B] draft nodes accepted
    accepted_per_position: jax.Array  # int32[B, max(D, 1)] steps where depth i+1 was accepted
    adaptive: Any = None  # adaptive.AdaptiveState when LoopSpec.adaptive is set
    # penalties.Penalties (settings and counts) when some row has penalties or logit_bias on
    penalties: Any = None
    logprobs: Any = None  # logprob_record.Record when LoopSpec.logprobs is not None
    grammar: Any = None  # constrain.loop.Grammar: rows' constraint states (None: all rows free)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Everything static about a decode program (hashable: part of the jit cache key)."""

    target: base.Target  # the model being decoded (models/base.py): hashable
    drafter: Drafter | None
    num_speculative_tokens: int  # γ (the static maximum); 0 for plain decoding
    eos_ids: tuple[int, ...]
    # Verify windows the loop may pick from (each compiled once); a variable-length drafter whose
    # rows all proposed fewer tokens verifies the smallest window that fits.
    windows: tuple[int, ...] = ()
    # A sharding.MeshPlan (or None): the state is constrained to it at prefill and every step,
    # so params, cache, tokens and drafter state stay sharded through the loop.
    mesh: Any = None
    # Adaptive speculation (jaxspec/decode/adaptive.py): per-row lengths as data; every window width
    # 2..γ+1 and a one-token step (no drafting) are compiled into the one program.
    adaptive: adaptive.Controller | None = None
    # Emitted tokens' logprobs recorded, with this many top alternatives (0..20; None: none
    # recorded, the program carries no logprob code), under `logprobs_mode` (decode/logprobs.py)
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    # A chain's verify window written into the cache in place (decode/speculate.py
    # `verify.chain_in_place`; trees stay read-only): None = where this host's backend is a TPU / GPU,
    # not on XLA:CPU (whose width switch would copy a cache written inside it). A program
    # exported for a device from a CPU host sets it (as jaxspec.tools.spec_steps does).
    write_chains: bool | None = None

    @property
    def num_nodes(self) -> int:  # N: window entries after the root
        if self.drafter is None:
            return 0
        return traits(self.drafter).tree_nodes or self.num_speculative_tokens

    @property
    def depth(self) -> int:  # D: the deepest path (tokens committed per step <= D + 1)
        if self.drafter is None:
            return 0
        return traits(self.drafter).tree_depth or self.num_speculative_tokens

    def verify_windows(self) -> tuple[int, ...]:
        g1 = self.num_nodes + 1
        if self.drafter is not None and self.adaptive is not None:  # 1 entry: decode_step's
            if not traits(self.drafter).tree_nodes:  # plain branch (a need of 1: width 2)
                return tuple(range(2, g1 + 1))
            # a tree cut to a depth: any node count, so widths doubling up to the whole tree
            # (a window at most ~2x what it needs, log2(N) compiled forwards)
            return tuple(sorted({min(2**i + 1, g1) for i in range(math.ceil(math.log2(g1)) + 1)}))
        if self.drafter is None or not self.drafter.variable_length:
            return (g1,)
        return tuple(sorted({w for w in self.windows if w < g1} | {1, g1}))


def place(spec: LoopSpec, state: DecodeState) -> DecodeState:
    """Constrain the state to the mesh plan: target rules, the drafter state by the drafter's."""
    if spec.mesh is None:
        return state
    b = state.lengths.shape[0]
    dstate = spec.mesh.constrain_drafter_state(state.drafter_state, b, spec.drafter)
    grammar = state.grammar  # the stacked tables are not per row: left as placed
    state = spec.mesh.constrain(dataclasses.replace(state, drafter_state=None, grammar=None), b)
    return dataclasses.replace(state, drafter_state=dstate, grammar=grammar)
