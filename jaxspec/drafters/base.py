"""The drafter protocol. A drafter is a frozen (hashable) dataclass of static settings whose methods
are pure functions of (drafter params, target params, drafter state, context); the speculative loop
calls them inside one jitted `lax.while_loop`.

Token bookkeeping shared by every drafter (row b):
  ctx.tokens[b, :ctx.lengths[b]]  committed tokens: prompt, then generated ones. The last one was
                                  sampled from the target but not yet run through it.
  propose -> γ draft tokens continuing that sequence, their draft probabilities q (after the same
             logits transform as the target's: this is what keeps sampling lossless) and how many
             of them are real (`num_proposed`, <= γ; the rest are ignored by the acceptance rule).
  commit  -> after verification: `num_accepted` drafts kept, then one target token; lengths advance.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from jaxspec.sampling import SamplingParams


class DraftContext(NamedTuple):
    tokens: jax.Array  # int32[B, W] committed tokens (valid below lengths)
    lengths: jax.Array  # int32[B]
    active: jax.Array  # bool[B]; finished rows may skip work where a drafter can


class Proposal(NamedTuple):
    tokens: jax.Array  # int32[B, G]
    probs: jax.Array  # f32[B, G, V] draft distribution each token was drawn from
    num_proposed: jax.Array  # int32[B] in 0..G


class CommitContext(NamedTuple):
    tokens: jax.Array  # int32[B, W] committed tokens after this step
    lengths: jax.Array  # int32[B] after this step
    prev_lengths: jax.Array  # int32[B] before this step
    window: jax.Array  # int32[B, G+1] the verified window: last committed token, then the drafts
    num_accepted: jax.Array  # int32[B]
    hidden: jax.Array | None  # [len(hidden_layers), B, G+1, D] target hidden states on the window


class Drafter(Protocol):
    name: str
    hidden_layers: tuple[int, ...]  # target hidden states (HF indexing) the drafter reads; () if none
    variable_length: bool  # num_proposed may be < γ: the loop then verifies a shorter window

    def init(
        self,
        dparams: Any,
        tparams: Any,
        prompt_tokens: jax.Array,  # int32[B, P]
        prompt_lengths: jax.Array,  # int32[B]
        prompt_hidden: jax.Array | None,  # [len(hidden_layers), B, P, D]
        capacity: int,
    ) -> Any: ...

    def propose(
        self,
        dparams: Any,
        tparams: Any,
        state: Any,
        ctx: DraftContext,
        num_tokens: int,
        sampling: SamplingParams,
        keys: jax.Array,  # [B] one key per row
    ) -> tuple[Proposal, Any]: ...

    def commit(self, dparams: Any, tparams: Any, state: Any, ctx: CommitContext) -> Any: ...
